"""The μP learning-rate search: Optuna studies per parametrization × width on one storage, a fitted
optimum per width, and the transfer of the optimum to the target width checked against a direct
sweep there.

Studies. One per (parametrization, width) over the widths of ``search.widths`` plus the target
width (``model.d_model``, pretrain's), named ``<experiment>/search/<p>/w<width>/<digest>``; the
digest covers everything else that decides a trial's numbers (the training config, the grid, the
data), so a changed config starts fresh studies and an unchanged one finds its finished trials.
After them, a ``transfer`` study trains the target width at the transferred LR once per seed.

Points. Every (log2 LR, seed) of the grid is put in the study's trial queue (``enqueue_trial``)
by this process before any worker starts; workers only pop queued trials, which the storage hands
to exactly one of them (Optuna's WAITING -> RUNNING transition is atomic), and never ask the
sampler for new points. So the evaluated set is the grid whatever the worker count. (Optuna's
GridSampler alone re-evaluates a point when workers race at the end of the grid, and counts an
interrupted trial's point as visited.)

Dead workers. On an RDB storage (``search.storage: postgresql://...``, workers on any host) a
worker records a heartbeat for the trial it trains every ``search.heartbeat_s``; a trial without
one for twice that is stale. Before claiming, every worker (and the stage, before queueing) calls
``optuna.storages.fail_stale_trials``: the storage lets exactly one process move a stale trial to
FAIL, and that process's ``RetryHeartbeatStaleTrialCallback`` adds a WAITING copy with the same
params and system attributes, i.e. the same grid point, which a live worker then trains. A worker
with nothing queued waits while trials run elsewhere, so a dead worker's point is trained in the
same run. The journal storage (the default: one file, one node) has no heartbeats: there the stage
holds a lock on the state directory the journal lives in, so any RUNNING trial it finds belongs to
a killed search: it is marked FAIL (kept, tagged ``interrupted``) and its point queued again.
Points with a finished trial are never queued again, so a finished study is not rerun.

Scores. A trial is a short run of :class:`model.train.Trainer` without checkpoints, scored by its
final validation loss; intermediate validation losses go to Optuna's ThresholdPruner. A diverged
run is a result: its value is ln(vocab_size), the loss of a uniform guess (the loss at init,
as in Wortsman et al.'s LR sensitivity), with ``status: diverged`` among its user attributes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import threading
import time
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import yaml
from optuna.trial import TrialState
from prefect import task
from prefect.futures import as_completed

from model.callbacks import Callback
from model.checkpoint import RunLock
from model.config import CheckpointConfig
from model.data import open_split
from model.stops import Diverged
from model.train import Trainer
from model.typed_config import ConfigError
from tasks.config import Config
from tasks.pretrain.train import read_manifest
from tasks.runtime.files import read_json, staged, write_json
from tasks.runtime.outputs import MANIFEST, SEARCH_LR, SEARCH_METRICS, SEARCH_REPORTS
from tasks.runtime.paths import state
from tasks.runtime.progress import Progress, run_logger
from tasks.runtime.workers import clean_state, executor
from tasks.search.fit import Point, counts, slope, transfer_check, transferred_log2_lr, width_summary

# --------------------------------------------------------------------------------------------
# What is searched
# --------------------------------------------------------------------------------------------


def lr_grid(cfg: Config) -> list[float]:
    """The log2 LRs of the grid, evenly spaced from ``log2_lr_min`` to ``log2_lr_max``."""
    s = cfg.search
    return [round(float(x), 6) for x in np.linspace(s.log2_lr_min, s.log2_lr_max, s.lr_points)]


def target_width(cfg: Config) -> int:
    return cfg.model.d_model


def swept_widths(cfg: Config) -> list[int]:
    """Every width with a study: the configured ones and the target (the direct sweep)."""
    return sorted({*cfg.search.widths, target_width(cfg)})


def proxy_widths(cfg: Config) -> list[int]:
    """The widths the LR is transferred from: those below the target (at least one)."""
    proxies = [w for w in swept_widths(cfg) if w < target_width(cfg)]
    if not proxies:
        raise ConfigError(
            f"search.widths: {cfg.search.widths} has no proxy width below the target "
            f"model.d_model={target_width(cfg)}, to transfer the LR from"
        )
    return proxies


def trial_config(cfg: Config, parametrization: str, width: int, log2_lr: float, seed: int) -> Config:
    """Pretrain's training config at another width, parametrization, LR and seed, for the
    search's steps and batch, with one torch thread and no checkpoints. Built section by section:
    the spike and checkpoint keys refer to pretrain's steps, not a trial's."""
    s = cfg.search
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, d_model=width),
        mup=dataclasses.replace(cfg.mup, parametrization=parametrization),
        optim=dataclasses.replace(cfg.optim, lr=2.0**log2_lr),
        schedule=dataclasses.replace(cfg.schedule, warmup_steps=min(cfg.schedule.warmup_steps, s.steps // 5)),
        train=dataclasses.replace(
            cfg.train,
            steps=s.steps,
            batch_size=s.batch_size,
            grad_accum=1,
            seed=seed,
            eval_every=s.eval_every,
            cpu_threads=1,
            num_workers=0,
        ),
        checkpoint=CheckpointConfig(every_steps=0, milestones=[]),
    )


def uniform_loss(cfg: Config) -> float:
    """ln(vocab_size): the loss of a uniform guess, and of a μP model at init."""
    return math.log(cfg.tokenizer.vocab_size)


def prune_bound(cfg: Config) -> float:
    """``search.prune_above``, by default a nat above the loss of a uniform guess."""
    return cfg.search.prune_above or uniform_loss(cfg) + 1.0


def search_digest(cfg: Config, data: dict[str, str]) -> str:
    """What decides a trial's numbers besides its width, parametrization, LR and seed."""
    base = trial_config(cfg, "sp", 0, 0.0, 0).to_flat_dict()
    varied = {"model.d_model", "mup.parametrization", "optim.lr", "train.seed"}
    spec = {
        "config": {
            k: v
            for k, v in base.items()
            if k.split(".")[0] in ("tokenizer", "model", "mup", "optim", "schedule", "precision", "train")
            and k not in varied
        },
        "search": {"grid": lr_grid(cfg), "seeds": cfg.search.seeds, "prune_above": prune_bound(cfg)},
        "data": data,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:8]


@dataclasses.dataclass(frozen=True)
class StudySpec:
    """One study: what it trains and which points it holds."""

    name: str
    kind: str  # "sweep" or "transfer"
    parametrization: str
    width: int
    points: tuple[tuple[float, int], ...]  # (log2 LR, seed)

    @property
    def log2_lr_range(self) -> tuple[float, float]:
        lrs = [lr for lr, _ in self.points]
        return min(lrs), max(lrs)


def sweep_specs(cfg: Config, digest: str) -> list[StudySpec]:
    """The grid studies, widest first (so the longest trials start first)."""
    points = tuple((lr, seed) for lr in lr_grid(cfg) for seed in cfg.search.seeds)
    return [
        StudySpec(f"{cfg.tracking.experiment}/search/{p}/w{w}/{digest}", "sweep", p, w, points)
        for w in reversed(swept_widths(cfg))
        for p in cfg.search.parametrizations
    ]


def transfer_spec(cfg: Config, digest: str, log2_lr: float) -> StudySpec:
    points = tuple((round(log2_lr, 6), seed) for seed in cfg.search.seeds)
    p = cfg.mup.parametrization
    return StudySpec(
        f"{cfg.tracking.experiment}/transfer/{p}/w{target_width(cfg)}/{digest}",
        "transfer",
        p,
        target_width(cfg),
        points,
    )


# --------------------------------------------------------------------------------------------
# Storage, queue, recovery
# --------------------------------------------------------------------------------------------


def optuna_storage(cfg: Config) -> str:
    """The search's Optuna storage: ``search.storage`` (any Optuna URL), else the journal file
    under the state directory as ``journal:<path>``."""
    return cfg.search.storage or f"journal:{state().optuna_journal}"


def open_storage(url: str, heartbeat_s: int | None = None) -> optuna.storages.BaseStorage:
    """The storage at ``url``. An RDB URL with ``heartbeat_s`` gets heartbeats, and a stale trial's
    point is queued again by whichever process fails it (module docstring: dead workers). The
    password of a ``postgresql://`` URL comes from PGPASSWORD or ~/.pgpass (libpq reads them)."""
    if url.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        return JournalStorage(JournalFileBackend(url.removeprefix("journal:")))
    if heartbeat_s is None:
        return optuna.storages.RDBStorage(url)
    with quiet_experimental():
        requeue = optuna.storages.RetryHeartbeatStaleTrialCallback()
        return optuna.storages.RDBStorage(url, heartbeat_interval=heartbeat_s, heartbeat_stale_trial_callback=requeue)


def study_storage(cfg: Config) -> optuna.storages.BaseStorage:
    """The storage the search's workers and its stage queue and claim trials on."""
    return open_storage(optuna_storage(cfg), cfg.search.heartbeat_s)


def has_heartbeats(storage: optuna.storages.BaseStorage) -> bool:
    return isinstance(storage, optuna.storages.RDBStorage) and storage.get_heartbeat_interval() is not None


@contextmanager
def quiet_experimental() -> Iterator[None]:
    """Optuna's heartbeat API is marked experimental; one warning per call would flood the workers' logs."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        yield


def pruner(cfg: Config) -> optuna.pruners.BasePruner:
    """A bound on the reported loss: unlike the median rule, its verdict depends on the trial
    alone, not on which other trials happened to finish first, so the worker count cannot
    change what is pruned."""
    return optuna.pruners.ThresholdPruner(upper=prune_bound(cfg))


def load_study(storage: optuna.storages.BaseStorage, spec: StudySpec, cfg: Config) -> optuna.Study:
    return optuna.load_study(study_name=spec.name, storage=storage, pruner=pruner(cfg))


def trial_ids(storage: optuna.storages.BaseStorage, study: optuna.Study, states: tuple[TrialState, ...]) -> list[int]:
    """The storage's ids of the study's trials in ``states``, by Optuna's public storage API."""
    study_id = storage.get_study_id_from_name(study.study_name)
    return [
        storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
        for t in study.get_trials(deepcopy=False, states=states)
    ]


def prepare_study(storage: optuna.storages.BaseStorage, spec: StudySpec) -> int:
    """Create the study if new, recover the trials of dead workers, and queue every point without
    a finished, queued or running trial. Returns how many trials are queued or running: the
    work still to do (a running one may turn out stale and be queued again)."""
    study = optuna.create_study(study_name=spec.name, storage=storage, direction="minimize", load_if_exists=True)
    for key, value in {
        "kind": spec.kind,
        "parametrization": spec.parametrization,
        "width": spec.width,
        "log2_lr_range": list(spec.log2_lr_range),
    }.items():
        study.set_user_attr(key, value)
    if has_heartbeats(storage):
        fail_stale(study)
    else:  # the journal: the stage's lock says no other search runs on it (module docstring)
        for trial_id in trial_ids(storage, study, (TrialState.RUNNING,)):
            storage.set_trial_user_attr(trial_id, "status", "interrupted")
            storage.set_trial_state_values(trial_id, TrialState.FAIL)
    pending = (TrialState.WAITING, TrialState.RUNNING)
    kept = {
        _point(t) for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, *pending))
    }
    for lr, seed in spec.points:
        if (lr, seed) not in kept:
            study.enqueue_trial({"log2_lr": lr, "seed": seed})
    return len(study.get_trials(deepcopy=False, states=pending))


def fail_stale(study: optuna.Study) -> None:
    """Fail the study's trials whose heartbeat is stale; the storage's callback queues their points again."""
    with quiet_experimental():
        optuna.storages.fail_stale_trials(study)


def _point(trial: optuna.trial.FrozenTrial) -> tuple[float, int]:
    # A trial killed between its two suggestions holds only log2_lr; its queued point holds both.
    params = {**trial.system_attrs.get("fixed_params", {}), **trial.params}
    return params["log2_lr"], params["seed"]


def claim(storage: optuna.storages.BaseStorage, study: optuna.Study) -> tuple[int, optuna.Trial] | None:
    """The next queued trial (its storage id and the trial), now RUNNING and ours alone, or None
    when the queue is empty. The
    storage lets exactly one process move a trial out of WAITING (on an RDB storage a conditional
    UPDATE; what ``Study.ask`` does first; unlike ``ask`` this never creates a trial outside the
    queue). Its first heartbeat is recorded at once: a trial without any never goes stale."""
    for trial_id in trial_ids(storage, study, (TrialState.WAITING,)):
        try:
            if storage.set_trial_state_values(trial_id, TrialState.RUNNING):
                if has_heartbeats(storage):
                    storage.record_heartbeat(trial_id)
                return trial_id, optuna.Trial(study, trial_id)
        except optuna.exceptions.UpdateFinishedTrialError:
            continue
    return None


def next_trial(
    storage: optuna.storages.BaseStorage, studies: list[tuple[StudySpec, optuna.Study]]
) -> tuple[StudySpec, optuna.Study, tuple[int, optuna.Trial]] | None:
    """Claim the first queued trial of ``studies`` (in order). With heartbeats, when none is queued
    but some run elsewhere, wait: one whose worker dies goes stale, is queued again, and is
    claimed here. None when nothing is queued (or, with heartbeats, running)."""
    while True:
        for spec, study in studies:
            if has_heartbeats(storage):
                fail_stale(study)
            if (claimed := claim(storage, study)) is not None:
                return spec, study, claimed
        running = any(study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)) for _, study in studies)
        if not (has_heartbeats(storage) and running):
            return None
        time.sleep(storage.get_heartbeat_interval())


@contextmanager
def heartbeats(storage: optuna.storages.BaseStorage, trial_id: int) -> Iterator[None]:
    """Record the heartbeat of the trial ``trial_id`` every interval while the block runs. Optuna's own heartbeat
    thread runs only inside ``study.optimize``; our workers claim queued trials themselves."""
    if not has_heartbeats(storage):
        yield
        return
    stop, interval = threading.Event(), storage.get_heartbeat_interval()

    def beat() -> None:
        while not stop.wait(interval):
            storage.record_heartbeat(trial_id)

    thread = threading.Thread(target=beat, name=f"heartbeat of trial {trial_id}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


# --------------------------------------------------------------------------------------------
# The objective
# --------------------------------------------------------------------------------------------


class ReportToOptuna(Callback):
    """Reports every validation loss to the trial; stops the run when the pruner says so."""

    name = "optuna"

    def __init__(self, trial: optuna.Trial):
        self.trial, self.trainer = trial, None

    def on_step_start(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def on_eval(self, step: int, val_loss: float) -> None:
        self.trial.report(val_loss, step)
        if self.trial.should_prune():
            self.trainer.request_stop(f"pruned by Optuna at step {step}: val loss {val_loss:.4g} above the bound")


@dataclasses.dataclass(frozen=True)
class Tokens:
    train: np.ndarray
    val: np.ndarray

    @classmethod
    def of(cls, project: Path) -> Tokens:
        return cls(*(open_split(project / MANIFEST, split) for split in ("train", "val")))


def suggest_point(trial: optuna.Trial, cfg: Config) -> tuple[float, int]:
    """The trial's (log2 LR, seed): its queued values (the same on every call)."""
    low, high = trial.study.user_attrs["log2_lr_range"]
    return trial.suggest_float("log2_lr", low, high), trial.suggest_categorical("seed", cfg.search.seeds)


def objective(
    trial: optuna.Trial, cfg: Config, parametrization: str, width: int, tokens: Tokens, callbacks: Iterable[Any] = ()
) -> float:
    """Train the trial's point; returns its final validation loss (ln(vocab) when it diverged) and
    raises ``optuna.TrialPruned`` when the pruner stopped it. Records what ran as user attributes."""
    log2_lr, seed = suggest_point(trial, cfg)
    run_cfg = trial_config(cfg, parametrization, width, log2_lr, seed)
    started = time.process_time()
    trainer = Trainer(run_cfg, tokens.train, tokens.val, [ReportToOptuna(trial), *callbacks])
    summary = trainer.run()
    flops = trainer.flops_per_token * trainer.tokens_per_step * summary["steps"]
    for key, value in {
        "status": summary["status"],
        "steps": summary["steps"],
        "val_loss": summary["val_loss"],
        "flops": flops,
        "cpu_s": time.process_time() - started,
        "lr": 2.0**log2_lr,
        "precision": summary["precision"],
    }.items():
        trial.set_user_attr(key, value)
    if summary["status"] == "stopped":
        trial.set_user_attr("status", "pruned")
        raise optuna.TrialPruned(summary["stop_reason"])
    if summary["status"] == "diverged":
        return uniform_loss(cfg)
    return summary["val_loss"]


# --------------------------------------------------------------------------------------------
# Workers
# --------------------------------------------------------------------------------------------


@functools.cache
def worker_storage(url: str, heartbeat_s: int) -> optuna.storages.BaseStorage:
    """The storage a worker process keeps open across its trials."""
    return open_storage(url, heartbeat_s)


@functools.cache
def worker_tokens(project: Path) -> Tokens:
    """The token shards a worker process keeps mapped across its trials."""
    return Tokens.of(project)


@task
def train_queued_trial(cfg: Config, project: Path, specs: list[StudySpec], parent_run: str | None) -> tuple[str, str]:
    """In a worker: claim the first queued trial of ``specs`` (in order; :func:`next_trial`) and
    train it, recording its heartbeats. Returns the trial's name and status; ("", "none") when
    other workers took the last ones."""
    clean_state()
    storage = worker_storage(optuna_storage(cfg), cfg.search.heartbeat_s)
    claimed = next_trial(storage, [(spec, load_study(storage, spec, cfg)) for spec in specs])
    if claimed is None:
        return "", "none"
    spec, study, (trial_id, trial) = claimed
    with heartbeats(storage, trial_id):
        status = run_trial(study, trial, spec, cfg, worker_tokens(project), parent_run)
    return trial_name(spec, *suggest_point(trial, cfg)), status


def run_trial(
    study: optuna.Study, trial: optuna.Trial, spec: StudySpec, cfg: Config, tokens: Tokens, parent_run: str | None
) -> str:
    """The objective in an MLflow run nested under the stage's, its outcome told to the study.
    An exception other than pruning fails the trial (queued again at the next start) and the
    task. Returns the trial's status: completed, diverged or pruned; "stale" when another worker
    took this one's heartbeats for dead and queued its point again (its result is dropped: the
    storage refuses a finished trial's updates)."""
    try:
        with trial_run(spec, trial, *suggest_point(trial, cfg), parent_run) as callbacks:
            try:
                value = objective(trial, cfg, spec.parametrization, spec.width, tokens, callbacks)
            except optuna.TrialPruned:
                study.tell(trial, state=TrialState.PRUNED)
                return "pruned"
            except optuna.exceptions.UpdateFinishedTrialError:
                raise
            except BaseException:
                study.tell(trial, state=TrialState.FAIL)
                raise
            study.tell(trial, value)
            return trial.user_attrs["status"]
    except optuna.exceptions.UpdateFinishedTrialError:
        return "stale"


def trial_name(spec: StudySpec, log2_lr: float, seed: int) -> str:
    return f"{spec.kind} {spec.parametrization} w{spec.width} lr 2^{log2_lr:g} seed {seed}"


@contextmanager
def trial_run(
    spec: StudySpec, trial: optuna.Trial, log2_lr: float, seed: int, parent: str | None
) -> Iterator[list[Any]]:
    """The trial's MLflow run, a child of the stage's run ``parent`` (None: no tracking), tagged
    with its study and trial; yields the trainer callbacks that log to it. It ends as its stop
    kind says: a diverged trial FAILED (model/stops.py), a completed or pruned one FINISHED."""
    if not parent:
        yield []
        return
    import mlflow

    from tasks.runtime.tracking import MLflowMetrics, child_run

    tags = {
        "optuna.study": spec.name,
        "optuna.trial": str(trial.number),
        "search.width": str(spec.width),
        "search.parametrization": spec.parametrization,
        "search.kind": spec.kind,
    }
    try:
        with child_run(trial_name(spec, log2_lr, seed), tags, parent_id=parent):
            yield [MLflowMetrics()]
            status = trial.user_attrs.get("status")
            mlflow.set_tag("search.status", status)
            if status == "diverged":
                raise Diverged(trial.user_attrs["steps"], "a search trial")
    except Diverged:
        pass  # a result, recorded as such


ROUNDS = 3
"""How many times :func:`run_workers` queues and trains what is unfinished in one stage run."""


def run_workers(cfg: Config, project: Path, specs: list[StudySpec], parent_run: str | None) -> None:
    """Train every point of ``specs`` that has no finished trial, in rounds: queue what is left
    (:func:`prepare_study`), then one Prefect task per queued (or running) trial on the executor's
    workers (``search.workers`` local ones, or a cluster's: tasks/runtime/workers.py). A worker that
    dies mid-trial (killed; or restarted by the Dask scheduler when its heartbeats stall) leaves
    its trial RUNNING while Dask gives its task to another worker, which claims another point; the
    next round fails that trial and trains its point again. Raises when a trial failed (it is
    queued again at the next start) or points are left after :data:`ROUNDS` rounds."""
    storage = study_storage(cfg)
    for _ in range(ROUNDS):
        queued = sum(prepare_study(storage, spec) for spec in specs)
        if queued == 0:
            return
        train_round(cfg, project, specs, parent_run, queued)
    raise RuntimeError(f"search: points still unfinished after {ROUNDS} rounds; run the stage again")


def train_round(cfg: Config, project: Path, specs: list[StudySpec], parent_run: str | None, queued: int) -> None:
    """One task per queued trial, one progress line per task; raises when a trial failed."""
    progress = Progress("search", "trial", queued, run_logger())
    failed = []
    units = executor(cfg, cfg.search.workers, queued)
    with units.runner() as runner, units.placement():
        futures = [
            runner.submit(
                train_queued_trial.with_options(task_run_name=f"{specs[0].kind} trial {i + 1}/{queued}"),
                {"cfg": cfg, "project": project, "specs": specs, "parent_run": parent_run},
            )
            for i in range(queued)
        ]
        for future in as_completed(futures):
            try:
                name, status = future.result()
            except Exception as e:
                name, status = f"({type(e).__name__}: {e})", "failed"
                failed.append(name)
            progress.finished(name, status)
    progress.close()
    if failed:
        raise RuntimeError(f"search trials failed: {failed}; their trials are queued again at the next run")


# --------------------------------------------------------------------------------------------
# The search
# --------------------------------------------------------------------------------------------


def search_lock() -> RunLock:
    """One search at a time per state directory: what lets a restart on the journal storage fail
    its RUNNING trials (on an RDB storage their heartbeats say which workers died)."""
    return RunLock(state().root / "search")


def data_hashes(project: Path) -> dict[str, str]:
    manifest = read_json(project / MANIFEST)
    return {split: manifest["splits"][split]["sha256"] for split in ("train", "val")}


def points_of(storage: optuna.storages.BaseStorage, spec: StudySpec) -> tuple[list[Point], int]:
    """The study's finished trials as points, and how many trials were interrupted and retried."""
    trials = optuna.load_study(study_name=spec.name, storage=storage).get_trials(deepcopy=False)
    points = [
        Point(
            t.params["log2_lr"],
            t.params["seed"],
            t.value,
            t.user_attrs.get("status", "completed"),
            t.user_attrs.get("flops", 0.0),
        )
        for t in trials
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
    ]
    return points, sum(t.state == TrialState.FAIL for t in trials)


@dataclasses.dataclass
class Findings:
    """Everything the stage reports: per study its points, and the summary (metrics/search.json)."""

    points: dict[StudySpec, list[Point]]
    metrics: dict[str, Any]

    def of(self, kind: str, parametrization: str | None = None, width: int | None = None) -> dict[int, list[Point]]:
        """Points by width of the studies of one kind (and parametrization)."""
        return {
            spec.width: pts
            for spec, pts in self.points.items()
            if spec.kind == kind and parametrization in (None, spec.parametrization) and width in (None, spec.width)
        }


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


def sweep_optima(cfg: Config, sweeps: list[StudySpec]) -> dict[int, dict]:
    """The fitted optimum per width of the transferred parametrization's finished sweeps."""
    storage = open_storage(optuna_storage(cfg))
    return {
        spec.width: width_summary(points_of(storage, spec)[0])
        for spec in sweeps
        if spec.parametrization == cfg.mup.parametrization
    }


def summarize(cfg: Config, sweeps: list[StudySpec], transfer: StudySpec) -> Findings:
    """The findings of finished studies: optima per width, slopes, the transfer check, counts."""
    storage = open_storage(optuna_storage(cfg))
    collected = {spec: points_of(storage, spec) for spec in [*sweeps, transfer]}
    points = {spec: pts for spec, (pts, _) in collected.items()}
    by_width = {
        p: {s.width: width_summary(pts) for s, pts in points.items() if s.kind == "sweep" and s.parametrization == p}
        for p in cfg.search.parametrizations
    }
    sweep_of = {(s.parametrization, s.width): pts for s, pts in points.items() if s.kind == "sweep"}
    proxies, log2_lr = proxy_widths(cfg), transfer.points[0][0]
    proxy_flops = sum(p.flops for w in proxies for p in sweep_of[(transfer.parametrization, w)])
    check = transfer_check(sweep_of[(transfer.parametrization, transfer.width)], points[transfer], proxy_flops, log2_lr)
    metrics = {
        **{
            p: {"widths": {str(w): summary for w, summary in sorted(by_width[p].items())}, **slope(by_width[p])}
            for p in cfg.search.parametrizations
        },
        "transfer": {
            "parametrization": transfer.parametrization,
            "target_width": transfer.width,
            "proxy_widths": proxies,
            **check,
        },
        "trials": counts([p for pts in points.values() for p in pts], sum(r for _, r in collected.values())),
        "studies": sorted(spec.name for spec in points),
        "storage": optuna_storage(cfg),
    }
    return Findings(points, metrics)


def publish(cfg: Config, project: Path, findings: Findings) -> list[Path]:
    """metrics/search.json, search/lr.yaml and the figures, all or none; returns the figures."""
    from model.coord_check import coord_check
    from tasks.search import figures

    m = findings.metrics
    transfer = m["transfer"]
    with staged(project / SEARCH_METRICS, project / SEARCH_LR, project / SEARCH_REPORTS) as (metrics, lr, reports):
        write_json(metrics, m)
        lr.write_text(LR_FILE_HEADER + yaml.safe_dump({"optim": {"lr": transfer["lr"]}}), encoding="utf-8")
        reports.mkdir()
        sweeps = {p: findings.of("sweep", p) for p in cfg.search.parametrizations}
        figures.mu_transfer(sweeps, reports / "mu_transfer.png", uniform_loss(cfg))
        widths = swept_widths(cfg)
        coords = {
            p: coord_check(p, widths, steps=5, lr=transfer["lr"], base_width=cfg.mup.base_width)
            for p in cfg.search.parametrizations
        }
        figures.coord_check_figure(coords, widths, transfer["lr"], reports / "coord_check.png")
        direct = findings.of("sweep", transfer["parametrization"], transfer["target_width"])
        figures.transfer_figure(
            direct[transfer["target_width"]],
            findings.of("transfer")[transfer["target_width"]],
            transfer,
            transfer["target_width"],
            reports / "transfer.png",
        )
    return sorted((project / SEARCH_REPORTS).glob("*.png"))


LR_FILE_HEADER = """\
# The learning rate the search stage transferred from the proxy widths to the target width
# (tasks/search/study.py; how it was found: metrics/search.json). pretrain trains with it when
# search.transfer_lr is true (tasks/pretrain/train.py: pretrain_config).
"""
