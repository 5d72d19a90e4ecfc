"""The spike finding's version-4 rules on small constructed matrices (tasks/report/recovery.py, pure
functions, no training): a recovery is equivalence to the clean control within the margin, pooled
and in each half, at its edges (p exactly at α, a gap exactly at ±margin); the step-tied claim
holds only where rollback_lower_lr beats every other policy, skip_step included; the detector's
latency and the origins whose poison outlasts the skip window."""

from __future__ import annotations

import pytest

from tasks.design.stats import ALPHA
from tasks.report.recovery import (
    BETTER,
    NOT_SHOWN,
    RECOVERED,
    WORSE,
    latency_text,
    poison_met,
    recovery,
    recovery_label,
    step_comparisons,
    step_tied,
    step_tied_verdict,
)
from tasks.report.sections.stages import spike_section
from tasks.report.verdict import EQUIVALENCE, Claim, adjust

HALVES = {"discovery": [0, 1, 2, 3], "confirmation": [4, 5, 6, 7]}
MARGIN = 0.03
SPREAD = (-0.002, 0.001, 0.002, -0.001)  # per-origin noise around the mean, mean 0 in each half
POLICIES = ("continue", "skip_step", "skip_batch", "rollback", "rollback_lower_lr", "lower_lr", "swap_data")


def gaps(mean: float, second_half: float | None = None, spread: tuple[float, ...] = SPREAD) -> dict[tuple, float]:
    """Eight origins' gaps to their clean controls: ``mean`` in the first half, ``second_half`` (or
    ``mean``) in the second, with the same small spread in each."""
    later = mean if second_half is None else second_half
    return {(s,): (mean if s < 4 else later) + spread[s % 4] for s in range(8)}


def judged(estimate: float, p: float, ci: tuple[float, float], halves: tuple[float, float]) -> Claim:
    return Claim(
        "a×b − clean control",
        estimate,
        p,
        0,
        kind=EQUIVALENCE,
        sesoi=MARGIN,
        ci95=list(ci),
        halves=dict(zip(HALVES, halves, strict=True)),
    )


def test_a_gap_well_inside_the_margin_at_every_origin_is_recovered():
    assert recovery_label(recovery("x", gaps(0.005), HALVES, MARGIN)) == RECOVERED


def test_a_mean_gap_exactly_at_the_margin_is_not_shown_as_recovered():
    at_edge = recovery("x", gaps(MARGIN), HALVES, MARGIN)
    assert at_edge.p == pytest.approx(0.5, abs=1e-6)  # the upper one-sided test cannot reject at its bound
    assert recovery_label(at_edge) == NOT_SHOWN


def test_one_half_at_the_margin_blocks_a_recovery_the_pooled_test_shows():
    pooled_inside = recovery("x", gaps(0.0, MARGIN), HALVES, MARGIN)
    assert pooled_inside.p < ALPHA and pooled_inside.halves["confirmation"] == pytest.approx(MARGIN)
    assert recovery_label(pooled_inside) == NOT_SHOWN
    just_inside = recovery("x", gaps(0.0, MARGIN - 1e-4), HALVES, MARGIN)
    assert recovery_label(just_inside) == RECOVERED


@pytest.mark.parametrize(("p", "label"), [(ALPHA, NOT_SHOWN), (ALPHA - 1e-9, RECOVERED)])
def test_a_recovery_needs_the_tost_p_strictly_below_alpha(p, label):
    assert recovery_label(judged(0.01, p, (0.0, 0.02), (0.01, 0.01))) == label


@pytest.mark.parametrize(
    ("ci", "halves", "label"),
    [
        ((MARGIN, 0.05), (0.04, 0.04), NOT_SHOWN),  # the interval starts exactly at +margin: not beyond it
        ((MARGIN + 1e-9, 0.05), (0.04, 0.04), WORSE),
        ((MARGIN + 1e-9, 0.05), (0.04, -0.001), NOT_SHOWN),  # a half on the other side
        ((-0.05, -MARGIN - 1e-9), (-0.04, -0.04), BETTER),
    ],
)
def test_worse_or_better_than_clean_needs_the_interval_wholly_beyond_the_margin(ci, halves, label):
    assert recovery_label(judged(sum(ci) / 2, 0.9, ci, halves)) == label


def test_a_cell_whose_gate_failed_says_why_instead_of_a_verdict():
    claim = recovery("x", gaps(0.005), HALVES, MARGIN)
    claim.not_tested = "lr: continue ended more than 3% above the control at 2 of 8 seeds"
    assert recovery_label(claim) == f"not tested ({claim.not_tested})"


def step_matrix(best: float, others: dict[str, float]) -> dict:
    """The lr cause's cells: rollback_lower_lr's gap ``best`` at every origin, each other policy's
    its own (0.2 unless given), each with a spread of its own so the paired differences vary."""
    means = {**{p: 0.2 for p in POLICIES}, **others, "rollback_lower_lr": best}

    def cells(policy: str, mean: float) -> dict:
        spread = SPREAD if policy == "rollback_lower_lr" else SPREAD[::-1]
        return {str(s): {"scored_gap": g, "final_gap": g} for (s,), g in gaps(mean, spread=spread).items()}

    return {"lr": {p: cells(p, m) for p, m in means.items()}}


def step_verdict(matrix: dict) -> tuple[list[Claim], str]:
    claims = step_tied(step_comparisons(matrix, HALVES, POLICIES))
    adjust(list(claims.values()))
    return list(claims.values()), step_tied_verdict(claims)


def test_the_step_tied_claim_compares_rollback_lower_lr_with_every_other_policy_skip_step_included():
    claims, verdict = step_verdict(step_matrix(0.05, {}))
    others = ["continue", "skip_step", "skip_batch", "rollback", "lower_lr", "swap_data"]
    assert [c.what for c in claims] == [f"lr×rollback_lower_lr − lr×{p}, scored gap" for p in others]
    assert verdict == "holds: rollback_lower_lr better than each of the 6 other policies"


def test_one_policy_as_good_as_rollback_lower_lr_leaves_the_step_tied_claim_not_shown():
    claims, verdict = step_verdict(step_matrix(0.05, {"skip_step": 0.05}))
    assert [c.holds for c in claims] == [True, False, True, True, True, True]
    assert verdict == "not shown: rollback_lower_lr not shown better than skip_step"


def test_a_lead_exactly_at_the_sesoi_does_not_count_as_better():
    _, verdict = step_verdict(step_matrix(0.05, {"lower_lr": 0.05 + MARGIN}))
    assert verdict == "not shown: rollback_lower_lr not shown better than lower_lr"
    _, verdict = step_verdict(step_matrix(0.05, {"lower_lr": 0.05 + MARGIN + 0.005}))
    assert verdict.startswith("holds")


def test_a_policy_shown_better_than_rollback_lower_lr_contradicts_the_step_tied_claim():
    _, verdict = step_verdict(step_matrix(0.15, {"skip_step": 0.05}))
    assert verdict == "contradicted: skip_step ended below rollback_lower_lr by more than the SESOI"


def test_the_step_tied_comparisons_are_holm_adjusted_so_one_raw_p_under_alpha_is_not_enough():
    claims = {
        p: Claim(f"lr×rollback_lower_lr − lr×{p}", -0.1, 0.03, -1, sesoi=MARGIN, ci95=[-0.2, -0.05]) for p in "ab"
    }
    adjust(list(claims.values()))
    assert [c.p_adjusted for c in claims.values()] == [0.06, 0.06]
    assert step_tied_verdict(claims) == "not shown: rollback_lower_lr not shown better than a, b"


@pytest.mark.parametrize(
    ("policy", "poison", "latency", "met"),
    [
        ("skip_batch", 200, 0, False),  # flagged on the first poisoned batch, the window covers the stretch
        ("skip_batch", 201, 0, True),  # one poisoned batch past the window
        ("skip_batch", 120, 1, True),  # restored after one poisoned update
        ("rollback", 230, 30, False),  # restored before the stretch, skipped to its end
        ("rollback", 231, 30, True),
        ("rollback", 150, 99, False),
        ("rollback", 150, 100, True),  # the restore point may lie inside the stretch
        ("swap_data", 400, 0, False),  # excluded from the first poisoned batch on
        ("swap_data", 120, 1, True),
        ("rollback_lower_lr", 120, None, True),  # never flagged: no policy acted
    ],
)
def test_a_data_policy_meets_poison_past_its_window_or_after_a_late_flag(policy, poison, latency, met):
    assert poison_met(policy, {1: poison}, {1: latency}, window=200, rollback_steps=100) == ([1] if met else [])


def test_the_latency_line_gives_range_median_and_the_origins_never_flagged():
    assert (
        latency_text({1: 0, 2: 12, 3: 3, 4: None}) == "latency 0-12 steps (median 3) at 3 origins, never flagged at 1"
    )
    assert latency_text({1: None}) == "never flagged at 1 origins"


def test_the_report_tables_each_cells_verdict_against_clean_and_the_detectors_latency(tmp_path):
    recovered = {str(s): {"scored_gap": g, "final_gap": g, "outcome": "recovered"} for (s,), g in gaps(0.005).items()}
    lingering = {str(s): {"scored_gap": g, "final_gap": g, "outcome": "gap"} for (s,), g in gaps(0.2).items()}
    latency = {"continue": {"latency": 0}, "injection": {"tied_to": "once"}}
    spike = {
        "matrix": {"param": {"continue": lingering, "rollback": recovered}},
        "causes": ["param"],
        "policies": ["continue", "rollback"],
        "seeds": {str(s): {"param": latency | ({"continue": {"latency": None}} if s == 7 else {})} for s in range(8)},
        "discovery_seeds": HALVES["discovery"],
        "confirm_seeds": HALVES["confirmation"],
        "detection": {"param": {"injected": 8, "detected": 7, "missed_seeds": [7]}},
        "postmortem_seed": 0,
        "false_positives": 0,
    }
    lines = [str(line) for line in spike_section(tmp_path, spike).lines]
    assert "| vs clean | continue | rollback |" in lines
    row = next(line for line in lines if line.startswith("| param | worse: +20.0% ["))
    assert "| recovered (c): +0.5% [" in row, "param×rollback is a construction check"
    assert any("param latency 0-0 steps (median 0) at 7 origins, never flagged at 1" in line for line in lines)
