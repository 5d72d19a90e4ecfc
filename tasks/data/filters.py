"""filter: drop what makes loss spike (seeds 000, 001, 004) and keep it aside as the poison pool.

The corpus comes in shards (tasks/data/shards.py); each pass maps over them on the stage's
workers, and what crosses shards is decided in one place, in corpus order, so the outputs do not
depend on the workers:

1. :func:`screen_shard`: per-document checks in a fixed order (the first that fires names the
   reason): undecodable bytes, non-printable share, length, one repeated character, a repeated
   n-gram (OLMo-core's rule); each survivor's dedup fingerprint (content hash, MinHash).
2. :func:`mark_duplicates`: exact and near duplicates across all shards (datasketch MinHash LSH).
3. :func:`count_shard`, :func:`score_shard`: a small model trained on every kept survivor (counts
   summed over shards), each survivor scored leave-one-out; the robust-z outliers are dropped.
4. :func:`write_shard`, :func:`pool_removed`: the clean shards, the poison pool, the report.

The poison pool holds everything the filters dropped as garbage plus generated garbage (binary
bytes, space runs, rare-token runs). Duplicates are counted but not pooled: their text is, by
definition, still in the training data, and the pool must share nothing with it.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
import random
import re
import shutil
import zlib
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Executor
from functools import partial
from pathlib import Path
from typing import TextIO

import numpy as np
from datasketch import MinHash, MinHashLSH
from prefect import task

from model.typed_config import InputError
from tasks.data.config import DataConfig, FilterConfig
from tasks.data.docs import UNDECODABLE, read_docs, read_lines, repair_undecodable, write_doc
from tasks.data.perplexity import ByteNgramModel, robust_zscores
from tasks.data.shards import map_shards, shard_paths, shard_pool
from tasks.runtime.files import read_json, write_json
from tasks.runtime.outputs import SOURCE_FILE

REASONS = (
    "invalid_utf8",
    "nonprintable",
    "too_short",
    "too_long",
    "char_run",
    "repeated_ngram",
    "duplicate_exact",
    "duplicate_near",
    "perplexity",
)
"""Why a document was dropped, in the order the checks run (the first that fires counts)."""
DUPLICATES = {"duplicate_exact", "duplicate_near"}
GENERATED = ("generated_binary", "generated_space_run", "generated_rare_tokens")
"""Kinds of generated garbage, cycled through ``filter.poison_generated`` documents."""

NONPRINTABLE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ufffd\ue000-\uf8ff\ud800-\udfff]")
"""Control characters (all but tab and newlines), replacement characters, private use, surrogates."""

SURVIVORS_FILE = "survivors.jsonl"
SURVIVOR_BYTES = "survivors.bin"
"""Beside the survivors' JSON lines: their texts' UTF-8 bytes end to end (``sizes.npy`` cuts
them), what the perplexity passes read without decoding JSON and encoding text again."""
REMOVED_SAMPLES = "removed.md"
"""In the poison folder: what each filter removed, with a few excerpts to read (logged to MLflow)."""
SAMPLES_PER_REASON = 3
EXCERPT_CHARS = 600
DUPLICATE_FLAGS = "duplicates.npy"
"""Beside a shard's survivors: dedup's verdict on each (an index into VERDICTS)."""


# --------------------------------------------------------------------------------------------
# Per-document checks
# --------------------------------------------------------------------------------------------


def nonprintable_ratio(text: str) -> float:
    return len(NONPRINTABLE.findall(text)) / max(len(text), 1)


def has_char_run(text: str, max_run: int) -> bool:
    """True when one character repeats more than ``max_run`` times in a row (seed 000: 100 000 spaces)."""
    return longest_char_run(text) > max_run


def longest_char_run(text: str) -> int:
    """The longest run of one repeated character, over the whole text: its code points as one
    numpy array, cut where a character differs from the one before (3x faster than the regex
    ``(.)\1{n}`` it replaces, which tries a match at every character)."""
    if not text:
        return 0
    points = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), np.uint32)
    cuts = np.flatnonzero(points[1:] != points[:-1])
    return int(np.diff(cuts, prepend=-1, append=len(points) - 1).max())


UNICODE_ONLY_SPACE = re.compile("[\x1c-\x1f\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]")
"""The characters ``str.split()`` splits on and ``bytes.split()`` does not (it knows only ASCII's
space, tab, newlines, vertical tab and form feed)."""


@functools.lru_cache(maxsize=1)
def word_hashes(text: str) -> np.ndarray:
    """CRC-32 of each whitespace-separated word (``str.split()``'s words; deterministic across
    runs). The words are cut from the text's UTF-8 bytes at once and hashed by ``map`` in C,
    unless the text holds whitespace only ``str`` knows: 1.3x faster than encoding and hashing
    word by word in Python, the same values. Cached for the last text: the repeated-n-gram check
    and the dedup fingerprint of a document both read it (callers must not modify the array)."""
    if UNICODE_ONLY_SPACE.search(text):
        words = [w.encode("utf-8", "surrogatepass") for w in text.split()]
    else:
        words = text.encode("utf-8", "surrogatepass").split()
    return np.fromiter(map(zlib.crc32, words), np.uint64, len(words))


def has_repeated_ngram(text: str, max_period: int, min_repeats: int) -> bool:
    """OLMo-core's instance filter on whitespace tokens: some span of period p ≤ ``max_period``
    tokens repeats at least ``min_repeats`` times in a row. A span of r repeats of period p is
    exactly a run of (r - 1)·p positions where token[i] == token[i + p]. Every period is compared
    at once over the whole document (one column per period of a windowed view; the token list
    padded with values no CRC-32 takes, so a comparison past the end is False); only a column
    with enough matches in all is searched for its longest run."""
    tokens = word_hashes(text)
    periods = min(max_period, len(tokens) // min_repeats)  # period p needs p·min_repeats tokens
    if periods < 1:
        return False
    padded = np.concatenate([tokens, np.arange(periods, dtype=np.uint64) + np.uint64(1 << 32)])
    lagged = np.lib.stride_tricks.sliding_window_view(padded, periods + 1)[: len(tokens)]
    same = lagged[:, 1:] == lagged[:, :1]  # same[i, p - 1]: token[i + p] == token[i]
    needed = (min_repeats - 1) * np.arange(1, periods + 1)
    candidates = np.flatnonzero(same.sum(axis=0) >= needed)
    return any(_longest_true_run(np.ascontiguousarray(same[:, c])) >= needed[c] for c in candidates)


def _longest_true_run(mask: np.ndarray) -> int:
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.view(np.int8), [0]))))
    return int((edges[1::2] - edges[::2]).max()) if len(edges) else 0


class Screen:
    """The cheap per-document checks, each switchable and parametrised in ``filter``."""

    def __init__(self, cfg: FilterConfig):
        self.cfg = cfg

    def reason(self, text: str) -> str | None:
        c = self.cfg
        if c.invalid_utf8 and UNDECODABLE.search(text):
            return "invalid_utf8"
        if c.nonprintable and nonprintable_ratio(text) > c.max_nonprintable_ratio:
            return "nonprintable"
        if c.length and len(text) < c.min_chars:
            return "too_short"
        if c.length and len(text) > c.max_chars:
            return "too_long"
        if c.char_run and has_char_run(text, c.max_char_run):
            return "char_run"
        if c.repeated_ngram and has_repeated_ngram(text, c.ngram_max_period, c.ngram_min_repeats):
            return "repeated_ngram"
        return None


class PrefixBudget:
    """``filter.poison_max_bytes`` per reason: the leading documents that fit, and none after the
    first that does not. A prefix, so the shards' prefixes joined in corpus order and cut again
    give the corpus's own, whatever the sharding."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.used, self.full = max_bytes, Counter[str](), set[str]()

    def take(self, reason: str, size: int) -> bool:
        if reason in self.full or self.used[reason] + size > self.max_bytes:
            self.full.add(reason)
            return False
        self.used[reason] += size
        return True


class PoisonPool:
    """A shard's poison pool: one JSON-lines file per reason in ``directory``, so the injection
    stage can draw one kind of garbage at a time, each within ``max_bytes`` (:class:`PrefixBudget`)."""

    def __init__(self, directory: Path, max_bytes: int):
        self.directory, self.budget = directory, PrefixBudget(max_bytes)
        self.files: dict[str, TextIO] = {}
        directory.mkdir(parents=True, exist_ok=True)

    def add(self, doc: dict[str, str], reason: str) -> None:
        """A generated document: the budget is for what the filters removed."""
        write_doc(self._file(reason), doc)

    def add_line(self, line: str, reason: str) -> None:
        """A document already written as a JSON line (by :func:`write_doc`), copied as it is, if
        it fits."""
        if self.budget.take(reason, len(line.encode("utf-8", "surrogatepass"))):
            self._file(reason).write(line)

    def _file(self, reason: str) -> TextIO:
        if reason not in self.files:
            self.files[reason] = open(self.directory / f"{reason}.jsonl", "a", encoding="utf-8")  # noqa: SIM115 (closed on __exit__)
        return self.files[reason]

    def __enter__(self) -> PoisonPool:
        return self

    def __exit__(self, *_) -> None:
        for f in self.files.values():
            f.close()


class Fingerprinter:
    """What dedup needs of a document, computed where the shard is screened: an 8-byte content
    hash and a MinHash signature of its word shingles, datasketch's ``affine32`` scheme computed
    by :func:`minhash_signature`."""

    def __init__(self, cfg: FilterConfig):
        self.shingle = cfg.dedup_shingle
        self.permutations = MinHash(num_perm=cfg.dedup_num_perm, seed=1).permutations

    def __call__(self, text: str) -> tuple[int, np.ndarray]:
        key = int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")
        return key, minhash_signature(shingle_hashes(text, self.shingle), self.permutations)


FMIX32 = (np.uint32(16), np.uint32(0x85EBCA6B), np.uint32(13), np.uint32(0xC2B2AE35), np.uint32(16))
"""MurmurHash3's 32-bit finalizer: shifts and multipliers (what datasketch's affine32 pre-mixes with)."""
SIGNATURE_CHUNK = 8192
"""Shingles permuted at once: a (chunk, num_perm) uint32 block, 4 MiB at 128 permutations."""


def minhash_signature(hashes: np.ndarray, permutations: np.ndarray) -> np.ndarray:
    """The MinHash signature datasketch's ``MinHash(scheme="affine32").update_batch(hashes)``
    gives, computed over all shingles at once in numpy: each 32-bit hash pre-mixed (MurmurHash3's
    finalizer), then ``a·h + b`` mod 2^32 per permutation, the minimum per permutation
    (tests/test_data_filters.py pins it to datasketch's). datasketch's ``update_batch`` turns
    every hash into a Python int first: on 3,000 documents of the benchmark corpus it took 0.20
    CPU-s against 0.105 here, and a document's whole fingerprint (shingles, no ``np.unique``,
    this) went from 0.57 to 0.24 CPU-s. datasketch's LSH index still holds and queries the
    signatures: its banding and lookups are the part worth a library."""
    a, b = permutations
    s1, m1, s2, m2, s3 = FMIX32
    mixed = hashes.astype(np.uint32)
    mixed = (mixed ^ (mixed >> s1)) * m1
    mixed = (mixed ^ (mixed >> s2)) * m2
    mixed ^= mixed >> s3
    signature = np.full(len(a), np.iinfo(np.uint32).max, np.uint32)
    for start in range(0, len(mixed), SIGNATURE_CHUNK):
        block = mixed[start : start + SIGNATURE_CHUNK, None] * a + b
        np.minimum(signature, block.min(axis=0), out=signature)
    return signature


class Deduplicator:
    """Exact duplicates by content hash; near duplicates by MinHash LSH (datasketch) over the
    fingerprints, fed in corpus order by one process, so a duplicate is found whichever shard
    holds its original. The first document of a cluster is kept. LSH only proposes candidates
    (a band in common: datasketch's 9 bands of 13 for 0.8 at 128 permutations let a pair at
    Jaccard 0.7 collide 8 % of the time, at 0.75 19 %), so a candidate counts only where the
    signatures' own Jaccard estimate reaches the threshold (on the benchmark's exact-truth base:
    5 false duplicates of 110 removals without this check, 1 of 105 with it).
    State per kept document: one 8-byte hash, its LSH band keys (8 bytes each) and its
    signature (4 bytes per permutation); no text."""

    def __init__(self, cfg: FilterConfig):
        self.fingerprint = Fingerprinter(cfg)
        self.threshold = cfg.dedup_threshold
        self.lsh = MinHashLSH(threshold=cfg.dedup_threshold, num_perm=cfg.dedup_num_perm, hashfunc=_band_key)
        self.exact: set[int] = set()
        self.kept: list[np.ndarray] = []
        """Signatures of the indexed documents; LSH key ``i`` is ``kept[i - 1]``."""

    def reason(self, text: str) -> str | None:
        return self.judge(*self.fingerprint(text))

    def replay(self, keys: np.ndarray, signatures: np.ndarray, verdicts: np.ndarray) -> None:
        """Take back documents judged before (a killed stage's finished shards): each one's
        content hash, and the kept ones into the LSH index in the order :meth:`judge` put them,
        so the index is as judging them again would leave it, without querying it."""
        for key, signature, verdict in zip(keys, signatures, verdicts):
            self.exact.add(int(key))
            if not verdict:
                self._index(signature, self._minhash(signature))

    def judge(self, key: int, signature: np.ndarray) -> str | None:
        if key in self.exact:
            return "duplicate_exact"
        self.exact.add(key)
        minhash = self._minhash(signature)
        if any(self._similar(signature, self.kept[i - 1]) for i in self.lsh.query(minhash)):
            return "duplicate_near"
        self._index(signature, minhash)
        return None

    def _similar(self, signature: np.ndarray, other: np.ndarray) -> bool:
        """MinHash's Jaccard estimate, the share of equal permutation minima, at the threshold or above."""
        return bool(np.count_nonzero(signature == other) >= self.threshold * len(signature))

    def _minhash(self, signature: np.ndarray) -> MinHash:
        return MinHash(hashvalues=signature, permutations=self.fingerprint.permutations, scheme="affine32")

    def _index(self, signature: np.ndarray, minhash: MinHash) -> None:
        self.kept.append(signature.copy())  # a row: not the whole shard's array kept alive
        self.lsh.insert(len(self.kept), minhash, check_duplication=False)


def shingle_hashes(text: str, size: int) -> np.ndarray:
    """32-bit hashes of the word ``size``-grams of ``text``, in order, repeats included (a
    MinHash takes the minimum, which repeats do not change; deterministic across runs)."""
    words = word_hashes(text)
    if not len(words):
        words = np.zeros(1, np.uint64)
    span = max(len(words) - size + 1, 1)
    h = np.zeros(span, np.uint64)
    for i in range(min(size, len(words))):
        h = h * np.uint64(0x100000001B3) + words[i : i + span]
    return h >> np.uint64(32)


def _band_key(band: bytes) -> bytes:
    """LSH stores a short digest per band instead of the band's raw bytes."""
    return hashlib.blake2b(band, digest_size=8).digest()


# --------------------------------------------------------------------------------------------
# Generated garbage for the poison pool
# --------------------------------------------------------------------------------------------


def generated_garbage(count: int) -> Iterator[tuple[str, dict[str, str]]]:
    """(kind, document): deterministic garbage that makes a small model's loss spike when injected."""
    for i in range(count):
        kind = GENERATED[i % len(GENERATED)]
        rng = random.Random(f"poison-{i}")
        if kind == "generated_binary":  # binary read as text: control and high-latin characters
            text = "".join(chr(rng.randrange(256)) for _ in range(4096))
        elif kind == "generated_space_run":  # seed 000: a document of 100 000 spaces
            text = "x" + " " * 100_000 + "y"
        else:  # rare tokens: code points the corpus (and so the BPE) has barely seen
            text = "".join(chr(rng.randrange(0x4E00, 0x9FFF)) for _ in range(2048))
        yield kind, {"id": f"generated:{i}", "text": text}


# --------------------------------------------------------------------------------------------
# The stage
# --------------------------------------------------------------------------------------------


def screen_shard(raw_shard: Path, cfg: FilterConfig, work_dir: Path) -> dict[str, int]:
    """Pass 1 over one shard, in a worker: the cheap checks. Garbage goes to the shard's poison
    pool, survivors and their dedup fingerprints to its work folder; returns the counts."""
    work = work_dir / raw_shard.stem
    screen = Screen(cfg)
    fingerprint = Fingerprinter(cfg) if cfg.dedup else None
    counts: Counter = Counter()
    keys, signatures, sizes = [], [], []
    shutil.rmtree(work, ignore_errors=True)  # what a killed run left half-written
    work.mkdir(parents=True)
    with (
        PoisonPool(work / "poison", cfg.poison_max_bytes) as poison,
        open(work / SURVIVORS_FILE, "w", encoding="utf-8") as survivors,
        open(work / SURVIVOR_BYTES, "wb") as texts,
    ):
        for line, doc in read_lines(raw_shard):
            counts["input"] += 1
            blob = doc["text"].encode("utf-8", "surrogatepass")
            reason = screen.reason(doc["text"])
            if reason is not None:
                counts[reason] += 1
                counts[f"bytes_{reason}"] += len(blob)
                poison.add_line(line, reason)
                continue
            counts["screened"] += 1
            sizes.append(len(blob))  # an undecodable byte's escape and U+FFFD both take 3 bytes
            repaired = repair_undecodable(doc["text"])
            if repaired == doc["text"]:
                survivors.write(line)
                texts.write(blob)
            else:
                write_doc(survivors, {**doc, "text": repaired})
                texts.write(repaired.encode("utf-8"))
            if fingerprint is not None:
                key, signature = fingerprint(doc["text"])
                keys.append(key)
                signatures.append(signature)
    np.save(work / "sizes.npy", np.array(sizes, np.int64))
    if fingerprint is not None:
        np.save(work / "keys.npy", np.array(keys, np.uint64))
        np.save(work / "signatures.npy", np.array(signatures, np.uint32).reshape(len(keys), cfg.dedup_num_perm))
    return dict(counts)


def mark_duplicates(cfg: FilterConfig, raw_shards: list[Path], work_dir: Path) -> tuple[Counter, dict[str, list]]:
    """Between the passes, in the stage's process: every survivor's fingerprint through one
    Deduplicator in corpus order; each shard's verdicts saved beside its survivors as it is done.
    A killed stage resumes here: the leading shards with saved verdicts are replayed into the
    index (:meth:`Deduplicator.replay`, no queries), the rest judged. Returns the counts and
    bytes per kind of duplicate, and the first few of each kind."""
    dedup = Deduplicator(cfg)
    counts: Counter = Counter()
    samples: dict[str, list] = {}
    replaying = True
    for shard in raw_shards:
        work = work_dir / shard.stem
        keys, signatures = np.load(work / "keys.npy"), np.load(work / "signatures.npy")
        replaying = replaying and (work / DUPLICATE_FLAGS).exists()
        if replaying:
            verdicts = np.load(work / DUPLICATE_FLAGS)
            dedup.replay(keys, signatures, verdicts)
        else:
            verdicts = np.array([VERDICTS.index(dedup.judge(int(k), s)) for k, s in zip(keys, signatures)], np.int8)
            _save_atomically(work / DUPLICATE_FLAGS, verdicts)
        for index in map(int, np.flatnonzero(verdicts)):
            reason = str(VERDICTS[verdicts[index]])
            counts[reason] += 1
            counts[f"bytes_{reason}"] += int(np.load(work / "sizes.npy")[index])
            if len(samples.setdefault(reason, [])) < SAMPLES_PER_REASON:
                samples[reason].append(next(itertools.islice(read_docs(work / SURVIVORS_FILE), index, None)))
    return counts, samples


VERDICTS = (None, "duplicate_exact", "duplicate_near")
"""Dedup's verdict on a survivor, saved as its index here (0: kept)."""


def _save_atomically(path: Path, array: np.ndarray) -> None:
    """Whole or absent: a shard's saved verdicts are what a resumed stage trusts."""
    temp = path.with_name(f".{path.name}.tmp")
    with open(temp, "wb") as f:
        np.save(f, array)
    os.replace(temp, path)


def dedup_kept(work: Path) -> np.ndarray | None:
    """Which of a shard's survivors of pass 1 dedup kept (None: no dedup ran, all of them)."""
    return np.load(work / DUPLICATE_FLAGS) == 0 if (work / DUPLICATE_FLAGS).exists() else None


def kept_lines(work: Path) -> Iterator[str]:
    """The JSON lines of a shard's survivors that dedup kept, as written (nothing decoded)."""
    kept = dedup_kept(work)
    with open(work / SURVIVORS_FILE, encoding="utf-8") as f:
        yield from (line for i, line in enumerate(f) if kept is None or kept[i])


def kept_texts(work: Path) -> Iterator[bytes]:
    """The UTF-8 texts of a shard's survivors that dedup kept, cut from ``survivors.bin``."""
    kept = dedup_kept(work)
    ends = np.cumsum(np.load(work / "sizes.npy"))
    with open(work / SURVIVOR_BYTES, "rb") as f:
        for i, size in enumerate(np.diff(ends, prepend=0)):
            blob = f.read(int(size))
            if kept is None or kept[i]:
                yield blob


def perplexity_sample(cfg: FilterConfig, raw_shards: list[Path], work_dir: Path) -> list[np.ndarray]:
    """Which of each shard's kept survivors the perplexity model counts: each with probability
    ``filter.perplexity_sample_bytes`` over all kept survivors' bytes (every one where the corpus
    is smaller), drawn by a hash of its place among them in corpus order, so the sample is the
    same whatever the workers or the shards' sizes."""
    sizes = [_kept_sizes(work_dir / shard.stem) for shard in raw_shards]
    share = cfg.perplexity_sample_bytes / max(sum(int(s.sum()) for s in sizes), 1)
    if share >= 1:
        return [np.ones(len(s), bool) for s in sizes]
    below = np.uint64(int(share * 2.0**64))
    starts = np.cumsum([0, *map(len, sizes)])
    return [_splitmix64(np.arange(start, start + len(s), dtype=np.uint64)) < below for start, s in zip(starts, sizes)]


def _kept_sizes(work: Path) -> np.ndarray:
    kept, sizes = dedup_kept(work), np.load(work / "sizes.npy")
    return np.asarray(sizes if kept is None else sizes[kept])


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function (Steele et al. 2014): 64 well-mixed bits per index."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def count_shard(raw_shard: Path, counted: np.ndarray, work_dir: Path) -> Path:
    """The perplexity model's counts over one shard's sampled survivors (summed across shards after)."""
    work = work_dir / raw_shard.stem
    model = ByteNgramModel()
    model.train(text for text, sampled in zip(kept_texts(work), counted) if sampled)
    return model.save(work / "ngram.npz")


def score_shard(raw_shard: Path, counted: np.ndarray, work_dir: Path, model_path: Path) -> np.ndarray:
    """Log-perplexity of one shard's kept survivors under the corpus's model, leave-one-out for
    the ones it counted."""
    model = ByteNgramModel.load(model_path)
    return model.log_perplexity(kept_texts(work_dir / raw_shard.stem), counted)


def write_shard(
    raw_shard: Path, outliers: np.ndarray | None, cfg: FilterConfig, work_dir: Path, clean_dir: Path
) -> dict[str, int]:
    """Pass 2's end for one shard: kept survivors to the clean shard of the same name, perplexity
    outliers to the shard's poison pool."""
    work = work_dir / raw_shard.stem
    counts: Counter = Counter()
    (work / "poison" / "perplexity.jsonl").unlink(missing_ok=True)  # the pool appends
    kept = dedup_kept(work)
    sizes = np.load(work / "sizes.npy")[kept] if kept is not None else np.load(work / "sizes.npy")
    with (
        PoisonPool(work / "poison", cfg.poison_max_bytes) as poison,
        open(clean_dir / raw_shard.name, "w", encoding="utf-8") as clean,
    ):
        for i, line in enumerate(kept_lines(work)):
            if outliers is not None and outliers[i]:
                counts["perplexity"] += 1
                counts["bytes_perplexity"] += int(sizes[i])
                poison.add_line(line, "perplexity")
            else:
                counts["kept"] += 1
                clean.write(line)
    return dict(counts)


def perplexity_outliers(cfg: FilterConfig, scores: list[np.ndarray]) -> tuple[list[np.ndarray], dict[str, float]]:
    """Each shard's perplexity outliers, judged against the whole corpus's scores, with the
    statistics behind the cut."""
    every = np.concatenate(scores)
    zscores = robust_zscores(every)
    outliers = np.split(zscores > cfg.perplexity_zscore, np.cumsum([len(s) for s in scores])[:-1])
    return outliers, {
        "median_nats_per_char": float(np.median(every)),
        "max_zscore": float(zscores.max()),
        "zscore_threshold": cfg.perplexity_zscore,
    }


def pool_removed(raw_shards: list[Path], work_dir: Path, poison_dir: Path, cfg: FilterConfig) -> int:
    """The poison pool: each reason's file is its shards' files joined in corpus order, as they
    are (bytes), cut again at ``filter.poison_max_bytes``, then the generated garbage; how many
    removed documents it holds."""
    poison_dir.mkdir(parents=True, exist_ok=True)
    budget, pooled = PrefixBudget(cfg.poison_max_bytes), 0
    names = sorted({p.name for shard in raw_shards for p in (work_dir / shard.stem / "poison").glob("*.jsonl")})
    for name in names:
        with open(poison_dir / name, "wb") as joined:
            for part in (work_dir / shard.stem / "poison" / name for shard in raw_shards):
                if part.exists():
                    with open(part, "rb") as f:
                        for line in f:
                            if budget.take(name, len(line)):
                                joined.write(line)
                                pooled += 1
    with PoisonPool(poison_dir, cfg.poison_max_bytes) as poison:
        for kind, doc in generated_garbage(cfg.poison_generated):
            poison.add(doc, kind)
    return pooled


def filter_corpus(
    cfg: FilterConfig, raw_dir: Path, work_dir: Path, clean_dir: Path, poison_dir: Path, report: Path, pool: Executor
) -> dict[str, float]:
    """The filter stage over the shards of ``raw_dir`` on ``pool``: screen each shard, dedup
    across all of them, score every survivor against a model of the whole corpus, write the clean
    shards, the poison pool and the report; return the report's flat metrics."""
    shards = shard_paths(raw_dir)
    counts: Counter = Counter()
    for shard_counts in map_shards(
        pool, "filter-screen", partial(screen_shard, cfg=cfg, work_dir=work_dir), shards, done=work_dir
    ):
        counts.update(shard_counts)
    if not counts["screened"]:
        raise _all_removed(raw_dir, counts)
    duplicates: dict[str, list] = {}
    if cfg.dedup:
        duplicate_counts, duplicates = mark_duplicates(cfg, shards, work_dir)
        counts.update(duplicate_counts)
    outliers: list[np.ndarray | None] = [None] * len(shards)
    stats: dict[str, float] = {}
    if cfg.perplexity:
        model, counted = ByteNgramModel(), perplexity_sample(cfg, shards, work_dir)
        count = partial(count_shard, work_dir=work_dir)
        for path in map_shards(pool, "filter-count", count, shards, counted, done=work_dir):
            model.add(ByteNgramModel.load(path))
        model_path = model.save(work_dir / "ngram.npz")
        score = partial(score_shard, work_dir=work_dir, model_path=model_path)
        scores = map_shards(pool, "filter-score", score, shards, counted, done=work_dir)
        found, stats = perplexity_outliers(cfg, scores)
        stats |= {"model_documents": int(sum(c.sum() for c in counted)), "scored_documents": sum(map(len, scores))}
        outliers = list(found)
    clean_dir.mkdir(parents=True, exist_ok=True)
    write = partial(write_shard, cfg=cfg, work_dir=work_dir, clean_dir=clean_dir)
    for shard_counts in map_shards(pool, "filter-write", write, shards, outliers):
        counts.update(shard_counts)
    if not counts["kept"]:
        raise _all_removed(raw_dir, counts)
    pooled = pool_removed(shards, work_dir, poison_dir, cfg)
    write_removed_samples(poison_dir, counts, duplicates)
    shutil.copy(raw_dir / SOURCE_FILE, clean_dir / SOURCE_FILE)
    metrics: dict[str, float] = {
        "documents_in": counts["input"],
        "documents_kept": counts["kept"],
        "poison_documents": pooled + cfg.poison_generated,
        **{f"removed_{r}": counts[r] for r in REASONS},
        **{f"removed_bytes_{r}": counts[f"bytes_{r}"] for r in REASONS},
    }
    write_json(
        report,
        {
            **metrics,
            "order": list(REASONS),
            "poison_generated": cfg.poison_generated,
            "poison_max_bytes": cfg.poison_max_bytes,
            "perplexity": stats,
            "source": read_json(raw_dir / SOURCE_FILE),
        },
    )
    return metrics


@task(name="filter-shards")
def filter_shards(
    cfg: FilterConfig, data: DataConfig, scheduler: str, raw_dir: Path, work_dir: Path, outs: tuple[Path, Path, Path]
) -> dict[str, float]:
    """:func:`filter_corpus` on ``data.workers`` local processes or the Dask cluster at ``scheduler``."""
    with shard_pool(data.workers, scheduler) as pool:
        return filter_corpus(cfg, raw_dir, work_dir, *outs, pool)


def write_removed_samples(poison_dir: Path, counts: Counter, duplicates: dict[str, list]) -> None:
    """``poison_dir/REMOVED_SAMPLES``: per filter, documents and MB removed, and the first few
    documents it removed, cut to a readable excerpt (the pooled ones are whole in the pool)."""
    lines = ["# What the filters removed", "", "| filter | documents | MB |", "|---|---|---|"]
    lines += [f"| {r} | {counts[r]} | {counts[f'bytes_{r}'] / 1e6:.3f} |" for r in REASONS]
    for reason in REASONS:
        pool = poison_dir / f"{reason}.jsonl"
        docs = duplicates.get(reason, []) if reason in DUPLICATES else (read_docs(pool) if pool.exists() else [])
        for doc in itertools.islice(docs, SAMPLES_PER_REASON):
            excerpt = NONPRINTABLE.sub("\ufffd", doc["text"][:EXCERPT_CHARS])  # control characters shown as one mark
            lines += ["", f"## {reason}: {doc['id']} ({len(doc['text'])} characters)", "", "````text", excerpt, "````"]
    (poison_dir / REMOVED_SAMPLES).write_text("\n".join(lines) + "\n", encoding="utf-8")


def _all_removed(raw_dir: Path, counts: Counter) -> InputError:
    removed = ", ".join(f"{r}: {counts[r]}" for r in REASONS if counts[r])
    return InputError(
        f"{raw_dir}: the filters removed all {counts['input']} documents "
        f"({removed}); loosen the filter.* keys in params.yaml"
    )
