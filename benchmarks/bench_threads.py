"""Pretraining throughput by thread choice, on idle cores and beside a busy neighbour: 1 thread, every
core of the affinity, and ``train.cpu_threads: 0`` (model/threads.py: the cores no other process is
busy on at the start). The target: the automatic choice never below 1 thread's speed, and at the
all-cores speed when the cores are free. The neighbour is a pure-Python busy loop pinned to one
core of the affinity, started before the run chooses its threads. Needs only torch, numpy and model/:

    python benchmarks/bench_threads.py --out benchmarks/out/threads.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from model.callbacks import Callback  # noqa: E402
from model.config import TrainingConfig, load_training_config  # noqa: E402
from model.private import run_private  # noqa: E402
from model.train import Trainer  # noqa: E402


class StepClock(Callback):
    """Wall time of the steps after the first ``skip`` (allocator and kernel warm-up)."""

    def __init__(self, skip: int) -> None:
        self.skip, self.start, self.end, self.steps = skip, None, None, 0

    def on_step_end(self, trainer: Trainer) -> None:
        if trainer.step == self.skip:
            self.start = time.perf_counter()
        elif trainer.step > self.skip:
            self.end, self.steps = time.perf_counter(), self.steps + 1


def tokens_per_s(cfg: TrainingConfig, threads: int, steps: int) -> tuple[float, int]:
    """(tokens/s, threads used) of a pretraining run of ``cfg`` with ``train.cpu_threads=threads``."""
    run = cfg.replace(
        **{
            "train.cpu_threads": threads,
            "train.steps": steps,
            "train.eval_every": 0,
            "checkpoint.milestones": [],
            "train.device": "cpu",
        }
    )
    n = (steps + 2) * run.train.batch_size * (run.model.seq_len + 1)
    tokens = np.random.default_rng(0).integers(0, run.tokenizer.vocab_size, n).astype(np.uint16)
    clock = StepClock(skip=3)
    trainer = Trainer(run, tokens, tokens, [clock])
    used = torch.get_num_threads()
    trainer.run()
    return clock.steps * run.train.batch_size * run.model.seq_len / (clock.end - clock.start), used


@contextlib.contextmanager
def busy_neighbour(cpu: int) -> Iterator[None]:
    proc = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
    time.sleep(1.0)  # running before the trainer samples /proc/stat
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def measure(cfg: TrainingConfig, steps: int) -> dict[str, dict[str, float]]:
    cores = len(os.sched_getaffinity(0))
    out = {}
    for name, threads in (("1 thread", 1), (f"{cores} threads", cores), ("auto (cpu_threads 0)", 0)):
        rate, used = tokens_per_s(cfg, threads, steps)
        out[name] = {"tokens_per_s": rate, "threads": used}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default=None, help="study profile whose pretraining model is measured")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "threads.json")
    args = p.parse_args(argv)
    cfg = load_training_config(ROOT / "params.yaml", args.profile)
    result = {"idle": measure(cfg, args.steps)}
    with busy_neighbour(max(os.sched_getaffinity(0))):
        result["busy neighbour"] = measure(cfg, args.steps)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for situation, rows in result.items():
        print(situation)
        for name, r in rows.items():
            print(f"  {name:<22} {r['tokens_per_s']:>8,.0f} tokens/s  ({r['threads']} threads)")
    return 0


if __name__ == "__main__":
    sys.exit(run_private(main))
