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
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler


def open_tokens(path: str | Path, dtype: str) -> np.ndarray:
    """Memory-map a token shard (read-only; pages are loaded on demand)."""
    return np.memmap(path, dtype=np.dtype(dtype), mode="r")


def open_split(manifest: str | Path, split: str) -> np.ndarray:
    """Memory-map one shard (``train``, ``val`` or ``poison``) of a tokenize manifest, with the
    dtype it names; shard paths in the manifest are relative to it."""
    manifest = Path(manifest)
    info = json.loads(manifest.read_text(encoding="utf-8"))
    return open_tokens(manifest.parent / info["splits"][split]["path"], info["dtype"])


class Windows(Dataset):
    """Window i = tokens[i·(T+1) : (i+1)·(T+1)], returned as (x, y) shifted by one."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
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
        return self.tokens[: len(self) * self.span].reshape(len(self), self.span)[:, 1:]


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


class TokenLoader:
    """The trainer's view of the data: ``next_batch()`` and a checkpointable position. ``batch_size``
    is the global batch; ``shard`` = (rank, ranks) takes one of ``ranks`` equal slices of it."""

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        batch_size: int,
        seed: int,
        num_workers: int = 0,
        pin_memory: bool = False,
        shard: tuple[int, int] = (0, 1),
    ):
        if batch_size % shard[1]:
            raise ValueError(f"a batch of {batch_size} does not split into {shard[1]} equal slices, one per rank")
        self.windows = Windows(tokens, seq_len)
        self.batch_size, self.seed, self.shard = batch_size, seed, shard
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.batches_served = 0
        self._it: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), each (B, T) int64 (B: this rank's slice of the batch)."""
        if self._it is None:
            sampler = ResumableSampler(len(self.windows), self.batch_size, self.seed, self.batches_served, self.shard)
            self._it = iter(
                DataLoader(
                    self.windows,
                    batch_sampler=sampler,
                    num_workers=self.num_workers,
                    pin_memory=self.pin_memory,
                    persistent_workers=self.num_workers > 0,
                )
            )
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
