"""Whether the fused trainer (model/fused.py) trains the study's arms faster than the single-arm path
on this machine (issue 60): K arms of the default profile's ablation shape, each its own seed and
peak LR, trained one after another by the Trainer (model/train.py, as a stage worker trains them)
and as one fused group (tasks/ablate/fused.py's way), on one thread, each arm with the probes an
ablation arm trains with (tasks/ablate/arm.py: ArmProbes: spike detector, per-step trace with
Adam's update RMS, layer statistics, the end probe's samples) and everything the loop does
(data, telemetry, evaluation); neither path writes checkpoints (a stage arm does, a fused group
does not: left out, in the single path's favour). Arm-steps per CPU-second each way and their
ratio, for each K, the median of ``--repeats`` interleaved runs; CPU time, not wall time: on cores
shared with other jobs wall time varies by +-20 %, and even CPU time by ~15 % from run to run.
The tokens are random (a Zipf draw over the vocabulary): the step's cost does not depend on them.
Prints and writes JSON; needs only torch, model/ and tasks/ablate/:

    python benchmarks/bench_fused.py --arms 2 4 8 --repeats 3 --out benchmarks/out/fused.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from model.fused import FusedArms  # noqa: E402
from model.private import run_private  # noqa: E402
from model.train import train  # noqa: E402
from tasks.ablate.arm import ArmProbes  # noqa: E402
from tasks.config import Config, load_config  # noqa: E402

Tokens = tuple[np.ndarray, np.ndarray]


def arm_configs(k: int, steps: int, precision: str = "fp32") -> list[Config]:
    """K arms of the default profile's ablation shape in ``precision``, one thread; seeds and peak
    LRs differ."""
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
        "precision.mode": precision,
        "mup.parametrization": "sp",
        "checkpoint.milestones": [],  # neither path writes checkpoints
    }
    return [
        load_config(
            ROOT / "params.yaml", "default", {**shape, "train.seed": 16 + i, "optim.lr": a.sp_lr * 2.0 ** (i % 3 - 1)}
        )
        for i in range(k)
    ]


def one_after_another(cfgs: list[Config], tokens: Tokens, manifest: Path) -> float:
    start = time.process_time()
    for cfg in cfgs:
        train(cfg, *tokens, callbacks=ArmProbes(cfg, manifest, tokens[1]).callbacks, identity="bench")
    return time.process_time() - start


def fused(cfgs: list[Config], tokens: Tokens, manifest: Path) -> float:
    start = time.process_time()
    callbacks = [ArmProbes(cfg, manifest, tokens[1]).callbacks for cfg in cfgs]
    FusedArms(cfgs, *tokens, callbacks, ["bench"] * len(cfgs)).run()
    return time.process_time() - start


def median_rates(k: int, steps: int, repeats: int, tokens: Tokens, manifest: Path, precision: str) -> dict[str, float]:
    """Arm-steps per CPU-second each way, the median over ``repeats`` runs taken in turn."""
    cfgs = arm_configs(k, steps, precision)
    seconds: dict[str, list[float]] = {"one after another": [], "fused": []}
    for _ in range(repeats):
        seconds["one after another"].append(one_after_another(cfgs, tokens, manifest))
        seconds["fused"].append(fused(cfgs, tokens, manifest))
    return {way: k * steps / statistics.median(s) for way, s in seconds.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", type=int, nargs="+", default=[2, 4, 8], help="K: the arms of one group")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="the arms' precision.mode")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/out/fused.json")
    args = p.parse_args()
    cfg = arm_configs(1, args.steps)[0]
    rng = np.random.default_rng(0)
    train_tokens, val_tokens = (
        (rng.zipf(1.3, n) % cfg.tokenizer.vocab_size).astype(np.uint16) for n in (2_000_000, 100_000)
    )
    tokens = (train_tokens, val_tokens)
    rows = []
    with tempfile.TemporaryDirectory() as folder:  # the end probe reads the end-of-text id from a manifest
        manifest = Path(folder) / "manifest.json"
        manifest.write_text(json.dumps({"eot_id": 0}))
        fused(arm_configs(2, 30, args.precision), tokens, manifest)  # warm-up: kernels, allocator
        for k in args.arms:
            rate = median_rates(k, args.steps, args.repeats, tokens, manifest, args.precision)
            row = {
                "precision": args.precision,
                "arms": k,
                "steps": args.steps,
                "repeats": args.repeats,
                "arm_steps_per_cpu_s": rate,
                "fused_vs_one_after_another": rate["fused"] / rate["one after another"],
            }
            rows.append(row)
            print(
                f"K={k}: one after another {rate['one after another']:6.1f} arm-steps/CPU-s, "
                f"fused {rate['fused']:6.1f}  ({row['fused_vs_one_after_another']:.2f}x)",
                flush=True,
            )
    m = cfg.model
    result = {
        "shape": {
            "d_model": m.d_model,
            "n_layer": m.n_layer,
            "batch": cfg.train.batch_size,
            "seq_len": m.seq_len,
            "vocab": cfg.tokenizer.vocab_size,
        },
        "rows": rows,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(run_private(main))
