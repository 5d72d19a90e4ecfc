"""The unigram baseline (tasks/data/unigram.py): add-½ smoothing, the trainer's targets counted and
nothing else, and the shards read through a tokenize manifest."""

from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np
import pytest

from model.config import TokenizerConfig
from model.data import Windows, open_split
from tasks.data.config import DataConfig
from tasks.data.shards import shard_path
from tasks.data.tokenize import tokenize_shards
from tasks.data.unigram import unigram_baseline, unigram_cross_entropy
from tasks.runtime.outputs import MANIFEST, SOURCE_FILE

# seq_len 1: windows of 2 tokens, the second the target. Id 0 plays end-of-text; id 3 only ever
# opens a window, so it is never a target and never counted.
TRAIN = np.array([3, 0, 3, 0, 3, 1, 3, 2], dtype=np.uint16)  # targets 0, 0, 1, 2


def test_cross_entropy_of_add_half_training_frequencies_on_the_validation_targets():
    val = np.array([3, 0, 3, 1, 2], dtype=np.uint16)  # targets 0, 1; the ragged tail (2) is not one
    # counts + ½ over 4 ids: 0 -> 2.5, 1 -> 1.5, 2 -> 1.5, 3 -> 0.5, of 4 + 4/2 = 6
    expected = -(math.log(2.5 / 6) + math.log(1.5 / 6)) / 2
    assert unigram_cross_entropy(TRAIN, val, vocab_size=4, seq_len=1) == pytest.approx(expected, rel=1e-12)


def test_a_validation_token_unseen_in_training_costs_a_finite_loss():
    val = np.array([0, 3], dtype=np.uint16)  # target 3, never a training target: ½ of 6
    assert unigram_cross_entropy(TRAIN, val, vocab_size=4, seq_len=1) == pytest.approx(math.log(6 / 0.5))


def test_the_counted_tokens_are_the_targets_of_the_trainers_windows():
    tokens = np.arange(23, dtype=np.uint16)  # 5 windows of 4 and a ragged tail of 3
    windows = Windows(tokens, seq_len=3)
    assert np.array_equal(windows.targets(), np.stack([windows[i][1].numpy() for i in range(len(windows))]))


SEQ_LEN = 8
VOCAB = 300


def tokenize_tiny_corpus(project) -> None:
    """Forty short documents through the tokenize stage's own tasks into ``project/data/tokens``."""
    clean, poison = project / "data" / "clean", project / "data" / "poison"
    clean.mkdir(parents=True)
    poison.mkdir()
    words = ["spike", "loss", "plateau", "token", "window", "batch", "the", "a", "warm", "milestone"]
    docs = [" ".join(words[(i * k) % len(words)] for k in range(3 + i % 7)) for i in range(40)]
    shard_path(clean, 0).write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (clean / SOURCE_FILE).write_text("{}")
    data, tokenizer = DataConfig(val_fraction=0.3), TokenizerConfig(vocab_size=VOCAB, min_frequency=1)
    tokenize_shards.fn(tokenizer, data, "local", clean, poison, project / MANIFEST.parent, project / "work")


def targets(ids: list[int]) -> list[int]:
    span = SEQ_LEN + 1
    return [t for start in range(0, len(ids) - span + 1, span) for t in ids[start + 1 : start + span]]


def test_baseline_reads_the_manifests_train_and_val_shards_at_its_vocabulary(tmp_path):
    tokenize_tiny_corpus(tmp_path)
    shards = {split: np.asarray(open_split(tmp_path / MANIFEST, split)) for split in ("train", "val")}
    train, val = (targets(shards[split].tolist()) for split in ("train", "val"))
    counts = Counter(train)
    expected = -sum(math.log((counts[t] + 0.5) / (len(train) + VOCAB / 2)) for t in val) / len(val)

    baseline = unigram_baseline(tmp_path / MANIFEST, SEQ_LEN)

    assert baseline == {
        "unigram_val_loss": pytest.approx(expected, rel=1e-9),
        "train_tokens": len(train),
        "val_tokens": len(val),
        "smoothing": f"add-0.5 over {VOCAB} ids",
    }
