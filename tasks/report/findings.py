"""The findings the study tests, each read off the stages' outputs as its pre-registered design
says (tasks/design/preregistration.yaml), with its verdict from the one rule
(tasks/report/verdict.py) and the one method (tasks/report/method.py).

Five findings are declared: their families and claims are data in preregistration.yaml, tested
by the same code as a researcher's own (tasks/report/declared.py); each adds here only the
numbers a reader checks beside its claims (NOTES). Three remain code, each for one reason:

  xiong_init   reads the depth probe's gradients at initialisation, not trained arms.
  mu_transfer  fits each seed's LR optimum per width from the search's trials, then a slope.
  spike        reads the spike stage's cause × policy matrix of recovery branches, not arms.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from scipy import stats as scipy_stats

from tasks.ablate.rounds import DECIDED, GATED
from tasks.config import Config
from tasks.design.families import DeclaredClaim, DeclaredFamily
from tasks.design.preregistration import design
from tasks.design.stats import ALPHA, divergence_rates, tost_paired
from tasks.design.studies import builtin_families, builtin_names
from tasks.report.declared import declared_finding, diverged_seeds, rate_sides
from tasks.report.method import (
    Arms,
    Finding,
    Halves,
    ablation_halves,
    claims_numbers,
    compare_line,
    decide,
    direction,
    halves_for,
    halves_of,
    mean_text,
    number,
    per_seed_difference,
    plateau_gate,
    pooled_and_halves,
    rate_line,
    sesoi,
    subtract,
)
from tasks.report.recovery import (
    BEST_FOR_STEP,
    latencies,
    latency_text,
    margin,
    poison_met,
    recovery,
    recovery_label,
    recovery_text,
    scored_gaps,
    step_comparisons,
    step_tied,
    step_tied_verdict,
)
from tasks.report.verdict import (
    CONTRADICTED,
    EQUIVALENCE,
    NEGLIGIBLE,
    RATE,
    REPRODUCED,
    Claim,
    adjust,
    significant,
)
from tasks.search.spec import target_width
from tasks.spike.config import OUTCOMES

FAMILY_OF = {finding: family for family, finding in builtin_names().items()}
"""The family of arms each declared finding reads (its ``family`` in preregistration.yaml)."""


# ----------------------------------------------------------------------------------------------
# The findings that remain code
# ----------------------------------------------------------------------------------------------


def xiong_init(cfg: Config, ablate: dict[str, Any], **_: Any) -> Finding:
    probe = (ablate.get("depth_probe") or {}).get("xavier") or {}
    if not {"pre_ln", "post_ln"} <= set(cfg.ablation.blocks) or len(cfg.ablation.probe_depths) < 3:
        return _missing("xiong_init", "ablation.blocks needs pre_ln and post_ln, ablation.probe_depths three or more")
    if not probe.get("last_layer"):
        return decide("xiong_init", [], "the depth probe did not run", [], "no depth probe in metrics/ablate.json")
    last = probe["last_layer"]  # block -> depth -> seed -> gradient norm, under the paper's init
    depths = sorted(int(d) for d in last["post_ln"])
    ratio = {
        (int(s), d): math.log(last["post_ln"][str(d)][s] / last["pre_ln"][str(d)][s])
        for d in depths
        for s in last["post_ln"][str(d)]
    }
    halves = ablation_halves(cfg)
    deepest = {(s,): r for (s, d), r in ratio.items() if d == depths[-1]}
    slopes = {
        (s,): float(scipy_stats.linregress(np.log(depths), [ratio[s, d] for d in depths]).slope)
        for s in sorted({s for s, _ in ratio})
    }
    tested = {
        f"log(Post-LN / Pre-LN) last-layer grad norm at depth {depths[-1]}": pooled_and_halves(deepest, halves),
        "per-seed slope of that log ratio on log depth": pooled_and_halves(slopes, halves),
    }
    (what_deep, deep), (what_slope, slope) = tested.items()
    claims = [
        direction("xiong_init", "deepest", what_deep, deep, +1, "log ratio"),
        direction("xiong_init", "slope", what_slope, slope, +1, "slope"),
    ]
    mean_ratio = {d: float(np.exp(np.mean([r for (s, dd), r in ratio.items() if dd == d]))) for d in depths}
    numbers = (
        "Post-LN / Pre-LN last-layer gradient norm at init, geometric mean over seeds: "
        + ", ".join(f"L={d}: {mean_ratio[d]:.2f}x" for d in depths)
        + f"; {claims_numbers(tested, 'log')} (Theorem 1 predicts a slope of +0.5)"
    )
    return decide(
        "xiong_init",
        claims,
        numbers,
        [f"depth probe: L={d}" for d in depths],
        details={"ratio_by_depth": mean_ratio},
        halves=halves_of(tested),
    )


def search_halves(cfg: Config) -> Halves:
    return halves_for(cfg.search.seeds, cfg.search.confirm_seeds)


def seed_slopes(entry: dict[str, Any]) -> dict[tuple, float]:
    """Per seed, the least-squares slope of its optimum log₂ LR on log₂ width; a seed missing a
    width, or censored at one (tasks/search/fit.py: censoring, version 4), has none."""
    widths = sorted(entry["widths"], key=int)
    censored = {s for w in widths for s in entry["widths"][w].get("censored", {})}
    seeds = set.intersection(*(set(entry["widths"][w]["per_seed"]) for w in widths)) - censored if widths else set()
    x = [math.log2(int(w)) for w in widths]
    return {
        (int(s),): float(scipy_stats.linregress(x, [entry["widths"][w]["per_seed"][s] for w in widths]).slope)
        for s in sorted(seeds, key=int)
    }


def non_inferior(what: str, gaps: dict[tuple, float], margin: float, halves: Halves) -> Claim:
    """A non-inferiority claim on per-seed gaps (positive: worse), read by the direction rule on
    gap − margin (expected below 0, no SESOI of its own): it holds when the 95 % interval of the gap
    lies wholly below +margin (CONSORT's non-inferiority rule, Piaggio et al. 2012), the paired
    t-test of gap − margin is significant and every half's gap is below the margin; contradicted
    when the interval lies wholly above it, every half there (worse by more than the margin)."""
    tested = pooled_and_halves({unit: gap - margin for unit, gap in gaps.items()}, halves)
    return Claim(
        what,
        tested.get("estimate"),
        tested.get("p"),
        -1,
        ci95=tested.get("ci95"),
        halves={h: c.get("estimate") for h, c in tested["halves"].items()},
        mde=tested.get("mde"),
        unit="nats",
    )


TRANSFER_MIN_SEEDS = 3
"""Seeds with an uncensored direct optimum the transfer test needs (registered, version 4): fewer
leave a t-test with one degree of freedom, whose interval spans any margin."""


def transfer_claim(cfg: Config, transfer: dict[str, Any]) -> tuple[Claim, str]:
    """The primary claim (version 4): the LR transferred from the proxy widths does as well at the
    target as the direct sweep's best, within the registered margin; and its numbers."""
    margin = sesoi("mu_transfer", "transfer")
    gaps = {(int(s),): g for s, g in (transfer.get("gap_per_seed") or {}).items()}
    what = (
        f"transfer: per-seed loss at the LR from widths {transfer['proxy_widths']} minus the direct sweep's best at "
        f"width {transfer['target_width']}, less the margin {margin:g} (non-inferior: below 0)"
    )
    claim = non_inferior(what, gaps, margin, search_halves(cfg))
    censored = sorted(transfer.get("direct_censored") or {}, key=int)
    if "gap_per_seed" not in transfer:
        claim.not_tested = "metrics/search.json has no per-seed transfer gaps (written before version 4)"
    elif len(gaps) < TRANSFER_MIN_SEEDS:
        claim.not_tested = (
            f"{len(gaps)} seeds with an uncensored direct optimum at width {transfer['target_width']} "
            f"(censored: {', '.join(censored) or 'none'}); at least {TRANSFER_MIN_SEEDS} needed"
        )
    mean = f"{claim.estimate + margin:+.3f}" if claim.estimate is not None else "n/a"
    upper = f"{max(claim.ci95) + margin:+.3f}" if claim.ci95 else "n/a"
    numbers = (
        f"transfer (primary): LR 2^{transfer['log2_lr']:.2f} from widths {transfer['proxy_widths']} at width "
        f"{transfer['target_width']}, gap to the direct sweep's best {mean} nats (95 % upper bound {upper}; "
        f"non-inferior below +{margin:g}) over {len(gaps)} seeds; direct optima censored: {len(censored)}"
    )
    return claim, numbers


def slopes_secondary(cfg: Config, search: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The secondary analysis (version 4): per parametrization the per-seed slopes of log₂ η* on
    log₂ width, shown with estimate, interval and μP's TOST p against ±margin, deciding nothing."""
    halves = search_halves(cfg)
    slopes = {p: seed_slopes(search[p]) for p in ("sp", "mup")}
    tested = {
        f"{name}: per-seed slope of log₂ η* on log₂ width": pooled_and_halves(slopes[p], halves)
        for p, name in (("sp", "SP"), ("mup", "μP"))
    }
    margin = design()["findings"]["mu_transfer"]["secondary"]["margin"]
    tost = tost_paired(list(slopes["mup"].values()), margin)
    return (
        tested,
        f"secondary: {claims_numbers(tested, 'slope')}; μP TOST ±{margin:g} p={number(tost.get('p'), '{:.3g}')}",
    )


def mu_transfer(cfg: Config, search: dict[str, Any] | None, unigram: float | None, **_: Any) -> Finding:
    if not search or not {"sp", "mup", "transfer"} <= search.keys():
        return decide("mu_transfer", [], "the search stage compared no SP and μP", [], "no SP and μP search")
    claim, transfer_numbers = transfer_claim(cfg, search["transfer"])
    tested, slope_numbers = slopes_secondary(cfg, search)
    s = cfg.search
    seeds = len(s.seeds) + len(s.confirm_seeds)
    failed = None
    if s.lr_points < 7 or seeds < 3 or len(s.widths) < 3:
        failed = f"the search has {s.lr_points} LR points, {seeds} seeds, {len(s.widths)} widths (needs >= 7, 3, 3)"
    entries = [(p, w, e) for p in ("sp", "mup") for w, e in search[p]["widths"].items()]
    censored = [f"{p} w{w} seed {s} ({why})" for p, w, e in entries for s, why in (e.get("censored") or {}).items()]
    worst = max(e["loss_opt"] for _, _, e in entries)
    failed = failed or plateau_gate(worst, unigram, "the search's worst fitted optimum")
    failed = failed or mup_trains(cfg, search)
    numbers = (
        f"{transfer_numbers}; {slope_numbers}; widths {', '.join(sorted(search['sp']['widths'], key=int))}; "
        f"censored optima (bounds, left out of the slopes): {len(censored)} of "
        f"{sum(len(e['per_seed']) for _, _, e in entries)}; loss at the optimum up to {worst:.3f} "
        f"nats{gate_numbers(cfg, search)}"
    )
    return decide(
        "mu_transfer",
        [claim],
        numbers,
        ["search stage: " + ", ".join(search.get("studies", []))],
        failed,
        worst,
        {"censored": censored, **tested},
        halves_of(tested),
    )


MUP_TOLERANCE = 0.1
"""How much worse than SP μP may train at the target width, in nats of the loss at the fitted
optimum (version 3's value): a μP that trains worse than SP where its transfer is claimed is not
the μP whose transfer the paper claims; a tenth of a nat is xiong's SESOI, 2 % of a trained arm's
loss. Version 3 read the base width, where with mup.zero_init_* off μP and SP are the same model:
a gate true by construction (tasks/register/gates.py)."""


def gate_losses(cfg: Config, search: dict[str, Any]) -> tuple[float, float] | None:
    """SP's and μP's loss at the optimum fitted from the grid's points at the target width; None
    where the search did not train it."""
    width = str(target_width(cfg))
    if width not in search["sp"]["widths"] or width not in search["mup"]["widths"]:
        return None
    sp, mup = search["sp"]["widths"][width], search["mup"]["widths"][width]
    # fitted from the grid alone: the second stage refines μP only (version 4; version 3 had none)
    return sp.get("grid_loss_opt", sp["loss_opt"]), mup.get("grid_loss_opt", mup["loss_opt"])


def gate_numbers(cfg: Config, search: dict[str, Any]) -> str:
    """The μ-transfer gate's measured values beside its threshold, for the numbers line."""
    if (losses := gate_losses(cfg, search)) is None:
        return ""
    sp, mup = losses
    return (
        f"; gate at the target width {target_width(cfg)}: μP {mup:.3f} against SP {sp:.3f} nats "
        f"(at most {MUP_TOLERANCE:g} worse)"
    )


def mup_trains(cfg: Config, search: dict[str, Any]) -> str | None:
    """The mechanism gate of μ-transfer: μP trains at least as well as SP (within MUP_TOLERANCE) at
    the target width, or the transfer it would show is of a μP that does not work here."""
    width = target_width(cfg)
    if (losses := gate_losses(cfg, search)) is None:
        return f"the search did not train the target width {width} under both SP and μP"
    sp, mup = losses
    if mup > sp + MUP_TOLERANCE:
        return (
            f"the mechanism did not occur: μP trains worse than SP at the target width {width} (loss at the fitted "
            f"optimum {mup:.3f} against {sp:.3f} nats; at most {MUP_TOLERANCE:g} worse needed), so its optima "
            "are not those of a working μP"
        )
    return None


SPIKE_MIN_SEEDS = 4
"""Seeds at which each cause's ``continue`` branch must have left a gap (registered): fewer, and
there is no spike worth recovering from to compare the policies on."""

SPIKE_CAUSES = {"data": "stream", "param": "once", "lr": "step"}
"""The three causes (injection kinds) and what each must be tied to: data-tied (poisoned batches,
skipping them clears it), state-tied (a corrupted state, restoring a clean one clears it),
step-tied (no replay clears it)."""

SPIKE_RECOVERS = {
    ("data", "skip_batch"): "data_skip_batch",
    ("data", "rollback"): "data_rollback",
    ("data", "swap_data"): "data_swap_data",
    ("lr", "rollback_lower_lr"): "step_rollback_lower_lr",
}
"""The registered recovery claims (version 4), each with its key in the registered design: the
branch's scored gap equivalent to its clean control within the SESOI, where the playbook predicts
the policy recovers and the construction does not decide it (SPIKE_CONSTRUCTION)."""

SPIKE_CONSTRUCTION = {
    ("param", "rollback"): "restores a checkpoint from before the one-off fault, which never recurs",
    ("lr", "rollback"): "replays the step-tied pulse at the same LR: flagged again, it gives up",
    ("lr", "skip_batch"): "replays the step-tied pulse at the same LR: flagged again, it gives up",
    ("param", "swap_data"): "no data source to swap: it is continue",
    ("lr", "swap_data"): "no data source to swap: it is continue",
}
"""Cells whose outcome the construction decides (version 4): construction checks, shown with their
verdict and this reason, in no claim."""

SPIKE_NO_BETTER = (("param", "skip_batch"), ("lr", "rollback"), ("lr", "skip_batch"), ("lr", "lower_lr"))
"""Registered predictions of no improvement over continue, shown with their estimate and interval,
not claims: PaLM's rollback and skip_batch replay the steps and meet a step-tied pulse again at the
same LR, lower_lr acts after a 3-step pulse has done its damage, and skip_batch's restart point (the
state just before the flagged step) may already hold a corrupted state."""


def spike_precondition(spike: dict[str, Any], policies: Sequence[str]) -> str | None:
    """Why the spike finding cannot be tested, or None: a cause missing or tied to the wrong thing,
    or a policy of recovery.policies without its step-tied branch (the step-tied claim compares
    every policy)."""
    matrix = spike["matrix"]
    for cause, tied in SPIKE_CAUSES.items():
        if cause not in matrix or "continue" not in matrix[cause]:
            return f"the spike stage ran no {cause} injection with a continue branch (spike.kinds)"
        ties = {entry[cause]["injection"]["tied_to"] for entry in spike["seeds"].values()}
        if ties != {tied}:
            return f"the {cause} injection was tied to {sorted(ties)}, not to the {tied}: another cause"
    missing = [p for p in (BEST_FOR_STEP, *policies) if not matrix["lr"].get(p)]
    return f"the spike stage ran no lr branch of {', '.join(dict.fromkeys(missing))}" if missing else None


def cause_gate(matrix: dict[str, Any], cause: str, epsilon: float) -> str | None:
    """The gate of a cause's claims (each judged on its own, issue 58): its ``continue`` branch left
    a gap at >= SPIKE_MIN_SEEDS seeds, else there was nothing for a policy to recover."""
    gapped = [s for s, gap in scored_gaps(matrix, cause, "continue").items() if gap > epsilon]
    if len(gapped) >= SPIKE_MIN_SEEDS:
        return None
    return (
        f"{cause}: continue ended more than {epsilon:.0%} above the control at {len(gapped)} of "
        f"{len(matrix[cause]['continue'])} seeds (needs >= {SPIKE_MIN_SEEDS})"
    )


def detection_text(spike: dict[str, Any], cause: str) -> str:
    """``, detected 7 of 8 (missed: 6), latency 0-12 steps (median 3) at 7 origins, never flagged
    at 1``: the detector's rate (version 3) and latency (version 4) on the cause."""
    d = spike.get("detection", {}).get(cause)
    if not d:
        return ""
    missed = f" (missed: {', '.join(map(str, d['missed_seeds']))})" if d["missed_seeds"] else ""
    return f", detected {d['detected']} of {d['injected']}{missed}, {latency_text(latencies(spike, cause))}"


def poison_met_text(spike: dict[str, Any], cfg: Config) -> str:
    """At how many origins each data claim's policy may meet poison (tasks/report/recovery.py:
    poison_met): where none, its recovery was given by the construction."""
    poison = {int(s): n for s, n in spike["poison_batches"].items()}
    by_origin, r = latencies(spike, "data"), cfg.recovery
    met = {
        p: poison_met(p, poison, by_origin, r.skip_batches, r.rollback_steps) for c, p in SPIKE_RECOVERS if c == "data"
    }
    counts = ", ".join(f"{p} {len(seeds)} of {len(by_origin)}" for p, seeds in met.items())
    return f"data: origins where the construction leaves poison to meet (the claim can come out otherwise): {counts}"


def origins_gate(spike: dict[str, Any]) -> str | None:
    """The plateau gate of the origin runs, each on its own: the stage leaves out those that fail,
    naming them, and says why when a half keeps too few (version 3). A version-2 study has no such
    record, and its claims are not version 3's: its rollback cut the LR, and it ran neither
    rollback_lower_lr nor swap_data."""
    if "plateau" not in spike:
        return (
            "a version-2 spike study: its rollback cut the LR (version 3's rollback_lower_lr), and it ran no "
            "PaLM rollback, rollback_lower_lr or swap_data, so version 3's claims cannot be read on it"
        )
    why: str | None = spike["plateau"]["why"]
    return why


def spike_outcomes(matrix: dict[str, Any], cause: str, policy: str) -> str:
    """A cell's outcome counts over seeds, e.g. ``0 recovered / 3 gap / 1 gave up``."""
    cells = matrix.get(cause, {}).get(policy, {}).values()
    return " / ".join(f"{sum(c['outcome'] == o for c in cells)} {o.replace('_', ' ')}" for o in OUTCOMES)


def recovery_margin(cell: tuple[str, str]) -> float:
    """A cell's equivalence margin: its claim's registered SESOI, else the finding's ``margin``."""
    return sesoi("spike", SPIKE_RECOVERS[cell]) if cell in SPIKE_RECOVERS else margin()


def recovery_entry(cell: tuple[str, str], claim: Claim, gaps: dict[str, Any]) -> dict[str, Any]:
    """A cell's recovery as metrics/report.json and the report carry it: its verdict, whether it is
    a claim or a construction check (and why), and its mean gap to the clean control with the TOST."""
    return {
        "verdict": recovery_label(claim),
        "role": "claim" if cell in SPIKE_RECOVERS else "construction" if cell in SPIKE_CONSTRUCTION else "shown",
        "construction": SPIKE_CONSTRUCTION.get(cell),
        "estimate": claim.estimate,
        "ci95": claim.ci95,
        "tost_p": claim.p,
        "tost_p_adjusted": claim.p_adjusted,
        "margin": claim.sesoi,
        "halves": claim.halves,
        "n": gaps.get("n"),
    }


def spike(cfg: Config, spike: dict[str, Any] | None, **_: Any) -> Finding:
    """Version 4's claims (tasks/report/recovery.py), Holm-adjusted together: recovery as
    equivalence to the clean control within the SESOI where the playbook predicts it and the
    construction does not decide it (SPIKE_RECOVERS), and the step-tied claim, rollback_lower_lr
    better than every other policy, one comparison per policy. Every other cause × policy cell is
    shown with its recovery verdict (unadjusted: no claim; a construction check says why), and the
    predicted-no-better cells against continue. A cause's claims are not tested unless its
    continue branch left a gap at >= SPIKE_MIN_SEEDS origins (:func:`cause_gate`)."""
    if not spike or "matrix" not in spike:
        return decide("spike", [], "the spike stage did not run", [], "the spike stage did not run")
    matrix, epsilon = spike["matrix"], cfg.recovery.recover_epsilon
    policies: list[str] = list(cfg.recovery.policies)
    failed = origins_gate(spike) or spike_precondition(spike, policies)
    halves = halves_for(spike.get("discovery_seeds", []), spike.get("confirm_seeds", []))
    gaps = {(c, p): scored_gaps(matrix, c, p) for c in SPIKE_CAUSES if c in matrix for p in policies}
    recoveries = {
        (c, p): recovery(f"{c}×{p} − clean control, scored gap", g, halves, recovery_margin((c, p)))
        for (c, p), g in gaps.items()
    }
    step = step_comparisons(matrix, halves, policies) if "lr" in matrix else {}
    step_claims = step_tied(step)
    by_cause = [(c, recoveries[c, p]) for c, p in SPIKE_RECOVERS if (c, p) in recoveries]
    by_cause += [("lr", claim) for claim in step_claims.values()]
    claims = [claim for _, claim in by_cause]
    if not failed:  # each cause's claims gated on its own continue gap
        for cause, claim in by_cause:
            claim.not_tested = cause_gate(matrix, cause, epsilon)
    adjust(claims)  # decide() adjusts the same way; the labels below read the adjusted p
    tested = {cell: pooled_and_halves(g, halves) for cell, g in gaps.items()}
    versus = {(c, p): pooled_and_halves(subtract(gaps[c, p], gaps[c, "continue"]), halves) for c, p in SPIKE_NO_BETTER}
    step_verdict = step_tied_verdict(step_claims)
    details: dict[str, Any] = {
        **{f"{c}/{p}": versus[c, p] for c, p in SPIKE_NO_BETTER},
        "recovery": {f"{c}/{p}": recovery_entry((c, p), r, tested[c, p]) for (c, p), r in recoveries.items()},
        "step_tied": {"verdict": step_verdict, **{f"lr/{BEST_FOR_STEP} − lr/{o}": t for o, t in step.items()}},
    }
    numbers = "; ".join(
        [
            *(
                f"{cause}: continue {spike_outcomes(matrix, cause, 'continue')}, mean scored gap "
                f"{mean_text(gaps[cause, 'continue'])}{detection_text(spike, cause)}"
                for cause in SPIKE_CAUSES
                if (cause, "continue") in gaps
            ),
            *([poison_met_text(spike, cfg)] if spike.get("poison_batches") else []),
            *([f"origins left out on the plateau: {spike['plateau']['excluded']}"] if spike.get("plateau") else []),
            *(
                f"{c}×{p} vs clean (claim): {recovery_text(recoveries[c, p])}; {spike_outcomes(matrix, c, p)}"
                for c, p in SPIKE_RECOVERS
                if (c, p) in recoveries
            ),
            f"step-tied, {BEST_FOR_STEP} against every other policy: {step_verdict}",
            *(f"lr×{BEST_FOR_STEP} − lr×{o}: {compare_line(t, '')}" for o, t in step.items()),
            *(
                f"{c}×{p} vs clean (construction check: {why}): {recovery_text(recoveries[c, p])}; "
                f"{spike_outcomes(matrix, c, p)}"
                for (c, p), why in SPIKE_CONSTRUCTION.items()
                if (c, p) in recoveries
            ),
            *(
                f"{c}×{p} − continue (predicted no better): {compare_line(versus[c, p], '')}; {spike_outcomes(matrix, c, p)}"
                for c, p in SPIKE_NO_BETTER
            ),
        ]
    )
    seeds = ", ".join(str(s) for half in halves.values() for s in half)
    arms = [
        f"spike stage: seeds {seeds}, causes {', '.join(matrix)}, x{cfg.spike.magnitude:g} for {cfg.spike.duration} steps"
    ]
    shown = {r.what: tested[cell] for cell, r in recoveries.items() if cell in SPIKE_RECOVERS}
    shown |= {step_claims[other].what: tested for other, tested in step.items()}
    return decide("spike", claims, numbers, arms, failed, details=details, halves=halves_of(shown))


def _missing(key: str, why: str) -> Finding:
    return decide(key, [], f"not in this grid: {why}", [], f"not in this grid: {why}")


# ----------------------------------------------------------------------------------------------
# The declared findings: what each shows beside its claims
# ----------------------------------------------------------------------------------------------


def _diverged(arms: Arms, family: str, **factors: Any) -> dict[tuple, bool]:
    return {u: bool(v) for u, v in arms.values(family, "diverged", **factors).items()}


def xiong_notes(arms: Arms, cfg: Config, ablate: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    a = cfg.ablation
    warm = a.xiong_warmups[0]
    pre = pooled_and_halves(
        per_seed_difference(
            arms.values("xiong", "capped_loss", block="pre_ln", warmup=0.0),
            arms.values("xiong", "capped_loss", block="pre_ln", warmup=warm),
        ),
        ablation_halves(cfg),
    )
    diverged = divergence_rates(
        _diverged(arms, "xiong", block="post_ln", warmup=0.0), _diverged(arms, "xiong", block="post_ln", warmup=warm)
    )
    text = (
        f"per seed the mean over LRs {', '.join(f'{lr:g}' for lr in a.xiong_lrs)}; Pre-LN no warmup − warmup "
        f"{compare_line(pre)}; Post-LN diverged without vs with warmup, per (seed, LR) {rate_line(diverged)}; depth "
        f"{a.xiong_depth}, {a.xiong_steps:,} steps (warmup {warm:.0%} of them; ablation.xiong_steps, sized by "
        "tasks/ablate/sizing.py), the paper's model (Xavier init, LayerNorm, GELU)"
    )
    return text, {"pre_ln": pre, "divergence": diverged}


def fp16_notes(arms: Arms, cfg: Config, ablate: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    a = cfg.ablation
    shift = (ablate.get("conditions") or {}).get("loss_shift") or {}
    k, details = shift.get("k"), {}
    at_k = "-" if k is None else f"{shift['shares'][str(k)]:.1%}"
    means = ", ".join(f"{p} {number(arms.mean('precision', 'capped_loss', precision=p))}" for p in a.precisions)
    if k is None:  # the registered condition: no shift reached the target share (a probe, not an arm's metric)
        details["failed"] = (
            f"no loss shift up to 2^-16 put {a.underflow_target:.0%} of activation gradients below 2^-24 in the "
            "one-step probe (the condition was not reached)"
        )
    text = (
        f"loss x 2^-{'?' if k is None else k} (one-step probe: {at_k} of the worst block's activation gradients "
        f"below 2⁻²⁴ there, target {a.underflow_target:.0%}); final val loss (capped), mean over seeds: {means}"
    )
    return text, {"loss_shift": shift, **details}


def overflow_notes(arms: Arms, cfg: Config, ablate: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    multipliers = [v for v in arms.values("overflow", "injected_multiplier", spike="param").values() if v is not None]
    broken = divergence_rates(
        _diverged(arms, "overflow", precision="fp16", spike="param"),
        _diverged(arms, "overflow", precision="bf16", spike="param"),
    )
    shown = sorted({f"2^{round(math.log2(m))}" for m in multipliers}) or "-"
    text = (
        f"block 0's weights x the probe's multiplier at step {cfg.ablation.inject_step} (multipliers {shown}); "
        f"runs broken under the injection fp16 vs bf16 {rate_line(broken)}"
    )
    return text, {"divergence": broken, "multipliers": multipliers}


def beta2_notes(arms: Arms, cfg: Config, ablate: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    a = cfg.ablation
    final = pooled_and_halves(
        per_seed_difference(
            arms.values("beta2", "capped_loss", beta2=0.999), arms.values("beta2", "capped_loss", beta2=0.95)
        ),
        ablation_halves(cfg),
    )
    text = (
        f"clean runs of {a.beta2_steps} steps at LR ablation.lr = {a.lr:g} x"
        f"{', x'.join(f'{m:g}' for m in a.beta2_lr_mults)}, per seed the mean over those LRs; final loss "
        f"0.999 − 0.95 {compare_line(final)}"
    )
    return text, {"capped_loss": final}


def wortsman_notes(arms: Arms, cfg: Config, ablate: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    critical: dict[str, dict[int, float | None]] = {}
    for s in cfg.ablation.stabilizers:
        for (seed, lr), diverged in sorted(arms.values("wortsman", "diverged", stabilizer=s).items()):
            lowest = critical.setdefault(s, {}).setdefault(seed, None)
            if diverged and lowest is None:
                critical[s][seed] = lr
    text = f"LRs {', '.join(f'{lr:g}' for lr in cfg.ablation.lrs)}; lowest LR that diverged, per seed: " + ", ".join(
        f"{s} {[c[k] for k in sorted(c)]}" for s, c in critical.items()
    )
    return text, {"critical_lr": critical}


NOTES: dict[str, Callable[..., tuple[str, dict[str, Any]]]] = {
    "xiong": xiong_notes,
    "fp16": fp16_notes,
    "overflow": overflow_notes,
    "beta2": beta2_notes,
    "wortsman": wortsman_notes,
}
"""Per declared finding, the numbers a reader checks beside its claims: divergence rates, the
probes' conditions, the LR grid (text for the report, values for metrics/report.json)."""

SPECIAL: dict[str, Callable[..., Finding]] = {"xiong_init": xiong_init, "mu_transfer": mu_transfer, "spike": spike}


def evaluate(
    cfg: Config,
    ablate: dict[str, Any],
    search: dict[str, Any] | None,
    spike_metrics: dict[str, Any] | None,
    unigram: float | None,
) -> list[Finding]:
    """Every built-in finding, in the pre-registration's order (a declared family's:
    tasks/report/declared.py)."""
    families = {f.name: f for f in builtin_families(cfg)}
    found = []
    for key in design()["findings"]:
        if key in SPECIAL:
            found.append(SPECIAL[key](cfg=cfg, ablate=ablate, search=search, spike=spike_metrics, unigram=unigram))
        else:
            found.append(builtin_finding(key, families[FAMILY_OF[key]], cfg, ablate, unigram))
    return found


def builtin_finding(
    key: str, family: DeclaredFamily, cfg: Config, ablate: dict[str, Any], unigram: float | None
) -> Finding:
    """A declared built-in finding: its claims by the declared engine, its notes beside them."""
    if not family.claims:
        return _missing(key, family.missing or "the config crosses none of the variants its claims compare")
    notes = NOTES[key](Arms(ablate), cfg, ablate)
    return declared_finding(cfg, ablate, unigram, family, key=key, notes=notes)


def family_finding(cfg: Config, ablate: dict[str, Any], unigram: float | None, family: DeclaredFamily) -> Finding:
    """The finding of one family of arms, built-in or declared, as the report stage judges it."""
    key = builtin_names().get(family.name)
    return builtin_finding(key, family, cfg, ablate, unigram) if key else declared_finding(cfg, ablate, unigram, family)


def mark_fragile(findings: list[Finding], cfg: Config, sensitivity: dict[str, Any] | None) -> None:
    """The registered replication (issue 58, after version 3's results): every claim that holds on
    the full data is tested again on the sensitivity stage's perturbed data, at the seeds it reran
    (metrics/sensitivity.json), and marked FRAGILE (``Claim.fragile``, why) where it does not
    replicate there (:func:`not_replicated`). A finding the stage did not rerun is left as it is."""
    if not sensitivity:
        return
    families = {f.name: f for f in builtin_families(cfg)}
    perturbed = Arms({"arms": sensitivity.get("arms") or []})
    for f in findings:
        rows = (sensitivity.get("findings", {}).get(f.key) or {}).get("claims") or []
        family = families.get(FAMILY_OF.get(f.key, ""))
        if family is None or len(rows) != len(f.claims):
            continue
        for claim, row, declared in zip(f.claims, rows, family.claims, strict=False):
            if claim.holds:
                claim.fragile = not_replicated(claim, row, perturbed, family, declared)


def not_replicated(
    claim: Claim, row: dict[str, Any], perturbed: Arms, family: DeclaredFamily, declared: DeclaredClaim
) -> str | None:
    """Why the claim does not replicate on the perturbed data, or None: the claim's own test at the
    rerun's seeds at α, unadjusted (one claim, one replication), without the SESOI (a rerun of 4
    seeds has an MDE near 1.9 SD): a direction claim's paired t-test significant the predicted
    way, an equivalence claim's TOST significant, a divergence-rate claim's exact test significant
    the predicted way, or, where its seeds are too few for any p below α (2^(1-n)), every seed
    discordant the predicted way."""
    where = f"under the registered data perturbation (seeds {', '.join(row['perturbed']['per_seed'])})"
    if claim.kind == RATE:
        sides = rate_sides(declared) or ({}, {})
        d = divergence_rates(*(diverged_seeds(perturbed, family, side) for side in sides))
        toward = d["discordant"][0 if claim.expected > 0 else 1]
        if (significant(d["p"]) and toward > d["discordant"][1 if claim.expected > 0 else 0]) or (
            d["n"] and toward == d["n"] and 2.0 ** (1 - d["n"]) >= ALPHA
        ):
            return None
        return f"{where}: diverged {rate_line(d)}"
    values = {(int(s),): float(v) for s, v in row["perturbed"]["per_seed"].items()}
    if claim.kind == EQUIVALENCE:
        tost = tost_paired(list(values.values()), claim.sesoi)
        return None if significant(tost["p"]) else f"{where}: TOST p = {tost['p']}, not inside ±{claim.sesoi:g}"
    tested = pooled_and_halves(values, {})
    if significant(tested["p"]) and (tested["estimate"] > 0) == (claim.expected > 0):
        return None
    return f"{where}: {compare_line(tested, claim.unit)}, not significant the predicted way"


CROSSED = (REPRODUCED, CONTRADICTED, NEGLIGIBLE)
"""The sequential outcomes that end a claim's walk at a boundary."""


def family_state(finding: Finding) -> str | None:
    """Whether a family trained in rounds stops after this look: GATED when a precondition failed or
    every claim's own gate did, DECIDED when every tested claim crossed a boundary, None while one
    has not (after the last look the schedule then says it stopped at the last round)."""
    if finding.precondition_failed:
        return GATED
    judged = [c for c in finding.claims if c.not_tested is None]
    if judged and all((c.sequential or {}).get("outcome") in CROSSED for c in judged):
        return DECIDED
    return None
