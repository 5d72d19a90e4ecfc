"""The unigram baseline: the validation loss of a model that predicts every token from the training
split's token frequencies alone. Small transformers learn this first and sit on it for a while
(about 6 nats on the default corpus), so a study arm that never got below it tested nothing.

The tokens counted are the ones the trainer's validation loss scores (model/train.py:
``Trainer.evaluate``): the split cut into windows of ``seq_len + 1`` tokens (model/data.py:
``Windows``), whose targets are tokens 1..seq_len of each window. End-of-text tokens count (the model
predicts them too); each window's first token and the ragged tail do not. The trainer scores a
seeded sample of those windows, whose expected loss is the mean over all of them, which is what is
computed here. The frequencies are those of the training windows' targets, what the model learns.

Smoothing is add-½ (Jeffreys) over the model's whole vocabulary: a validation token never seen in
training costs a finite ``log((N + V/2) / ½)`` nats instead of an infinite loss, and with N in the
millions and V = 1024 the seen tokens' probabilities move by about 1e-4 of themselves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from model.data import Tokens, Windows, open_split
from tasks.runtime.files import read_json

PSEUDOCOUNT = 0.5
"""Added to every id's training count (add-½, the Jeffreys prior)."""


def unigram_cross_entropy(train: Tokens, val: Tokens, vocab_size: int, seq_len: int) -> float:
    """Cross-entropy (nats/token) of the training targets' smoothed unigram distribution over
    ``vocab_size`` ids, on the validation targets (both as windows of ``seq_len + 1``)."""
    counts = np.bincount(Windows(train, seq_len).targets().ravel(), minlength=vocab_size) + PSEUDOCOUNT
    log_p = np.log(counts) - np.log(counts.sum())
    return float(-log_p[Windows(val, seq_len).targets().ravel()].mean())


def unigram_baseline(manifest: Path, seq_len: int) -> dict[str, Any]:
    """The baseline on a tokenize manifest's shards, read as the trainer reads them, with the
    number of target tokens counted on each side and the smoothing used."""
    vocab_size = read_json(manifest)["vocab_size"]
    train, val = (open_split(manifest, split) for split in ("train", "val"))
    return {
        "unigram_val_loss": unigram_cross_entropy(train, val, vocab_size, seq_len),
        "train_tokens": len(Windows(train, seq_len)) * seq_len,
        "val_tokens": len(Windows(val, seq_len)) * seq_len,
        "smoothing": f"add-{PSEUDOCOUNT:g} over {vocab_size} ids",
    }
