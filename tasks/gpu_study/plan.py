"""The gpu study's plan and its slices, made here (where the orchestration is installed).

The plan (flows/gpu_study.py: study_plan) is every run the ablate stage would train under the
``gpu`` profile (flows/ablate.py: plan), each with its run identity and the command that trains it, ordered seed by seed: the first
discovery seed of every variant of every family, then the next seed, so that whatever has
accumulated compares variants on the same seeds. Its id is a digest of those runs: a results file
names the plan it trained, and a file from another plan is refused.

A slice is the next arms not yet in, as many as fit one GPU window, in whole fused groups (arms
of one shape and precision trained as one model K times wider: model/fused.py): each group's GPU
time estimated from the arms of its families already measured (wall seconds at the packing they
ran with, times ``MARGIN``), groups packed ``workers`` at once. Before any arm of a family is measured, a slice is a
calibration slice: the window measures as it goes and starts no arm its own measurements say
cannot finish (tasks/gpu_study/window.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from model.typed_config import UserError

PROFILE = "gpu"
"""The study the windows train: the gpu profile's ablation (profiles/gpu.yaml: ablation)."""
MARGIN = 1.3
"""An estimate's margin over the slowest measured arm of its family at the same packing."""
GROUP_SIZE = 5
"""Arms per fused group: vmap over 5 stacked arms brought the packing benchmark's most arm-steps
per second (77.1, 1.76x one arm alone; 8 brought 76.0, so the GPU is full at 5), and a smaller
group fits a window sooner (benchmarks/bench_gpu_packing.py, docs/gpu-study.md)."""
STUDY = Path("gpu_study")
PLAN = STUDY / "plan.json"
SLICES = STUDY / "slices"
RESULTS = STUDY / "results"


def arm_steps(arm: dict[str, Any]) -> int:
    """The steps an arm trains (its ``--set=train.steps=N``)."""
    return int(next(a.split("=", 2)[2] for a in arm["arguments"] if a.startswith("--set=train.steps=")))


def estimates(measures: list[dict[str, Any]], arms_at_once: int) -> dict[str, float]:
    """Per family, the wall seconds an arm takes when ``arms_at_once`` share the GPU: the slowest
    measured arm of the family (a cut arm's wall time scaled from the step it reached to its last),
    scaled linearly from the arms it shared the GPU with to ``arms_at_once``, times ``MARGIN``.
    Linear, since the GPU is full (docs/gpu-study.md); a fused arm costs less GPU than one in a
    process of its own, so an estimate from the latter errs long."""
    by_family: dict[str, float] = {}
    for m in measures:
        whole = m["wall_s"] * m["steps_total"] / max(1, m["steps_done"])
        scaled = whole * arms_at_once / max(1, m["sharing"])
        by_family[m["family"]] = max(by_family.get(m["family"], 0.0), scaled)
    return {family: seconds * MARGIN for family, seconds in by_family.items()}


def fused_groups(arms: list[dict[str, Any]], size: int) -> list[list[dict[str, Any]]]:
    """``arms`` in groups of at most ``size`` that train as one fused group: arms of one
    ``fuse`` key (tasks/ablate/fused.py: fusion_key), in plan order, each group placed where its
    first arm is; an arm without a key (or ``size`` 1) is a group of its own."""
    groups: list[list[dict[str, Any]]] = []
    open_groups: dict[str, list[dict[str, Any]]] = {}
    for arm in arms:
        key = arm.get("fuse")
        group = open_groups.get(key) if key else None
        if group is None or len(group) >= size:
            group = []
            groups.append(group)
            if key:
                open_groups[key] = group
        group.append(arm)
    return groups


def next_slice(
    plan: dict[str, Any],
    done: set[str],
    measures: list[dict[str, Any]],
    window_s: float,
    workers: int,
    number: int,
    families: Sequence[str] = (),
    group_size: int = 1,
) -> dict[str, Any]:
    """The next fused groups of arms (:func:`fused_groups`) in plan order (of ``families`` only,
    when given) that fit ``window_s``, ``workers`` groups at once: a window holds whole groups.
    A group's estimate is its slowest family's at the arms sharing the GPU (its size times
    ``workers``). Arms of a family not measured yet make it a calibration slice (the window
    decides which groups start). Raises :class:`UserError` when not even one group fits."""
    todo = [arm for arm in plan["arms"] if arm["key"] not in done and (not families or arm["family"] in families)]
    if not todo:
        raise UserError(f"gpu study: every arm of plan {plan['plan']} is in; nothing to slice")
    chosen, lanes = [], [0.0] * workers  # each lane: the GPU time its groups take one after another
    quickest = math.inf
    for number_in_slice, group in enumerate(fused_groups(todo, group_size)):
        seconds = estimates(measures, workers * len(group))
        known = [seconds.get(arm["family"]) for arm in group]
        estimate = None if None in known else max(s for s in known if s is not None)
        if estimate is not None:
            lane = min(range(workers), key=lanes.__getitem__)
            if lanes[lane] + estimate > window_s:
                quickest = min(quickest, estimate)
                continue
            lanes[lane] += estimate
        rounded = None if estimate is None else round(estimate, 1)
        chosen += [arm | {"group": number_in_slice, "estimate_s": rounded} for arm in group]
    if not chosen:
        raise UserError(
            f"gpu study: no arm fits a {window_s:.0f} s window (the quickest left needs {quickest:.0f} s at "
            f"{workers} at once); give the window more time or fewer workers"
        )
    calibration = any(arm["estimate_s"] is None for arm in chosen)
    return {
        "plan": plan["plan"],
        "slice": number,
        "calibration": calibration,
        "window_s": window_s,
        "workers": workers,
        "group_size": group_size,
        "estimate_s": None if calibration else round(max(lanes), 1),
        "arms": chosen,
    }


def supersede(project: Path, new_id: str) -> Path | None:
    """Move the current plan, its slices and results to ``superseded/<its id>/`` when ``new_id``
    differs (their arms are other runs than the new plan's); the folder they went to, or None."""
    old = str(read_plan(project)["plan"])
    if old == new_id:
        return None
    target = project / STUDY / "superseded" / old
    target.mkdir(parents=True, exist_ok=True)
    for path in (PLAN, SLICES, RESULTS):
        if (project / path).exists():
            (project / path).rename(target / path.name)
    return target


def read_plan(project: Path) -> dict[str, Any]:
    path = project / PLAN
    if not path.is_file():
        raise UserError(f"gpu study: {PLAN} is missing; make it with `python -m flows.gpu_study plan`")
    plan: dict[str, Any] = json.loads(path.read_text())
    return plan
