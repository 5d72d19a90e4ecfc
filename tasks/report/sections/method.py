"""How the report's verdicts are reached and where its numbers come from: the rule in one
paragraph (:func:`method_section`), then the provenance (:func:`provenance_section`): the code commit,
the config and design hashes, the arithmetic that computed the inputs (tasks/report/arithmetic.py)
and each stage's wall time (:func:`stage_times`)."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

from tasks.config import Config
from tasks.design.preregistration import DESIGN_CODE, design, design_hash
from tasks.design.stats import ALPHA
from tasks.report.lineage import commits_line, trained_at
from tasks.report.method import number
from tasks.report.sections.section import Section, badge
from tasks.report.verdict import CONTRADICTED, INCONCLUSIVE, NEGLIGIBLE, NOT_TESTED, REPRODUCED
from tasks.runtime.staleness import LEDGER


def method_section(ablate: dict[str, Any]) -> Section:
    """The one rule every finding is judged by, the unit of analysis, the baseline and the plateau
    margin; under rounds (version 3), the group-sequential rule."""
    lines = [
        "Each finding was tested as its pre-registered design says (tasks/design/preregistration.yaml), with "
        f"one rule for all: {badge(NOT_TESTED)} when a named precondition failed; {badge(CONTRADICTED)} when a "
        f"claim is shown the other way (p < {ALPHA:g}, the 95 % interval beyond its smallest effect of interest, "
        f"both halves of the seeds that way); {badge(REPRODUCED)} when every claim holds: significant the "
        "predicted way, its 95 % interval clearing its smallest effect of interest (SESOI), and the discovery "
        'and confirmation seeds each pointing that way (a "no effect" claim by two one-sided tests against '
        f"±SESOI); {badge(NEGLIGIBLE)} when every claim is shown smaller than its SESOI either way (two "
        "one-sided tests against ±SESOI, each half of the seeds inside it): the effect the source predicts is "
        f"absent or too small to act on at this scale; {badge(INCONCLUSIVE)} otherwise. The seed is the unit: per-seed differences (averaged over an "
        "LR grid within each seed), the paired t-test, its MDE (the smallest effect it detects with 80 % power; "
        "powered: MDE ≤ SESOI / 2; an equivalence's power is the TOST's own). Diverged runs count at the loss at initialisation, and none is dropped. "
        f"Unigram baseline on validation: **{number(ablate.get('unigram_val_loss'), '{:.3f}')} nats**; every "
        f"variant a claim compares must end {design()['plateau_margin']:g} nats below it (those predicted to "
        "fail aside).",
        *(
            [
                "",
                "Version 3: the families' seeds came in rounds, so a claim of a family of arms is decided by the "
                "group-sequential rule instead: after each round its one-sided tests against ±SESOI (the same "
                "holds / contradicted / negligible) at the level the registered spending leaves that look, which "
                "keeps the fixed design's error rates over all looks ([Seeds in rounds](#seeds-in-rounds)); the "
                "halves are shown, not required.",
            ]
            if ablate.get("sequential")
            else []
        ),
        "",
    ]
    return Section("How a verdict is reached", lines)


def stage_times(outputs: dict[str, dict[str, Any] | None]) -> dict[str, float | None]:
    """Each training stage's wall seconds as its metrics file records it (the search's under
    ``time``); None where the stage did not run or its file records no wall time (a version-3
    spike stage recorded only its CPU seconds)."""
    times: dict[str, float | None] = {}
    for stage, metrics in outputs.items():
        wall = (metrics or {}).get("wall_s", (metrics or {}).get("time", {}).get("wall_s"))
        times[stage] = None if wall is None else float(wall)
    return times


def provenance_section(
    cfg: Config, provenance: dict[str, Any], arithmetic: dict[str, Any], times: dict[str, float | None]
) -> Section:
    """The code, config and design the numbers come from, the arithmetic that computed them and each
    stage's wall time."""
    shown = ", ".join(f"{s} {'not recorded' if t is None else f'{t / 60:.1f} min'}" for s, t in times.items())
    lines = [
        f"- Profile **{cfg.profile}**; {commits_line(provenance['trained'], provenance['commit'])}, "
        f"{provenance['built']} (`{provenance['commit']}`)",
        *_stale_lines(provenance["trained"]),
        f"- config hash `{provenance['config_hash']}` (sha256 of params/resolved.yaml)",
        f"- design hash `{design_hash()}` (sha256 of the pre-registration and the code that decides verdicts: "
        f"{', '.join(DESIGN_CODE)})",
        *_arithmetic_lines(arithmetic),
        *([f"- wall time per stage, as each stage's metrics record it: {shown}"] if times else []),
        "",
    ]
    return Section("Where the numbers come from", lines)


def _stale_lines(lineage: dict[str, dict[str, Any]]) -> list[str]:
    """A line per stage whose outputs are older than its code: what changed since its commit, or
    (commit unrecorded) why and the rerun the ledger owes it."""
    lines = []
    for stage, entry in lineage.items():
        if entry["changed_since"]:
            changed = entry["changed_since"]
            more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
            lines.append(f"  - {stage}: changed since `{entry['commit'][:7]}`: {', '.join(changed[:3])}{more}")
        elif entry["owed"]:
            lines.append(f"  - {stage}: {entry['owed']['reason']}; owed: {entry['owed']['rerun']}")
    return [f"- outputs older than their code ({LEDGER} owes the reruns of those unrecorded):", *lines] if lines else []


def _arithmetic_lines(arithmetic: dict[str, Any]) -> list[str]:
    """Which machine(s) computed the numbers, one line per numeric path."""
    return [
        f"- numeric path `{p}` ({', '.join(e['produced'])}): {e['machine']}" for p, e in arithmetic["inputs"].items()
    ]


def config_hash(project: Path, resolved: Path) -> str:
    path = project / resolved
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.is_file() else "unknown (no params/resolved.yaml)"


def provenance(
    project: Path, resolved: Path, commit: str | None, outputs: dict[str, dict[str, Any] | None]
) -> dict[str, Any]:
    """The report's build stamp (``commit``: the commit it is built at), its config's hash, and
    ``trained``: the commit each stage of ``outputs`` (stage -> metrics) ran at (tasks/report/lineage.py)."""
    return {
        "commit": commit or "unknown (not a git checkout)",
        "config_hash": config_hash(project, resolved),
        "built": time.strftime("%Y-%m-%d %H:%M %Z"),
        "trained": trained_at(project, outputs),
    }
