"""One trial of the search: its training run, reported to Optuna and recorded in MLflow, in a
worker that claims it from the queue.

A trial is a short run of :class:`model.train.Trainer` without checkpoints, scored by its final
validation loss; intermediate validation losses go to the search's pruner (tasks/search/groups.py:
the ThresholdPruner, and the median rule within the trial's group). A pruned trial records the
step it was stopped at (``pruned_at``) and the rule (``pruned_by``: threshold | median). A
diverged run is a result: its value is ln(vocab_size), the loss of a uniform guess (the loss at
init, as in Wortsman et al.'s LR sensitivity), with ``status: diverged`` among its user attributes.

A worker trains one group's trials in a row (:func:`train_queued_group`): the queue lets a
group's next LR start only after the one before it has ended (tasks/search/queue.py: claim).

What MLflow and optuna-dashboard show of a trial: its MLflow run carries its point and size as
params (:func:`trial_params`), so runs compare and plot by LR, width and seed; in Optuna the one
param is ``log2_lr`` and the seed is the ``seed`` user attribute it was queued with (a seed is not a
hyperparameter: optuna-dashboard would rank its importance and call the luckiest seed the best
trial; tasks/search/groups.py: grid_point reads both, and the seed param of older studies).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState
from prefect import task

from model.callbacks import Callback, TrainerView
from model.config import Parametrization
from model.data import Tokens as TokenIds
from model.data import open_split
from model.stops import Diverged
from model.train import Trainer
from tasks.config import Config
from tasks.runtime.outputs import MANIFEST
from tasks.runtime.workers import clean_state
from tasks.search.groups import SearchPruner
from tasks.search.queue import claim, heartbeats, load_study, next_trial, open_storage, optuna_storage, quiet_optuna
from tasks.search.spec import StudySpec, trial_config, uniform_loss


class ReportToOptuna(Callback):
    """Reports every validation loss to the trial; stops the run when the pruner says so."""

    name = "optuna"

    def __init__(self, trial: optuna.Trial):
        self.trial = trial
        self.trainer: TrainerView | None = None

    def on_step_start(self, trainer: TrainerView) -> None:
        self.trainer = trainer

    def on_eval(self, step: int, val_loss: float) -> None:
        self.trial.report(val_loss, step)
        if self.trial.should_prune() and self.trainer is not None:  # an eval follows a step
            pruner = self.trial.study.pruner
            rule = (pruner.last if isinstance(pruner, SearchPruner) else None) or "threshold"
            self.trial.set_user_attr("pruned_at", step)
            self.trial.set_user_attr("pruned_by", rule)
            why = "above the bound" if rule == "threshold" else "worse than its group's median"
            self.trainer.request_stop(f"pruned by Optuna ({rule}) at step {step}: val loss {val_loss:.4g} {why}")


@dataclasses.dataclass(frozen=True)
class Tokens:
    train: TokenIds
    val: TokenIds

    @classmethod
    def of(cls, project: Path) -> Tokens:
        return cls(*(open_split(project / MANIFEST, split) for split in ("train", "val")))


def suggest_point(trial: optuna.Trial) -> tuple[float, int]:
    """The trial's (log2 LR, seed): its queued LR (the same on every call) and seed."""
    low, high = trial.study.user_attrs["log2_lr_range"]
    return trial.suggest_float("log2_lr", low, high), int(trial.user_attrs["seed"])


def objective(
    trial: optuna.Trial,
    cfg: Config,
    parametrization: Parametrization,
    width: int,
    tokens: Tokens,
    callbacks: Iterable[Any] = (),
) -> float:
    """Train the trial's point; returns its final validation loss (ln(vocab) when it diverged) and
    raises ``optuna.TrialPruned`` when the pruner stopped it. Records what ran as user attributes."""
    log2_lr, seed = suggest_point(trial)
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
    return float(summary["val_loss"])


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
def train_queued_group(cfg: Config, project: Path, specs: list[StudySpec], parent_run: str | None) -> None:
    """In a worker: claim the first claimable trial of ``specs`` (in order; :func:`next_trial`),
    train it, recording its heartbeats, then its group's next LRs in a row while they are
    claimable (each once the one before has ended: tasks/search/queue.py: claim). What it trained
    the stage reads from the storage (tasks/search/study.py: ended_trials), the one record of it;
    nothing to do when other workers hold or took what is left."""
    clean_state()
    quiet_optuna()
    storage = worker_storage(optuna_storage(cfg), cfg.search.heartbeat_s)
    claimed = next_trial(storage, [(spec, load_study(storage, spec, cfg)) for spec in specs])
    while claimed is not None:
        spec, study, (trial_id, trial) = claimed
        with heartbeats(storage, trial_id):
            run_trial(study, trial, spec, cfg, worker_tokens(project), parent_run)
        following = claim(storage, study, suggest_point(trial)[1])  # the group's next LR, now this one ended
        claimed = (spec, study, following) if following is not None else None


def run_trial(
    study: optuna.Study, trial: optuna.Trial, spec: StudySpec, cfg: Config, tokens: Tokens, parent_run: str | None
) -> str:
    """The objective in an MLflow run nested under the stage's, its outcome told to the study.
    An exception other than pruning fails the trial (queued again at the next start) and the
    task. Returns the trial's status: completed, diverged or pruned; "stale" when another worker
    took this one's heartbeats for dead and queued its point again (its result is dropped: the
    storage refuses a finished trial's updates)."""
    try:
        with trial_run(spec, trial, *suggest_point(trial), parent_run, cfg.search.steps) as callbacks:
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
            return str(trial.user_attrs["status"])
    except optuna.exceptions.UpdateFinishedTrialError:
        return "stale"


def trial_name(spec: StudySpec, log2_lr: float, seed: int) -> str:
    return f"{spec.kind} {spec.parametrization} w{spec.width} lr 2^{log2_lr:g} seed {seed}"


def trial_params(spec: StudySpec, log2_lr: float, seed: int, steps: int) -> dict[str, Any]:
    """The trial's MLflow params: what varies between trials (LR, width, parametrization, seed) and
    its length, under the names the ablation arms' runs use (``lr``, ``seed``), so the runs table
    sorts and the charts plot loss against any of them."""
    return {
        "log2_lr": log2_lr,
        "lr": 2.0**log2_lr,
        "width": spec.width,
        "parametrization": spec.parametrization,
        "seed": seed,
        "steps": steps,
        "kind": spec.kind,
    }


@contextmanager
def trial_run(
    spec: StudySpec, trial: optuna.Trial, log2_lr: float, seed: int, parent: str | None, steps: int
) -> Iterator[list[Any]]:
    """The trial's MLflow run, a child of the stage's run ``parent`` (None: no tracking), tagged
    with its study and trial, its point as params (:func:`trial_params`); yields the trainer
    callbacks that log to it. It ends as its stop kind says: a diverged trial FAILED
    (model/stops.py), a completed or pruned one FINISHED."""
    if not parent:
        yield []
        return
    import mlflow

    from tasks.runtime.tracking import MLflowMetrics, child_run, log_params

    tags = {
        "optuna.study": spec.name,
        "optuna.trial": str(trial.number),
        "search.width": str(spec.width),
        "search.parametrization": spec.parametrization,
        "search.kind": spec.kind,
    }
    try:
        with child_run(trial_name(spec, log2_lr, seed), tags, parent_id=parent):
            log_params(trial_params(spec, log2_lr, seed, steps))
            yield [MLflowMetrics()]
            status = trial.user_attrs.get("status")
            mlflow.set_tag("search.status", status)
            if status == "diverged":
                raise Diverged(trial.user_attrs["steps"], "a search trial")
    except Diverged:
        pass  # a result, recorded as such
