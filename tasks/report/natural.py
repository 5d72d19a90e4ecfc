"""The spike finding's secondary analysis (version 4, issue 59): natural spikes scored by the same
policies, pure functions of metrics/ablate.json's ``natural`` record (flows/ablate.py writes it).

The beta2 family's arm at β₂ = 0.999, 4 x LR raises spikes of its own; each policy of
``ablation.natural_policies`` is that arm with the policy attached to its detector, on the first
round's seeds, and continue is the family's own arm. Per policy, paired by seed: the policy's final
validation loss relative to continue's, over the runs where the policy acted (a run its detector
never flagged is continue's run bitwise: it says nothing about the policy), judged as the spike
finding judges a recovery, equivalence within its margin (TOST). Fewer acted runs than the
registered minimum: NOT TESTED. Secondary: its verdicts count in no claim, finding verdict or Holm
family (tasks/design/preregistration.yaml: findings.spike.secondary)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tasks.design.preregistration import design
from tasks.report.method import equivalence_within
from tasks.report.recovery import margin
from tasks.report.verdict import Claim

EQUIVALENT, WORSE, BETTER, NOT_SHOWN = (
    "equivalent to continue",
    "worse than continue",
    "better than continue",
    "not shown",
)
"""A policy's verdict: TOST within ±margin holds; the 95 % interval wholly above +margin (worse)
or below −margin (better); otherwise not shown."""

CONTINUE = "continue"


def min_runs() -> int:
    """The registered fewest runs in which a policy must have acted for it to be tested."""
    value: int = design()["findings"]["spike"]["secondary"]["min_runs"]
    return value


def acted(run: Mapping[str, Any]) -> bool:
    """The policy acted in this run: its detector flagged a step and the policy recorded an action."""
    return bool(run.get("actions"))


def relative_gaps(
    runs: Mapping[str, Mapping[str, Any]], control: Mapping[str, Mapping[str, Any]]
) -> dict[tuple, float]:
    """Per seed (a pairing unit) where the policy acted and continue ran: (policy − continue) /
    continue on the capped final validation loss."""
    return {
        (int(seed),): (run["capped_loss"] - control[seed]["capped_loss"]) / control[seed]["capped_loss"]
        for seed, run in runs.items()
        if acted(run) and seed in control
    }


def natural_claim(
    policy: str,
    runs: Mapping[str, Mapping[str, Any]],
    control: Mapping[str, Mapping[str, Any]],
    least: int,
    within: float,
) -> Claim:
    """The policy's equivalence to continue within ±``within`` over the seeds where it acted, the
    seeds one half (the first round); NOT TESTED where fewer than ``least`` runs acted."""
    what = f"natural spikes: {policy} − continue, relative final validation loss"
    gaps = relative_gaps(runs, control)
    if len(gaps) < least:
        why = f"{policy} acted in {len(gaps)} of {len(runs)} runs, fewer than the registered {least}"
        return Claim(what, None, None, 0, kind="equivalence", sesoi=within, unit="relative", not_tested=why)
    return equivalence_within(what, gaps, {"discovery": sorted(s for (s,) in gaps)}, within, "relative")


def natural_label(claim: Claim) -> str:
    """The policy's verdict (EQUIVALENT, WORSE, BETTER, NOT_SHOWN) by the equivalence rule
    (tasks/report/verdict.py), unadjusted; an untested policy says why."""
    if claim.not_tested:
        return f"not tested ({claim.not_tested})"
    if claim.holds:
        return EQUIVALENT
    if claim.contradicted:
        return WORSE if (claim.estimate or 0.0) > 0 else BETTER
    return NOT_SHOWN


def actions_of(runs: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
    """What a policy did over its runs: how many runs it acted in, the steps its detector flagged,
    its actions and each kind of action."""
    every = [a["action"] for run in runs.values() for a in run.get("actions", [])]
    return {
        "runs": len(runs),
        "acted": sum(1 for run in runs.values() if acted(run)),
        "flagged": sum(run.get("flagged", 0) for run in runs.values()),
        "actions": len(every),
        "vetoed": sum(1 for a in every if a.startswith("update vetoed")),
        "let_through": sum(1 for a in every if a.startswith("let through")),
        "lowered_lr": sum(1 for a in every if a.startswith("LR x")),
    }


def analyse(record: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per policy of the record: its claim's numbers, verdict and what it did (metrics/ablate.json:
    natural.analysis). No Holm: a secondary analysis, each policy read at α alone."""
    control = record["runs"][CONTINUE]
    out = {}
    for policy in record["policies"]:
        runs = record["runs"][policy]
        claim = natural_claim(policy, runs, control, min_runs(), margin())
        out[policy] = {
            "verdict": natural_label(claim),
            "estimate": claim.estimate,
            "ci95": claim.ci95,
            "tost_p": claim.p,
            "margin": claim.sesoi,
            "power": claim.power,
            "seeds_needed": claim.seeds_needed,
            "gaps": {str(s): g for (s,), g in relative_gaps(runs, control).items()},
            **actions_of(runs),
        }
    return out
