"""The code the report's numbers came from: per stage that trains, the commit its metrics record
it ran at (``provenance.code``: tasks/runtime/tracking.py, stage_provenance) and whether its
code moved on since, beside the commit the report is built at (its build stamp, which is not
the commit that trained the arms once stage code changes after a study).

Outputs written before stages recorded their commit say so ("unrecorded"), never a guessed
commit; for those the ledger of reruns owed (stale_outputs.yaml, tasks/runtime/staleness.py)
says whether they are older than their code."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tasks.runtime.staleness import changed_since, code_deps, read_ledger

UNRECORDED = "unrecorded"


def trained_at(project: Path, outputs: dict[str, dict[str, Any] | None]) -> dict[str, dict[str, Any]]:
    """Per stage of ``outputs`` (stage -> its metrics; None: not run, left out): ``commit`` (None
    where unrecorded or not a git checkout), ``recorded``, ``changed_then`` (code files not
    committed when it ran), ``changed_since`` (its code and config files that differ now from
    that commit; None where git cannot tell) and ``owed`` (the ledger's entry, for outputs whose
    commit is unrecorded)."""
    ledger = read_ledger(project)
    lineage = {}
    for stage, metrics in outputs.items():
        if metrics is None:
            continue
        code = (metrics.get("provenance") or {}).get("code")
        commit = code["commit"] if code else None
        lineage[stage] = {
            "commit": commit,
            "recorded": code is not None,
            "changed_then": code["changed"] if code else [],
            "changed_since": changed_since(project, commit, code_deps(project, stage)) if commit else None,
            "owed": None if code else ledger.get(stage),
        }
    return lineage


def stale(lineage: dict[str, dict[str, Any]]) -> list[str]:
    """The stages whose outputs are older than their code: their code changed since their recorded
    commit, or (commit unrecorded) the ledger owes their rerun."""
    return [stage for stage, entry in lineage.items() if entry["changed_since"] or entry["owed"]]


def commits_line(lineage: dict[str, dict[str, Any]], built: str) -> str:
    """``arms trained at `2101f23` (ablate, spike), unrecorded (search); report built at `1c5351b```."""
    by_commit: dict[str, list[str]] = {}
    for stage, entry in lineage.items():
        by_commit.setdefault(_commit_text(entry), []).append(stage)
    trained = ", ".join(f"{commit} ({', '.join(stages)})" for commit, stages in by_commit.items())
    stamp = f"`{built[:7]}`" if _is_sha(built) else built
    if set(by_commit) == {UNRECORDED}:
        return (
            f"the commit that trained the arms is {UNRECORDED} ({', '.join(lineage)}: outputs from before stages "
            f"recorded it); the report was built at {stamp}, not necessarily that commit"
        )
    return f"arms trained at {trained or 'no stage that trains has run'}; report built at {stamp}"


def _commit_text(entry: dict[str, Any]) -> str:
    if not entry["recorded"]:
        return UNRECORDED
    if entry["commit"] is None:
        return "unknown (not a git checkout)"
    return f"`{entry['commit'][:7]}`" + (" with uncommitted changes" if entry["changed_then"] else "")


def _is_sha(text: str) -> bool:
    return len(text) == 40 and all(c in "0123456789abcdef" for c in text)
