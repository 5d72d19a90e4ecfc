"""How well do the filters work? Precision and recall on a corpus with planted garbage.

Real documents (the base) get garbage of known kinds appended, each kind aimed at one filter.
Each filter then runs alone over the whole corpus, and all of them together:

  precision  share of what the filter removed that is garbage (planted, of any kind, or a
             duplicate)
  recall     share of the garbage aimed at the filter that it removed

Duplicates are judged by exact Jaccard similarity of word shingles against every earlier
document (pairwise, fine at test sizes), so dedup is measured against the truth, not against
its own MinHash estimate; that includes the near copies the base already holds (the standard
library repeats some docstrings). Any other base document removed is a false positive, even an
odd one (a table of symbols): the base is taken as clean.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import random
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tasks.data.config import FilterConfig
from tasks.data.docs import read_docs, write_doc
from tasks.data.filters import filter_corpus
from tasks.data.shards import shard_path, shard_pool
from tasks.runtime.outputs import SOURCE_FILE

SWITCHES = ("invalid_utf8", "nonprintable", "length", "char_run", "repeated_ngram", "dedup", "perplexity")
"""The filters' on/off keys in ``filter``."""
PLANTED = {
    "undecodable_bytes": "invalid_utf8",
    "control_chars": "nonprintable",
    "too_short": "length",
    "too_long": "length",
    "space_run": "char_run",
    "repeated_phrase": "repeated_ngram",
    "exact_copy": "dedup",
    "near_copy": "dedup",
    "gibberish": "perplexity",
    "base64_blob": "perplexity",
    "foreign_script": "perplexity",
}
"""Kind of planted garbage -> the filter meant to catch it."""


def planted_corpus(base: list[str], per_kind: int, cfg: FilterConfig, seed: int = 0) -> Iterator[dict[str, str]]:
    """The base documents (ids ``base:i``), then ``per_kind`` documents of every planted kind
    (ids ``<kind>:j``); copies come after their originals, so dedup keeps the original."""
    rng = random.Random(seed)
    for i, text in enumerate(base):
        yield {"id": f"base:{i}", "text": text}
    for kind in PLANTED:
        for j in range(per_kind):
            yield {"id": f"{kind}:{j}", "text": garbage(kind, rng.choice(base), base, cfg, rng)}


def garbage(kind: str, text: str, base: list[str], cfg: FilterConfig, rng: random.Random) -> str:
    cut = rng.randrange(len(text))
    if kind == "undecodable_bytes":  # bytes 0xF8-0xFF never occur in UTF-8
        junk = bytes(rng.randrange(0xF8, 0x100) for _ in range(8))
        return text[:cut] + junk.decode("utf-8", "surrogateescape") + text[cut:]
    if kind == "control_chars":  # binary read as text
        return "".join(chr(rng.choice([*range(1, 9), *range(14, 32)])) if rng.random() < 0.1 else c for c in text)
    if kind == "too_short":
        return text[: rng.randrange(8, cfg.min_chars)]
    if kind == "too_long":
        parts = [text]
        while sum(map(len, parts)) <= cfg.max_chars:
            parts.append(rng.choice(base))
        return "\n\n".join(parts)
    if kind == "space_run":  # seed 000: a document with 100 000 spaces
        return text[:cut] + " " * 100_000 + text[cut:]
    if kind == "repeated_phrase":
        words = text.split()
        start = rng.randrange(max(len(words) - 4, 1))
        phrase = " ".join(words[start : start + rng.randint(1, 4)])
        return text + (" " + phrase) * (cfg.ngram_min_repeats + 8)
    if kind == "exact_copy":
        return text
    if kind == "near_copy":
        words = text.split(" ")
        words[rng.randrange(len(words))] = "changed"
        return " ".join(words)
    if kind == "gibberish":
        return " ".join("".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) for _ in range(120))
    if kind == "base64_blob":
        blob = base64.b64encode(rng.randbytes(600)).decode()
        return "\n".join(blob[i : i + 76] for i in range(0, len(blob), 76))
    if kind == "foreign_script":
        return " ".join("".join(chr(rng.randrange(0x430, 0x450)) for _ in range(rng.randint(2, 9))) for _ in range(120))
    raise ValueError(f"unknown planted kind {kind!r}")


def true_duplicates(docs: list[dict[str, str]], cfg: FilterConfig) -> set[str]:
    """Ids of documents whose word-shingle Jaccard similarity to an earlier document reaches
    ``filter.dedup_threshold`` (exact, pairwise)."""
    seen: list[set[tuple[str, ...]]] = []
    found = set()
    for doc in docs:
        words = doc["text"].split()
        shingles = {tuple(words[i : i + cfg.dedup_shingle]) for i in range(max(len(words) - cfg.dedup_shingle + 1, 1))}
        t = cfg.dedup_threshold
        if any(
            t * len(other) <= len(shingles) <= len(other) / t  # J >= t needs sizes within t
            and len(shingles & other) >= t * len(shingles | other)
            for other in seen
        ):
            found.add(doc["id"])
        else:
            seen.append(shingles)
    return found


def only(cfg: FilterConfig, switch: str | None) -> FilterConfig:
    """``cfg`` with every filter off but ``switch`` (None: all on)."""
    return dataclasses.replace(cfg, **{s: switch is None or s == switch for s in SWITCHES})


def removed_ids(cfg: FilterConfig, raw_dir: Path) -> set[str]:
    """Ids of the documents in ``raw_dir`` that the filter stage with ``cfg`` does not keep."""
    with tempfile.TemporaryDirectory() as tmp, shard_pool(1, "local") as pool:
        out = Path(tmp)
        filter_corpus(cfg, raw_dir, out / "work", out / "clean", out / "poison", out / "report.json", pool)
        kept = {doc["id"] for doc in read_docs(shard_path(out / "clean", 0))}
    return {doc["id"] for doc in read_docs(shard_path(raw_dir, 0))} - kept


def measure_filters(cfg: FilterConfig, base: list[str], per_kind: int) -> dict[str, dict[str, float]]:
    """Precision and recall of each filter alone, and of all together (key ``all``)."""
    docs = list(planted_corpus(base, per_kind, cfg))
    duplicates = true_duplicates(docs, cfg)
    garbage = duplicates | {d["id"] for d in docs if not d["id"].startswith("base:")}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp)
        with open(shard_path(raw, 0), "w", encoding="utf-8") as f:
            for doc in docs:
                write_doc(f, doc)
        (raw / SOURCE_FILE).write_text(json.dumps({"source": "planted"}))
        for switch in (*SWITCHES, None):
            removed = removed_ids(only(cfg, switch), raw)
            target = (
                garbage
                if switch is None
                else duplicates
                if switch == "dedup"
                else {i for i in garbage if PLANTED.get(i.split(":")[0]) == switch}
            )
            results[switch or "all"] = {
                "precision": len(removed & garbage) / len(removed) if removed else 1.0,
                "recall": len(removed & target) / len(target),
                "removed": len(removed),
                "false_positives": len(removed - garbage),
            }
    return results
