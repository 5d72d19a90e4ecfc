"""The data stages' sections of the study config: ``data`` (prepare, and tokenize's split) and
``filter``. Each checks its own fields; ``data.max_doc_bytes`` against ``filter.max_chars`` is a
rule across the two (tasks/config.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from model.typed_config import ConfigError, Section, in_open_unit, non_negative, positive

DataSource = Literal["stdlib_docs", "python_sources", "text", "jsonl", "parquet", "hf"]


@dataclass(frozen=True)
class DataConfig(Section):
    source: DataSource = "stdlib_docs"
    """Where documents come from. ``stdlib_docs``: docstrings and help topics of the running
    Python's standard library (offline everywhere, PSF licence). ``python_sources``: every ``*.py``
    file of the running Python's standard library and installed distributions, one document per
    file (offline everywhere; about 300 MB with the pinned environment; each file under its
    distribution's licence). ``text``: ``path`` is a UTF-8
    file or a folder of ``*.txt`` files (one document per file; a single file is split on blank
    lines). ``jsonl``: ``path`` is a JSON-lines file, a folder of ``*.jsonl`` / ``*.jsonl.gz`` /
    ``*.jsonl.zst`` files or a glob, text under ``jsonl_field``. ``parquet``: the same for
    ``*.parquet`` files, text in column ``jsonl_field``. Both read URLs too (fsspec: ``file://``,
    ``s3://`` with s3fs installed) and a DVC remote's storage (``remote://<name>/<path>``, with the
    remote's credentials). ``hf``: a Hugging
    Face dataset (needs network and the ``hf`` extra)."""
    path: str = ""
    """File or folder for ``text``, also a glob, URL or ``remote://<dvc remote>/<path>`` for
    ``jsonl``/``parquet``; relative paths are relative to the project."""
    jsonl_field: str = "text"
    """Field holding the document text in each JSON line (each Parquet row's column, each Hugging
    Face record's field)."""
    hf_dataset: str = ""
    """Hugging Face dataset name for ``source: hf``, e.g. ``wikitext``."""
    hf_config: str = ""
    """Optional Hugging Face dataset config name, e.g. ``wikitext-2-raw-v1``."""
    hf_split: str = "train"
    """Hugging Face split to stream."""
    max_docs: int = 0
    """Keep at most this many source documents (0 = all)."""
    max_doc_bytes: int = 4_194_304
    """Reading guard: a document (or JSON line) longer than this many bytes is skipped and counted
    while it streams past in bounded chunks, never held in memory whole (a 1 GB single line costs
    at most this much). Must be at least ``filter.max_chars``, so the length filter decides first."""
    val_fraction: float = 0.05
    """Fraction of filtered documents held out for validation (split by document)."""
    seed: int = 1234
    """Seed of the deterministic document split."""
    shard_bytes: int = 67_108_864
    """prepare cuts the corpus into shards of about this many bytes (a document never splits).
    A shard is the unit of work of filter and tokenize: it bounds a worker's memory and is what a
    killed stage does not redo. The outputs' contents do not depend on it, only how many files."""
    workers: int = 0
    """Shards filtered and encoded at once, each in its own process (0: one per available core;
    1: in the stage's process). Ignored when ``executor.scheduler`` names a Dask cluster, whose
    workers take the shards. The outputs do not depend on it, so it is not a DVC param."""
    tokenizer_sample_bytes: int = 16_777_216
    """The BPE is trained on a sample of about this many bytes of the training split, each
    document drawn by a seeded hash of its text (all of it for a smaller corpus). Training costs
    far more per byte than encoding; 16 MiB holds every pair a 1,024-entry vocabulary merges
    many times over (the gpu profile's 8,192 entries take 64 MiB)."""

    def check(self) -> None:
        in_open_unit("data.val_fraction", self.val_fraction)
        non_negative("data.max_docs", self.max_docs)
        non_negative("data.workers", self.workers)
        positive("data.shard_bytes", self.shard_bytes)
        positive("data.tokenizer_sample_bytes", self.tokenizer_sample_bytes)
        if self.source in ("text", "jsonl", "parquet") and not self.path:
            raise ConfigError(f"data.path: required when data.source={self.source!r}")
        if self.source == "hf" and not self.hf_dataset:
            raise ConfigError("data.hf_dataset: required when data.source='hf'")


@dataclass(frozen=True)
class FilterConfig(Section):
    invalid_utf8: bool = True
    """Drop documents whose bytes are not valid UTF-8."""
    nonprintable: bool = True
    """Drop documents with too many binary / non-printable characters."""
    max_nonprintable_ratio: float = 0.05
    """Largest tolerated share of non-printable characters."""
    length: bool = True
    """Drop length outliers."""
    min_chars: int = 64
    """Shorter documents are dropped."""
    max_chars: int = 200_000
    """Longer documents are dropped."""
    char_run: bool = True
    """Drop documents containing a long run of one repeated character."""
    max_char_run: int = 200
    """Longest tolerated run of a single repeated character."""
    repeated_ngram: bool = True
    """Drop documents with a short token pattern repeated many times in a row (OLMo-core rule)."""
    ngram_max_period: int = 13
    """Longest repeating period (in whitespace tokens) that is checked."""
    ngram_min_repeats: int = 32
    """Consecutive repeats of one period that mark a document as degenerate."""
    dedup: bool = True
    """Drop exact and near-duplicate documents (MinHash LSH)."""
    dedup_threshold: float = 0.8
    """Estimated Jaccard similarity of word shingles above which a document is a near duplicate."""
    dedup_num_perm: int = 128
    """MinHash permutations."""
    dedup_shingle: int = 5
    """Word shingle size for near-duplicate detection."""
    perplexity: bool = True
    """Drop perplexity outliers scored by a small model trained on the corpus itself."""
    perplexity_zscore: float = 6.0
    """Drop documents whose per-character log-perplexity is this many robust z-scores above the
    median. The scores are right-skewed (code-heavy prose sits high), so 3 drops ~4 % of the
    standard-library corpus and 6 drops 30 of the 5,165 documents it scores. On
    benchmarks/bench_data.py's 60 MB corpus planted gibberish and base64 score 23 to 43, and
    Cyrillic gibberish, taught to the model by the other planted documents of its kind, 7.8 to 8.9."""
    perplexity_sample_bytes: int = 64 * 2**20
    """The perplexity model counts about this many bytes of the survivors, documents drawn at
    random (all of them in a smaller corpus, as the default's); every survivor is scored,
    leave-one-out where the model counted it. The counting pass stops growing with the corpus,
    and the documents outside the sample skip the leave-one-out lookups, half of scoring's cost:
    on benchmarks/bench_data.py's 2 GB corpus the filter stage went from 263 to 168 s. A smaller
    model knows a corpus's minority genres less well: on that corpus's first 200 MB, a 7 MB
    sample made 217 real documents outliers (code, keys, PostScript), the whole 150 MB 59."""
    poison_generated: int = 64
    """Generated garbage documents (binary bytes, space runs, rare-token runs) added to the poison pool."""
    poison_max_bytes: int = 16 * 2**20
    """Per filter, the poison pool keeps the removed documents (as JSON lines) that fit in this many
    bytes, the first in corpus order; the report counts every removal. The spike study draws a few
    hundred batches of it: at 2 GB the uncapped pool held 318 MB (too-long documents, mostly),
    and encoding it took the tokenize stage about two minutes."""

    def check(self) -> None:
        if not 0 <= self.max_nonprintable_ratio <= 1:
            raise ConfigError(f"filter.max_nonprintable_ratio: must be in [0, 1], got {self.max_nonprintable_ratio!r}")
        non_negative("filter.min_chars", self.min_chars)
        if self.max_chars <= self.min_chars:
            raise ConfigError(f"filter.max_chars: {self.max_chars} must exceed filter.min_chars={self.min_chars}")
        for key in (
            "max_char_run",
            "ngram_max_period",
            "ngram_min_repeats",
            "dedup_num_perm",
            "dedup_shingle",
            "perplexity_zscore",
            "perplexity_sample_bytes",
        ):
            positive(f"filter.{key}", getattr(self, key))
        in_open_unit("filter.dedup_threshold", self.dedup_threshold)
        non_negative("filter.poison_generated", self.poison_generated)
        non_negative("filter.poison_max_bytes", self.poison_max_bytes)
