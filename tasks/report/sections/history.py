"""The change history of the study's design: every change to the design, the arms, sizes, seeds,
thresholds or tests made after any of its results was seen, as the pre-registration records it
(tasks/design/preregistration.yaml, ``changes_after_results``), under the design's hash; the
registrations made with ``spikelab register`` and the results each came after; and where results
are exploratory, the mark on every verdict that says so (:func:`marked_exploratory`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from tasks.design.preregistration import design, design_hash
from tasks.design.registration import CONFIRMATORY, LABEL_KEY, load_records, record_path
from tasks.report.sections.section import Section

BRIEF = 280
"""Characters of each change shown in the report: its opening, where the date, the reason and the
issue are; the whole entry is in the pre-registration (the report stays a page a reader finishes)."""


def changes_section() -> Section:
    changes = design().get("changes_after_results") or []
    lines = [
        f"Design hash `{design_hash()}`. Every change to the design, the arms, sizes, seeds, thresholds or tests "
        "made after any of its results was seen, each by its opening; in full, by number: "
        "tasks/design/preregistration.yaml, `changes_after_results`:",
        "",
        *([f"{i}. {brief(c)}" for i, c in enumerate(changes, 1)] or ["None."]),
        "",
    ]
    return Section("Changes made after a result was seen", lines)


def brief(text: str) -> str:
    """``text`` up to :data:`BRIEF` characters, cut at a word, marked where it was cut."""
    return text if len(text) <= BRIEF else text[:BRIEF].rsplit(" ", 1)[0] + " …"


def unregistered(results: dict[str, dict[str, Any] | None]) -> dict[str, str]:
    """Each stage whose results are not confirmatory, and why (their ``registration`` label: results
    with none were made before registrations existed, and count as exploratory)."""
    found = {}
    for stage, data in results.items():
        if not data:  # the stage has not run
            continue
        label = data.get(LABEL_KEY)
        if not isinstance(label, dict):
            found[stage] = BEFORE_REGISTRATIONS
        elif label.get("state") != CONFIRMATORY:
            found[stage] = str(label.get("why") or "exploratory")
    return found


BEFORE_REGISTRATIONS = "made before registrations"


def reanalysis(results: dict[str, dict[str, Any] | None]) -> str | None:
    """The design's ``reanalysis`` note (rules written after these results were read) where it
    applies: to results made before registrations existed (no label), never to later ones."""
    note = design().get("reanalysis")
    return note if note and BEFORE_REGISTRATIONS in unregistered(results).values() else None


def marked_exploratory(sections: list[Section], exploratory: dict[str, str]) -> list[Section]:
    """The one place the report reads the registration: where a stage's results are exploratory,
    every section with a verdict opens by saying no verdict of it counts."""
    if not exploratory:
        return sections
    why = "; ".join(f"{stage}: {reason}" for stage, reason in exploratory.items())
    line = f"**EXPLORATORY**: results of no registered design ({why}); this verdict counts for nothing."
    return [dataclasses.replace(s, lines=[line, "", *s.lines]) if s.verdict else s for s in sections]


def registrations_section(project: Path, profile: str) -> Section | None:
    """Per registration of the profile: when, at which commit, and which results existed before it
    (tasks/design/registrations/<profile>.yaml: results_before)."""
    records = load_records(project, profile)
    if not records:
        return None
    lines = [f"Registrations of profile {profile} ({record_path(profile)}), oldest first:", ""]
    for i, r in enumerate(records, 1):
        before = [f"{b['path']} ({b['state']}, commit {str(b['commit'])[:12]})" for b in r.get("results_before", [])]
        lines.append(
            f"{i}. {r['registered_at']} at commit `{str(r['commit'])[:12]}`, design `{r['design_hash']}`: "
            f"results that existed before it: {', '.join(before) or 'none'}"
        )
    return Section("Registrations", [*lines, ""])
