"""Checkpoint files: atomic writes, sha256 sidecars, fallback on corruption, RNG capture.

Layout: ``<dir>/step_00000100.pt`` (a ``torch.save`` of plain tensors, dicts, lists, numbers and
strings, so ``torch.load(weights_only=True)`` reads it) and ``step_00000100.pt.sha256``
(``sha256sum`` format). A checkpoint counts only when its sidecar exists and matches: the sidecar
is written after the payload, so a crash in between leaves an incomplete checkpoint that is skipped.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import os
import random
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, BinaryIO, TypeVar, cast

import numpy as np
import torch

from model.private import UnsafeFolder, create_exclusive, private_run_dir
from model.typed_config import UserError

_NAME = re.compile(r"step_(\d+)\.pt")
_T = TypeVar("_T")


class CheckpointError(UserError):
    """A checkpoint is incomplete, truncated, corrupt, unreadable or another run's; the message
    names the file. A UserError: one given as input (the spike study's pretrain milestone, ``train``'s
    ``init_from``) stops the command with that line (exit 2); a run's own are passed over (load_latest)."""

    def __init__(self, path: Path, why: str):
        super().__init__(path, why)  # both in args: the error pickles back across processes
        self.path, self.why = path, why

    def __str__(self) -> str:
        return f"checkpoint {self.path} is unusable: {self.why}"


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"step_{step:08d}.pt"


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every payload file, oldest first, valid or not."""
    found = [(int(m.group(1)), p) for p in directory.glob("step_*.pt") if (m := _NAME.fullmatch(p.name))]
    return sorted(found)


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


class _HashingWriter:
    """File wrapper that hashes what torch.save writes, so the payload is never read back."""

    def __init__(self, f: BinaryIO):
        self.f, self.sha = f, hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def _write_atomically(
    path: Path, write: Callable[[BinaryIO], _T], before_replace: Callable[[], object] = lambda: None
) -> _T:
    """Write through ``write(file)`` into a temp file in the same directory, fsync, rename over
    ``path``, fsync the directory; on any failure the temp file is removed and ``path`` untouched."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with os.fdopen(create_exclusive(tmp), "wb") as f:
            result = write(f)
            f.flush()
            os.fsync(f.fileno())
        before_replace()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return result


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(path: Path, payload: dict[str, Any]) -> str:
    """Write ``payload`` atomically with its sha256 sidecar; returns the hex digest."""
    private_run_dir(path.parent, "checkpoint folder")

    def write_payload(f: BinaryIO) -> str:
        writer = _HashingWriter(f)
        torch.save(payload, cast(IO[bytes], writer))  # torch.save calls only write and flush
        return writer.sha.hexdigest()

    # Re-saving a step: the old sidecar goes just before the rename, so it never vouches for the
    # new payload, and a failed write leaves the old pair intact.
    digest = _write_atomically(path, write_payload, before_replace=lambda: _sidecar(path).unlink(missing_ok=True))
    _write_atomically(_sidecar(path), lambda f: f.write(f"{digest}  {path.name}\n".encode()))
    return digest


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Verify the sidecar and load on the CPU with ``weights_only=True``; raises CheckpointError.
    A payload or sidecar that is a link, or that another user owns, is never read: whoever could
    write it could hand this run any weights (and any step, data position and identity)."""
    sidecar = _sidecar(path)
    if not sidecar.exists():
        raise CheckpointError(path, "no sha256 sidecar (incomplete write)")
    data, vouched = _read_own(path), _read_own(sidecar).decode(errors="replace")
    expected = vouched.split()[0] if vouched.strip() else ""
    if hashlib.sha256(data).hexdigest() != expected:
        raise CheckpointError(path, f"sha256 mismatch ({len(data)} bytes; truncated or corrupt)")
    try:
        payload: dict[str, Any] = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        return payload
    except Exception as e:  # a matching checksum over an unloadable file: wrong format or version
        raise CheckpointError(path, f"unreadable: {e}") from e


def _read_own(path: Path) -> bytes:
    """The bytes of ``path`` (a checkpoint or its sidecar): a regular file this user owns, opened
    without following a link; else CheckpointError."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise CheckpointError(path, f"{e.strerror} (a link is never followed)") from None
    with os.fdopen(fd, "rb") as f:
        owner = os.fstat(fd).st_uid
        if owner != os.getuid():
            raise CheckpointError(path, f"{path.name} is owned by another user (uid {owner}): never loaded")
        return f.read()


def load_latest(directory: Path, identity: str, before: int | None = None) -> tuple[Path, dict[str, Any]] | None:
    """The newest valid checkpoint of run ``identity`` in ``directory`` (of a step below ``before``,
    if given). A newer one that is damaged, or belongs to another run (a foreign file dropped in,
    a checkpoint without an identity), is reported on stderr and passed over like a corrupt one:
    never resumed."""
    for step, path in reversed(list_checkpoints(directory)):
        if before is not None and step >= before:
            continue
        try:
            state = load_checkpoint(path)
            if state.get("identity") != identity:
                raise CheckpointError(path, f"belongs to run {state.get('identity')!r}, not {identity!r}")
            return path, state
        except CheckpointError as e:
            print(f"spikelab: {e}; falling back to the previous one", file=sys.stderr, flush=True)
    return None


def remove_orphans(directory: Path) -> list[Path]:
    """Delete the temporary files of interrupted writes (``.<name>.tmp<pid>``). Call only while
    holding the directory's :class:`RunLock`: then no live writer owns them."""
    orphans = [p for p in directory.glob(".*.tmp*") if p.is_file()] if directory.is_dir() else []
    for p in orphans:
        p.unlink(missing_ok=True)
    return orphans


def remove_checkpoint(path: Path) -> None:
    _sidecar(path).unlink(missing_ok=True)  # sidecar first: a half-removed checkpoint is invalid
    path.unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------------
# One writer per run directory
# ----------------------------------------------------------------------------------------------


class RunLocked(UserError):
    """Another live process holds the run directory."""


class RunLock:
    """An exclusive ``flock`` on ``<directory>/.lock`` for the life of a run. The kernel drops it
    when the holder dies, even by ``kill -9``, so a stale lock is taken over without a step; the
    file's content (the holder's pid) is only for the message a second launch prints."""

    def __init__(self, directory: str | Path):
        self.path = Path(directory) / ".lock"
        self.fd: int | None = None

    def __enter__(self) -> RunLock:
        private_run_dir(self.path.parent)  # before anything is written there: this user's alone
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:  # a link where the lock goes: never opened through it
            raise UnsafeFolder(f"run lock {self.path}: {e.strerror}; remove it") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunLocked(
                f"{self.path.parent}: another run is writing here (pid {holder}); wait for it or stop it first"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


# ----------------------------------------------------------------------------------------------
# RNG state as weights_only-loadable values
# ----------------------------------------------------------------------------------------------


def capture_rng() -> dict[str, Any]:
    """Every RNG a step can touch: torch CPU, CUDA (when initialised), numpy, Python."""
    legacy = np.random.get_state(legacy=True)
    assert isinstance(legacy, tuple)  # legacy=True: the MT19937 tuple, never the dict
    _, keys, pos, has_gauss, cached_gaussian = legacy
    version, py_state, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "python": {"version": version, "state": list(py_state), "gauss_next": gauss_next},
    }


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    n = state["numpy"]
    np.random.set_state(
        ("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss_next"]))
