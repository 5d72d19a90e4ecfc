"""A blind, labelled judgement of the perplexity filter's removals of prose-origin documents, the
false positives of benchmarks/bench_data.py's precision by origin (issue 31).

    python checks/label_removals.py filter --size 2000 --project P   # prepare + filter into P
    python checks/label_removals.py draw --size 2000 --project P --out-dir D
    # a labeller who sees neither the key nor the filter reads D/blind-*.md, writes D/labels-*.json
    python checks/label_removals.py score --size 2000 --project P --out-dir D

``draw`` takes every prose-origin base document the perplexity filter removed and as many
prose-origin base documents it kept (seeded sample), shuffles them together and writes them as
numbered items in chunk files headed by RUBRIC; which item is which goes to ``D/key.json`` only,
with what the draw was made from (``score`` refuses a project whose removals differ). The
labeller judges each item by the rubric alone: GOOD, LOW or UNSURE.

Decision rule, declared before any label was read (precision counts LOW removals as right):

- labelled precision = (judged garbage + removals labelled LOW) / judged removals, as
  bench_data.py's ``precision`` with the removals labelled GOOD or UNSURE left false positives;
- it stands only if the labeller tells removals from kept documents: a larger LOW share among
  the removals than among the kept controls, Fisher's exact test one-sided at p < 0.05;
- shown beside it, the conservative figure: the LOW removals less the kept controls' LOW rate
  times the removals (a labeller's false alarms, or garbage the filter missed, taken as noise).

Added after the labels were read (a review, 2026-11-26): the corpus holds each base text up to
ten times (bench_data.py's perturbed copies), so the items are not independent: the 284 removals
at 2 GB are copies of 58 texts. The test is also made over distinct texts (each text's majority
label: LOW when more than half its copies are), and precision is shown with each text's
majority label given to all its copies. One false positive by origin is not a perplexity removal
(another filter's, breaking no rule by the reference code): it stays a false positive, counted
apart (``other_false_positives``).
"""

from __future__ import annotations

import argparse
import hashlib
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

from model.private import run_private  # noqa: E402
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
    if out_dir.exists():
        raise SystemExit(f"{out_dir}: exists; draw writes a new folder, never over labels")
    cfg, path, planted, unlabelled = load(size)
    outcome = bench_data.filter_outcome(project)
    _, removed, _ = bench_data.base_removals(outcome, planted, unlabelled, path, cfg)
    keepable = sorted(set(outcome["kept_lines"]) - set(planted) - unlabelled)
    rng = random.Random(seed)
    kept = rng.sample(keepable, len(removed))
    lines = [(line, "removed") for line in sorted(removed)] + [(line, "kept") for line in sorted(kept)]
    rng.shuffle(lines)
    n_base = sum(1 for _ in bench_data.base_texts(cfg))
    items = {
        str(n): {"line": line, "arm": arm, "text": bench_data.base_index(line, n_base)}
        for n, (line, arm) in enumerate(lines, start=1)
    }
    out_dir.mkdir(parents=True)
    made_from = {"size": size, "seed": seed, "removed_sha256": _digest(removed)}
    (out_dir / "key.json").write_text(json.dumps({"made_from": made_from, "items": items}, indent=1))
    write_blind(items, texts_at(path, {line for line, _ in lines}), out_dir)
    return {"removed": len(removed), "kept": len(kept)}


def write_blind(items: dict[str, dict], texts: dict[int, str], out_dir: Path) -> None:
    """Item n in chunk file ``blind-<(n - 1) % CHUNKS>.md``, under RUBRIC and the chunk's item list."""
    for chunk in range(CHUNKS):
        numbers = range(chunk + 1, len(items) + 1, CHUNKS)
        body = "".join(
            f"\n===== item {n} =====\n{texts[items[str(n)]['line']]}\n===== end of item {n} =====\n" for n in numbers
        )
        (out_dir / f"blind-{chunk}.md").write_text(f"{RUBRIC}\nItems: {', '.join(map(str, numbers))}\n{body}")


def _digest(lines: set[int]) -> str:
    return hashlib.sha256(json.dumps(sorted(lines)).encode()).hexdigest()


def texts_at(path: Path, lines: set[int]) -> dict[int, str]:
    found = {}
    with open(path, encoding="utf-8") as f:
        for line, raw in enumerate(f, start=1):
            if line in lines:
                found[line] = json.loads(raw)["text"]
    return found


def read_labels(out_dir: Path, items: dict[str, dict]) -> dict[str, str]:
    """Every item's label from ``labels-*.json``; an item unlabelled, labelled twice, not in the key
    or labelled outside LABELS is an error naming it."""
    labels: dict[str, str] = {}
    for file in sorted(out_dir.glob("labels-*.json")):
        for item, label in json.loads(file.read_text()).items():
            if item not in items:
                raise SystemExit(f"{file}: item {item} is not in the key")
            if item in labels:
                raise SystemExit(f"{file}: item {item} labelled twice")
            if label not in LABELS:
                raise SystemExit(f"{file}: item {item}: {label!r} is not one of {LABELS}")
            labels[item] = label
    if missing := sorted(set(items) - set(labels), key=int):
        raise SystemExit(f"{out_dir}: no label for items {missing[:10]}{' ...' if len(missing) > 10 else ''}")
    return labels


def score(size: float, project: Path, out_dir: Path) -> dict:
    cfg, path, planted, unlabelled = load(size)
    key = json.loads((out_dir / "key.json").read_text())
    labels = read_labels(out_dir, key["items"])
    outcome = bench_data.filter_outcome(project)
    removals = bench_data.base_removals(outcome, planted, unlabelled, path, cfg)
    removed = removals[1]
    if key["made_from"]["size"] != size or key["made_from"]["removed_sha256"] != _digest(removed):
        raise SystemExit(
            f"{out_dir / 'key.json'}: drawn from another corpus or filter run than {project} at --size {size}"
        )
    judged = bench_data.filter_quality(outcome, planted, unlabelled, removals)["judged"]
    return precision_from_labels(key["items"], labels, judged)


def precision_from_labels(items: dict[str, dict], labels: dict[str, str], judged: dict[str, int]) -> dict:
    """The module's decision rule applied to the labels (``judged``: bench_data's counts by origin),
    over the items as declared and over distinct texts."""
    arms = ("removed", "kept")
    counts = {arm: {label: 0 for label in LABELS} for arm in arms}
    copies: dict[str, dict[int, list[str]]] = {arm: {} for arm in arms}
    for item, entry in items.items():
        counts[entry["arm"]][labels[item]] += 1
        copies[entry["arm"]].setdefault(entry["text"], []).append(labels[item])
    removed = sum(counts["removed"].values())
    if (other := judged["removals"] - judged["garbage"] - removed) < 0:
        raise SystemExit(
            f"{removed} removals labelled, more than the {judged['removals'] - judged['garbage']} false positives by origin"
        )
    low = {arm: counts[arm]["LOW"] for arm in arms}
    by_items = _discrimination(low, {arm: sum(counts[arm].values()) for arm in arms})
    majority = {arm: [text.count("LOW") * 2 > len(text) for text in copies[arm].values()] for arm in arms}
    by_text = _discrimination({arm: sum(majority[arm]) for arm in arms}, {arm: len(majority[arm]) for arm in arms})
    low_copies_by_text = sum(
        len(ls) for ls, low_text in zip(copies["removed"].values(), majority["removed"]) if low_text
    )
    conservative = max(low["removed"] - by_items["low_share"]["kept"] * removed, 0.0)
    removals = max(judged["removals"], 1)
    return {
        "counts": counts,
        "by_items": by_items,
        "by_text": by_text,
        "other_false_positives": other,
        "precision_by_origin": judged["garbage"] / removals,
        "precision_labelled": (judged["garbage"] + low["removed"]) / removals,
        "precision_by_text": (judged["garbage"] + low_copies_by_text) / removals,
        "precision_conservative": (judged["garbage"] + conservative) / removals,
        "judged": judged,
    }


def _discrimination(low: dict[str, int], total: dict[str, int]) -> dict:
    """Whether LOW is more common among the removals than among the kept: Fisher's exact test,
    one-sided, at p < 0.05."""
    table = [[low["removed"], total["removed"] - low["removed"]], [low["kept"], total["kept"] - low["kept"]]]
    p = float(stats.fisher_exact(table, alternative="greater").pvalue)
    return {
        "low": low,
        "total": total,
        "low_share": {arm: low[arm] / max(total[arm], 1) for arm in low},
        "fisher_p": p,
        "discriminates": p < 0.05,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spikelab check labels",
        description="A blind, labelled judgement of the perplexity filter's removals: `filter` runs prepare\n"
        "and filter on the benchmark's corpus, `draw` writes the removed prose documents and as many\n"
        "kept ones, shuffled, as numbered items for a labeller who sees neither the key nor the filter,\n"
        "`score` reads the labels and judges them by the rule declared before any was read\n"
        "(docs/checks.md): labelled precision, and whether the labeller tells removals from kept ones.",
        epilog="examples:\n"
        "  spikelab check labels filter --size 2000 --project P                prepare + filter into P\n"
        "  spikelab check labels draw --size 2000 --project P --out-dir D\n"
        "  spikelab check labels score --size 2000 --project P --out-dir D     after D/labels-*.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("command", choices=["filter", "draw", "score"], help="the step: %(choices)s")
    p.add_argument("--size", type=float, default=2000, help="MB of the benchmark's corpus")
    p.add_argument("--project", type=Path, required=True, help="where prepare + filter wrote their outputs")
    p.add_argument("--out-dir", type=Path, help="the blind chunks, the key and the labels")
    p.add_argument("--workers", type=int, default=2, help="filter's worker processes (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="which kept documents are the controls, and the order")
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
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
    sys.exit(run_private(main))
