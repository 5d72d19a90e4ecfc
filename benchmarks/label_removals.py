"""A blind, labelled judgement of the perplexity filter's removals of prose-origin documents, the
false positives of benchmarks/bench_data.py's precision by origin (issue 31).

    python benchmarks/label_removals.py filter --size 2000 --project P   # prepare + filter into P
    python benchmarks/label_removals.py draw --size 2000 --project P --out-dir D
    # a labeller who sees neither the key nor the filter reads D/blind-*.md, writes D/labels-*.json
    python benchmarks/label_removals.py score --size 2000 --project P --out-dir D

``draw`` takes every prose-origin base document the perplexity filter removed and as many
prose-origin base documents it kept (seeded sample), shuffles them together and writes them as
numbered items in chunk files headed by RUBRIC; which item is which goes to ``D/key.json`` only.
The labeller judges each item by the rubric alone: GOOD, LOW or UNSURE.

Decision rule, declared before any label was read (precision counts LOW removals as right):

- labelled precision = (judged garbage + removals labelled LOW) / judged removals, as
  bench_data.py's ``precision`` with the removals labelled GOOD or UNSURE left false positives;
- it stands only if the labeller tells removals from kept documents: a larger LOW share among
  the removals than among the kept controls, Fisher's exact test one-sided at p < 0.05;
- shown beside it, the conservative figure: the LOW removals less the kept controls' LOW rate
  times the removals (a labeller's false alarms, or garbage the filter missed, taken as noise).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_data  # noqa: E402

from tasks.config import Config, load_config  # noqa: E402
from tasks.data.shards import shard_pool  # noqa: E402

LABELS = ("GOOD", "LOW", "UNSURE")
CHUNKS = 8
"""Chunk files per draw: one per labeller, each a few hundred kB of text."""
RUBRIC = """\
You are judging documents for a language model's pretraining corpus. For each item decide
whether a careful curator of pretraining data would want it in the corpus as text worth
learning from.

GOOD: text written for people to read. Sentences or paragraphs of natural language in any
language (documentation, explanations, release notes written in sentences, licences, letters),
including documentation that mixes prose with code examples, command lines or doctests; and
source code that is complete and readable.

LOW: text a quality filter is meant to keep out. Gibberish or random characters; encoded or
binary-like data (base64, hex dumps, key fingerprints); mostly (by length) lists of names,
e-mail addresses, user handles or URLs; tables of values, flags or symbols with little running
prose; markup, configuration or boilerplate with little natural-language text.

UNSURE: you cannot tell.

The program that built the corpus swapped words at random positions in most documents (every
fifth word or so, replaced by another word of the same document). Ignore that: judge what kind
of document it is, not the swapped words. Judge each item alone, by its own text.
"""


def load(size: float) -> tuple[Config, Path, dict[int, str], set[int]]:
    cfg = load_config(ROOT / "params.yaml", "default")
    path, planted, unlabelled = bench_data.corpus(cfg, size)
    return cfg, path, planted, unlabelled


def run_filter(size: float, project: Path, workers: int) -> None:
    """prepare + filter on the benchmark's corpus into ``project`` (the outputs ``draw`` reads)."""
    cfg, path, _, _ = load(size)
    cfg = cfg.replace(**{"data.source": "jsonl", "data.path": str(path), "data.workers": workers})
    project.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=project) as work, shard_pool(workers, "local") as pool:
        seconds = bench_data.prepare_and_filter(cfg, project, Path(work), pool)
    print(json.dumps(seconds))


def draw(size: float, project: Path, out_dir: Path, seed: int) -> dict[str, int]:
    """The blind chunk files and the key (``out_dir`` must be new: labels are never overwritten)."""
    cfg, path, planted, unlabelled = load(size)
    run = bench_data.filter_outcome(project)
    _, removed, _ = bench_data.base_removals(run, planted, unlabelled, path, cfg)
    keepable = sorted(set(run["kept_lines"]) - set(planted) - unlabelled)
    rng = random.Random(seed)
    kept = rng.sample(keepable, len(removed))
    items = [(line, "removed") for line in sorted(removed)] + [(line, "kept") for line in sorted(kept)]
    rng.shuffle(items)
    texts = texts_at(path, {line for line, _ in items})
    out_dir.mkdir(parents=True)
    key = {str(n): {"line": line, "arm": arm} for n, (line, arm) in enumerate(items, start=1)}
    (out_dir / "key.json").write_text(json.dumps(key, indent=1))
    for chunk in range(CHUNKS):
        numbers = range(chunk + 1, len(items) + 1, CHUNKS)
        body = "".join(
            f"\n===== item {n} =====\n{texts[key[str(n)]['line']]}\n===== end of item {n} =====\n" for n in numbers
        )
        (out_dir / f"blind-{chunk}.md").write_text(f"{RUBRIC}\nItems: {', '.join(map(str, numbers))}\n{body}")
    return {"removed": len(removed), "kept": len(kept)}


def texts_at(path: Path, lines: set[int]) -> dict[int, str]:
    found = {}
    with open(path, encoding="utf-8") as f:
        for line, raw in enumerate(f, start=1):
            if line in lines:
                found[line] = json.loads(raw)["text"]
    return found


def read_labels(out_dir: Path, key: dict[str, dict]) -> dict[str, str]:
    """Every item's label from ``labels-*.json``; an item unlabelled, labelled twice or with a
    label outside LABELS is an error naming it."""
    labels: dict[str, str] = {}
    for file in sorted(out_dir.glob("labels-*.json")):
        for item, label in json.loads(file.read_text()).items():
            if item in labels:
                raise SystemExit(f"{file}: item {item} labelled twice")
            if label not in LABELS:
                raise SystemExit(f"{file}: item {item}: {label!r} is not one of {LABELS}")
            labels[item] = label
    if missing := sorted(set(key) - set(labels), key=int):
        raise SystemExit(f"{out_dir}: no label for items {missing[:10]}{' ...' if len(missing) > 10 else ''}")
    return labels


def score(size: float, project: Path, out_dir: Path) -> dict:
    cfg, path, planted, unlabelled = load(size)
    key = json.loads((out_dir / "key.json").read_text())
    labels = read_labels(out_dir, key)
    quality = bench_data.filter_quality(bench_data.filter_outcome(project), planted, unlabelled, path, cfg)
    return precision_from_labels(key, labels, quality["judged"])


def precision_from_labels(key: dict[str, dict], labels: dict[str, str], judged: dict[str, int]) -> dict:
    """The module's decision rule applied to the labels (``judged``: bench_data's counts by origin)."""
    counts = {arm: {label: 0 for label in LABELS} for arm in ("removed", "kept")}
    for item, entry in key.items():
        counts[entry["arm"]][labels[item]] += 1
    removed, kept = sum(counts["removed"].values()), sum(counts["kept"].values())
    low_removed, low_kept = counts["removed"]["LOW"], counts["kept"]["LOW"]
    table = [[low_removed, removed - low_removed], [low_kept, kept - low_kept]]
    p = float(stats.fisher_exact(table, alternative="greater").pvalue)
    conservative = max(low_removed - low_kept / max(kept, 1) * removed, 0.0)
    return {
        "counts": counts,
        "low_share": {"removed": low_removed / max(removed, 1), "kept": low_kept / max(kept, 1)},
        "fisher_p": p,
        "discriminates": p < 0.05,
        "precision_by_origin": judged["garbage"] / judged["removals"],
        "precision_labelled": (judged["garbage"] + low_removed) / judged["removals"],
        "precision_conservative": (judged["garbage"] + conservative) / judged["removals"],
        "judged": judged,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["filter", "draw", "score"])
    p.add_argument("--size", type=float, default=2000, help="MB of the benchmark's corpus")
    p.add_argument("--project", type=Path, required=True, help="where prepare + filter wrote their outputs")
    p.add_argument("--out-dir", type=Path, help="the blind chunks, the key and the labels")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="which kept documents are the controls, and the order")
    args = p.parse_args(argv)
    if args.command == "filter":
        return run_filter(args.size, args.project, args.workers)
    if args.out_dir is None:
        p.error(f"{args.command} needs --out-dir")
    if args.command == "draw":
        result = draw(args.size, args.project, args.out_dir, args.seed)
    else:
        result = score(args.size, args.project, args.out_dir)
        (args.out_dir / "score.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
