"""The formats' arms on real fp16/bf16 arithmetic: the precision and overflow families' arms, each
trained twice from the same config and data, once as the study trains it (every matmul's rounding
emulated in fp32 on the CPU, ``precision.emulate: always``) and once on a CUDA device with the
hardware's own formats (autocast, ``emulate: never``). The study decides its fp16 findings on the
emulation (the precision family's `fixed` keys in tasks/design/preregistration.yaml); this shows whether what decides them — which arms go
non-finite, how far each ends from fp32, the probe-sized excursion, the fp16 range probe's shares —
holds where the formats are real.

    python checks/formats_gpu.py --seeds 0 1 --out checks/out/formats_gpu.json

Needs ``dvc repro tokenize`` (data/tokens) and a CUDA device; imports only torch, numpy, pyyaml
(it runs on a bare GPU box). The CPU arms run in a process pool, one thread each; the CUDA arms
one after another (the pool spawns: CUDA is initialised here). Prints one row per arm, both paths side by side, and writes every result.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from model.private import run_private  # noqa: E402
from tasks.ablate.arm import run_arm  # noqa: E402
from tasks.ablate.conditions import loss_shift_probe  # noqa: E402
from tasks.ablate.grid import Arm, arm_config, expand, families, range_extremes  # noqa: E402
from tasks.config import Config, load_config  # noqa: E402

FAMILIES = ("precision", "overflow")
PATHS = {
    "cpu_emulated": {},
    "cuda_native": {"train.device": "cuda", "precision.emulate": "never", "train.cpu_threads": 0},
}
"""Each path's keys over the arm's own config (the study's arms are the emulated ones)."""


def arms(cfg: Config, seeds: list[int]) -> list[Arm]:
    """The two families' arms at ``seeds``, each run once (the overflow family's clean twins are
    the precision family's arms)."""
    chosen: dict[tuple, Arm] = {}
    for arm in expand(cfg):
        if arm.family in FAMILIES and arm.seed in seeds:
            precision = arm.factors["precision"]
            chosen.setdefault((precision, arm.spike, arm.seed), arm)
    return list(chosen.values())


def train_one(cfg: Config, arm: Arm, path: str, loss_shift: int, out: Path) -> dict[str, Any]:
    family = families(cfg)[arm.family]
    arm_cfg = arm_config(cfg, arm, family, loss_shift).replace(**PATHS[path])
    started = time.perf_counter()
    result = run_arm(arm_cfg, ROOT, out / path / arm.name.replace("/", "_"), arm.spike, family.range_probe_every)
    summary = result["summary"]
    return {
        "arm": arm.name,
        "path": path,
        "status": summary["status"],
        "diverged_at": summary["diverged_at"],
        "val_loss": summary["val_loss"],
        "overflows": summary["overflows"],
        "injected_multiplier": result["injected_multiplier"],
        **range_extremes(result["ranges"]),
        "precision_path": summary["precision"],
        "seconds": time.perf_counter() - started,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spikelab check formats-gpu",
        description="Train the precision and overflow families' arms twice from the same config and data:\n"
        "once as the study does (fp16/bf16 rounding emulated in fp32 on the CPU) and once on a CUDA\n"
        "device's own formats, and print both side by side: which arms go non-finite, how far each\n"
        "ends from fp32, the excursion and the range probe's shares. Needs data/tokens\n"
        "(`dvc repro tokenize`) and a CUDA device.",
        epilog="example:\n  spikelab check formats-gpu --seeds 0 1 --out checks/out/formats_gpu.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="the seeds trained (default: %(default)s)")
    p.add_argument("--profile", default="default", help="the profile whose arms train (default: %(default)s)")
    p.add_argument("--workers", type=int, default=8, help="processes for the CPU arms")
    p.add_argument(
        "--out", type=Path, default=ROOT / "checks" / "out" / "formats_gpu.json", help="every result, as JSON"
    )
    return p


def main() -> int:
    p = parser()
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        p.error("needs a CUDA device (the point is the hardware's own fp16/bf16)")
    cfg = load_config(ROOT / "params.yaml", args.profile)
    shift = loss_shift_probe(cfg, ROOT)
    print(f"loss shift k = {shift['k']} (target {shift['target']}), on {torch.cuda.get_device_name()}", flush=True)
    runs_dir = args.out.parent / "formats_gpu_runs"
    todo = arms(cfg, args.seeds)
    with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        cpu = [pool.submit(train_one, cfg, arm, "cpu_emulated", shift["k"] or 0, runs_dir) for arm in todo]
        cuda = [train_one(cfg, arm, "cuda_native", shift["k"] or 0, runs_dir) for arm in todo]
        rows = [f.result() for f in cpu] + cuda
    show(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"loss_shift": shift, "device": torch.cuda.get_device_name(), "arms": rows}, indent=1)
    )
    return 0


def show(rows: list[dict[str, Any]]) -> None:
    by_arm: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_arm.setdefault(row["arm"], {})[row["path"]] = row
    print(
        f"{'arm':34}{'path':14}{'status':11}{'val loss':>10}{'overflows':>10}{'x mult':>8}{'underflow':>11}{'act>65504':>11}"
    )
    for name, paths in by_arm.items():
        for path, r in paths.items():
            loss = "—" if r["val_loss"] is None else f"{r['val_loss']:.4f}"
            mult = "—" if r["injected_multiplier"] is None else f"{r['injected_multiplier']:g}"
            under = "—" if r["grad_underflow_share"] is None else f"{r['grad_underflow_share']:.4f}"
            over = "—" if r["act_overflow_share"] is None else f"{r['act_overflow_share']:.2e}"
            print(f"{name:34}{path:14}{r['status']:11}{loss:>10}{r['overflows']:>10}{mult:>8}{under:>11}{over:>11}")


if __name__ == "__main__":
    sys.exit(run_private(main))
