"""How a spike study's branch is read against its seed's control: the spike classified (recoverable,
lingering, divergent), the branch's outcome (recovered, gap, gave up), and its scores (the gap the
paired comparison reads, the excess area, the detector's latency, what the incident cost). Pure
functions of the branches' recorded losses; tasks/spike/study.py runs the branches."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from model.spike.branch import Branch
from model.spike.injections import Injection
from tasks.design.curves import trailing_mean
from tasks.spike.config import RecoveryConfig


class Classification(NamedTuple):
    type: int  # 1 recoverable, 2 lingering, 3 divergent
    steps_to_recover: int | None  # steps after the injection until back within ε for good
    final_gap: float  # smoothed relative gap to the control at the end
    why: str


def classify(
    branch: Sequence[float], control: Sequence[float], epsilon: float, within: int, smooth: int
) -> Classification:
    """The spike type of a branch's per-step losses against the control's over the same steps
    (index 0: the first injected step); seed 004's three trajectories, with ε and W from
    ``recovery.recover_epsilon`` and ``recovery.recover_steps``:

      3 divergent    a non-finite loss, or the gap above ε at the end and still widening (the
                     last ``smooth`` steps' gap above the ``smooth`` before by more than ε)
      1 recoverable  back within ε of the control (smoothed, relative) at most W steps after
                     the injection, and within it from then on
      2 lingering    otherwise: back later than W, or settled more than ε above the control

    A branch with no step in the window (a policy that gave up before it) counts as divergent.
    """
    b, c = np.asarray(branch, dtype=float), np.asarray(control, dtype=float)[: len(branch)]
    if not len(b):
        return Classification(3, None, float("nan"), "no step in the window: the run gave up before it")
    if not np.isfinite(b).all():
        return Classification(3, None, float("nan"), "non-finite loss")
    gap = trailing_mean(b, smooth) / trailing_mean(c, smooth) - 1.0
    final = float(gap[-1])
    above = np.flatnonzero(gap > epsilon)
    back = 0 if not len(above) else int(above[-1]) + 1
    back_at = back if back < len(gap) else None
    late, before = gap[-smooth:].mean(), gap[-2 * smooth : -smooth].mean() if len(gap) >= 2 * smooth else gap[0]
    if final > epsilon and late > before + epsilon:
        return Classification(3, None, final, f"gap {final:+.1%} at the end and still widening")
    if back_at is not None and back_at <= within:
        return Classification(1, back_at, final, f"back within {epsilon:.0%} of the control after {back_at} steps")
    if back_at is not None:
        return Classification(2, back_at, final, f"back within {epsilon:.0%} only after {back_at} steps (> {within})")
    return Classification(2, None, final, f"settled {final:+.1%} from the control (> {epsilon:.0%})")


def capped(loss: float | None, cap: float) -> float:
    """A loss as the scores read it: at most ``cap`` (ln V), and the cap where it is not finite."""
    return min(loss, cap) if loss is not None and math.isfinite(loss) else cap


def unreached_loss(branch: Branch, cap: float) -> float:
    """What a step the branch never ran counts at. A branch that gave up (the retry cap) is left
    where its policy left it: the model that had just spiked again, trained no further, so every
    step after it counts at the loss of the step it gave up at (capped). That is the branch's own
    number, borrowed from no other branch or seed, so each seed's pair stays a pair; it scores the
    give-up in the same comparison as every other branch, where dropping it would favour the
    policies that give up. Any other stop (diverged) counts at the cap, as a diverged arm's loss
    is its loss at init (tasks/design/stats.py: capped_loss)."""
    if branch.status == "stopped" and branch.rows:
        return capped(branch.rows[-1]["loss"], cap)
    return cap


def window_curves(branch: Branch, control: Branch, smooth: int, cap: float) -> tuple[np.ndarray, np.ndarray]:
    """The branch's and the control's smoothed losses over the control's steps (the injection to
    the window's end). Every loss is capped at ``cap`` (ln V, the loss of a uniform guess), a loss
    that is not finite counts at the cap, and a step the branch never reached at
    :func:`unreached_loss`."""
    mine = {r["step"]: r["loss"] for r in branch.rows}
    missing = unreached_loss(branch, cap)
    steps = [r["step"] for r in control.rows]
    b = np.array([capped(mine[s], cap) if s in mine else missing for s in steps])
    c = np.array([capped(r["loss"], cap) for r in control.rows])
    return trailing_mean(b, smooth), trailing_mean(c, smooth)


def detected(branch: Branch, injection: Injection, within: int) -> bool:
    """Whether the detector caught the injected spike: a flag from the injection's first step to
    ``within`` steps after its last (``spike.detect_within``)."""
    last = injection.start + injection.duration - 1 + within
    return any(injection.start <= step <= last for step in branch.detections)


def outcome(status: str, spike_type: int) -> str:
    """``gave_up``: the branch did not run its window out (the policy's retry cap, or any stop
    other than divergence); ``recovered``: it completed and came back in time (type 1); ``gap``:
    otherwise (back late, settled above, or diverged: a diverged run is a result, as in the arms)."""
    if status not in ("completed", "diverged"):
        return "gave_up"
    return "recovered" if status == "completed" and spike_type == 1 else "gap"


def excess_area(branch: np.ndarray, control: np.ndarray) -> float:
    """Area of excess loss, nat·steps: the sum over steps of max(0, branch − control), both smoothed;
    what the spike cost on top of the clean run, whether it lingered or came back."""
    return float(np.clip(branch - control, 0.0, None).sum())


def aligned_losses(branch: Branch, control: Branch) -> tuple[list[float], list[float]]:
    """Losses of the steps both ran, in step order (a branch that gave up ends early)."""
    mine = {r["step"]: r["loss"] for r in branch.rows}
    steps = [r["step"] for r in control.rows if r["step"] in mine]
    theirs = {r["step"]: r["loss"] for r in control.rows}
    return [mine[s] for s in steps], [theirs[s] for s in steps]


@dataclasses.dataclass(frozen=True)
class Costs:
    """What one step costs, measured on the control: for tokens, FLOPs and dollars wasted."""

    seconds_per_step: float
    tokens_per_step: int
    flops_per_token: float
    gpu_hour_usd: float


def score(
    branch: Branch,
    control: Branch,
    injection: Injection,
    r: RecoveryConfig,
    costs: Costs,
    cap: float,
    detect_within: int,
) -> dict[str, Any]:
    """A policy's scores against the control (seed 004's incident cost included). ``scored_gap``
    (relative, at the window's end) reads the capped curves of :func:`window_curves`, a branch that
    gave up included (:func:`unreached_loss`): what the paired comparison reads, so no seed drops
    out. ``final_gap`` and ``excess_area`` are the same reading for a branch that ran its window
    out, None for one that gave up (its ``outcome`` says so); the type describes the raw losses of
    the steps it ran. ``detected``: whether the detector caught the injected spike
    (:func:`detected`); a missed spike's branch is scored all the same (its policy never acted)."""
    losses, control_losses = aligned_losses(branch, control)
    kind = classify(losses, control_losses, r.recover_epsilon, r.recover_steps, r.smooth_steps)
    result = outcome(branch.status, kind.type)
    smooth_branch, smooth_clean = window_curves(branch, control, r.smooth_steps, cap)
    gap = float(smooth_branch[-1] / smooth_clean[-1] - 1.0)
    scored = result != "gave_up"
    smooth_control = trailing_mean(np.asarray(control_losses), r.smooth_steps)
    peak = max(losses[i] / smooth_control[i] for i in range(len(losses))) if losses else float("nan")
    rerun = branch.steps_run - control.steps_run
    vetoed = sum(1 for row in branch.rows if row["skipped"])
    # Steps off the control's track (a recoverable branch, type 1, always came back at a step).
    spent = kind.steps_to_recover if kind.type == 1 and kind.steps_to_recover is not None else r.eval_steps
    wasted = max(0, rerun) + vetoed + spent
    flagged = [d for d in branch.detections if d >= injection.start]
    return {
        "outcome": result,
        "type": kind.type,
        "why": kind.why,
        "steps_to_recover": kind.steps_to_recover,
        "peak_ratio": peak,
        "peak_loss": max(losses) if losses else float("nan"),
        "grad_norm_peak": max((row["grad_norm"] for row in branch.rows), default=float("nan")),
        "final_loss": float(np.mean(losses[-r.smooth_steps :])) if losses else float("nan"),
        "scored_gap": gap,
        "final_gap": gap if scored else None,
        "excess_area": excess_area(smooth_branch, smooth_clean) if scored else None,
        "val_loss": branch.val_loss,
        "val_gap": (
            branch.val_loss - control.val_loss if branch.val_loss is not None and control.val_loss is not None else None
        ),
        "detected": detected(branch, injection, detect_within),
        "detected_at": flagged[0] if flagged else None,
        "latency": flagged[0] - injection.start if flagged else None,
        "status": branch.status,
        "stop_reason": branch.stop_reason,
        "steps_run": branch.steps_run,
        "restarts": branch.segments - 1,
        "rerun_steps": rerun,
        "vetoed_steps": vetoed,
        "wasted_steps": wasted,
        "wasted_tokens": wasted * costs.tokens_per_step,
        "wasted_flops": wasted * costs.tokens_per_step * costs.flops_per_token,
        "cost_usd": wasted * costs.seconds_per_step * costs.gpu_hour_usd / 3600,
        "actions": branch.actions,
        "segments": branch.segments,
    }
