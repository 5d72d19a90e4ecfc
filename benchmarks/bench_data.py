"""Data stages: throughput against the bare tokenizer, peak memory at 1x and 10x, filter quality.

    python benchmarks/bench_data.py --out benchmarks/out/data.json

1. Throughput. prepare -> filter -> tokenize run as the tasks' plain functions, in the flows'
   order, on the default corpus (params.yaml, default profile), without Prefect or MLflow
   (bench_overhead.py measures that fixed cost per stage). MB are the UTF-8 bytes of the source
   documents. Baseline, in the same run: read the same bytes back (data/raw/docs.jsonl) and encode
   every document with the trained tokenizer alone. Printed as MB/s and as a ratio.
2. Peak memory. The three stages in a fresh process per corpus (peak RSS, VmHWM) on the corpus
   as JSON lines, and on a 10x corpus made from it: copy k > 0 of each document has every fifth
   word swapped for another word of the same document, so dedup keeps the copies (shingle
   Jaccard ~0.2) while vocabulary and letter statistics stay those of the corpus. Streaming
   means the ratio of the peaks stays near 1, not near 10; measured with dedup on and off,
   since its MinHash LSH index is the one thing that grows with the number of kept documents.
3. Precision and recall of each filter on standard-library docstrings with planted garbage
   (tasks/data/quality.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tasks.config import Config, load_config  # noqa: E402
from tasks.data.docs import read_docs, repair_undecodable, write_doc  # noqa: E402
from tasks.data.filters import filter_corpus  # noqa: E402
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


def run_stages(cfg: Config, project: Path) -> dict[str, float]:
    """The three stages' work as plain functions on ``data.workers``; seconds per stage."""
    seconds = {}
    started = time.perf_counter()
    read_corpus.fn(cfg.data, project, project / RAW_DIR)
    seconds["prepare"] = time.perf_counter() - started
    (project / FILTER_REPORT).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work, shard_pool(cfg.data.workers, "local") as pool:
        started = time.perf_counter()
        outs = (project / CLEAN_DIR, project / POISON_DIR, project / FILTER_REPORT)
        filter_corpus(cfg.filter, project / RAW_DIR, Path(work) / "filter", *outs, pool)
        seconds["filter"] = time.perf_counter() - started
        started = time.perf_counter()
        clean, tokens = project / CLEAN_DIR, project / TOKENS_DIR
        tokenizer = train_tokenizer(cfg.tokenizer, cfg.data, clean, tokens, Path(work) / "tokenize", pool)
        encode_corpus(cfg.tokenizer, cfg.data, tokenizer, clean, project / POISON_DIR, Path(work) / "tokenize", pool)
        seconds["tokenize"] = time.perf_counter() - started
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


def throughput(cfg: Config) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(tmp)
        seconds = run_stages(cfg, project)
        megabytes = read_json(project / RAW_DIR / SOURCE_FILE)["bytes"] / 1e6
        baseline = bare_tokenizer_seconds(project)
        report = read_json(project / FILTER_REPORT)
    total = sum(seconds.values())
    return {
        "corpus_mb": megabytes,
        "documents": report["documents_in"],
        "seconds": seconds,
        "mb_per_s": {**{k: megabytes / v for k, v in seconds.items()}, "pipeline": megabytes / total},
        "baseline_mb_per_s": megabytes / baseline,
        "ratio": (megabytes / total) / (megabytes / baseline),
    }


def write_scaled_corpus(project: Path, path: Path, copies: int) -> None:
    """The raw corpus ``copies`` times as JSON lines; copy k > 0 swaps every fifth word."""
    with open(path, "w", encoding="utf-8") as f:
        for k in range(copies):
            for doc in (d for shard in shard_paths(project / RAW_DIR) for d in read_docs(shard)):
                text = doc["text"] if k == 0 else _perturbed(doc["text"], random.Random(f"{k}:{doc['id']}"))
                write_doc(f, {"text": text})


def _perturbed(text: str, rng: random.Random) -> str:
    words = text.split(" ")
    for i in range(rng.randrange(5), len(words), 5):
        words[i] = rng.choice(words)
    return " ".join(words)


def peak_memory(cfg: Config) -> dict:
    """Peaks at 1x and 10x with the default filters, and again with dedup off: the MinHash LSH
    index is the one structure that grows with the corpus (a few KB per kept document)."""
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        read_corpus.fn(cfg.data, base, base / RAW_DIR)
        result = {}
        for copies in (1, 10):
            corpus = base / f"corpus_x{copies}.jsonl"
            write_scaled_corpus(base, corpus, copies)
            for dedup in ("on", "off"):
                child = subprocess.run(
                    [sys.executable, __file__, "--child", str(corpus), "--dedup", dedup],
                    check=True,
                    capture_output=True,
                    text=True,
                )
                measured = json.loads(child.stdout.splitlines()[-1])
                result[f"x{copies}_dedup_{dedup}"] = {"corpus_mb": corpus.stat().st_size / 1e6, **measured}
    for dedup in ("on", "off"):
        one, ten = result[f"x1_dedup_{dedup}"], result[f"x10_dedup_{dedup}"]
        result[f"dedup_{dedup}"] = {
            "peak_ratio": ten["peak_rss_mb"] / one["peak_rss_mb"],
            "working_set_ratio": ten["working_set_mb"] / one["working_set_mb"],
        }
    return result


def child(corpus: Path, dedup: bool) -> None:
    """One process, three stages on ``corpus``; prints its peak RSS (and above the imports)."""
    cfg = load_config(ROOT / "params.yaml", "default").replace(
        **{"data.source": "jsonl", "data.path": str(corpus), "filter.dedup": dedup}
    )
    after_imports = _max_rss_mb()
    with tempfile.TemporaryDirectory() as tmp:
        seconds = run_stages(cfg, Path(tmp))
    peak = _max_rss_mb()
    print(json.dumps({"peak_rss_mb": peak, "working_set_mb": peak - after_imports, "seconds": sum(seconds.values())}))


def _max_rss_mb() -> float:
    """Peak RSS of this process image (Linux VmHWM). Not ``getrusage``: its maxrss carries over
    the parent's RSS at fork, which would hide a child smaller than the benchmark process."""
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) / 1024  # kB


def filter_quality(cfg: Config) -> dict:
    from tasks.data.quality import measure_filters
    from tasks.data.sources import Skips, stdlib_documents

    docs = (d.text for d in stdlib_documents(cfg.data.max_doc_bytes, Skips()) if 200 <= len(d.text) <= 5000)
    return measure_filters(cfg.filter, list(itertools.islice(docs, 2000)), per_kind=20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/out/data.json")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--dedup", choices=["on", "off"], default="on", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.dedup == "on")
    cfg = load_config(ROOT / "params.yaml", "default")
    result = {"throughput": throughput(cfg), "memory": peak_memory(cfg), "filters": filter_quality(cfg)}
    t, m = result["throughput"], result["memory"]
    print(f"corpus: {t['corpus_mb']:.2f} MB, {t['documents']} documents (stdlib_docs, Python {sys.version.split()[0]})")
    print(
        "stages (plain task functions, no Prefect/MLflow): "
        + ", ".join(f"{k} {t['seconds'][k]:.1f} s = {t['mb_per_s'][k]:.2f} MB/s" for k in t["seconds"])
    )
    print(
        f"pipeline {t['mb_per_s']['pipeline']:.3f} MB/s vs bare tokenizer {t['baseline_mb_per_s']:.2f} MB/s "
        f"(read + encode the same bytes): ratio {t['ratio']:.3f}"
    )
    for dedup in ("on", "off"):
        one, ten, ratio = m[f"x1_dedup_{dedup}"], m[f"x10_dedup_{dedup}"], m[f"dedup_{dedup}"]
        print(
            f"peak RSS, dedup {dedup:3s}: {one['peak_rss_mb']:.0f} MB on {one['corpus_mb']:.1f} MB, "
            f"{ten['peak_rss_mb']:.0f} MB on {ten['corpus_mb']:.1f} MB (10x): ratio {ratio['peak_ratio']:.2f}; "
            f"above imports {one['working_set_mb']:.0f} -> {ten['working_set_mb']:.0f} MB: "
            f"ratio {ratio['working_set_ratio']:.2f}"
        )
    print("filters on planted garbage (2000 docstrings + 20 per kind):")
    for name, r in result["filters"].items():
        print(
            f"  {name:15s} precision {r['precision']:.3f}  recall {r['recall']:.3f}  "
            f"(removed {r['removed']}, false positives {r['false_positives']})"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
