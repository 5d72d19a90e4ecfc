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

from pathlib import Path

from prefect.futures import as_completed

from tasks.config import Config
from tasks.pretrain.train import read_manifest
from tasks.runtime.files import read_json
from tasks.runtime.outputs import MANIFEST
from tasks.runtime.progress import Progress, run_logger
from tasks.runtime.workers import executor
from tasks.search.findings import Findings, summarize, sweep_optima
from tasks.search.fit import transferred_log2_lr
from tasks.search.queue import pending_groups, prepare_study, search_lock, study_storage
from tasks.search.spec import StudySpec, proxy_widths, search_digest, sweep_specs, transfer_spec, trial_cost
from tasks.search.trial import train_queued_group

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
    storage = study_storage(cfg)
    for _ in range(ROUNDS):
        queued = {spec.name: prepare_study(storage, spec) for spec in specs}
        if not any(queued.values()):
            return
        groups = sum(pending_groups(storage, spec) for spec in specs)
        cost = sum(n * trial_cost(cfg, spec) for spec, n in zip(specs, queued.values()))
        train_round(cfg, project, specs, parent_run, sum(queued.values()), cost, groups)
    raise RuntimeError(f"search: points still unfinished after {ROUNDS} rounds; run the stage again")


def train_round(
    cfg: Config,
    project: Path,
    specs: list[StudySpec],
    parent_run: str | None,
    queued: int,
    cost: float,
    groups: int,
) -> None:
    """One task per group with queued trials, one progress line per trial trained (lines come as
    each group ends; the ETA weighed by the trials' training FLOPs, ``cost`` in all: the widest
    run first); raises when a trial failed."""
    progress = Progress("search", "trial", queued, run_logger(), total_cost=cost)
    failed = []
    units = executor(cfg, cfg.search.workers, groups)
    with units.runner() as runner, units.placement():
        futures = [
            runner.submit(
                train_queued_group.with_options(task_run_name=f"{specs[0].kind} group {i + 1}/{groups}"),
                {"cfg": cfg, "project": project, "specs": specs, "parent_run": parent_run},
            )
            for i in range(groups)
        ]
        for future in as_completed(futures):
            try:
                trained = future.result()
            except Exception as e:
                name = f"({type(e).__name__}: {e})"
                failed.append(name)
                progress.finished(name, "failed", 0.0)
                continue
            for name, status, done in trained:
                progress.finished(name, status, done)
    progress.close()
    if failed:
        raise RuntimeError(f"search trials failed: {failed}; their trials are queued again at the next run")


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
        transfer = transfer_spec(cfg, digest, transferred_log2_lr(sweep_optima(cfg, sweeps), proxies))
        run_workers(cfg, project, [transfer], parent_run)
        return summarize(cfg, sweeps, transfer)
