"""The gpu study's plan projected onto GPU-minutes (issue 60): its arms in fused groups, each costed
from the packing benchmark's measured rows (benchmarks/bench_gpu_packing.py, H200), against the
60 GPU-minute goal. A projection, not a measurement: what a window of fused groups brings is the
first thing a lent GPU measures (docs/gpu-study.md).

How an arm is costed. Each packing row is arm-steps per second at the gpu profile's ablation
shape (4 layers, d_model 256, seq 256, batch 32, the 50,304-entry readout), on random tokens; the
window measured 35 arm-steps/s where the bare benchmark's 5 processes ran 39.5 (its data loader,
telemetry and evaluation), and every row is scaled by that ratio. An arm of another shape costs
its share of a step's FLOPs: the readout is 0.63 of them at this shape, the 4 layers the rest, so
xiong's 12 layers cost (0.63 + 0.37 * 3) = 1.74 steps a step. beta2's batch of 4 is given as a
range: 1/8 of a step by FLOPs (its floor), a whole step where a step that small is bound by kernel
launches (its ceiling). Arms that may fuse (the plan's ``fuse`` key, tasks/ablate/fused.py:
fusion_key; computed here for a plan made before it) train at a vmap row, the rest one arm a
process at the processes row of the same vocabulary.

    python benchmarks/project_gpu_plan.py [--plan gpu_study/plan.json] [--rows gpu_study/packing/h200-2026-11-27.jsonl]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from model.private import run_private  # noqa: E402
from tasks.ablate.fused import fusion_key  # noqa: E402

GOAL_MINUTES = 60.0
"""Issue 60's goal: the gpu registration's plan in four 15-minute windows."""
READOUT_SHARE = 0.63
"""The 50,304-entry readout's share of a step's FLOPs at the ablation shape (docs/gpu-study.md)."""
SHAPE = {"model.n_layer": 4, "train.batch_size": 32}
"""The shape the packing rows measured."""
WINDOW_OVER_BENCH = 35.0 / 39.5
"""Window 1's arm-steps/s (5 processes, with loader, telemetry, eval) over the bare benchmark's."""
SCENARIOS = (  # name, the fused arms' row, the lone arms' row: (mode, k, vocab, tf32) each
    ("50,304 vocabulary: one arm a process", ("processes", 5, 50304, False), ("processes", 5, 50304, False)),
    ("50,304: fused groups, fp32", ("vmap", 5, 50304, False), ("processes", 5, 50304, False)),
    ("50,304: fused groups, TF32", ("vmap", 8, 50304, True), ("processes", 5, 50304, True)),
    ("8,192 (registered): one arm a process", ("processes", 5, 8192, False), ("processes", 5, 8192, False)),
    ("8,192 (registered): fused groups, fp32", ("vmap", 8, 8192, False), ("processes", 5, 8192, False)),
)


def fuse_of(arm: dict[str, Any]) -> str | None:
    """The arm's fuse key, from the plan or (a plan made before fused groups) computed here."""
    return arm["fuse"] if "fuse" in arm else fusion_key(arm["arguments"], ROOT)


def settings(arm: dict[str, Any]) -> dict[str, str]:
    return {a.split("=", 2)[1]: a.split("=", 2)[2] for a in arm["arguments"] if a.startswith("--set=")}


def step_cost(arm: dict[str, Any], vocab: int, launch_bound: bool) -> float:
    """The arm's step in steps of the measured shape at ``vocab`` (see the module doc)."""
    s = settings(arm)
    readout = READOUT_SHARE * vocab / 50304
    body = (1 - READOUT_SHARE) * int(s["model.n_layer"]) / SHAPE["model.n_layer"]
    batch = 1.0 if launch_bound else int(s["train.batch_size"]) / SHAPE["train.batch_size"]
    return batch * (readout + body) / (readout + 1 - READOUT_SHARE)


def rate(rows: list[dict[str, Any]], mode: str, k: int, vocab: int, tf32: bool) -> float:
    """The measured arm-steps/s of that packing, scaled to a window's (see the module doc)."""
    found = [
        r["arm_steps_per_s"]
        for r in rows
        if "arm_steps_per_s" in r and (r["mode"], r["k"], r["vocab"], r["tf32"]) == (mode, k, vocab, tf32)
    ]
    if not found:
        raise SystemExit(f"project_gpu_plan: no measured row for {mode}, K={k}, vocab {vocab}, tf32 {tf32}")
    return float(max(found)) * WINDOW_OVER_BENCH


def project(plan: dict[str, Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per scenario: the plan's GPU-minutes, floor and ceiling (beta2's small batch)."""
    fuses = [fuse_of(arm) for arm in plan["arms"]]
    out = []
    for name, fused_row, alone_row in SCENARIOS:
        minutes = []
        for launch_bound in (False, True):
            seconds = 0.0
            for arm, fuse in zip(plan["arms"], fuses, strict=True):
                row = fused_row if fuse else alone_row
                steps = int(settings(arm)["train.steps"]) * step_cost(arm, row[2], launch_bound)
                seconds += steps / rate(rows, *row)
            minutes.append(seconds / 60)
        out.append({"scenario": name, "minutes_floor": round(minutes[0]), "minutes_ceiling": round(minutes[1])})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plan", type=Path, default=ROOT / "gpu_study" / "plan.json")
    p.add_argument("--rows", type=Path, default=ROOT / "gpu_study" / "packing" / "h200-2026-11-27.jsonl")
    args = p.parse_args()
    plan = json.loads(args.plan.read_text())
    rows = [json.loads(line) for line in args.rows.read_text().splitlines() if line.strip()]
    fusable = sum(1 for arm in plan["arms"] if fuse_of(arm))
    print(
        f"plan {plan['plan']}: {len(plan['arms'])} arms, {fusable} of them in fused groups; goal {GOAL_MINUTES:.0f} GPU-minutes"
    )
    for line in project(plan, rows):
        print(f"  {line['scenario']:<40} {line['minutes_floor']:>4}-{line['minutes_ceiling']} GPU-minutes")
    return 0


if __name__ == "__main__":
    sys.exit(run_private(main))
