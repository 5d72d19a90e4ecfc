"""The spike study's summary over its seeds (metrics/spike.json): what each spike looked like with
nobody intervening, the cause x policy x seed matrix of outcomes, the plateau gate over the origins,
the detector's rate per cause and each policy's give-ups."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from tasks.config import Config
from tasks.design.curves import trailing_mean
from tasks.design.preregistration import design
from tasks.spike.study import Study


def observed_policy(policies: Iterable[str]) -> str:
    """The branch that shows a spike with nobody intervening: ``continue``, else the first. Every
    branch of a cause runs the same steps up to the detector's first flag (the policies act on
    flags alone), so its detection is every branch's."""
    names = list(policies)
    return "continue" if "continue" in names else names[0]


def symptoms(study: Study, kind: str) -> dict[str, Any]:
    """What the spike looked like with nobody intervening (:func:`observed_policy`)."""
    r, injection = study.cfg.recovery, study.injections[kind]
    policy = observed_policy(study.branches[kind])
    rows = study.branches[kind][policy].rows
    after = [row for row in rows if row["step"] >= injection.start]
    before = [row["loss"] for row in study.warm.rows][-r.smooth_steps :]
    peak = max(after, key=lambda row: row["loss"])
    grad_peak = max(after, key=lambda row: row["grad_norm"])
    smoothed = trailing_mean(np.array([row["loss"] for row in after]), r.smooth_steps)
    later = min(r.recover_steps, len(after) - 1)
    return {
        "observed_policy": policy,
        "pre_spike_loss": float(np.mean(before)),
        "peak_loss": peak["loss"],
        "peak_step": peak["step"],
        "recovery_loss": float(smoothed[later]),
        "recovery_step": after[later]["step"],
        "grad_norm_peak": grad_peak["grad_norm"],
        "grad_norm_peak_step": grad_peak["step"],
    }


def origin_metrics(study: Study) -> dict[str, Any]:
    """One seed's entry of ``metrics/spike.json``: its origin run, and per injection and policy the
    scores without the action log, and the injection as run (``tied_to`` included: the finding
    checks it)."""
    control_losses = [r["loss"] for r in study.control.rows]
    out: dict[str, Any] = {
        "origin_run": study.origin_run,
        "fork_step": study.fork_step,
        "end_step": study.end_step,
        "false_positives": len(study.false_positives),
        "false_positive_steps": study.false_positives,
        "seconds_per_step": study.costs.seconds_per_step,
        "cpu_seconds": study.cpu_seconds,
        "control": {
            "final_loss": float(np.mean(control_losses[-study.cfg.recovery.smooth_steps :])),
            "val_loss": study.control.val_loss,
        },
        "collapse_before": study.collapse_before,
    }
    for kind, by_policy in study.scores.items():
        out[kind] = {
            "injection": study.injections[kind].spec(),
            "replay_spiked": study.replays[kind]["spiked"],
            "symptoms": symptoms(study, kind),
            **{p: {k: v for k, v in s.items() if k not in ("actions", "why")} for p, s in by_policy.items()},
        }
    return out


MATRIX_FIELDS = (
    "outcome",
    "scored_gap",
    "final_gap",
    "excess_area",
    "detected",
    "latency",
    "type",
    "status",
    "restarts",
    "steps_run",
)
"""What the matrix keeps of a branch's scores: what the finding and the report's table read."""

Matrix = dict[str, dict[str, dict[str, dict[str, Any]]]]
"""cause -> policy -> seed -> a branch's MATRIX_FIELDS."""


def matrix(studies: Sequence[Study], cfg: Config) -> Matrix:
    """cause -> policy -> seed -> the branch's outcome and scores (MATRIX_FIELDS), over ``studies``;
    every cause of ``spike.kinds`` and every policy has its cell, if empty, so a reader finds the
    grid whatever origins it holds."""
    out: Matrix = {kind: {p: {} for p in cfg.recovery.policies} for kind in cfg.spike.kinds}
    for study in studies:
        for kind, by_policy in study.scores.items():
            for policy, scores in by_policy.items():
                cell = out.setdefault(kind, {}).setdefault(policy, {})
                cell[str(study.seed)] = {k: scores[k] for k in MATRIX_FIELDS}
    return out


def plateau_gate(studies: Sequence[Study], unigram: float, margin: float) -> dict[str, Any]:
    """The plateau gate, one origin at a time (method: plateau): an origin whose validation loss at
    its checkpoint is not ``margin`` nats below the unigram baseline has learned no more than
    unigram statistics, a spike on it tests nothing, and it leaves the study, its seed named in
    ``excluded`` (a mean over origins would let one past the bound carry one that is not). ``why``:
    the half of the seeds (discovery, confirmation; one with no seeds aside) that keeps fewer than
    ``spike.min_origins_per_half`` origins, with which the finding is not tested; None if none."""
    spike = studies[0].cfg.spike
    bound = unigram - margin

    def passed(loss: float | None) -> bool:
        return loss is not None and math.isfinite(loss) and loss <= bound

    origins = {str(s.seed): {"role": s.origin_run["role"], "val_loss": s.origin_run["val_loss"]} for s in studies}
    for entry in origins.values():
        entry["passed"] = passed(entry["val_loss"])
    halves = {"discovery": spike.seeds, "confirmation": spike.confirm_seeds}
    short = [
        f"{half}: {kept} of {len(seeds)} origins past the plateau (needs >= {spike.min_origins_per_half})"
        for half, seeds in halves.items()
        if seeds and (kept := sum(origins[str(seed)]["passed"] for seed in seeds)) < spike.min_origins_per_half
    ]
    return {
        "unigram_val_loss": unigram,
        "margin": margin,
        "bound": bound,
        "origins": origins,
        "excluded": [int(seed) for seed, entry in origins.items() if not entry["passed"]],
        "min_origins_per_half": spike.min_origins_per_half,
        "why": "; ".join(short) or None,
    }


def detection(cells: Matrix) -> dict[str, dict[str, Any]]:
    """Per cause, how often the detector caught the injected spike over the matrix's origins (each
    cause's observed branch, :func:`observed_policy`), and the seeds it missed; a missed spike's
    branches stay in the matrix, scored (their policies never acted). Also each origin's latency
    (steps from the injection's first step to the first flag; None: never flagged) and their
    distribution (:func:`latency_spread`): a latency of 0 at every origin means the policies
    acted on the spike's first step by construction."""
    out = {}
    for cause, by_policy in cells.items():
        by_seed = by_policy[observed_policy(by_policy)] if by_policy else {}
        missed = [int(seed) for seed, cell in by_seed.items() if not cell["detected"]]
        injected = len(by_seed)
        latency = {seed: cell["latency"] for seed, cell in by_seed.items()}
        out[cause] = {
            "injected": injected,
            "detected": injected - len(missed),
            "rate": (injected - len(missed)) / injected if injected else None,
            "missed_seeds": missed,
            "latency": latency,
            "latency_spread": latency_spread([v for v in latency.values() if v is not None]),
        }
    return out


def latency_spread(latencies: Sequence[int]) -> dict[str, float | int] | None:
    """Fewest, median and most steps to the first flag over the origins the detector flagged, and
    how many distinct values they take (1: every origin flagged at the same step); None if none was."""
    if not latencies:
        return None
    return {
        "min": min(latencies),
        "median": float(np.median(latencies)),
        "max": max(latencies),
        "distinct": len(set(latencies)),
    }


def give_ups(cells: Matrix) -> dict[str, dict[str, int]]:
    """Per cause and policy, the branches that gave up (the retry cap) over the matrix's origins:
    scored like every branch (:func:`unreached_loss`), and counted apart."""
    return {
        cause: {p: sum(c["outcome"] == "gave_up" for c in by_seed.values()) for p, by_seed in by_policy.items()}
        for cause, by_policy in cells.items()
    }


def summary_metrics(studies: Sequence[Study], unigram: float) -> dict[str, Any]:
    """``metrics/spike.json``: the cause x policy x seed matrix over the origins past the plateau
    (``plateau``: every origin's gate, the excluded seeds, and why the finding is not tested if a
    half keeps too few), its causes and policies in the config's order (the file's keys are sorted),
    the detection rate and the give-ups per cause, every seed's entry (its origin run, drawn poison
    length and details, excluded origins too), which seeds discover and which confirm, and the
    totals."""
    cfg = studies[0].cfg
    gate = plateau_gate(studies, unigram, design()["plateau_margin"])
    cells = matrix([s for s in studies if s.seed not in gate["excluded"]], cfg)
    out = {
        "matrix": cells,
        "causes": cfg.spike.kinds,
        "policies": cfg.recovery.policies,
        "plateau": gate,
        "detection": detection(cells),
        "give_ups": give_ups(cells),
        "poison_batches": {str(s.seed): s.injections["data"].duration for s in studies if "data" in s.injections},
        "seeds": {str(s.seed): origin_metrics(s) for s in studies},
        "discovery_seeds": cfg.spike.seeds,
        "confirm_seeds": cfg.spike.confirm_seeds,
        "postmortem_seed": studies[0].seed,
        "false_positives": sum(len(s.false_positives) for s in studies),
        "cpu_seconds": sum(s.cpu_seconds for s in studies),
    }
    plain: dict[str, Any] = json.loads(json.dumps(out, default=str))
    return plain
