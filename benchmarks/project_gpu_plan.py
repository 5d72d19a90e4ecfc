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
process at the processes row of the same vocabulary. Every row trained fp32 (TF32 on or off): an
arm of another precision (the gpu profile's bf16) is costed at the fp32 rows, the conservative
estimate, since no bf16 row has been measured on a GPU, and the output says so.

    python benchmarks/project_gpu_plan.py [--plan gpu_study/plan.json | --profile gpu] [--rows gpu_study/packing/h200-2026-11-27.jsonl]

``--profile`` projects a profile's design (its families, grid and seeds) before its plan is made,
which needs the profile's data.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from model.fused import shared_settings, why_alone  # noqa: E402
from model.private import run_private  # noqa: E402
from model.typed_config import UserError  # noqa: E402
from tasks.ablate.fused import fusion_key  # noqa: E402
from tasks.ablate.grid import arm_config, expand, families  # noqa: E402
from tasks.config import Config, load_config  # noqa: E402
from tasks.gpu_study.plan import GROUP_SIZE, MARGIN, next_slice  # noqa: E402

GOAL_MINUTES = 60.0
"""Issue 60's goal: the gpu registration's plan in four 15-minute windows."""
READOUT_SHARE = 0.63
"""The 50,304-entry readout's share of a step's FLOPs at the ablation shape (docs/gpu-study.md)."""
SHAPE = {"model.n_layer": 4, "train.batch_size": 32}
"""The shape the packing rows measured."""
MEASURED_PRECISION = "fp32"
"""The precision every packing row trained in; an arm of another is costed as if it trained in it."""
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


def plan_arms(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """A plan's arms as the projection costs them: family, steps, depth, batch, and whether it fuses."""
    return [
        {
            "key": arm["key"],
            "family": arm["family"],
            "steps": int(s["train.steps"]),
            "n_layer": int(s["model.n_layer"]),
            "batch_size": int(s["train.batch_size"]),
            "precision": s.get("precision.mode", MEASURED_PRECISION),
            "fuse": fuse_of(arm),
        }
        for arm in plan["arms"]
        for s in [settings(arm)]
    ]


def profile_arms(cfg: Config) -> list[dict[str, Any]]:
    """The arms a profile's design trains (its families, grid and seeds: tasks/ablate/grid.py:
    expand), costed like :func:`plan_arms` without its data: the design before its plan is made. An
    arm fuses as tasks/ablate/fused.py: fusion_key decides (no injected spike, no range probe, and
    nothing model/fused.py: why_alone names)."""
    every = families(cfg)
    out = []
    for arm in expand(cfg):
        family = every[arm.family]
        arm_cfg = arm_config(cfg, arm, family)
        fuses = arm.spike == "none" and not family.range_probe_every and why_alone(arm_cfg) is None
        shared = json.dumps(shared_settings(arm_cfg), sort_keys=True, default=str)
        out.append(
            {
                "key": arm.name,
                "family": arm.family,
                "seed": arm.seed,
                "steps": arm_cfg.train.steps,
                "n_layer": arm_cfg.model.n_layer,
                "batch_size": arm_cfg.train.batch_size,
                "precision": arm_cfg.precision.mode,
                "fuse": hashlib.sha256(shared.encode()).hexdigest()[:16] if fuses else None,
            }
        )
    seeds, order = cfg.ablation.all_seeds, list(every)  # the plan's order: seed by seed (flows/gpu_study.py)
    return sorted(out, key=lambda arm: (seeds.index(arm["seed"]), order.index(arm["family"])))


def step_cost(arm: dict[str, Any], vocab: int, launch_bound: bool) -> float:
    """The arm's step in steps of the measured shape at ``vocab`` (see the module doc)."""
    readout = READOUT_SHARE * vocab / 50304
    body = (1 - READOUT_SHARE) * arm["n_layer"] / SHAPE["model.n_layer"]
    batch = 1.0 if launch_bound else arm["batch_size"] / SHAPE["train.batch_size"]
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


def arm_seconds(
    arm: dict[str, Any], rows: list[dict[str, Any]], scenario: tuple[Any, ...], launch_bound: bool
) -> float:
    """The GPU-seconds ``arm`` takes under ``scenario`` (name, fused row, lone row): its steps, each
    costed by :func:`step_cost`, at its row's rate."""
    _, fused_row, alone_row = scenario
    row = fused_row if arm["fuse"] else alone_row
    return arm["steps"] * step_cost(arm, row[2], launch_bound) / rate(rows, *row)


def project(arms: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per scenario: the arms' GPU-minutes, floor and ceiling (beta2's small batch), in all and per family."""
    out = []
    for scenario in SCENARIOS:
        bounds = {}
        for launch_bound in (False, True):
            per_family: dict[str, float] = {}
            for arm in arms:
                per_family[arm["family"]] = (
                    per_family.get(arm["family"], 0.0) + arm_seconds(arm, rows, scenario, launch_bound) / 60
                )
            bounds[launch_bound] = per_family
        out.append(
            {
                "scenario": scenario[0],
                "minutes_floor": round(sum(bounds[False].values())),
                "minutes_ceiling": round(sum(bounds[True].values())),
                "families": {f: (round(bounds[False][f], 1), round(bounds[True][f], 1)) for f in bounds[False]},
            }
        )
    return out


def windows(
    arms: list[dict[str, Any]], rows: list[dict[str, Any]], window_s: float, workers: int, launch_bound: bool
) -> list[dict[str, Any]]:
    """The windows the arms need at the last scenario's rates, each as tasks/gpu_study/plan.py:
    next_slice cuts it (whole fused groups of ``GROUP_SIZE``, in plan order, ``workers`` at once),
    every arm estimated at its projected GPU-seconds instead of a measured arm's (its margin
    undone): per window its groups and the seconds its fullest lane takes."""
    scenario = SCENARIOS[-1]
    seconds = {arm["family"]: arm_seconds(arm, rows, scenario, launch_bound) for arm in arms}
    measures = [
        {"family": f, "wall_s": s / MARGIN, "steps_total": 1, "steps_done": 1, "sharing": 1} for f, s in seconds.items()
    ]
    plan, done, out = {"plan": "projected", "arms": arms}, set(), []
    while len(done) < len(arms):
        cut = next_slice(plan, done, measures, window_s, workers, len(out) + 1, group_size=GROUP_SIZE)
        done |= {arm["key"] for arm in cut["arms"]}
        groups = {}
        for arm in cut["arms"]:
            groups.setdefault(arm["group"], arm["family"])
        out.append({"groups": list(groups.values()), "busy_s": cut["estimate_s"]})
    return out


def unmeasured_precisions(arms: list[dict[str, Any]]) -> str | None:
    """One line saying which arms train in a precision no row measured, costed at the fp32 rows; None
    when every arm trains fp32."""
    other = Counter(arm["precision"] for arm in arms if arm["precision"] != MEASURED_PRECISION)
    if not other:
        return None
    which = ", ".join(f"{n} arms train {precision}" for precision, n in other.items())
    return (
        f"{which}: no packing row of that precision was measured on a GPU, so they are costed at the "
        f"{MEASURED_PRECISION} rows, the conservative estimate"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plan", type=Path, default=ROOT / "gpu_study" / "plan.json")
    p.add_argument("--profile", help="project this profile's design instead of a plan (no data needed)")
    p.add_argument("--window-s", type=float, default=780.0, help="a window's seconds (default: %(default)s)")
    p.add_argument("--workers", type=int, default=1, help="fused groups a window trains at once (default: %(default)s)")
    p.add_argument("--rows", type=Path, default=ROOT / "gpu_study" / "packing" / "h200-2026-11-27.jsonl")
    args = p.parse_args()
    rows = [json.loads(line) for line in args.rows.read_text().splitlines() if line.strip()]
    if args.profile:
        arms, what = profile_arms(load_config(ROOT / "params.yaml", args.profile)), f"profile {args.profile}'s design"
    else:
        plan = json.loads(args.plan.read_text())
        arms, what = plan_arms(plan), f"plan {plan['plan']}"
    fusable = sum(1 for arm in arms if arm["fuse"])
    print(f"{what}: {len(arms)} arms, {fusable} of them in fused groups; goal {GOAL_MINUTES:.0f} GPU-minutes")
    if note := unmeasured_precisions(arms):
        print(f"  {note}")
    for line in project(arms, rows):
        print(f"  {line['scenario']:<40} {line['minutes_floor']:>4}-{line['minutes_ceiling']} GPU-minutes")
        for family, (floor, ceiling) in line["families"].items():
            print(f"    {family:<12} {floor:>6.1f}-{ceiling:.1f}")
    for launch_bound, bound in ((False, "floor"), (True, "ceiling")):
        try:
            cut = windows(arms, rows, args.window_s, args.workers, launch_bound)
        except UserError as e:  # a group longer than the window: the slicer's own refusal
            raise SystemExit(f"project_gpu_plan: {e}") from None
        print(
            f"at the last row ({bound}): {len(cut)} windows of {args.window_s:.0f} s, {args.workers} fused groups at "
            f"once, groups of {GROUP_SIZE}"
        )
        for number, window in enumerate(cut, 1):
            kinds = ", ".join(f"{window['groups'].count(f)} {f}" for f in dict.fromkeys(window["groups"]))
            print(f"  {number}: {len(window['groups'])} groups ({kinds}), fullest lane {window['busy_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(run_private(main))
