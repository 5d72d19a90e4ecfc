"""The μP learning-rate search: Optuna studies per parametrization × width on one storage, a fitted
optimum per width, and the transfer of the optimum to the target width checked against a direct
sweep there.

One room each: what is searched (spec.py), the work queue over Optuna's storage (queue.py), the
pruning rule within each (parametrization, width, seed) group (groups.py), a trial (trial.py),
the fits (fit.py) and what the stage reports (findings.py). This module runs
them in order: the sweeps' grids in rounds of workers, the optima fitted, the transfer study at
the transferred LR, then the findings.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import optuna
from optuna.trial import TrialState

from tasks.config import Config
from tasks.pretrain.train import read_manifest
from tasks.runtime.files import read_json
from tasks.runtime.outputs import MANIFEST
from tasks.runtime.progress import Progress, pace_record, run_logger
from tasks.runtime.workers import Executor, executor
from tasks.search.findings import Findings, points_of, summarize, sweep_optima
from tasks.search.fit import transferred_log2_lr
from tasks.search.groups import FINISHED, grid_point
from tasks.search.queue import (
    open_storage,
    optuna_storage,
    pending_groups,
    prepare_study,
    quiet_optuna,
    search_lock,
    study_storage,
)
from tasks.search.spec import (
    StudySpec,
    lr_grid,
    proxy_widths,
    refine_lrs,
    search_digest,
    sweep_specs,
    transfer_spec,
    trial_cost,
)
from tasks.search.trial import train_queued_group, trial_name

ROUNDS = 3
"""How many times :func:`run_workers` queues and trains what is unfinished in one stage run."""


def run_workers(cfg: Config, project: Path, specs: list[StudySpec], parent_run: str | None) -> None:
    """Train every point of ``specs`` that has no finished trial, in rounds: queue what is left
    (:func:`prepare_study`), then one Prefect task per group with queued (or running) trials on
    the executor's workers (``search.workers`` local ones, or a cluster's:
    tasks/runtime/workers.py), each training a group's trials in LR order
    (tasks/search/trial.py: train_queued_group). A worker that dies mid-trial (killed; or
    restarted by the Dask scheduler when its heartbeats stall) leaves its trial RUNNING while Dask
    gives its task to another worker; the group's later LRs wait for that point (the next round
    fails the trial and trains its point again; on an RDB storage its stale copy, in this round).
    Raises when a trial failed (it is queued again at the next start) or points are left after
    :data:`ROUNDS` rounds."""
    quiet_optuna()
    storage = study_storage(cfg)
    points = sum(len(spec.points) for spec in specs)
    for round_ in range(ROUNDS):
        queued = {spec.name: prepare_study(storage, spec) for spec in specs}
        if not any(queued.values()):
            if round_ == 0:
                run_logger().info(f"search: {describe(specs)}: all {points} trials kept from the last run")
            return
        groups = sum(pending_groups(storage, spec) for spec in specs)
        cost = sum(n * trial_cost(cfg, spec) for spec, n in zip(specs, queued.values()))
        todo = sum(queued.values())
        units = executor(cfg, cfg.search.workers, groups)
        what = f"{describe(specs)}; {cost / 1e12:.3g} TFLOP by model/flops.py"
        progress = Progress(
            "search",
            "trial",
            todo,
            run_logger(),
            total_cost=cost,
            workers=units.workers,
            kept=points - todo,
            what=what,
            record=pace_record("search", cfg),
        )
        train_round(cfg, project, specs, parent_run, units, groups, progress)
    raise RuntimeError(f"search: points still unfinished after {ROUNDS} rounds; run the stage again")


def describe(specs: list[StudySpec]) -> str:
    """What a set of studies trains: ``sweep: 2 parametrizations x 2 widths x 3 LRs x 1 seed``."""

    def count(n: int, what: str) -> str:
        return f"{n} {what}" + ("s" if n != 1 else "")

    parametrizations = {spec.parametrization for spec in specs}
    widths = {spec.width for spec in specs}
    lrs = {lr for spec in specs for lr, _ in spec.points}
    seeds = {seed for spec in specs for _, seed in spec.points}
    sizes = [count(len(parametrizations), "parametrization"), count(len(widths), "width")]
    return f"{specs[0].kind}: " + " x ".join([*sizes, count(len(lrs), "LR"), count(len(seeds), "seed")])


def train_round(
    cfg: Config,
    project: Path,
    specs: list[StudySpec],
    parent_run: str | None,
    units: Executor,
    groups: int,
    progress: Progress,
) -> None:
    """One task per group with queued trials; a progress line per trial as it ends, read from the
    study storage every :data:`POLL_S` (a worker returns only when its whole group has ended:
    minutes of silence with wide trials); a group that crashed, a line of its own (it may have
    crashed before any trial ended). Raises when a trial or a group failed."""
    storage = study_storage(cfg)
    seen = {key for key, _ in ended_trials(cfg, storage, specs)}
    failed = []
    with units.runner() as runner, units.placement():
        names = [f"{specs[0].kind} group {i + 1}/{groups}" for i in range(groups)]
        group_of = {
            runner.submit(
                train_queued_group.with_options(task_run_name=name),
                {"cfg": cfg, "project": project, "specs": specs, "parent_run": parent_run},
            ): name
            for name in names
        }
        running = list(group_of)
        while running:
            time.sleep(POLL_S)
            # Each group's task-run state, read from the server: Prefect's wait(timeout=...) around
            # Dask futures once left a future's result() waiting for ever (a whole-suite run)
            done = [future for future in running if future.state.is_final()]
            running = [future for future in running if future not in done]
            for key, (name, status, cost, seconds) in ended_trials(cfg, storage, specs):
                if key not in seen:
                    seen.add(key)
                    progress.finished(name, status, cost, seconds)
            for future in done:
                try:
                    future.result()
                except Exception as e:
                    progress.failed(group_of[future], e)
                    failed.append(f"({type(e).__name__}: {e})")
    progress.close()
    if failed:
        raise RuntimeError(f"search trials failed: {failed}; their trials are queued again at the next run")


POLL_S = 2.0
"""Seconds between the stage's looks at the storage for trials that ended."""


class Trained(NamedTuple):
    """A trial that ended: its name and status, its training FLOPs and the seconds it took where
    it ran (the progress line's ETA: tasks/runtime/progress.py)."""

    name: str
    status: str
    cost: float
    seconds: float


def ended_trials(
    cfg: Config, storage: optuna.storages.BaseStorage, specs: list[StudySpec]
) -> Iterator[tuple[tuple[str, int], Trained]]:
    """Every ended trial of ``specs`` (finished or failed), keyed by study and number: its name,
    status, training FLOPs and the seconds from its claim to its end (its own time, not the
    stage's start-up's)."""
    for spec in specs:
        cost = trial_cost(cfg, spec)
        study = optuna.load_study(study_name=spec.name, storage=storage)
        for t in study.get_trials(deepcopy=False, states=(*FINISHED, TrialState.FAIL)):
            status = {TrialState.PRUNED: "pruned", TrialState.FAIL: "failed"}.get(t.state)
            start, end = t.datetime_start, t.datetime_complete
            took = (end - start).total_seconds() if start and end else 0.0
            name = trial_name(spec, *grid_point(t))
            yield (spec.name, t.number), Trained(name, status or t.user_attrs.get("status", "completed"), cost, took)


def refine_specs(cfg: Config, sweeps: list[StudySpec]) -> list[StudySpec]:
    """The second stage (search.refine_points): each sweep of the transferred parametrization with,
    per seed, the LRs around its best completed grid LR added to its points (the grid's, finished,
    are kept, not trained again); none when the setting is 0."""
    n = cfg.search.refine_points
    storage = open_storage(optuna_storage(cfg))
    grid = lr_grid(cfg)
    out = []
    for spec in sweeps:
        if not n or spec.parametrization != cfg.mup.parametrization:
            continue
        best: dict[int, tuple[float, float]] = {}
        on_grid = {(lr, seed) for lr, seed in spec.points}  # not the second stage's: a rerun adds nothing
        for p in points_of(storage, spec)[0]:
            if (p.log2_lr, p.seed) not in on_grid or p.status != "completed":
                continue
            if p.completed_value < best.get(p.seed, (0.0, float("inf")))[1]:
                best[p.seed] = (p.log2_lr, p.completed_value)
        extra = tuple((lr, seed) for seed, (at, _) in sorted(best.items()) for lr in refine_lrs(grid, at, n))
        out.append(dataclasses.replace(spec, points=spec.points + extra))
    return out


def data_hashes(project: Path) -> dict[str, str]:
    manifest = read_json(project / MANIFEST)
    return {split: manifest["splits"][split]["sha256"] for split in ("train", "val")}


def search(cfg: Config, project: Path, parent_run: str | None = None) -> Findings:
    """Run (or resume) every study, fit the optima, transfer the LR and check it at the target."""
    proxies = proxy_widths(cfg)  # raises before any trial when no width is below the target
    read_manifest(project, cfg)  # the shards' vocabulary is the config's
    with search_lock():
        digest = search_digest(cfg, data_hashes(project))
        sweeps = sweep_specs(cfg, digest)
        run_workers(cfg, project, sweeps, parent_run)
        if refined := refine_specs(cfg, sweeps):
            run_workers(cfg, project, refined, parent_run)
        transfer = transfer_spec(cfg, digest, transferred_log2_lr(sweep_optima(cfg, sweeps), proxies))
        run_workers(cfg, project, [transfer], parent_run)
        return summarize(cfg, sweeps, transfer)
