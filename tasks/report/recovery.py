"""The spike finding's rules of version 4 (issue 59), pure functions of metrics/spike.json: a policy's
recovery judged as equivalence to its origin's clean control within the SESOI (TOST), the step-tied
claim as rollback_lower_lr against every other policy, and the detector's latency per cause.

A branch's scored gap is already its difference from its own origin's clean control
(tasks/spike/scores.py: scored_gap), so the per-origin gaps are the paired differences the
equivalence test reads: "recovered" means the data rule out a gap as large as the SESOI either way,
pooled (TOST at α) and in each half of the origins (the replication rule's reading of an
equivalence claim: each half's estimate inside the margin)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tasks.design.preregistration import design
from tasks.report.method import Halves, direction, equivalence_within, pooled_and_halves, subtract
from tasks.report.verdict import Claim

RECOVERED, NOT_SHOWN, WORSE, BETTER = "recovered (equivalent to clean)", "not shown", "worse", "better than clean"
"""A cell's recovery verdict: the TOST within ±margin holds (pooled and every half inside);
the 95 % interval lies wholly above +margin (every half above 0): the branch ended worse than its
clean control by more than the SESOI; wholly below -margin: better than it (a lower LR late in a
run can end below the control); otherwise not shown."""

BEST_FOR_STEP = "rollback_lower_lr"
"""The one policy the playbook (D) predicts to help a step-tied spike: it changes the LR the
replayed pulse meets."""


def margin() -> float:
    """The registered equivalence margin of a recovery (the spike finding's ``margin``: ε)."""
    value: float = design()["findings"]["spike"]["margin"]
    return value


def scored_gap(cell: Mapping[str, Any]) -> float | None:
    """A branch's scored gap (version 3 on), or a version-2 branch's final gap (None for a give-up)."""
    gap: float | None = cell.get("scored_gap", cell["final_gap"])
    return gap


def scored_gaps(matrix: Mapping[str, Any], cause: str, policy: str) -> dict[tuple, float]:
    """Per origin (its seed, as a pairing unit), the branch's scored gap to its clean control: a
    branch that gave up is scored at the loss it gave up at, never dropped (tasks/spike/scores.py)."""
    cells = matrix.get(cause, {}).get(policy, {})
    gaps = {(int(seed),): scored_gap(cell) for seed, cell in cells.items()}
    return {unit: gap for unit, gap in gaps.items() if gap is not None}


def recovery(what: str, gaps: dict[tuple, float], halves: Halves, within: float) -> Claim:
    """The equivalence of a cell's per-origin gaps to 0 (its clean control) within ±``within``."""
    return equivalence_within(what, gaps, halves, within, "relative")


def recovery_label(claim: Claim) -> str:
    """The cell's verdict (RECOVERED, WORSE, BETTER, NOT_SHOWN) by the project's equivalence rule
    (tasks/report/verdict.py: holds, contradicted), on its Holm-adjusted p where it is a claim;
    a cell whose gate failed says why."""
    if claim.not_tested:
        return f"not tested ({claim.not_tested})"
    if claim.holds:
        return RECOVERED
    if claim.contradicted:
        return WORSE if (claim.estimate or 0.0) > 0 else BETTER
    return NOT_SHOWN


def recovery_text(claim: Claim) -> str:
    """A recovery in a line: its verdict, mean gap to the clean control [95 % interval], the TOST p
    against ±margin (Holm-adjusted where it is a claim) and each half's estimate."""
    if claim.estimate is None:
        return f"{recovery_label(claim)}, no gap"
    ci = f" [{claim.ci95[0]:+.3g}, {claim.ci95[1]:+.3g}]" if claim.ci95 else ""
    p = "untested" if claim.p is None else f"{claim.p:.3g}"
    holm = "" if claim.p_adjusted is None else f" (Holm {claim.p_adjusted:.3g})"
    halves = ", ".join(f"{h} {'-' if e is None else format(e, '+.3g')}" for h, e in claim.halves.items())
    return f"{recovery_label(claim)}: gap {claim.estimate:+.3g}{ci}, TOST ±{claim.sesoi:g} p={p}{holm}; {halves}"


def step_comparisons(
    matrix: Mapping[str, Any], halves: Halves, policies: Sequence[str], cause: str = "lr"
) -> dict[str, dict[str, Any]]:
    """Per other policy, rollback_lower_lr − that policy on the scored gap over the same origins:
    the paired test pooled and within each half (skip_step and swap_data included)."""
    mine = scored_gaps(matrix, cause, BEST_FOR_STEP)
    return {
        other: pooled_and_halves(subtract(mine, scored_gaps(matrix, cause, other)), halves)
        for other in policies
        if other != BEST_FOR_STEP
    }


def step_tied(comparisons: Mapping[str, dict[str, Any]], cause: str = "lr") -> dict[str, Claim]:
    """The step-tied claim, one directional claim per other policy (keyed by it), each predicted
    below −SESOI (the registered ``step_best``); the claim holds only where every one holds
    (:func:`step_tied_verdict`)."""
    return {
        other: direction(
            "spike", "step_best", f"{cause}×{BEST_FOR_STEP} − {cause}×{other}, scored gap", tested, -1, "relative"
        )
        for other, tested in comparisons.items()
    }


def step_tied_verdict(claims: Mapping[str, Claim]) -> str:
    """``holds`` only where rollback_lower_lr beat every other policy (each comparison holds, on its
    Holm-adjusted p); ``contradicted`` where some policy beat it by the same standard; else ``not
    shown``, naming the policies it was not shown to beat."""
    untested = [c.not_tested for c in claims.values() if c.not_tested]
    if not claims or untested:
        return "not tested" + "".join(f" ({why})" for why in untested[:1])
    beaten_by = [other for other, c in claims.items() if c.contradicted]
    if beaten_by:
        return f"contradicted: {', '.join(beaten_by)} ended below {BEST_FOR_STEP} by more than the SESOI"
    open_ = [other for other, c in claims.items() if not c.holds]
    if open_:
        return f"not shown: {BEST_FOR_STEP} not shown better than {', '.join(open_)}"
    return f"holds: {BEST_FOR_STEP} better than each of the {len(claims)} other policies"


def latencies(spike: Mapping[str, Any], cause: str, observed: str = "continue") -> dict[int, int | None]:
    """Per origin in the matrix (past the plateau), the detector's latency on the cause: steps from
    the injection's first step to the first flag on the observed branch (every branch runs the same
    steps up to it); None where it never flagged."""
    seeds = spike["matrix"].get(cause, {}).get(observed, {})
    return {int(s): spike["seeds"][s][cause].get(observed, {}).get("latency") for s in seeds}


def latency_text(by_origin: Mapping[int, int | None]) -> str:
    """``latency 0-37 steps (median 4) at 7 origins, never flagged at 1``, or ``no origins``."""
    flagged = sorted(v for v in by_origin.values() if v is not None)
    missed = len(by_origin) - len(flagged)
    if not flagged:
        return f"never flagged at {missed} origins" if missed else "no origins"
    text = f"latency {flagged[0]}-{flagged[-1]} steps (median {float(np.median(flagged)):g}) at {len(flagged)} origins"
    return text + (f", never flagged at {missed}" if missed else "")


def poison_met(
    policy: str, poison: Mapping[int, int], latency: Mapping[int, int | None], window: int, rollback_steps: int
) -> list[int]:
    """The origins at which a data policy may meet poison, so that its recovery is not given by
    construction (the claim can come out otherwise there). Never flagged: the policy never acts.
    skip_batch restores the state just before the first flag, so any poisoned update before it
    (latency > 0) stays, and skips ``window`` batches from the flag; a rollback restores a checkpoint
    ``rollback_steps`` before the flag (before the stretch unless the latency reaches that) and skips
    to the same window's end; swap_data keeps the updates before the flag. A stretch longer than
    latency + window goes on past the window (skip_batch and the rollbacks meet its rest)."""

    def meets(lat: int | None, length: int) -> bool:
        if lat is None:
            return True
        if policy == "swap_data":
            return lat > 0
        beyond = length > lat + window
        return beyond or (lat > 0 if policy == "skip_batch" else lat >= rollback_steps)

    return [s for s, lat in sorted(latency.items()) if s in poison and meets(lat, poison[s])]
