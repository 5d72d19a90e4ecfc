"""The spike finding's secondary analysis in the report, beside the spike study: natural spikes
(the β₂ 0.999 x4 arms' own) scored by the policies that act within a run, each against continue
(tasks/report/natural.py, recomputed from metrics/ablate.json's ``natural`` runs)."""

from __future__ import annotations

from typing import Any

from tasks.report.natural import analyse, min_runs
from tasks.report.recovery import margin
from tasks.report.sections.section import Section, table

TITLE = "Natural spikes (secondary analysis of the spike finding)"


def natural_section(ablate: dict[str, Any]) -> Section | None:
    """Per policy: its verdict, the mean relative gap to continue with its 95 % interval, the TOST p,
    and in how many runs it acted (its detector flagged a natural spike) with what it did. None
    where the ablate stage ran no such arms (a profile whose beta2 grid lacks the condition)."""
    record = ablate.get("natural")
    if not record:
        return None
    analysis = analyse(record)
    condition = ", ".join(f"{k} {v:g}" for k, v in record["condition"].items())
    rows = [_row(policy, analysis[policy]) for policy in record["policies"]]
    return Section(
        TITLE,
        [
            f"The beta2 family's arm at {condition} (its spikes are its own, nothing injected) on seeds "
            f"{', '.join(map(str, record['seeds']))}, retrained with each policy attached to its detector; continue "
            "is the family's own arm. Per policy, paired by seed over the runs where it acted: its final validation "
            f"loss relative to continue's, equivalent within ±{margin():.0%} by TOST at α, worse or better by more, "
            f"or not shown; not tested where it acted in fewer than {min_runs()} runs (a run it never acted in is "
            "continue's). Secondary: unadjusted, counted in no claim or verdict. skip_batch and the rollbacks "
            "(restarts) are not run on natural spikes.",
            "",
            *table(["policy", "verdict", "gap to continue [95 %]", "TOST p", "flagged and acted in", "steps"], rows),
            "",
        ],
    )


def _row(policy: str, a: dict[str, Any]) -> list[str]:
    ci = f" [{a['ci95'][0]:+.2%}, {a['ci95'][1]:+.2%}]" if a["ci95"] else ""
    gap = "-" if a["estimate"] is None else f"{a['estimate']:+.2%}{ci}"
    p = "-" if a["tost_p"] is None else f"{a['tost_p']:.3g}"
    did = f"{a['flagged']} flagged: {a['vetoed']} vetoed, {a['let_through']} let through, {a['lowered_lr']} LR lowered"
    return [policy, a["verdict"], gap, p, f"{a['acted']} of {a['runs']} runs", did]
