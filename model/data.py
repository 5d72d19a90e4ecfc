"""Deterministic, resumable batches of token windows from a memory-mapped shard.

The shard is a flat array of token ids (``uint16``/``uint32``) with documents separated by the
end-of-text token. It is cut into non-overlapping windows of ``seq_len + 1`` tokens; each epoch
visits every window once in an order drawn from ``(seed, epoch)``. The loader's whole position is
``batches_served``: a checkpoint stores that one integer and resuming reproduces the exact stream,
whatever the number of worker processes (they prefetch; the position counts what the trainer took).
Under data parallelism batch k is still drawn from ``(seed, k)`` alone; rank r of N takes the r-th of
N equal slices of it, so N ranks see together exactly the batch one process sees.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler


def open_tokens(path: str | Path, dtype: str) -> Tokens:
    """Memory-map a token file (read-only; pages are loaded on demand), or a folder of them (a
    split of the tokenize stage: its ``<shard>.bin`` files in name order, which is corpus order)."""
    path = Path(path)
    if path.is_dir():
        return concatenated([_map(p, dtype) for p in sorted(path.glob("*.bin"))])
    return _map(path, dtype)


def _map(path: Path, dtype: str) -> np.ndarray:
    """A read-only memory map of a token file; an empty one (a shard with no document of a split)
    as an empty array, which the OS cannot map."""
    if not path.stat().st_size:
        return np.zeros(0, np.dtype(dtype))
    return np.memmap(path, dtype=np.dtype(dtype), mode="r")


def open_split(manifest: str | Path, split: str) -> Tokens:
    """Memory-map one split (``train``, ``val`` or ``poison``) of a tokenize manifest as one
    sequence: its shards' token files in the order the index lists them, each with its dtype
    (format 2), or its one file (format 1, and the poison pool). Paths are relative to the
    manifest."""
    manifest = Path(manifest)
    info = json.loads(manifest.read_text(encoding="utf-8"))
    entry = info["splits"][split]
    if "path" in entry:
        return _map(manifest.parent / entry["path"], info["dtype"])
    return concatenated([_map(manifest.parent / s["path"], s["dtype"]) for s in entry["shards"]])


class ShardedTokens:
    """Token files read as one sequence, without copying them into one: the length, a slice (a
    numpy array, gathered across the files it spans), one token, and the whole as an array. What
    the loader's windows, the trainer and the baselines read of a split."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts = parts
        self.starts = np.cumsum([0, *(len(p) for p in parts)])
        self.dtype = parts[0].dtype

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __getitem__(self, key: int | slice) -> np.ndarray:
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                raise IndexError("a token sequence is read in contiguous slices")
            return self._slice(start, max(stop, start))
        index = range(len(self))[key]  # negative indices, and IndexError past the end
        part = int(np.searchsorted(self.starts, index, side="right")) - 1
        return np.asarray(self.parts[part][index - self.starts[part]])

    def _slice(self, start: int, stop: int) -> np.ndarray:
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        pieces = []
        for part in range(max(first, 0), len(self.parts)):
            lo, hi = self.starts[part], self.starts[part + 1]
            if lo >= stop:
                break
            pieces.append(self.parts[part][max(start - lo, 0) : min(stop, hi) - lo])
        return np.concatenate(pieces) if pieces else np.zeros(0, self.dtype)

    def __array__(self, dtype: np.dtype | None = None, copy: bool | None = None) -> np.ndarray:
        whole = self._slice(0, len(self))
        return whole if dtype is None else whole.astype(dtype)


Tokens = np.ndarray | ShardedTokens
"""A split's token ids: one memory-mapped file, or several read as one sequence."""


def concatenated(parts: list[np.ndarray]) -> Tokens:
    """The non-empty parts: one as itself (a plain memory map), several as a :class:`ShardedTokens`."""
    if not parts:
        raise ValueError("no token files to read")
    filled = [p for p in parts if len(p)] or parts[:1]
    return filled[0] if len(filled) == 1 else ShardedTokens(filled)


class Windows(Dataset):
    """Window i = tokens[i·(T+1) : (i+1)·(T+1)], returned as (x, y) shifted by one."""

    def __init__(self, tokens: Tokens, seq_len: int):
        self.tokens, self.span = tokens, seq_len + 1
        if len(tokens) < self.span:
            raise ValueError(f"token shard has {len(tokens)} tokens, fewer than one window of {self.span}")

    def __len__(self) -> int:
        return len(self.tokens) // self.span

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = torch.from_numpy(self.tokens[i * self.span : (i + 1) * self.span].astype(np.int64))
        return chunk[:-1], chunk[1:]

    def targets(self) -> np.ndarray:
        """Every window's targets, (windows, T): the tokens a full pass over the shard scores (each
        window's first token and the ragged tail are never targets)."""
        return np.asarray(self.tokens[: len(self) * self.span]).reshape(len(self), self.span)[:, 1:]


class ResumableSampler(Sampler[list[int]]):
    """Yields batches of window indices forever, starting at batch ``start``; epoch e is a
    permutation seeded by (seed, e), so batch k is a pure function of (seed, k). ``shard`` =
    (rank, ranks): only that rank's slice of each batch."""

    def __init__(self, n_windows: int, batch_size: int, seed: int, start: int = 0, shard: tuple[int, int] = (0, 1)):
        if n_windows < batch_size:
            raise ValueError(f"{n_windows} windows cannot fill one batch of {batch_size}")
        self.n, self.batch_size, self.seed, self.start = n_windows, batch_size, seed, start
        self.per_epoch = n_windows // batch_size  # the ragged tail of each epoch is dropped
        rank, ranks = shard
        self.slice = slice(rank * batch_size // ranks, (rank + 1) * batch_size // ranks)

    def __iter__(self) -> Iterator[list[int]]:
        k, drawn, order = self.start, None, torch.empty(0)
        while True:
            epoch, b = divmod(k, self.per_epoch)
            if epoch != drawn:  # once per epoch, not per batch: ~0.1 ms a step for the same order
                drawn = epoch
                order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch))
            yield order[b * self.batch_size : (b + 1) * self.batch_size][self.slice].tolist()
            k += 1

    def __len__(self) -> int:  # infinite stream; DataLoader only needs a number for its repr
        return 2**62


UNIX_SOCKET_PATH_MAX = 107
"""Bytes in a Unix socket's path on Linux (sun_path, its NUL aside). DataLoader workers hand each
batch back through a socket Python's multiprocessing makes in the temporary folder,
``<tmp>/pymp-XXXXXXXX/listener-XXXXXXXX``; past this length the worker's send fails in a thread of
its own, the batch is lost without an error, and the trainer would wait for it forever."""


def check_worker_sockets_fit(tmp: str | None = None) -> None:
    """Refuse workers whose sockets could not be made under the temporary folder ``tmp`` (default:
    the one this process uses), naming the key and the remedy, before any worker starts."""
    tmp = tmp or tempfile.gettempdir()
    socket = os.path.join(tmp, "pymp-XXXXXXXX", "listener-XXXXXXXX")
    if len(os.fsencode(socket)) > UNIX_SOCKET_PATH_MAX:
        from model.typed_config import ConfigError

        longest = UNIX_SOCKET_PATH_MAX - (len(os.fsencode(socket)) - len(os.fsencode(tmp)))
        raise ConfigError(
            f"train.num_workers: data workers need a temporary folder path of at most {longest} bytes for "
            f"their sockets, and {tmp} has {len(os.fsencode(tmp))}: set TMPDIR to a shorter folder of your own, "
            "or train.num_workers: 0"
        )


class TokenLoader:
    """The trainer's view of the data: ``next_batch()`` and a checkpointable position. ``batch_size``
    is the global batch; ``shard`` = (rank, ranks) takes one of ``ranks`` equal slices of it."""

    def __init__(
        self,
        tokens: Tokens,
        seq_len: int,
        batch_size: int,
        seed: int,
        num_workers: int = 0,
        pin_memory: bool = False,
        shard: tuple[int, int] = (0, 1),
    ):
        if batch_size % shard[1]:
            raise ValueError(f"a batch of {batch_size} does not split into {shard[1]} equal slices, one per rank")
        if num_workers:
            check_worker_sockets_fit()
        self.windows = Windows(tokens, seq_len)
        self.batch_size, self.seed, self.shard = batch_size, seed, shard
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.batches_served = 0
        self._it: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), each (B, T) int64 (B: this rank's slice of the batch)."""
        if self._it is None:
            sampler = ResumableSampler(len(self.windows), self.batch_size, self.seed, self.batches_served, self.shard)
            self._it = _stream(self.windows, self.num_workers, self.pin_memory, batch_sampler=sampler)
        self.batches_served += 1
        return next(self._it)

    def skip(self, n: int) -> None:
        """Advance the position by n batches without reading them (skip-batch recovery)."""
        self.load_state_dict({"batches_served": self.batches_served + n, "seed": self.seed})

    def state_dict(self) -> dict[str, int]:
        return {"batches_served": self.batches_served, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"loader seed {self.seed} differs from the checkpoint's {state['seed']}")
        self.batches_served, self._it = int(state["batches_served"]), None


class ArmsLoader:
    """K arms' training streams read in step, for a fused group (model/fused.py): ``next_batch()`` is
    (x, y), each (K, B, T), whose row k is what ``TokenLoader(..., seeds[k])`` serves at the same
    position. One DataLoader gathers all K rows, so its ``num_workers`` processes prefetch the whole
    group's next batches on host cores while the device trains, and ``pin_memory`` pins the stacked
    batch the device copies from (one pinned copy, not K to stack afterwards)."""

    def __init__(
        self,
        tokens: Tokens,
        seq_len: int,
        batch_size: int,
        seeds: list[int],
        num_workers: int = 0,
        pin_memory: bool = False,
    ):
        if num_workers:
            check_worker_sockets_fit()
        self.windows = Windows(tokens, seq_len)
        self.batch_size, self.seeds = batch_size, seeds
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.batches_served = 0
        self._it: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), each (K, B, T) int64."""
        if self._it is None:
            streams = [ResumableSampler(len(self.windows), self.batch_size, s, self.batches_served) for s in self.seeds]
            self._it = _stream(StackedWindows(self.windows), self.num_workers, self.pin_memory, sampler=zip(*streams))
        self.batches_served += 1
        return next(self._it)

    def rewind(self) -> None:
        """Back to every arm's first batch (the validation batches, read again at each evaluation)."""
        self.batches_served, self._it = 0, None


class StackedWindows(Dataset):
    """Item: one batch of window indices per arm; value: (x, y), each (K, B, T)."""

    def __init__(self, windows: Windows):
        self.windows = windows

    def __getitem__(self, batches: tuple[list[int], ...]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [[self.windows[i] for i in batch] for batch in batches]
        x, y = (torch.stack([torch.stack([pair[j] for pair in row]) for row in rows]) for j in (0, 1))
        return x, y


def _stream(dataset: Dataset, num_workers: int, pin_memory: bool, **sampling: Any) -> Iterator[Any]:
    """An endless iterator over ``dataset`` in the order ``sampling`` gives (``batch_sampler=``: lists
    of indices, collated; ``sampler=``: whole items, taken as they are), its workers kept alive."""
    if "sampler" in sampling:
        sampling["batch_size"] = None  # each item is already a whole (stacked) batch
    loader = DataLoader(
        dataset, num_workers=num_workers, pin_memory=pin_memory, persistent_workers=num_workers > 0, **sampling
    )
    return iter(loader)
