"""How surprising is a document to a small model of the corpus it came from?

A byte 4-gram language model with Dirichlet-prior interpolation down to the uniform byte
distribution, trained on the corpus itself (a bounded sample of the screened survivors, the
whole corpus when it is smaller). Its counts live in hashed tables of fixed size, so memory does
not grow with the corpus. A document the model counted is scored leave-one-out: its own counts
are subtracted before it is scored, so a long garbage document cannot vouch for itself. The
score is the log-perplexity per character (nats); outliers are documents whose robust z-score
(median / MAD) lies above ``filter.perplexity_zscore``.
"""

from __future__ import annotations

import itertools
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import numpy as np
import pandas as pd

ORDER = 4
"""Longest n-gram: three bytes of context and the predicted byte."""
TABLE_BITS = 20
"""Each order counts into 2^20 hashed cells (8 MiB of 64-bit counts): fixed memory. Collisions
are not rare: a 40 MB corpus fills half the 4-gram cells; scoring cuts each count to the bounds
the lower orders set (:meth:`ByteNgramModel._score`)."""
PRIOR = 2.0
"""Dirichlet prior mass a context gives to the next-shorter context's prediction."""
BATCH_BYTES = 1 << 18
"""Documents are hashed and scored in batches of about this many bytes (a batch's temporaries
take ~60 bytes per byte, so 256 KiB keeps them near 16 MiB). Each document is modelled and
scored whole, wherever its garbage sits: one longer than a batch is a batch of its own, bounded
by ``filter.max_chars`` (the length check runs first) or else ``data.max_doc_bytes``."""
TRAIN_BATCH_BYTES = 1 << 20
"""Training counts in batches of about this many bytes: each batch's counts are added over the
whole tables (8 sweeps of 2^20 cells), so larger batches sweep less often (~60 MiB of temporaries)."""
T = TypeVar("T")
B = TypeVar("B")
_PAD = ORDER - 1
_MIX = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: multiply, keep the top bits
_SHIFT = np.uint64(64 - TABLE_BITS)


class ByteNgramModel:
    def __init__(self) -> None:
        # 64-bit counts: the order-0 context counts every byte, past 2^32 on a multi-GB corpus
        self.joint = np.zeros((ORDER, 1 << TABLE_BITS), np.uint64)  # count(context, byte) per order
        self.context = np.zeros((ORDER, 1 << TABLE_BITS), np.uint64)  # count(context) per order

    def add(self, other: ByteNgramModel) -> None:
        """Count ``other``'s corpus too (models of shards summed into the corpus's)."""
        self.joint += other.joint
        self.context += other.context

    def save(self, path: Path) -> Path:
        np.savez(path, joint=self.joint, context=self.context)
        return path

    @classmethod
    def load(cls, path: Path) -> ByteNgramModel:
        model = cls()
        with np.load(path) as tables:
            model.joint, model.context = tables["joint"], tables["context"]
        return model

    def train(self, texts: Iterable[str | bytes]) -> None:
        """Count ``texts`` in (integer sums: the same tables whatever order the batches end in)."""
        for context, joint in _in_threads(_counts, _batches(texts, TRAIN_BATCH_BYTES)):
            self.context += context
            self.joint += joint

    def log_perplexity(self, texts: Iterable[str | bytes], counted: np.ndarray | None = None) -> np.ndarray:
        """Per-character log-perplexity of each text; leave-one-out for the texts the model
        counted (``counted[i]``; default: every text, each must then be in the training set)."""
        flags = iter(counted) if counted is not None else itertools.repeat(True)
        batches = (
            (blobs, np.fromiter(itertools.islice(flags, len(blobs)), bool, len(blobs)))
            for blobs in _batches(texts, BATCH_BYTES)
        )
        scores = list(_in_threads(lambda batch: self._score(batch[0], batch[1]), batches))
        return np.concatenate(scores) if scores else np.zeros(0)

    def _score(self, blobs: list[bytes], counted: np.ndarray) -> np.ndarray:
        """Each document's nats per character. A hashed cell holds the counts of every n-gram
        that falls in it, so a count read from the tables is at least the n-gram's own, never
        less; the true counts (other documents' occurrences, at one position) can only fall as
        the order rises, and a context is followed by each byte at most as often as it occurs:
        count(context) <= count(its shorter suffix), count(context + byte) <= count(shorter
        context + byte) and <= count(context). Each count is cut to those bounds, the smallest
        overestimate of one true count wins, as a count-min sketch takes its rows' minimum
        (Cormode & Muthukrishnan 2005). The lower orders' tables have few collisions, so a
        4-gram never seen but sharing its cell with a frequent one is no longer predicted as
        well as that one (a probability above 1 before, as the joint count could exceed its
        context's): benchmarks/bench_data.py's 60 MB corpus fills 53 % of the 4-gram cells,
        and a script the corpus barely holds scored as prose."""
        batch = _Batch(blobs, counted)
        prob = np.full(len(batch.doc), 1.0 / 256)
        ctx_bound: np.ndarray | float = np.inf
        joint_bound: np.ndarray | float = np.inf
        for order, (ctx, joint) in enumerate(batch.cells()):
            ctx_count = self.context[order][ctx].astype(np.float64) - batch.own_context(order, ctx)
            joint_count = self.joint[order][joint].astype(np.float64) - batch.own_joint(order, joint)
            ctx_count = np.minimum(ctx_count, ctx_bound)
            joint_count = np.minimum(np.minimum(joint_count, joint_bound), ctx_count)
            ctx_bound, joint_bound = ctx_count, joint_count
            prob = (joint_count + PRIOR * prob) / (ctx_count + PRIOR)
        nats = -np.bincount(batch.doc, weights=np.log(prob), minlength=batch.n_docs)
        return nats / np.maximum(batch.chars, 1)


def robust_zscores(values: np.ndarray) -> np.ndarray:
    """(x - median) / (1.4826 · MAD): a z-score that a few extreme outliers cannot inflate.
    All zeros when the spread is zero (nothing stands out)."""
    median = np.median(values)
    mad = 1.4826 * np.median(np.abs(values - median))
    return (values - median) / mad if mad > 0 else np.zeros_like(values)


class _Batch:
    """Documents as one byte array, each behind ORDER-1 zero bytes that stand for its start;
    ``counted``: which of them the model counted (their own counts are left out when scoring)."""

    def __init__(self, blobs: list[bytes], counted: np.ndarray | None = None):
        self.n_docs = len(blobs)
        lengths = np.array([len(b) for b in blobs], np.int64)
        buf = np.frombuffer(b"".join(b"\0" * _PAD + b for b in blobs), np.uint8).astype(np.uint64)
        segment = np.repeat(np.arange(self.n_docs), lengths + _PAD)
        offset = np.arange(len(buf)) - np.repeat(np.cumsum(lengths + _PAD) - (lengths + _PAD), lengths + _PAD)
        self.pos = np.flatnonzero(offset >= _PAD)
        self.doc = segment[self.pos]
        self.buf = buf
        is_char_start = (buf[self.pos] & np.uint64(0xC0)) != np.uint64(0x80)  # not a UTF-8 continuation byte
        self.chars = np.bincount(self.doc, weights=is_char_start, minlength=self.n_docs)
        self.counted_at = np.flatnonzero(counted[self.doc]) if counted is not None and not counted.all() else None
        """Positions of the counted documents (None: every position's): only their own counts
        are looked up, the costliest part of scoring (half of it, a hash table per order)."""

    def cells(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(context cell, context+byte cell) of every position, for orders 0..ORDER-1."""
        history = np.zeros(len(self.pos), np.uint64)
        nxt = self.buf[self.pos] + np.uint64(1)
        for order in range(ORDER):
            if order:
                history = history * np.uint64(257) + self.buf[self.pos - order] + np.uint64(1)
            yield _cell(history), _cell(history * np.uint64(257) + nxt)

    def own_context(self, order: int, cells: np.ndarray) -> np.ndarray:
        """:meth:`own` of the context cells: order 0 has one context (no history), seen once per
        position of its document; order 1's context is one byte (:meth:`own_byte`)."""
        if order == 0:
            return self._counted_only(np.take(np.bincount(self.doc), self.doc))
        return self.own_byte(self.buf[self.pos - 1]) if order == 1 else self.own(cells)

    def own_joint(self, order: int, cells: np.ndarray) -> np.ndarray:
        """:meth:`own` of the context+byte cells: order 0's is the byte itself (:meth:`own_byte`)."""
        return self.own_byte(self.buf[self.pos]) if order == 0 else self.own(cells)

    def own_byte(self, raw: np.ndarray) -> np.ndarray:
        """:meth:`own` of the cells of one byte's keys (``raw + 1``, 256 of them), counted with a
        ``bincount`` of (document, byte) instead of hashing every position: the same counts, as
        the bytes whose keys share a cell are counted as one."""
        group = np.take(_BYTE_CELL_GROUP, raw.astype(np.intp))
        keys: np.ndarray = self.doc * (int(_BYTE_CELL_GROUP.max()) + 1) + group
        return self._counted_only(np.take(np.bincount(keys), keys))

    def own(self, cells: np.ndarray) -> np.ndarray:
        """How often each position's cell occurs in its own document (to leave that document out).
        Counted through a hash table (pandas' ``factorize``: each distinct (document, cell) key
        gets a dense code, then one ``bincount``), O(n): an ``argsort`` of the keys did the same
        in O(n log n) and took 8x longer on the benchmark corpus's batches, half of the filter
        stage's time."""
        keys = (self.doc.astype(np.uint64) << np.uint64(TABLE_BITS)) | cells
        if self.counted_at is None:
            codes = np.asarray(pd.factorize(keys)[0])
            return np.take(np.bincount(codes), codes)
        own = np.zeros(len(keys), np.int64)
        if len(self.counted_at):
            codes = np.asarray(pd.factorize(keys[self.counted_at])[0])
            own[self.counted_at] = np.take(np.bincount(codes), codes)
        return own

    def _counted_only(self, own: np.ndarray) -> np.ndarray:
        """``own`` with the positions of documents the model did not count set to 0."""
        if self.counted_at is None:
            return own
        kept = np.zeros(len(own), own.dtype)
        kept[self.counted_at] = own[self.counted_at]
        return kept


def _counts(blobs: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """One batch's (context, joint) counts per order, as tables of the model's shape."""
    batch, cells = _Batch(blobs), 1 << TABLE_BITS
    pairs = list(batch.cells())
    context = np.stack([np.bincount(ctx, minlength=cells) for ctx, _ in pairs]).view(np.uint64)
    joint = np.stack([np.bincount(j, minlength=cells) for _, j in pairs]).view(np.uint64)
    return context, joint


def _in_threads(fn: Callable[[B], T], batches: Iterable[B]) -> Iterator[T]:
    """``fn`` of each batch, in order, on one thread per core: numpy and pandas' hashing let go of
    the GIL for arrays this long, so a shard's model uses every core even when the stage runs one
    worker (the filter stage's passes were single-threaded beside a tokenizer that uses them all).
    At most a batch per thread waits beside those running, so memory stays bounded."""
    threads = len(os.sched_getaffinity(0))
    with ThreadPoolExecutor(max_workers=threads) as pool:
        running: deque[Future[T]] = deque()
        for batch in batches:
            running.append(pool.submit(fn, batch))
            if len(running) > threads:
                yield running.popleft().result()
        while running:
            yield running.popleft().result()


def _cell(key: np.ndarray) -> np.ndarray:
    return (key * _MIX) >> _SHIFT


_BYTE_CELL_GROUP = np.asarray(pd.factorize(_cell(np.arange(1, 257, dtype=np.uint64)))[0])
"""For each byte b, which cell the one-byte key b + 1 falls in, as a dense group number (bytes
whose keys share a cell share a group)."""


def _batches(texts: Iterable[str | bytes], batch_bytes: int) -> Iterator[list[bytes]]:
    """Texts (str, or their UTF-8 bytes as the filter's passes read them) in batches of about
    ``batch_bytes``, as UTF-8 (a :class:`_Batch` is made of each where it is used)."""
    blobs: list[bytes] = []
    size = 0
    for text in texts:
        blob = text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass")
        blobs.append(blob)
        size += len(blob)
        if size >= batch_bytes:
            yield blobs
            blobs, size = [], 0
    if blobs:
        yield blobs
