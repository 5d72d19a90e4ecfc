"""The ablate stage's arms trained on another machine's CPU, for the cross-machine check of issue 28
(the study rerun on a CPU of the other vendor): ``plan`` writes the arms the stage would train
(their run identities and commands, with the loss shift its probe picks here); ``train`` trains
them where only torch, numpy and pyyaml are installed (a GPU box's host CPU, one thread per arm,
``--workers`` at once) and appends each result to one gzipped JSON-lines file as it finishes, so
a run cut short keeps what it trained. ``python checks/arithmetic.py --arms-from FILE``
then lends the results
to a copy of the project, whose ablate stage finds every arm stored and decides the findings from
the other machine's numbers.

    python checks/arms_elsewhere.py plan --out checks/out/arms-plan.json      # here
    python checks/arms_elsewhere.py train checks/out/arms-plan.json --out arms.jsonl.gz --workers 16
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from model.private import run_private  # noqa: E402


def plan_arms(project: Path, profile: str | None) -> list[dict[str, Any]]:
    """The stage's runs (one per run identity), its command's arguments after the module."""
    from flows.ablate import ARM_MODULE, plan, runs_to_train  # here: prefect is not on a bare box
    from tasks.ablate.conditions import loss_shift_probe
    from tasks.config import load_config
    from tasks.design.studies import read_studies

    cfg = load_config(project / "params.yaml", profile)
    shift = loss_shift_probe(cfg, project)["k"] or 0
    rows = plan(cfg, project, {}, shift, read_studies(project, cfg))
    for row in rows:
        row["cached"] = False  # the other machine trains every run, stored here or not
    todo = sorted(runs_to_train(rows), key=lambda row: -rough_cost(row["config"]))  # long arms first
    return [
        {"key": row["key"], "name": row["name"], "arguments": row["command"][1 + len(ARM_MODULE) :]} for row in todo
    ]


def rough_cost(cfg: Any) -> float:
    """An arm's matmul work, up to a constant: steps x tokens x layers x width squared."""
    m, t = cfg.model, cfg.train
    return float(t.steps * t.batch_size * t.grad_accum * m.seq_len * m.n_layer * m.d_model**2)


def train_one(arm: dict[str, Any], project: Path) -> tuple[str, bytes | None]:
    """One arm in a fresh process (the libraries read the numerics settings when torch loads), on
    ``project``'s params and data: its status and its result.json, or why there is none."""
    with tempfile.TemporaryDirectory(prefix="arm-") as scratch:
        arguments = list(arm["arguments"])
        arguments[arguments.index("--out") + 1] = scratch
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        command = [sys.executable, "-m", "tasks.ablate.arm", *arguments]
        done = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True)
        result = Path(scratch) / "result.json"
        if not result.is_file():
            return f"no result (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}", None
        stored = json.loads(result.read_text())
        if stored["key"] != arm["key"]:  # another code, data or config than the plan's: not the same run
            return f"no result: run identity {stored['key']} is not the plan's {arm['key']}", None
        return str(stored["summary"]["status"]), result.read_bytes()


def stored_results(path: Path) -> list[dict[str, Any]]:
    """The results in ``path`` (one gzip member per arm), up to a member a cut-short run left
    unfinished."""
    results: list[dict[str, Any]] = []
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            results.extend(json.loads(line) for line in f)
    except (OSError, EOFError, ValueError):  # the last member cut short: the ones before it stand
        pass
    return results


def train(arms: list[dict[str, Any]], project: Path, out: Path, workers: int) -> int:
    """Train the arms not in ``out`` yet, appending each result to it as one gzip member (one file:
    a machine that returns a few files returns it whole, and a run cut short keeps its arms)."""
    done = {result["key"] for result in stored_results(out)} if out.is_file() else set()
    todo = [arm for arm in arms if arm["key"] not in done]
    started, failed = time.perf_counter(), 0
    print(f"{len(arms)} arms, {len(done)} stored, {len(todo)} to train, {workers} at a time", flush=True)
    with ThreadPoolExecutor(workers) as pool, open(out, "ab") as sink:
        futures = {pool.submit(train_one, arm, project): arm for arm in todo}
        for n, future in enumerate(as_completed(futures), 1):
            status, result = future.result()
            if result is None:
                failed += 1
            else:
                sink.write(gzip.compress(json.dumps(json.loads(result)).encode() + b"\n"))
                sink.flush()
            print(
                f"[{n}/{len(todo)} {time.perf_counter() - started:.0f}s] {futures[future]['name']}: {status}",
                flush=True,
            )
    return 1 if failed else 0


EXAMPLES = (
    "examples:\n"
    "  spikelab check elsewhere plan --out checks/out/arms-plan.json          here\n"
    "  spikelab check elsewhere train checks/out/arms-plan.json --out arms.jsonl.gz --workers 16   there\n"
    "  spikelab check arithmetic --arms-from arms.jsonl.gz                    back here: the verdicts"
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spikelab check elsewhere",
        description="Train the ablate stage's arms on another machine's CPU: `plan` writes the arms the\n"
        "stage would train (run identities, commands, the loss shift its probe picks here); `train`\n"
        "trains them where only torch, numpy and pyyaml are installed, appending each result to one\n"
        "gzipped JSON-lines file as it finishes (a run cut short keeps what it trained). Then\n"
        "`spikelab check arithmetic --arms-from FILE` decides the findings on those numbers.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="ACTION")
    planned = sub.add_parser(
        "plan",
        help="write the ablate stage's arms (here, where the orchestration is)",
        description="Write the ablate stage's arms, as this project would train them, to a JSON plan.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    planned.add_argument("--project", type=Path, default=ROOT, help="whose params and data the plan reads")
    planned.add_argument("--profile", default=None, help="the profile planned (default: params.yaml's)")
    planned.add_argument("--out", type=Path, required=True, help="the plan's JSON file")
    trained = sub.add_parser(
        "train",
        help="train a plan's arms (on any machine with torch, numpy, pyyaml)",
        description="Train a plan's arms, one thread each, --workers at once, appending each result.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    trained.add_argument("plan", type=Path, help="the plan `plan` wrote")
    trained.add_argument("--out", type=Path, required=True, help="a .jsonl.gz file: one result per line (appended)")
    trained.add_argument("--project", type=Path, default=ROOT, help="whose params and data the arms read")
    trained.add_argument(
        "--workers", type=int, default=os.cpu_count() or 1, help="arms trained at once (default: one per core)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "plan":
        from model.typed_config import ConfigError

        try:
            arms = plan_arms(args.project.resolve(), args.profile)
        except ConfigError as e:
            print(f"arms_elsewhere: {e}", file=sys.stderr)
            return 2
        args.out.write_text(json.dumps(arms, indent=1) + "\n")
        print(f"{len(arms)} arms -> {args.out}")
        return 0
    return train(json.loads(args.plan.read_text()), args.project.resolve(), args.out.resolve(), args.workers)


if __name__ == "__main__":
    sys.exit(run_private(main))
