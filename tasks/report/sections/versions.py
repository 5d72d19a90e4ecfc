"""The section that shows the earlier version beside this one, claim by claim (tasks/report/versions.py)."""

from __future__ import annotations

from typing import Any

from tasks.report.sections.section import Section, interval, signed, table


def versions_section(compared: dict[str, Any] | None) -> Section | None:
    """Each claim of either version: its estimate, 95 % interval and outcome in each, and what
    became of a claim the earlier version held; None without an earlier version of this profile."""
    if compared is None:
        return None
    earlier = compared["earlier"]
    counts = ", ".join(f"{n} {label}" for label, n in compared["counts"].items()) or "none"
    lines = [
        f"Version {earlier} (exploratory: its conditions were chosen with pilots and earlier results in view) "
        f"beside this run (confirmatory: registered before it ran, on seeds no earlier step used). Only this "
        f"run decides a verdict. Of the {compared['held_earlier']} claims version {earlier} held: {counts}. "
        "A claim either version lacks shows a dash: its design changed, or the budget left it out "
        "(tasks/design/preregistration.yaml, `changes_after_results`).",
        "",
        *table(
            ["finding", "claim", f"version {earlier}", "this run", f"version {earlier}'s held claim"],
            [
                [r["finding"], r["claim"], shown(r["earlier"]), shown(r["now"]), r["replication"] or "-"]
                for r in compared["rows"]
            ],
        ),
        "",
    ]
    return Section(f"Version {earlier} beside this run", lines, anchor="versions")


def shown(side: dict[str, Any] | None) -> str:
    """One version's estimate, interval and outcome in a cell."""
    if side is None:
        return "-"
    if side["estimate"] is None:
        return str(side["outcome"])
    return f"{signed(side['estimate'])} [{interval(side['ci95'])}]: {side['outcome']}"
