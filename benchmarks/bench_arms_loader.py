"""How much of a fused group's step the training thread spends loading its data (issue 60: host
cores), in process against ``train.num_workers`` worker processes. The group is the gpu profile's
ablation shape (K arms, batch 32 of 256 tokens each); the device step is stood in for by a wait of
``--step-ms`` (a GPU step leaves the host thread free: its kernels run asynchronously), 65 ms by
default, the H200's measured vmap rate at K = 5 (77 arm-steps/s: gpu_study/packing). Reported per
worker count: the training thread's load time a step, the median over ``--steps`` steps after a
warm-up, and its share of the step. Needs only torch, numpy and model/:

    python benchmarks/bench_arms_loader.py --arms 5 --workers 0 2 4 --out benchmarks/out/arms_loader.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from model.data import ArmsLoader  # noqa: E402
from model.private import run_private  # noqa: E402
from tasks.config import load_config  # noqa: E402

WARMUP = 10  # steps before the clock: the workers' start and first prefetch


def load_seconds(loader: ArmsLoader, steps: int, step_s: float) -> list[float]:
    """The training thread's seconds in ``next_batch`` at each step, the device busy ``step_s`` after it."""
    seconds = []
    for step in range(WARMUP + steps):
        start = time.perf_counter()
        loader.next_batch()
        if step >= WARMUP:
            seconds.append(time.perf_counter() - start)
        time.sleep(step_s)
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", type=int, default=5, help="K: the arms of one fused group")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2, 4], help="train.num_workers to compare")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--step-ms", type=float, default=65.0, help="the device's time a step")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/out/arms_loader.json")
    args = p.parse_args()
    gpu = load_config(ROOT / "params.yaml", "gpu")
    a, seeds = gpu.ablation, list(range(40, 40 + args.arms))
    tokens = (np.random.default_rng(0).zipf(1.3, 20_000_000) % gpu.tokenizer.vocab_size).astype(
        np.uint16
    )  # gpu data's size order
    rows = []
    for workers in args.workers:
        loader = ArmsLoader(tokens, a.seq_len, a.batch_size, seeds, num_workers=workers)
        median = statistics.median(load_seconds(loader, args.steps, args.step_ms / 1000))
        rows.append({"workers": workers, "load_ms": median * 1000, "share_of_step": median * 1000 / args.step_ms})
        print(f"workers {workers}: {median * 1000:6.2f} ms a step on the training thread "
              f"({rows[-1]['share_of_step']:.1%} of a {args.step_ms:g} ms step)", flush=True)  # fmt: skip
    result = {
        "arms": args.arms,
        "step_ms": args.step_ms,
        "steps": args.steps,
        "rows": rows,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(run_private(main))
