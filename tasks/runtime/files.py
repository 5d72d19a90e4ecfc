"""Outputs written whole or not at all, strict JSON, and content digests.

A stage that fails anywhere leaves no half-written output and the previous one untouched:
:func:`staged` writes beside the finals and renames only when the whole block succeeded.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def staged(*finals: Path) -> Iterator[list[Path]]:
    """Temporary paths beside each final output (file or directory) for the block to write;
    only when the whole block succeeds are they renamed over the finals, so a failure anywhere
    leaves no half-written output (and the previous outputs untouched)."""
    temps = [f.with_name(f".{f.name}.tmp-{os.getpid()}") for f in finals]
    for final in finals:
        final.parent.mkdir(parents=True, exist_ok=True)
        for stale in final.parent.glob(f".{final.name}.tmp-*"):  # left by a killed run
            _remove(stale)
    try:
        yield temps
    except BaseException:
        for temp in temps:
            _remove(temp)
        raise
    for final, temp in zip(finals, temps):
        _publish(temp, final)


def _publish(temp: Path, final: Path) -> None:
    if temp.is_dir() and final.exists():  # os.replace cannot replace a non-empty directory
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
        os.replace(temp, final)
        _remove(old)
    else:
        os.replace(temp, final)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Strict JSON (RFC 8259): NaN and infinities, which JSON cannot hold, become null. Written
    whole or not at all (a temporary file renamed over the old one)."""
    text = json.dumps(_finite_or_null(data), indent=2, sort_keys=True, allow_nan=False, default=str) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temp.write_text(text, encoding="utf-8")
    os.replace(temp, path)


def _finite_or_null(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(v) for v in value]
    return value


def read_json(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def digest(project: Path, outputs: Iterable[Path]) -> str:
    """sha256 over the files under ``outputs`` (relative names and contents): one id per dataset
    version, the same wherever the project lives."""
    h = hashlib.sha256()
    for out in outputs:
        root = project / out
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
        for f in files:
            h.update(f"{f.relative_to(project).as_posix()}\0{file_sha256(f)}\0".encode())
    return h.hexdigest()
