"""Which stages' committed outputs are older than their code: `dvc status` read, and the ledger
of reruns owed.

`dvc status --json` compares every stage's deps with dvc.lock. A stage is *stale* when git holds
outputs of it (its ``cache: false`` outs: metrics, figures, the report) while a dep no stage makes
(its code, a config file) or a param it reads differs from the lock, or its command does: those
outputs describe an older tree. What a fresh clone lacks is not staleness: an upstream output
absent from the workspace ("deleted") or an output absent from DVC's cache ("not in cache").

A rerun can take longer than the change that made it owed, so it is owed in the open: the
ledger (:data:`LEDGER`) names each stale stage, why, and the rerun that clears it.
tests/test_outputs_in_step.py holds it equal to `dvc status` both ways (a stale stage missing
from it fails, and so does an entry whose stage is in step again), and the report quotes it.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from model.typed_config import UserError

LEDGER = Path("stale_outputs.yaml")
"""The reruns owed: stage -> {reason, rerun}. Not a dep of any stage: the report quotes it, and a
dep would make every update of the ledger stale the report it clears."""
LEDGER_KEYS = ("reason", "rerun")
OUT_KINDS = ("outs", "metrics", "plots")
"""The keys of a dvc.yaml stage that list what it writes."""
CHANGED_COMMAND = "changed command"
"""How `dvc status` says a stage's ``cmd`` differs from the lock's."""


def stale_stages(
    status: Mapping[str, list[Any]], outs: Mapping[str, Iterable[str]], committed: Iterable[str]
) -> dict[str, list[str]]:
    """The stages of `dvc status --json` (``status``) with an output git holds (``committed``: the
    outs git tracks files at) whose code, params or command changed since dvc.lock: stage -> what
    changed (a dep's path, ``<params file>:<key>``, or ``cmd``). ``outs``: every stage's outs, as
    dvc.yaml names them (the deps another stage makes are data, not code)."""
    made = [PurePosixPath(out) for paths in outs.values() for out in paths]
    tracked = set(committed)
    stale = {}
    for stage, changes in status.items():
        if not tracked.intersection(outs.get(stage, ())):
            continue
        changed = ["cmd"] if CHANGED_COMMAND in changes else []
        for dep, what in _changed_deps(changes).items():
            if isinstance(what, dict):  # a params file: the keys this stage reads that changed
                changed += [f"{dep}:{key}" for key in what]
            elif not _made_by_a_stage(PurePosixPath(dep), made):
                changed.append(dep)
        if changed:
            stale[stage] = changed
    return stale


def _changed_deps(changes: list[Any]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for change in changes:
        if isinstance(change, dict):
            found.update(change.get("changed deps", {}))
    return found


def _made_by_a_stage(dep: PurePosixPath, made: list[PurePosixPath]) -> bool:
    return any(dep == out or out in dep.parents for out in made)


def read_ledger(project: Path) -> dict[str, dict[str, str]]:
    """The project's ledger of reruns owed (empty without one), each entry checked: a stage of
    its dvc.yaml, with exactly a ``reason`` and a ``rerun``, each a line of text."""
    path = project / LEDGER
    if not path.is_file():
        return {}
    entries = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    if not isinstance(entries, dict):
        raise UserError(f"{LEDGER}: must map each stale stage to its {' and '.join(LEDGER_KEYS)}")
    known = list(dvc_stages(project)) if (project / "dvc.yaml").is_file() else []
    for stage, entry in entries.items():
        if stage not in known:
            raise UserError(f"{LEDGER}: {stage}: no such stage (dvc.yaml has {', '.join(known)})")
        if not isinstance(entry, dict) or sorted(entry) != sorted(LEDGER_KEYS):
            raise UserError(f"{LEDGER}: {stage}: needs exactly {' and '.join(LEDGER_KEYS)}")
        blank = [key for key in LEDGER_KEYS if not isinstance(entry[key], str) or not entry[key].strip()]
        if blank:
            raise UserError(f"{LEDGER}: {stage}.{blank[0]}: must be text, not empty")
    return entries


def dvc_stages(project: Path) -> dict[str, list[str]]:
    """Each stage of the project's dvc.yaml -> its outputs' paths (outs, metrics and plots), in
    pipeline order."""
    declared = yaml.safe_load((project / "dvc.yaml").read_text(encoding="utf-8")).get("stages", {})
    return {
        name: [next(iter(out)) if isinstance(out, dict) else out for kind in OUT_KINDS for out in spec.get(kind, [])]
        for name, spec in declared.items()
    }


def committed_outs(project: Path, outs: Mapping[str, Iterable[str]]) -> set[str]:
    """Those of the stages' ``outs`` git tracks a file at (in its index) in ``project``."""
    paths = sorted({out for stage_outs in outs.values() for out in stage_outs})
    done = subprocess.run(
        ["git", "ls-files", "-z", "--", *paths], cwd=project, capture_output=True, text=True, check=True, timeout=60
    )
    files = [PurePosixPath(f) for f in done.stdout.split("\0") if f]
    return {out for out in paths if any(f == PurePosixPath(out) or PurePosixPath(out) in f.parents for f in files)}


def code_deps(project: Path, stage: str) -> list[str]:
    """The deps of ``stage`` in the project's dvc.yaml that no stage makes: its code and config
    files (none without a dvc.yaml: a project that runs its stages by hand)."""
    if not (project / "dvc.yaml").is_file():
        return []
    declared = yaml.safe_load((project / "dvc.yaml").read_text(encoding="utf-8")).get("stages", {})
    made = [PurePosixPath(out) for outs in dvc_stages(project).values() for out in outs]
    deps = (declared.get(stage) or {}).get("deps", [])
    return [dep for dep in deps if not _made_by_a_stage(PurePosixPath(dep), made)]


def changed_since(project: Path, commit: str, paths: list[str]) -> list[str] | None:
    """The files of ``paths`` that differ in ``project``'s working tree from ``commit``; None where
    git cannot tell (not a git checkout, the commit unknown to it) or no path is named."""
    if not paths:  # git would diff the whole tree
        return None
    try:
        done = subprocess.run(
            ["git", "diff", "--name-only", commit, "--", *paths],
            cwd=project,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.split() if done.returncode == 0 else None
