"""Whether the fused trainer (model/fused.py) trains the study's arms faster than the single-arm path
on this machine (issue 60): K arms of the default profile's ablation shape, each its own seed and
peak LR, trained one after another by the Trainer (model/train.py, as a stage worker trains them)
and as one fused group, on one thread, with everything each path does per step (data, telemetry,
spike detector, layer statistics, evaluation). Arm-steps per CPU-second each way and their ratio,
for each K; CPU time, not wall time: on cores shared with other jobs wall time varies by +-20 %.
The tokens are random (a Zipf draw over the vocabulary): the step's cost does not depend on them.
Prints and writes JSON; needs only torch and model/:

    python benchmarks/bench_fused.py --arms 2 4 8 --out benchmarks/out/fused.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from model.config import TrainingConfig, load_training_config  # noqa: E402
from model.detect import SpikeDetector  # noqa: E402
from model.fused import FusedArms  # noqa: E402
from model.private import run_private  # noqa: E402
from model.train import train  # noqa: E402
from tasks.config import load_config  # noqa: E402


def arm_configs(k: int, steps: int) -> list[TrainingConfig]:
    """K arms of the default profile's ablation shape, fp32, one thread; seeds and peak LRs differ."""
    a = load_config(ROOT / "params.yaml", "default").ablation
    shape = {
        "model.d_model": a.d_model,
        "model.n_layer": a.n_layer,
        "model.n_head": a.n_head,
        "model.seq_len": a.seq_len,
        "train.batch_size": a.batch_size,
        "train.steps": steps,
        "train.device": "cpu",
        "train.cpu_threads": 1,
        "precision.mode": "fp32",
        "mup.parametrization": "sp",
    }
    return [
        load_training_config(
            ROOT / "params.yaml", "default", {**shape, "train.seed": 16 + i, "optim.lr": a.sp_lr * 2.0 ** (i % 3 - 1)}
        )
        for i in range(k)
    ]


def one_after_another(cfgs: list[TrainingConfig], tokens: tuple[Any, Any]) -> float:
    start = time.process_time()
    for cfg in cfgs:
        train(cfg, *tokens, callbacks=[SpikeDetector()])
    return time.process_time() - start


def fused(cfgs: list[TrainingConfig], tokens: tuple[Any, Any]) -> float:
    start = time.process_time()
    FusedArms(cfgs, *tokens, [[SpikeDetector()] for _ in cfgs], [str(i) for i in range(len(cfgs))]).run()
    return time.process_time() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", type=int, nargs="+", default=[2, 4, 8], help="K: the arms of one group")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/out/fused.json")
    args = p.parse_args()
    vocab = arm_configs(1, args.steps)[0].tokenizer.vocab_size
    rng = np.random.default_rng(0)
    tokens = tuple((rng.zipf(1.3, n) % vocab).astype(np.uint16) for n in (2_000_000, 100_000))
    fused(arm_configs(2, 30), tokens)  # warm-up: kernels, allocator
    rows = []
    for k in args.arms:
        cfgs = arm_configs(k, args.steps)
        seconds = {"one after another": one_after_another(cfgs, tokens), "fused": fused(cfgs, tokens)}
        rate = {way: k * args.steps / s for way, s in seconds.items()}
        row = {
            "arms": k,
            "steps": args.steps,
            "cpu_s": seconds,
            "arm_steps_per_cpu_s": rate,
            "fused_vs_one_after_another": rate["fused"] / rate["one after another"],
        }
        rows.append(row)
        print(
            f"K={k}: one after another {rate['one after another']:6.1f} arm-steps/CPU-s, "
            f"fused {rate['fused']:6.1f}  ({row['fused_vs_one_after_another']:.2f}x)",
            flush=True,
        )
    cfg = arm_configs(1, args.steps)[0]
    result = {
        "shape": {
            "d_model": cfg.model.d_model,
            "n_layer": cfg.model.n_layer,
            "batch": cfg.train.batch_size,
            "seq_len": cfg.model.seq_len,
            "vocab": vocab,
        },
        "rows": rows,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(run_private(main))
