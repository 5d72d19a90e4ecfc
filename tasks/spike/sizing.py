"""The spike study's sizing probes, run on ``spike.sizing_seeds`` (never a discovery or confirmation
seed) and blind to the recovery policies: they read only clean controls and ``continue`` branches.

Two registered rules (tasks/report/preregistration.yaml, the spike finding's ``conditions``):

  detector   ``spike.detect_zscore`` is the smallest of ``spike.sizing_zscores`` at which the
             detector, replayed over each sizing seed's clean stretch (the warm-up and the clean
             control: every step it watches without an injection), raises at most
             ``spike.max_false_alarms`` alarms per clean control (the mean over the sizing seeds).
             Every alarm on a clean run is a false one; a skip_batch or rollback branch that meets
             one after its last allowed restart gives up, so false alarms, not the spike, would
             decide its outcome.
  data       ``spike.data_batches`` is the smallest of ``spike.sizing_data_batches`` at which the
             ``continue`` branch of a data injection that long ends more than
             ``recovery.recover_epsilon`` above its clean control at every sizing seed (the spike
             finding's precondition asks it of half the study's seeds).

One seed's probe (:func:`probe_seed`) trains the seed's origin run, the warm-up and the clean
control as the stage does (tasks/spike/study.py), then one ``continue`` branch per candidate
length; the detector replay needs no training (a ``continue`` run is the same whatever the
detector says). ``python -m tasks.spike.sizing --out FILE`` (``--profile``, ``--set KEY=VALUE``)
runs the probes and prints what each rule picks; the values go into params.yaml by hand, with
what was seen, in the design's change history."""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from model.detect import SpikeDetector
from model.spike.branch import run_branch, warm_up
from model.spike.injections import Injection
from model.typed_config import add_config_arguments, parse_sets
from tasks.config import Config, load_config
from tasks.runtime.files import write_json
from tasks.runtime.workers import clean_state
from tasks.spike.curves import trailing_mean
from tasks.spike.study import TIED_TO, StudyRun, aligned_losses, poison_batches, window


def replay_alarms(
    values: Sequence[tuple[int, float, float]], window: int, warmup: int, zscore: float, ratio: float
) -> list[int]:
    """The steps a fresh detector with these settings flags over ``values`` ((step, loss, grad
    norm) in step order), as it would have in the run: the detector itself, fed the values."""
    detector = SpikeDetector(window=window, warmup=warmup, zscore=zscore, ratio=ratio)
    for step, loss, grad_norm in values:
        pending = SimpleNamespace(step=step, loss=torch.tensor(loss), grad_norm=torch.tensor(grad_norm))
        detector.on_before_optimizer(None, pending)  # type: ignore[arg-type]  # reads only the step, loss, grad norm
    return detector.flagged_steps()


def calibrate_zscore(
    clean: Sequence[Sequence[tuple[int, float, float]]], cfg: Config
) -> tuple[float | None, dict[str, list[int]]]:
    """The detector rule: the smallest candidate z-score whose alarms per clean stretch (mean over
    ``clean``, one per sizing seed) are at most ``spike.max_false_alarms``; None if no candidate
    is. Also every candidate's alarm count per stretch."""
    s = cfg.spike
    counts = {
        f"{z:g}": [len(replay_alarms(v, s.detect_window, s.detect_warmup, z, s.detect_ratio)) for v in clean]
        for z in s.sizing_zscores
    }
    chosen = next((z for z in s.sizing_zscores if np.mean(counts[f"{z:g}"]) <= s.max_false_alarms), None)
    return chosen, counts


def choose_data_batches(gaps: Mapping[int, Sequence[float]], epsilon: float) -> int | None:
    """The data rule: the smallest candidate length whose ``continue`` gaps (one per sizing seed)
    all exceed ``epsilon``; None if none does."""
    return next((n for n in sorted(gaps) if gaps[n] and min(gaps[n]) > epsilon), None)


def final_gap(branch_losses: Sequence[float], control_losses: Sequence[float], smooth: int) -> float:
    """The relative gap of the smoothed losses at the window's end, as the study scores it."""
    b, c = trailing_mean(np.asarray(branch_losses), smooth), trailing_mean(np.asarray(control_losses), smooth)
    return float(b[-1] / c[-1] - 1.0) if len(b) and math.isfinite(b[-1]) else float("inf")


def probe_seed(cfg: Config, project: Path, seed: int, run_dir: Path, lengths: Sequence[int]) -> dict[str, Any]:
    """One sizing seed: its clean stretch ((step, loss, grad norm) of the warm-up and the clean
    control), the alarms the configured detector raised on it, and the ``continue`` gap of a data
    injection of each of ``lengths`` batches."""
    started = time.perf_counter()
    study = StudyRun(cfg, project, seed, run_dir)
    checkpoint, origin_run = study.origin_run()
    c = study.cfg
    fork, end = window(c)
    warm = warm_up(study.maker(study.identity({"branch": "warm"})), checkpoint, fork, c.spike, run_dir / "warm")
    control = run_branch(
        study.maker(study.identity({"branch": "control"})), warm.origin, end, "continue", c.recovery, c.spike
    )
    clean = [(int(r["step"]), float(r["loss"]), float(r["grad_norm"])) for r in [*warm.rows, *control.rows]]
    position = int(warm.origin[1]["loader"]["batches_served"])
    gaps: dict[str, float] = {}
    for n in lengths:
        sized = c.replace(**{"spike.data_batches": n})
        injection = Injection.from_config("data", sized.spike, fork, position, TIED_TO["data"])
        poison = poison_batches(project, sized, n)
        branch = run_branch(
            study.maker(study.identity({"injection": injection.spec(), "policy": "continue"})),
            warm.origin,
            end,
            "continue",
            c.recovery,
            c.spike,
            injection,
            poison,
        )
        losses, control_losses = aligned_losses(branch, control)
        gaps[str(n)] = final_gap(losses, control_losses, c.recovery.smooth_steps)
    return {
        "seed": seed,
        "origin_val_loss": origin_run["val_loss"],
        "clean": clean,
        "alarms": sorted({*warm.alarms, *control.detections}),
        "data_gaps": gaps,
        "seconds": time.perf_counter() - started,
    }


def summary(cfg: Config, probes: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What each rule picks from the probes, and the numbers it read."""
    zscore, counts = calibrate_zscore([p["clean"] for p in probes], cfg)
    lengths = sorted({int(n) for p in probes for n in p["data_gaps"]})
    gaps = {n: [p["data_gaps"][str(n)] for p in probes] for n in lengths}
    return {
        "sizing_seeds": [p["seed"] for p in probes],
        "clean_steps": [len(p["clean"]) for p in probes],
        "alarms_at_registered_zscore": {str(p["seed"]): p["alarms"] for p in probes},
        "false_alarms_per_zscore": counts,
        "detect_zscore": zscore,
        "data_gaps": {str(n): g for n, g in gaps.items()},
        "data_batches": choose_data_batches(gaps, cfg.recovery.recover_epsilon),
        "origin_val_loss": {str(p["seed"]): p["origin_val_loss"] for p in probes},
        "seconds": {str(p["seed"]): p["seconds"] for p in probes},
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--project", type=Path, default=Path.cwd(), help="the project (its params.yaml and data)")
    add_config_arguments(parser, params=False)
    parser.add_argument("--out", type=Path, required=True, help="JSON file for the probes and what the rules pick")
    args = parser.parse_args(argv)
    cfg = load_config(args.project / "params.yaml", args.profile, parse_sets(args.sets))
    probes = []
    for seed in cfg.spike.sizing_seeds:
        clean_state()  # one thread, as a stage's worker runs a seed
        run_dir = args.out.parent / f"sizing_seed_{seed}"
        probes.append(probe_seed(cfg, args.project, seed, run_dir, cfg.spike.sizing_data_batches))
        print(json.dumps({k: v for k, v in probes[-1].items() if k != "clean"}), flush=True)
    result = {"summary": summary(cfg, probes), "probes": probes}
    write_json(args.out, result)
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
