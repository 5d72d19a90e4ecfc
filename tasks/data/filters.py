"""filter: drop what makes loss spike (seeds 000, 001, 004) and keep it aside as the poison pool.

Two streaming passes over ``data/raw/docs.jsonl``:

1. :func:`screen_documents`: per-document checks in a fixed order (the first that fires names
   the reason): undecodable bytes, non-printable share, length, one repeated character, a
   repeated n-gram (OLMo-core's rule), then exact and near duplicates (datasketch MinHash LSH).
2. :func:`drop_perplexity_outliers`: train a small model on the survivors, score each of them
   leave-one-out, drop the robust-z outliers; write the clean documents, the rest of the poison
   pool and the report.

The poison pool holds everything the filters dropped as garbage plus generated garbage (binary
bytes, space runs, rare-token runs). Duplicates are counted but not pooled: their text is, by
definition, still in the training data, and the pool must share nothing with it.
"""

from __future__ import annotations

import hashlib
import random
import re
import shutil
import zlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import numpy as np
from datasketch import MinHash, MinHashLSH
from prefect import task

from model.typed_config import InputError
from tasks.data.config import FilterConfig
from tasks.data.docs import UNDECODABLE, read_docs, repair_undecodable, write_doc
from tasks.data.perplexity import ByteNgramModel, robust_zscores
from tasks.runtime.files import read_json, write_json
from tasks.runtime.outputs import DOCS_FILE, SOURCE_FILE

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


# --------------------------------------------------------------------------------------------
# Per-document checks
# --------------------------------------------------------------------------------------------


def nonprintable_ratio(text: str) -> float:
    return len(NONPRINTABLE.findall(text)) / max(len(text), 1)


def has_char_run(text: str, max_run: int) -> bool:
    """True when one character repeats more than ``max_run`` times in a row (seed 000: 100 000 spaces)."""
    return _char_run_pattern(max_run).search(text) is not None


def _char_run_pattern(max_run: int) -> re.Pattern:
    return re.compile(rf"(.)\1{{{max_run}}}", re.DOTALL)


def has_repeated_ngram(text: str, max_period: int, min_repeats: int) -> bool:
    """OLMo-core's instance filter on whitespace tokens: some span of period p ≤ ``max_period``
    tokens repeats at least ``min_repeats`` times in a row. A span of r repeats of period p is
    exactly a run of (r - 1)·p positions where token[i] == token[i + p]."""
    tokens = np.array([zlib.crc32(w.encode("utf-8", "surrogatepass")) for w in text.split()], np.int64)
    for period in range(1, max_period + 1):
        needed = (min_repeats - 1) * period
        if len(tokens) - period < needed:
            break  # longer periods need even more tokens
        same = tokens[period:] == tokens[:-period]
        if same.sum() >= needed and _longest_true_run(same) >= needed:
            return True
    return False


def _longest_true_run(mask: np.ndarray) -> int:
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.view(np.int8), [0]))))
    return int((edges[1::2] - edges[::2]).max()) if len(edges) else 0


class Screen:
    """The cheap per-document checks, each switchable and parametrised in ``filter``."""

    def __init__(self, cfg: FilterConfig):
        self.cfg = cfg
        self.char_run = _char_run_pattern(cfg.max_char_run)

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
        if c.char_run and self.char_run.search(text):
            return "char_run"
        if c.repeated_ngram and has_repeated_ngram(text, c.ngram_max_period, c.ngram_min_repeats):
            return "repeated_ngram"
        return None


class PoisonPool:
    """The poison pool: one JSON-lines file per reason in ``directory``, so the injection stage
    can draw one kind of garbage at a time."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.files: dict[str, TextIO] = {}
        directory.mkdir(parents=True, exist_ok=True)

    def add(self, doc: dict[str, str], reason: str) -> None:
        if reason not in self.files:
            self.files[reason] = open(self.directory / f"{reason}.jsonl", "a", encoding="utf-8")  # noqa: SIM115 (closed on __exit__)
        write_doc(self.files[reason], doc)

    def __enter__(self) -> PoisonPool:
        return self

    def __exit__(self, *_) -> None:
        for f in self.files.values():
            f.close()


class Deduplicator:
    """Exact duplicates by content hash; near duplicates by MinHash LSH over word shingles
    (datasketch). The first document of a cluster is kept. State per kept document: one 8-byte
    hash and its LSH band keys; no text."""

    def __init__(self, cfg: FilterConfig):
        self.shingle = cfg.dedup_shingle
        self.num_perm = cfg.dedup_num_perm
        self.permutations = MinHash(num_perm=cfg.dedup_num_perm, seed=1).permutations
        self.lsh = MinHashLSH(threshold=cfg.dedup_threshold, num_perm=cfg.dedup_num_perm, hashfunc=_band_key)
        self.exact: set[bytes] = set()
        self.indexed = 0

    def reason(self, text: str) -> str | None:
        key = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
        if key in self.exact:
            return "duplicate_exact"
        self.exact.add(key)
        signature = MinHash(num_perm=self.num_perm, hashfunc=int, permutations=self.permutations, scheme="affine32")
        signature.update_batch(shingle_hashes(text, self.shingle))
        if self.lsh.query(signature):
            return "duplicate_near"
        self.indexed += 1
        self.lsh.insert(self.indexed, signature, check_duplication=False)
        return None


def shingle_hashes(text: str, size: int) -> np.ndarray:
    """Distinct 32-bit hashes of the word ``size``-grams of ``text`` (deterministic across runs)."""
    words = np.array([zlib.crc32(w.encode("utf-8", "surrogatepass")) for w in text.split()] or [0], np.uint64)
    span = max(len(words) - size + 1, 1)
    h = np.zeros(span, np.uint64)
    for i in range(min(size, len(words))):
        h = h * np.uint64(0x100000001B3) + words[i : i + span]
    return np.unique(h >> np.uint64(32))


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


@task(name="screen-documents")
def screen_documents(cfg: FilterConfig, raw_dir: Path, poison_dir: Path, work_dir: Path) -> dict[str, int]:
    """Pass 1: cheap checks and dedup. Survivors go to ``work_dir``, garbage to the poison pool;
    returns the counts per reason (and of the input, the survivors and the pooled)."""
    screen = Screen(cfg)
    dedup = Deduplicator(cfg) if cfg.dedup else None
    counts: Counter = Counter()
    work_dir.mkdir(parents=True, exist_ok=True)
    with PoisonPool(poison_dir) as poison, open(work_dir / SURVIVORS_FILE, "w", encoding="utf-8") as survivors:
        for doc in read_docs(raw_dir / DOCS_FILE):
            counts["input"] += 1
            reason = screen.reason(doc["text"]) or (dedup.reason(doc["text"]) if dedup else None)
            if reason is None:
                counts["survivors"] += 1
                write_doc(survivors, {**doc, "text": repair_undecodable(doc["text"])})
                continue
            counts[reason] += 1
            if reason not in DUPLICATES:
                counts["pooled"] += 1
                poison.add(doc, reason)
    if not counts["survivors"]:
        raise _all_removed(raw_dir, counts)
    return dict(counts)


@task(name="drop-perplexity-outliers")
def drop_perplexity_outliers(
    cfg: FilterConfig,
    counts: dict[str, int],
    raw_dir: Path,
    work_dir: Path,
    clean_dir: Path,
    poison_dir: Path,
    report: Path,
) -> dict[str, float]:
    """Pass 2: train the perplexity model on the survivors, move their outliers to the poison
    pool, add the generated garbage; the rest is the clean corpus. Writes the report and returns
    its flat metrics."""
    survivors = work_dir / SURVIVORS_FILE
    counts = Counter(counts)
    outlier, stats = perplexity_outliers(cfg, survivors) if cfg.perplexity else (None, {})
    clean_dir.mkdir(parents=True, exist_ok=True)
    with PoisonPool(poison_dir) as poison, open(clean_dir / DOCS_FILE, "w", encoding="utf-8") as clean:
        for i, doc in enumerate(read_docs(survivors)):
            if outlier is not None and outlier[i]:
                counts["perplexity"] += 1
                poison.add(doc, "perplexity")
            else:
                counts["kept"] += 1
                write_doc(clean, doc)
        for kind, doc in generated_garbage(cfg.poison_generated):
            poison.add(doc, kind)
    if not counts["kept"]:
        raise _all_removed(raw_dir, counts)
    shutil.copy(raw_dir / SOURCE_FILE, clean_dir / SOURCE_FILE)
    metrics: dict[str, float] = {
        "documents_in": counts["input"],
        "documents_kept": counts["kept"],
        "poison_documents": counts["pooled"] + counts["perplexity"] + cfg.poison_generated,
        **{f"removed_{r}": counts[r] for r in REASONS},
    }
    write_json(
        report,
        {
            **metrics,
            "order": list(REASONS),
            "poison_generated": cfg.poison_generated,
            "perplexity": stats,
            "source": read_json(raw_dir / SOURCE_FILE),
        },
    )
    return metrics


def perplexity_outliers(cfg: FilterConfig, docs: Path) -> tuple[np.ndarray, dict[str, float]]:
    """Which documents of ``docs`` are perplexity outliers, with the statistics behind the cut."""
    model = ByteNgramModel()
    model.train(d["text"] for d in read_docs(docs))
    scores = model.log_perplexity(d["text"] for d in read_docs(docs))
    zscores = robust_zscores(scores)
    return zscores > cfg.perplexity_zscore, {
        "median_nats_per_char": float(np.median(scores)),
        "max_zscore": float(zscores.max()),
        "zscore_threshold": cfg.perplexity_zscore,
    }


def _all_removed(raw_dir: Path, counts: Counter) -> InputError:
    removed = ", ".join(f"{r}: {counts[r]}" for r in REASONS if counts[r])
    return InputError(
        f"{raw_dir / DOCS_FILE}: the filters removed all {counts['input']} documents "
        f"({removed}); loosen the filter.* keys in params.yaml"
    )
