"""Pruned search (issue #47): the unpruned LR search's trials replayed through Optuna's
MedianPruner (tasks/search/pruning.py), the optima and slopes from complete trials only against
the unpruned ones. The evidence the search's live rule was chosen on (tasks/search/groups.py);
a search that prunes live keeps no curve past a stopped trial's step, so record or replay one
run with ``search.prune_median: false``.

    python scripts/search_pruning.py replay --storage journal:.spikelab/optuna.journal
    python scripts/search_pruning.py record --out trials.jsonl     # retrain the sweep, no storage
    python scripts/search_pruning.py replay --trials trials.jsonl --against metrics/search.json

``record`` trains every sweep point with the search's own objective (no MLflow, Prefect or Optuna
storage) and writes each trial's reported validation losses to ``--out``; ``replay`` reads them
from there or from the search's Optuna storage (``--storage``), prints the summary and writes the
whole report (per trial, per group) to ``--report``. ``--project`` is the project whose
params.yaml and data/tokens the search ran on (default: this checkout).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tasks.config import load_config  # noqa: E402
from tasks.search import pruning  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    record = sub.add_parser("record", help="retrain the sweep, recording every reported validation loss")
    record.add_argument("--out", type=Path, required=True, help="JSON lines file (resumed when it exists)")
    record.add_argument("--workers", type=int, default=1)
    replay = sub.add_parser("replay", help="replay the trials through the pruner")
    source = replay.add_mutually_exclusive_group(required=True)
    source.add_argument("--trials", type=Path, help="a record's JSON lines file")
    source.add_argument("--storage", help="the search's Optuna storage URL (journal:<path> or an RDB URL)")
    replay.add_argument("--report", type=Path, help="write the whole report here (JSON)")
    replay.add_argument("--against", type=Path, help="a committed metrics/search.json to compare the optima with")
    for p in (record, replay):
        p.add_argument("--project", type=Path, default=ROOT, help="the project the search ran in")
    args = parser.parse_args(argv)

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    cfg = load_config(args.project / "params.yaml")
    if args.command == "record":
        pruning.record_search(cfg, args.project, args.out, args.workers)
        return 0
    if args.trials:
        records = pruning.read_records(args.trials)
    else:
        from tasks.search.queue import open_storage

        records = pruning.records_from_storage(cfg, args.project, open_storage(args.storage))
    replayed = pruning.replay(records)
    report = pruning.compare(cfg, replayed)
    if args.against:
        report["against_committed"] = pruning.against_committed(cfg, replayed, json.loads(args.against.read_text()))
    print("\n".join(summary(report)))
    if args.report:
        args.report.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return 0


def summary(report: dict) -> list[str]:
    lines = [
        f"pruner: {report['pruner']}",
        f"trials pruned: {report['pruned']} of {report['trials']}; steps saved {report['steps_saved']} of "
        f"{report['steps']} ({report['steps_saved_share']:.1%}; {report['flops_saved_share']:.1%} of the FLOPs)",
    ]
    for t in report["per_trial"]:
        if t["pruned_at"] is not None:
            lines.append(
                f"  pruned: {t['parametrization']} w{t['width']} seed {t['seed']} lr 2^{t['log2_lr']:g} "
                f"at step {t['pruned_at']} ({t['steps_saved']} steps saved)"
            )
    lines.append("optima per (parametrization, width), seeds: equal / within one grid step / further / lost")
    for p, widths in report["optima"].items():
        for w, c in sorted(widths.items(), key=lambda kv: int(kv[0])):
            lines.append(f"  {p} w{w}: {c['equal']} / {c['within']} / {c['further']} / {c['lost']}")
    for g in report["per_group"]:
        if g["closeness"] != "equal":
            lines.append(
                f"  moved: {g['parametrization']} w{g['width']} seed {g['seed']}: "
                f"{g['unpruned']['log2_lr']:.3f} -> {g['complete_only']['log2_lr']:.3f} "
                f"({g['difference_grid_steps']:+.2f} grid steps)"
            )
    edge = report["censored"]
    lines.append(
        f"censored optima (at the grid's end or next to a stopped LR): unpruned {edge['unpruned']}, "
        f"complete-only {edge['complete_only']}"
    )
    for p, s in report["slopes"].items():
        lines.append(f"slope {p}: unpruned {slope_text(s['unpruned'])}; complete-only {slope_text(s['complete_only'])}")
    if against := report.get("against_committed"):
        c = against["counts"]
        lines.append(
            f"records' unpruned optima vs the committed metrics: {c['equal']} equal / {c['within']} within one grid "
            f"step / {c['further']} further / {c['lost']} missing; committed slopes {against['slope']}"
        )
    return lines


def slope_text(s: dict) -> str:
    """fit.py: slope's numbers, or why there are none (fewer than two widths)."""
    if s["slope"] is None:
        return "none (fewer than two widths)"
    return f"{s['slope']:.3f} (per seed {', '.join(f'{v:.3f}' for v in s['slope_per_seed'])})"


if __name__ == "__main__":
    from model.private import run_private

    sys.exit(run_private(main))
