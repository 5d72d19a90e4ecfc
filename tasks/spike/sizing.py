"""The spike study's sizing probe, run on ``spike.sizing_seeds`` (never a discovery or confirmation
seed) and blind to the recovery policies: it reads clean stretches and, for the poison's onset,
the data injection's continue branch (no policy acts on it).

Two registered rules (tasks/design/preregistration.yaml, the spike finding's ``conditions``):

  detector   ``spike.detect_zscore`` is the smallest of ``spike.sizing_zscores`` at which the
             detector (with its ``spike.detect_lag``, fixed before this rule runs), replayed over
             each sizing seed's clean stretch (the warm-up and the clean control: every step it
             watches without an injection), raises at most
             ``spike.max_false_alarms`` alarms per clean control (the mean over the sizing seeds).
             Every alarm on a clean run is a false one; a skip_batch or rollback branch that meets
             one after its last allowed restart gives up, so false alarms, not the spike, would
             decide its outcome.

  onset      ``spike.poison_ramp_batches`` is the longest of ``spike.sizing_ramps`` at which the
             detector, at the z-score the detector rule chose, flags the data injection (the
             shortest stretch, coming on over that ramp: model/spike/injections.py:
             poisoned_tokens) within ``spike.detect_within`` steps of its end at every sizing
             seed. The most gradual onset the calibrated detector still catches on the
             calibration origins: the study's origins then decide when (or whether) it does, so
             the latency is an outcome; an onset it never sees would test the detector alone.

The data injection's length is no longer sized here: version 2 took the shortest whose
``continue`` gap cleared the SESOI, so the finding knew its answer; each origin now draws it from
the registered ``spike.poison_batches_range`` (tasks/spike/study.py: poison_length).

One seed's probe (:func:`probe_seed`) trains the seed's origin run, the warm-up, the clean
control and one continue branch per candidate ramp as the stage does (tasks/spike/study.py); the
detector replay needs no training (a run no policy acts on is the same whatever the detector says). ``python -m tasks.spike.sizing --out FILE``
(``--profile``, ``--set KEY=VALUE``) runs the probes and prints what the rule picks; the value goes
into params.yaml by hand, with what was seen, in the design's change history."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from model.detect import SpikeDetector
from model.private import run_private
from model.spike.branch import run_branch, warm_up
from model.typed_config import add_config_arguments, parse_sets
from tasks.config import Config, load_config
from tasks.runtime.files import write_json
from tasks.runtime.workers import clean_state
from tasks.spike.study import StudyRun, make_injection, poison_batches, window


def replay_alarms(
    values: Sequence[tuple[int, float, float]], window: int, warmup: int, zscore: float, ratio: float, lag: int = 0
) -> list[int]:
    """The steps a fresh detector with these settings flags over ``values`` ((step, loss, grad
    norm) in step order), as it would have in the run: the detector itself, fed the values."""
    detector = SpikeDetector(window=window, warmup=warmup, zscore=zscore, ratio=ratio, lag=lag)
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
        f"{z:g}": [
            len(replay_alarms(v, s.detect_window, s.detect_warmup, z, s.detect_ratio, s.detect_lag)) for v in clean
        ]
        for z in s.sizing_zscores
    }
    chosen = next((z for z in s.sizing_zscores if np.mean(counts[f"{z:g}"]) <= s.max_false_alarms), None)
    return chosen, counts


def first_flag_latency(
    values: Sequence[tuple[int, float, float]], start: int, last: int, zscore: float, cfg: Config
) -> int | None:
    """Steps from ``start`` (the injection's first step) to the detector's first flag at or after
    it, replayed over ``values`` at ``zscore``; None if it flags none by step ``last``."""
    s = cfg.spike
    alarms = replay_alarms(values, s.detect_window, s.detect_warmup, zscore, s.detect_ratio, s.detect_lag)
    return next((step - start for step in alarms if start <= step <= last), None)


def calibrate_ramp(
    probes: Sequence[dict[str, Any]], zscore: float, cfg: Config
) -> tuple[int | None, dict[str, list[int | None]]]:
    """The onset rule: the longest candidate ramp whose data injection the detector flags at
    ``zscore`` at every probe (one per sizing seed), from the injection's first step to
    ``spike.detect_within`` steps after the stretch's last; None if no candidate is. Also each
    candidate's latency per probe (None: never flagged)."""
    stretch = cfg.spike.poison_batches_range[0]
    latencies: dict[str, list[int | None]] = {}
    for ramp in cfg.spike.sizing_ramps:
        latencies[str(ramp)] = []
        for p in probes:
            start = p["injection_step"]
            values = [*p["warm"], *p["ramped"][str(ramp)]]
            last = start + stretch - 1 + cfg.spike.detect_within
            latencies[str(ramp)].append(first_flag_latency(values, start, last, zscore, cfg))
    caught = [r for r in cfg.spike.sizing_ramps if None not in latencies[str(r)]]
    return (caught[-1] if caught else None), latencies


def steps_of(rows: Sequence[dict[str, Any]]) -> list[tuple[int, float, float]]:
    return [(int(r["step"]), float(r["loss"]), float(r["grad_norm"])) for r in rows]


def probe_seed(cfg: Config, project: Path, seed: int, run_dir: Path) -> dict[str, Any]:
    """One sizing seed: its clean stretch ((step, loss, grad norm) of the warm-up and the clean
    control), the alarms the configured detector raised on it, and per candidate ramp the data
    injection's continue branch over the shortest stretch and ``spike.detect_within`` steps more."""
    started = time.perf_counter()
    study = StudyRun(cfg, project, seed, run_dir)
    checkpoint, origin_run = study.origin_run()
    c = study.cfg
    fork, end = window(c)
    warm = warm_up(study.maker(study.identity({"branch": "warm"})), checkpoint, fork, c.spike, run_dir / "warm")
    control = run_branch(
        study.maker(study.identity({"branch": "control"})), warm.origin, end, "continue", c.recovery, c.spike
    )
    stretch = c.spike.poison_batches_range[0]
    injection = make_injection("data", c, fork, int(warm.origin[1]["loader"]["batches_served"]))
    injection = dataclasses.replace(injection, duration=stretch)
    poison = poison_batches(project, c, stretch)
    ramped = {}
    for ramp in c.spike.sizing_ramps:
        onset = dataclasses.replace(injection, ramp=ramp)
        branch = run_branch(
            study.maker(study.identity({"branch": "onset", "injection": onset.spec()})),
            warm.origin,
            min(end, fork + stretch + c.spike.detect_within),
            "continue",
            c.recovery,
            c.spike,
            onset,
            poison,
        )
        ramped[str(ramp)] = steps_of(branch.rows)
    return {
        "seed": seed,
        "origin_val_loss": origin_run["val_loss"],
        "clean": steps_of([*warm.rows, *control.rows]),
        "alarms": sorted({*warm.alarms, *control.detections}),
        "warm": steps_of(warm.rows),
        "injection_step": injection.start,
        "ramped": ramped,
        "seconds": time.perf_counter() - started,
    }


def summary(cfg: Config, probes: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What the rule picks from the probes, and the numbers it read."""
    zscore, counts = calibrate_zscore([p["clean"] for p in probes], cfg)
    ramp, latencies = calibrate_ramp(probes, zscore, cfg) if zscore is not None else (None, {})
    return {
        "poison_ramp_batches": ramp,
        "latency_per_ramp": latencies,
        "sizing_seeds": [p["seed"] for p in probes],
        "clean_steps": [len(p["clean"]) for p in probes],
        "alarms_at_registered_zscore": {str(p["seed"]): p["alarms"] for p in probes},
        "false_alarms_per_zscore": counts,
        "detect_zscore": zscore,
        "origin_val_loss": {str(p["seed"]): p["origin_val_loss"] for p in probes},
        "seconds": {str(p["seed"]): p["seconds"] for p in probes},
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--project", type=Path, default=Path.cwd(), help="the project (its params.yaml and data)")
    add_config_arguments(parser, params=False)
    parser.add_argument("--out", type=Path, required=True, help="JSON file for the probes and what the rule picks")
    args = parser.parse_args(argv)
    cfg = load_config(args.project / "params.yaml", args.profile, parse_sets(args.sets))
    probes = []
    for seed in cfg.spike.sizing_seeds:
        clean_state()  # one thread, as a stage's worker runs a seed
        run_dir = args.out.parent / f"sizing_seed_{seed}"
        probes.append(probe_seed(cfg, args.project, seed, run_dir))
        print(json.dumps({k: v for k, v in probes[-1].items() if k not in ("clean", "warm", "ramped")}), flush=True)
    result = {"summary": summary(cfg, probes), "probes": probes}
    write_json(args.out, result)
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    sys.exit(run_private(main))
