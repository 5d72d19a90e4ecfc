"""Data stages at scale: throughput against the bare tokenizer, 1 vs 2 workers, peak memory on a
corpus and on its half, filter precision and recall on planted garbage.

    python benchmarks/bench_data.py --size 2000 --out benchmarks/out/data.json   # MB of corpus

The corpus (built once, kept under benchmarks/out/): text that ships on this machine, the
standard library's docstrings and help topics and Debian's /usr/share/doc (plain or gzip, cut
into documents at blank lines), repeated with every fifth word swapped in each further copy
until ``--size`` MB of JSON lines, with one planted garbage document (tasks/data/quality.py,
the kinds in turn) after every PLANT_EVERY real ones. Its first half is the half corpus. Each
base text is labelled prose or not by its origin (``prose_file``: Debian's documentation holds
code, markup and data too), which the filters' precision is judged by.
Precision and recall are also measured against exact truth on a clean base (tasks/data/quality.py).

Each run is a fresh process (``--child``) that runs prepare -> filter -> tokenize as the tasks'
plain functions on ``data.workers`` workers, without Prefect or MLflow (bench_overhead.py
measures that fixed cost per stage), then, in the same process on the same bytes (the raw
shards), the baseline: read every document and encode it with the trained tokenizer alone
(``encode_batch_fast``, on every core). MB are the UTF-8 bytes of the source documents. Runs:
the corpus on 2 workers and on 1, and the half corpus on 2; each reports its peak RSS (the
stage's process, and its largest worker) and a digest of its outputs (1 and 2 workers must
match). Precision and recall come from the 2-worker run: what each planted kind lost, and what
the filters pooled. Timings on a shared machine are contended: compare ratios within a run; each
run also reports the CPU-seconds ratio (bare tokenizer's CPU time over the pipeline's, workers
included), which other jobs on the machine do not move; the dedup index's bytes per kept
document are measured with tracemalloc on the corpus's first 20,000 documents.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import itertools
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
import unicodedata
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import Executor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from model.private import run_private  # noqa: E402
from tasks.config import Config, load_config  # noqa: E402
from tasks.data.config import FilterConfig  # noqa: E402
from tasks.data.docs import read_docs, repair_undecodable  # noqa: E402
from tasks.data.filters import filter_corpus  # noqa: E402
from tasks.data.quality import PLANTED, garbage  # noqa: E402
from tasks.data.shards import shard_paths, shard_pool  # noqa: E402
from tasks.data.sources import read_corpus  # noqa: E402
from tasks.data.tokenize import ENCODE_BATCH, encode_corpus, train_tokenizer  # noqa: E402
from tasks.runtime.files import read_json  # noqa: E402
from tasks.runtime.outputs import (  # noqa: E402
    CLEAN_DIR,
    FILTER_REPORT,
    POISON_DIR,
    RAW_DIR,
    SOURCE_FILE,
    TOKENIZER_FILE,
    TOKENS_DIR,
)

OUT = ROOT / "benchmarks" / "out"
KINDS = list(PLANTED)
COPIES = {"exact_copy", "near_copy"}
"""Planted kinds that dedup, not a garbage filter, must remove (they are not pooled)."""


def run_stages(cfg: Config, project: Path) -> dict[str, float]:
    """The three stages' work as plain functions on ``data.workers``; seconds per stage."""
    with tempfile.TemporaryDirectory(dir=project) as work, shard_pool(cfg.data.workers, "local") as pool:
        seconds = prepare_and_filter(cfg, project, Path(work), pool)
        started = time.perf_counter()
        clean, tokens = project / CLEAN_DIR, project / TOKENS_DIR
        tokenizer = train_tokenizer(cfg.tokenizer, cfg.data, clean, tokens, Path(work) / "tokenize", pool)
        encode_corpus(cfg.tokenizer, cfg.data, tokenizer, clean, project / POISON_DIR, Path(work) / "tokenize", pool)
        seconds["tokenize"] = time.perf_counter() - started
    return seconds


def prepare_and_filter(cfg: Config, project: Path, work: Path, pool: Executor) -> dict[str, float]:
    """The prepare and filter stages' work into ``project``; seconds per stage."""
    started = time.perf_counter()
    read_corpus.fn(cfg.data, project, project / RAW_DIR)
    seconds = {"prepare": time.perf_counter() - started}
    (project / FILTER_REPORT).parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    outs = (project / CLEAN_DIR, project / POISON_DIR, project / FILTER_REPORT)
    filter_corpus(cfg.filter, project / RAW_DIR, work / "filter", *outs, pool)
    seconds["filter"] = time.perf_counter() - started
    return seconds


def bare_tokenizer_seconds(project: Path) -> float:
    """Read the source documents' bytes and encode them with the trained tokenizer, nothing else."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(project / TOKENS_DIR / TOKENIZER_FILE))
    started = time.perf_counter()
    docs = (d["text"] for shard in shard_paths(project / RAW_DIR) for d in read_docs(shard))
    while batch := list(itertools.islice(docs, ENCODE_BATCH)):
        tokenizer.encode_batch_fast([repair_undecodable(t) for t in batch])
    return time.perf_counter() - started


DEBIAN_DOCS = Path("/usr/share/doc")
CHUNK_CHARS = 4000
"""Debian's documentation files are cut at blank lines into documents of up to about this many characters."""
PLANT_EVERY = 100
"""One planted garbage document (the kinds in turn) after every this many real ones."""


def base_texts(cfg: Config) -> Iterator[tuple[str, bool]]:
    """Text that ships on this machine, each text once, with whether it is prose by its origin
    (:func:`prose_file`): the standard library's docstrings and help topics (prose), then Debian's
    documentation files (/usr/share/doc, plain or gzip) in chunks."""
    from tasks.data.sources import Skips, stdlib_documents

    seen: set[bytes] = set()
    texts = itertools.chain(
        ((d.text, True) for d in stdlib_documents(cfg.data.max_doc_bytes, Skips())),
        debian_chunks(sorted(DEBIAN_DOCS.rglob("*"))),
    )
    for text, prose in texts:
        key = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
        if len(text) >= 200 and key not in seen:
            seen.add(key)
            yield text, prose


def debian_chunks(paths: list[Path]) -> Iterator[tuple[str, bool]]:
    for path in paths:
        try:
            raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
            continue  # a folder, a link to nowhere, a binary file
        prose, chunk = prose_file(path, text), []
        for block in text.split("\n\n"):
            chunk.append(block)
            if sum(map(len, chunk)) >= CHUNK_CHARS:
                yield "\n\n".join(chunk), prose
                chunk = []
        if chunk:
            yield "\n\n".join(chunk), prose


PROSE_SUFFIXES = {"", ".txt", ".md", ".rst", ".debian"}
"""Formats people write prose in: plain text (no suffix, .txt, Debian's README.Debian and
changelog.Debian), Markdown, reStructuredText. Not markup (.html, .xml), code (.c, .pl, .py,
.sh), data (.json, .log) or page descriptions (.ps, .pdf)."""


def prose_file(path: Path, text: str) -> bool:
    """Whether a Debian documentation file is prose by its origin: its name, its folder and its
    first two bytes, never its text's statistics, so the label that the benchmark's precision is
    judged by is independent of the filters. Not prose: a format outside PROSE_SUFFIXES, an
    example (``examples/`` folders hold sample code and configuration), a script or a build file
    (``#!`` first, or a Makefile)."""
    name = path.name.removesuffix(".gz")
    return (
        Path(name).suffix.lower() in PROSE_SUFFIXES
        and not any(part.startswith("example") for part in path.parts)
        and name != "Makefile"
        and not text.startswith("#!")
    )


def write_corpus(cfg: Config, path: Path, megabytes: float) -> tuple[dict[int, str], list[int]]:
    """A JSON-lines corpus of ``megabytes`` MB: the base texts again and again, copy k > 0 with
    every fifth word swapped for another of the same text (so dedup keeps it, shingle Jaccard
    ~0.2, while vocabulary and letter statistics stay those of the base), and after every
    PLANT_EVERY of them one planted garbage document (tasks/data/quality.py, the kinds in turn;
    a copy copies a recent text). Returns the planted lines (line number from 1 -> kind) and the
    unlabelled ones: copies of base texts that are not prose by their origin."""
    base = list(base_texts(cfg))
    rng, limit, size, line = random.Random(0), megabytes * 1e6, 0, 0
    planted: dict[int, str] = {}
    unlabelled: list[int] = []
    recent: deque[str] = deque(maxlen=1000)
    with open(path, "w", encoding="utf-8") as f:
        for k in itertools.count():
            for i, (original, prose) in enumerate(base):
                text = original if k == 0 else _perturbed(original, random.Random(f"{k}:{i}"))
                size, line = size + _write(f, text), line + 1
                if not prose:
                    unlabelled.append(line)
                recent.append(text)
                if i % PLANT_EVERY == PLANT_EVERY - 1:
                    kind = KINDS[len(planted) % len(KINDS)]
                    size, line = (
                        size + _write(f, garbage(kind, rng.choice(recent), list(recent), cfg.filter, rng)),
                        line + 1,
                    )
                    planted[line] = kind
                if size >= limit:
                    return planted, unlabelled
    raise AssertionError("unreachable")


def base_index(line: int, n_base: int) -> int | None:
    """Which base text the corpus's ``line`` (from 1) is a copy of, as :func:`write_corpus` lays
    them out (each pass: the ``n_base`` texts, a planted document after every PLANT_EVERY);
    None for a planted line."""
    offset = (line - 1) % (n_base + n_base // PLANT_EVERY)
    group, place = divmod(offset, PLANT_EVERY + 1)
    return None if place == PLANT_EVERY else offset - group


def _perturbed(text: str, rng: random.Random) -> str:
    words = text.split(" ")
    for i in range(rng.randrange(5), len(words), 5):
        words[i] = rng.choice(words)
    return " ".join(words)


def _write(f, text: str) -> int:
    line = json.dumps({"text": text}, ensure_ascii=True) + "\n"
    f.write(line)
    return len(line)


def corpus(cfg: Config, megabytes: float) -> tuple[Path, dict[int, str], set[int]]:
    """The corpus of ``megabytes`` MB, its planted lines and its unlabelled ones, built once
    under benchmarks/out/ (a rebuild writes the same bytes: every choice is seeded)."""
    path = OUT / f"corpus-{megabytes:g}MB.jsonl"
    planted_path, unlabelled_path = path.with_suffix(".planted.json"), path.with_suffix(".unlabelled.json")
    if not (planted_path.exists() and unlabelled_path.exists()):
        OUT.mkdir(parents=True, exist_ok=True)
        planted, unlabelled = write_corpus(cfg, path, megabytes)
        planted_path.write_text(json.dumps(planted))
        unlabelled_path.write_text(json.dumps(unlabelled))
    planted = {int(k): v for k, v in json.loads(planted_path.read_text()).items()}
    return path, planted, set(json.loads(unlabelled_path.read_text()))


def child(path: Path, workers: int) -> None:
    """One run in this fresh process; prints its measurements as one JSON line."""
    cfg = load_config(ROOT / "params.yaml", "default").replace(
        **{"data.source": "jsonl", "data.path": str(path), "data.workers": workers}
    )
    with tempfile.TemporaryDirectory(dir=OUT) as tmp:
        project = Path(tmp)
        cpu = cpu_seconds()
        seconds = run_stages(cfg, project)
        cpu_pipeline, cpu = cpu_seconds() - cpu, cpu_seconds()
        bare = bare_tokenizer_seconds(project)
        cpu_bare = cpu_seconds() - cpu
        result = {
            "megabytes": read_json(project / RAW_DIR / SOURCE_FILE)["bytes"] / 1e6,
            "seconds": seconds,
            "bare_seconds": bare,
            "cpu_seconds": {"pipeline": cpu_pipeline, "bare_tokenizer": cpu_bare},
            "peak_rss_mb": _max_rss_mb(),
            "largest_worker_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
            "outputs_sha256": outputs_digest(project),
        } | filter_outcome(project)
    print(json.dumps(result))


def filter_outcome(project: Path) -> dict:
    """What the filter stage did in ``project``: the source lines it kept, those the perplexity
    filter removed, its report (what :func:`filter_quality` judges)."""
    return {
        "kept_lines": sorted(_lines(d for p in shard_paths(project / CLEAN_DIR) for d in read_docs(p))),
        "perplexity_removed_lines": perplexity_removed_lines(project),
        "report": read_json(project / FILTER_REPORT),
    }


def _lines(docs: Iterator[dict[str, str]]) -> Iterator[int]:
    """Line numbers of a jsonl source's documents (prepare names them ``<file>:<line>``)."""
    return (int(d["id"].rsplit(":", 1)[1]) for d in docs if not d["id"].startswith("generated:"))


def perplexity_removed_lines(project: Path) -> list[int]:
    """Lines the perplexity filter removed, from its file in the poison pool, which must hold them
    all (``filter.poison_max_bytes`` keeps only the first; the benchmark's corpora fit)."""
    pool = project / POISON_DIR / "perplexity.jsonl"
    lines = sorted(_lines(read_docs(pool))) if pool.exists() else []
    removed = read_json(project / FILTER_REPORT)["removed_perplexity"]
    if len(lines) != removed:
        raise SystemExit(
            f"{pool}: holds {len(lines)} of the perplexity filter's {removed} removals; "
            "raise filter.poison_max_bytes to judge them"
        )
    return lines


def outputs_digest(project: Path) -> str:
    """What must not depend on the workers: clean documents, poison pool, tokenizer and token files."""
    h = hashlib.sha256()
    files = [*shard_paths(project / CLEAN_DIR), *sorted((project / POISON_DIR).glob("*.jsonl"))]
    files += [project / TOKENS_DIR / n for n in (TOKENIZER_FILE, "poison.bin")]
    files += [
        *sorted((project / TOKENS_DIR / "train").glob("*.bin")),
        *sorted((project / TOKENS_DIR / "val").glob("*.bin")),
    ]
    for path in files:
        with open(path, "rb") as f:
            while block := f.read(1 << 24):
                h.update(block)
    return h.hexdigest()


def cpu_seconds() -> float:
    """CPU time of this process and of its reaped children (the stages' worker processes): what
    the work cost, whatever else the machine ran meanwhile (wall time on a shared machine is not)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _max_rss_mb() -> float:
    """Peak RSS of this process image (Linux VmHWM). Not ``getrusage``: its maxrss carries over
    the parent's RSS at fork, which would hide a child smaller than the benchmark process."""
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) / 1024  # kB


def measure(path: Path, workers: int) -> dict:
    child_run = subprocess.run(
        [sys.executable, __file__, "--child", str(path), "--workers", str(workers)],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    run = json.loads(child_run.stdout.splitlines()[-1])
    total = sum(run["seconds"].values())
    run["mb_per_s"] = {"pipeline": run["megabytes"] / total, "bare_tokenizer": run["megabytes"] / run["bare_seconds"]}
    run["ratio"] = run["mb_per_s"]["pipeline"] / run["mb_per_s"]["bare_tokenizer"]
    run["cpu_ratio"] = run["cpu_seconds"]["bare_tokenizer"] / run["cpu_seconds"]["pipeline"]
    return run


def filter_quality(
    run: dict, planted: dict[int, str], unlabelled: set[int], removals: tuple[dict[int, str], set[int], set[int]]
) -> dict:
    """Precision and recall on the planted garbage, from what the clean corpus kept and the
    report's counts (the poison pool holds only ``filter.poison_max_bytes`` of each filter's
    removals; ``removals``: :func:`base_removals` of the run). Garbage filters: recall over the
    planted kinds meant for them; precision over the documents they removed (all removals less
    dedup's), three ways:

    - ``precision``: over the documents whose truth is known. Garbage: the planted documents and
      the base documents that break a rule by :func:`rule_breaks`. Good: the other base documents
      that are prose by their origin (:func:`prose_file`). A base document of another origin
      (code, markup, data) that breaks no rule has no label: its removal by the perplexity filter
      is counted apart (``perplexity_removed_real_documents``), neither right nor wrong.
    - ``precision_rule_labelled``: as ``precision`` with every removal judged, an unlabelled
      document a false positive.
    - ``precision_planted_only``: every removed base document a false positive.

    Dedup: recall over the planted copies (it also removes near copies the base itself holds,
    e.g. Debian's licence texts: counted, not judged; its precision is judged on the exact-truth
    base). A planted garbage document is unique and a planted copy is prose, so each is removed
    by the filters meant for it or kept."""
    kept, report = set(run["kept_lines"]), run["report"]
    garbage_lines = {line for line, kind in planted.items() if kind not in COPIES}
    copies = {line for line, kind in planted.items() if kind in COPIES}
    removed_garbage, removed_copies = garbage_lines - kept, copies - kept
    by_dedup = report["removed_duplicate_exact"] + report["removed_duplicate_near"]
    by_garbage_filters = report["documents_in"] - report["documents_kept"] - by_dedup
    breakers, perplexity_prose, perplexity_unlabelled = removals
    judged = {
        "garbage": len(removed_garbage) + len(breakers),
        "removals": by_garbage_filters - len(perplexity_unlabelled),
    }
    per_kind = {
        kind: sum(1 for line, k in planted.items() if k == kind and line not in kept)
        / max(sum(1 for k in planted.values() if k == kind), 1)
        for kind in KINDS
    }
    return {
        "planted": len(planted),
        "precision": judged["garbage"] / max(judged["removals"], 1),
        "precision_rule_labelled": judged["garbage"] / max(by_garbage_filters, 1),
        "precision_planted_only": len(removed_garbage) / max(by_garbage_filters, 1),
        "recall": len(removed_garbage) / max(len(garbage_lines), 1),
        "dedup_recall": len(removed_copies) / max(len(copies), 1),
        "recall_per_kind": per_kind,
        "removed_real_documents": by_garbage_filters - len(removed_garbage),
        "removed_real_documents_breaking_a_rule": dict(Counter(breakers.values())),
        "perplexity_removed_real_documents": {
            "prose": len(perplexity_prose),
            "unlabelled": len(perplexity_unlabelled),
        },
        "unlabelled_share_of_corpus": len(unlabelled) / max(report["documents_in"], 1),
        "dedup_removed_real_documents": by_dedup - len(removed_copies),
        "judged": judged,
    }


def base_removals(
    run: dict, planted: dict[int, str], unlabelled: set[int], path: Path, cfg: Config
) -> tuple[dict[int, str], set[int], set[int]]:
    """The base documents the filters removed, judged by origin: those breaking a rule (line ->
    rule), and of the perplexity filter's removals that break none, the prose-origin ones (the
    false positives) and the unlabelled ones."""
    breakers = base_rule_breakers(path, set(run["kept_lines"]) | set(planted), cfg)
    perplexity_base = set(run["perplexity_removed_lines"]) - set(planted) - set(breakers)
    return breakers, perplexity_base - unlabelled, perplexity_base & unlabelled


def base_rule_breakers(path: Path, kept_or_planted: set[int], cfg: Config) -> dict[int, str]:
    """Base documents of the corpus at ``path`` that the pipeline removed (not kept, not planted,
    not a line prepare skipped as longer than ``data.max_doc_bytes``) and that break a rule: line
    -> the first rule."""
    found: dict[int, str] = {}
    with open(path, "rb") as f:
        for line, raw in enumerate(f, start=1):
            if line in kept_or_planted or len(raw) > cfg.data.max_doc_bytes:  # prepare's rule: the line's bytes
                continue
            if broken := rule_breaks(json.loads(raw)["text"], cfg.filter):
                found[line] = broken[0]
    return found


def rule_breaks(text: str, f: FilterConfig) -> list[str]:
    """The rules ``text`` breaks, judged by plain reference code written apart from the filters'
    (whole text, character by character): the truth for the base's own garbage."""
    nonprintable = sum(
        1 for c in text if c == "\ufffd" or (unicodedata.category(c) in ("Cc", "Co", "Cs") and c not in "\t\n\r")
    )
    words = text.split()
    broken = {
        "invalid_utf8": any("\ud800" <= c <= "\udfff" for c in text),  # what surrogateescape leaves of bad bytes
        "nonprintable": nonprintable > f.max_nonprintable_ratio * len(text),
        "too_short": len(text) < f.min_chars,
        "too_long": len(text) > f.max_chars,
        "char_run": max((len(list(run)) for _, run in itertools.groupby(text)), default=0) > f.max_char_run,
        "repeated_ngram": any(
            _longest_match_run(words, p) >= (f.ngram_min_repeats - 1) * p for p in range(1, f.ngram_max_period + 1)
        ),
    }
    return [rule for rule, yes in broken.items() if yes]


def _longest_match_run(words: list[str], period: int) -> int:
    """The longest run of positions i with words[i] == words[i + period]."""
    longest = current = 0
    for a, b in zip(words, words[period:]):
        current = current + 1 if a == b else 0
        longest = max(longest, current)
    return longest


def exact_truth_quality(cfg: Config) -> dict:
    """Precision and recall of each filter alone and all together on a clean base, 2,000
    standard-library docstrings with 20 planted documents of each kind, duplicates judged by exact
    shingle Jaccard (tasks/data/quality.py): the base of the big corpus, Debian's documentation,
    holds real garbage (PostScript, tables, licence copies) that no one has labelled."""
    from tasks.data.quality import measure_filters
    from tasks.data.sources import Skips, stdlib_documents

    docs = (d.text for d in stdlib_documents(cfg.data.max_doc_bytes, Skips()) if 200 <= len(d.text) <= 5000)
    return measure_filters(cfg.filter, list(itertools.islice(docs, 2000)), per_kind=20)


DEDUP_SAMPLE = 20_000
"""Documents whose dedup index is measured (the index grows by the same amount per kept document)."""


def dedup_index_bytes_per_doc(cfg: Config, path: Path) -> dict[str, float]:
    """Memory of the dedup index (content hashes and datasketch's LSH, as the filter stage holds
    it) per kept document, measured with tracemalloc over the corpus's first DEDUP_SAMPLE documents:
    the one part of the filter stage's memory that grows with the corpus."""
    import tracemalloc

    from tasks.data.filters import Deduplicator, Fingerprinter

    fingerprint = Fingerprinter(cfg.filter)
    with open(path, encoding="utf-8") as f:
        prints = [fingerprint(json.loads(line)["text"]) for line in itertools.islice(f, DEDUP_SAMPLE)]
    tracemalloc.start()
    dedup = Deduplicator(cfg.filter)
    kept = sum(dedup.judge(key, signature) is None for key, signature in prints)
    used = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {"documents": len(prints), "kept": kept, "bytes_per_kept_document": used / max(kept, 1)}


def scaling_and_memory(runs: dict[str, dict]) -> dict[str, float | bool]:
    """1 against 2 workers (speed, identical outputs) and peak RSS on the corpus against its half."""
    one, two, half = runs["full_1_worker"], runs["full_2_workers"], runs["half_2_workers"]
    return {
        "scaling_1_to_2_workers": sum(one["seconds"].values()) / sum(two["seconds"].values()),
        "identical_1_vs_2_workers": one["outputs_sha256"] == two["outputs_sha256"],
        "peak_rss_full_over_half": two["peak_rss_mb"] / half["peak_rss_mb"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=float, default=2000, help="MB of corpus (JSON lines)")
    parser.add_argument("--out", type=Path, default=OUT / "data.json")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument(
        "--quick", action="store_true", help="the 2-worker run and its planted precision/recall only (a before/after)"
    )
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.workers)
    cfg = load_config(ROOT / "params.yaml", "default")
    full, planted, unlabelled = corpus(cfg, args.size)
    plan = [("full_2_workers", full, 2)]
    if not args.quick:
        plan += [("full_1_worker", full, 1), ("half_2_workers", corpus(cfg, args.size / 2)[0], 2)]
    result = {"size_mb": args.size, "runs": {}}
    for name, path, workers in plan:
        result["runs"][name] = run = measure(path, workers)
        print(
            f"{name}: {run['megabytes']:.0f} MB, stages "
            + ", ".join(f"{k} {v:.0f} s" for k, v in run["seconds"].items())
            + f"; pipeline {run['mb_per_s']['pipeline']:.2f} MB/s vs bare tokenizer "
            f"{run['mb_per_s']['bare_tokenizer']:.2f} MB/s: ratio {run['ratio']:.2f} (CPU-seconds ratio "
            f"{run['cpu_ratio']:.2f}); peak RSS "
            f"{run['peak_rss_mb']:.0f} MB (largest worker {run['largest_worker_rss_mb']:.0f} MB)",
            flush=True,
        )
    runs = result["runs"]
    two = runs["full_2_workers"]
    result["filters"] = filter_quality(two, planted, unlabelled, base_removals(two, planted, unlabelled, full, cfg))
    for run in runs.values():
        del run["kept_lines"], run["perplexity_removed_lines"]
    if not args.quick:
        result |= scaling_and_memory(runs) | {
            "filters_exact_truth": exact_truth_quality(cfg),
            "dedup_index": dedup_index_bytes_per_doc(cfg, full),
        }
        print(
            f"1 -> 2 workers: {result['scaling_1_to_2_workers']:.2f}x faster, outputs identical: "
            f"{result['identical_1_vs_2_workers']}; peak RSS full / half: {result['peak_rss_full_over_half']:.2f}"
        )
    q = result["filters"]
    print(
        f"filters on {q['planted']} planted: precision {q['precision']:.3f} (base documents breaking a rule "
        f"counted as garbage: {q['removed_real_documents_breaking_a_rule']}; perplexity removals of the base "
        f"{q['perplexity_removed_real_documents']}, the unlabelled not judged; "
        f"{q['precision_rule_labelled']:.3f} with those wrong; {q['precision_planted_only']:.3f} with every "
        f"removed base document wrong), recall {q['recall']:.3f}, "
        f"dedup recall {q['dedup_recall']:.3f}; per kind "
        + ", ".join(f"{k} {v:.2f}" for k, v in q["recall_per_kind"].items())
    )
    for name, r in result.get("filters_exact_truth", {}).items():
        print(f"  exact truth, {name:15s} precision {r['precision']:.3f}  recall {r['recall']:.3f}")
    if "dedup_index" in result:
        d = result["dedup_index"]
        print(
            f"dedup index: {d['bytes_per_kept_document']:.0f} bytes per kept document "
            f"({d['kept']} of {d['documents']} kept)"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.exit(run_private(main))
