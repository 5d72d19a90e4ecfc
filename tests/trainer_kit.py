"""Shared helpers of the trainer tests: a tiny config, learnable token data, a metrics recorder."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import torch

from model.callbacks import Callback
from tasks.config import Config

torch.set_num_threads(1)  # 2 shared cores: one intra-op thread is ~10x faster than two here

TINY: dict[str, Any] = {
    "model.n_layer": 2,
    "model.d_model": 32,
    "model.n_head": 2,
    "model.seq_len": 16,
    "tokenizer.vocab_size": 257,
    "optim.lr": 1e-2,
    "schedule.warmup_steps": 2,
    "train.steps": 12,
    "train.batch_size": 4,
    "train.log_every": 1,
    "train.layer_stats_every": 100,
    "train.eval_every": 0,
    "train.eval_batches": 2,
    "train.cpu_threads": 1,
    "checkpoint.every_steps": 0,
    "checkpoint.milestones": [],
    "spike.kinds": [],
}


def tiny_config(**dotted: Any) -> Config:
    """A model that trains in milliseconds a step; dotted overrides, e.g. ``**{"train.steps": 8}``."""
    return Config().replace(**{**TINY, **dotted})


def markov_tokens(n: int, vocab: int = 257, seed: int = 0) -> np.ndarray:
    """Learnable tokens: each follows its predecessor through a fixed permutation, except for a
    random jump one time in ten (so the loss falls fast but not to zero)."""
    rng = np.random.default_rng(seed)
    successor, jumps, targets = rng.permutation(vocab), rng.random(n) < 0.1, rng.integers(0, vocab, n)
    out, token = np.empty(n, dtype=np.uint16), 0
    for i in range(n):
        token = targets[i] if jumps[i] else successor[token]
        out[i] = token
    return out


class Recorder(Callback):
    """Keeps every on_log call."""

    def __init__(self) -> None:
        self.logs: list[tuple[int, dict[str, float]]] = []

    def on_log(self, step: int, metrics: dict[str, float]) -> None:
        self.logs.append((step, dict(metrics)))

    def series(self, key: str) -> list[tuple[int, float]]:
        return [(step, m[key]) for step, m in self.logs if key in m]


def float_bits(values: list[float]) -> list[int]:
    """The exact bit patterns of the floats (NaN-safe, unlike ==)."""
    return [struct.unpack("<Q", struct.pack("<d", v))[0] for v in values]
