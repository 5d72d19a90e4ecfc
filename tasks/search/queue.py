"""The search's work queue over Optuna's storage: every grid point queued once, claimed by exactly
one worker, and a dead worker's point trained again.

Points. Every (log2 LR, seed) of the grid is put in the study's trial queue (``enqueue_trial``:
the LR as the trial's one param, the seed as its ``seed`` user attribute) by the stage before any worker starts; workers only pop queued trials, which the storage hands
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

Order within a group (the median rule, tasks/search/groups.py). A queued trial is claimed only when
every lower LR of its (parametrization, width, seed) group has a finished trial, so a group's
trials run one at a time in ascending LR, and each is compared with final curves only. A worker
takes a group's trials in a row (:func:`claim` with ``seed``); another finds the group's next
trial not yet claimable and takes another group. A point whose trial died waits for its retry
(the journal: the next round; an RDB storage: its stale copy) before the group goes on.

What Optuna does here: the queue (``enqueue_trial``), the atomic claim (``set_trial_state_values``,
as ``Study.ask`` does first), heartbeats, ``fail_stale_trials`` and the requeue callback, ``tell``.
What is ours, and why: :func:`claim` (``ask`` would sample a point off the grid when the queue is
empty), :func:`heartbeats` (Optuna's heartbeat thread runs only inside ``Study.optimize``), and the
journal's restart rule (the journal storage has no heartbeats).
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeGuard

import optuna
from optuna.trial import TrialState

from model.checkpoint import RunLock
from tasks.config import Config
from tasks.runtime.paths import state
from tasks.search.groups import SearchPruner, grid_point, unfinished_below
from tasks.search.spec import StudySpec, median_rule, prune_bound


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


def heartbeat_interval(storage: optuna.storages.BaseStorage) -> int | None:
    """Seconds between a running trial's heartbeats; None where the storage keeps none (the journal,
    an RDB storage opened without them)."""
    return storage.get_heartbeat_interval() if isinstance(storage, optuna.storages.RDBStorage) else None


def has_heartbeats(storage: optuna.storages.BaseStorage) -> TypeGuard[optuna.storages.RDBStorage]:
    return heartbeat_interval(storage) is not None


@contextmanager
def quiet_experimental() -> Iterator[None]:
    """Optuna's heartbeat API is marked experimental; one warning per call would flood the workers' logs."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        yield


def quiet_optuna() -> None:
    """Optuna's INFO lines off the console: "A new study created in Journal ...", and one "no-name"
    study per pruner check (tasks/search/groups.py: group_view's in-memory studies); the stage's
    progress lines say what ran. Its warnings and errors stay."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)


def pruner(cfg: Config) -> SearchPruner:
    """The search's pruner (tasks/search/groups.py): a bound on the reported loss, which depends on
    the trial alone, and, with ``search.prune_median``, Optuna's MedianPruner over the trial's
    group's earlier trials, which the queue's order (:func:`claim`) has finished before it starts:
    neither depends on the worker count or on which trials finished first."""
    return SearchPruner(prune_bound(cfg), median_rule(cfg), cfg.search.steps)


def threshold_pruner(cfg: Config) -> optuna.pruners.BasePruner:
    """The bound alone (``search.prune_above``): the unpruned search's own pruner."""
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


OBJECTIVE_NAME = "final val loss (nats; ln V if diverged)"
"""What optuna-dashboard calls the objective (else "Objective 0"): tasks/search/trial.py: objective."""


def prepare_study(storage: optuna.storages.BaseStorage, spec: StudySpec) -> int:
    """Create the study if new, name its objective, recover the trials of dead workers, and queue
    every point without a finished, queued or running trial. Returns how many trials are queued or
    running: the work still to do (a running one may turn out stale and be queued again)."""
    study = optuna.create_study(study_name=spec.name, storage=storage, direction="minimize", load_if_exists=True)
    if study.metric_names != [OBJECTIVE_NAME]:  # a study attribute: no trial, point or value changes
        with quiet_experimental():
            study.set_metric_names([OBJECTIVE_NAME])
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
    seed_queued_as_param(storage, study)
    pending = (TrialState.WAITING, TrialState.RUNNING)
    kept = {
        grid_point(t)
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, *pending))
    }
    for lr, seed in spec.points:
        if (lr, seed) not in kept:
            study.enqueue_trial({"log2_lr": lr}, user_attrs={"seed": seed})
    return len(study.get_trials(deepcopy=False, states=pending))


def seed_queued_as_param(storage: optuna.storages.BaseStorage, study: optuna.Study) -> None:
    """Give a queued trial of a search of before issue #57, whose seed is a queued param, its seed
    as the user attribute a worker reads (tasks/search/trial.py: suggest_point)."""
    study_id = storage.get_study_id_from_name(study.study_name)
    for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
        if "seed" not in t.user_attrs:
            trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
            storage.set_trial_user_attr(trial_id, "seed", grid_point(t)[1])


def fail_stale(study: optuna.Study) -> None:
    """Fail the study's trials whose heartbeat is stale; the storage's callback queues their points again."""
    with quiet_experimental():
        optuna.storages.fail_stale_trials(study)


def pending_groups(storage: optuna.storages.BaseStorage, spec: StudySpec) -> int:
    """How many of the study's groups (seeds) have a trial queued or running: the units of work
    (a worker trains a group's trials in a row)."""
    study = optuna.load_study(study_name=spec.name, storage=storage)
    pending = study.get_trials(deepcopy=False, states=(TrialState.WAITING, TrialState.RUNNING))
    return len({grid_point(t)[1] for t in pending})


def claim(
    storage: optuna.storages.BaseStorage, study: optuna.Study, seed: int | None = None
) -> tuple[int, optuna.Trial] | None:
    """The next claimable queued trial (of the group ``seed`` when given), with its storage id,
    now RUNNING and ours alone; None when none is claimable. A queued trial is claimable when
    every lower LR of its group has finished (module docstring: order within a group). The
    storage lets exactly one process move a trial out of WAITING (on an RDB storage a conditional
    UPDATE; what ``Study.ask`` does first; unlike ``ask`` this never creates a trial outside the
    queue). Its first heartbeat is recorded at once: a trial without any never goes stale."""
    trials = study.get_trials(deepcopy=False)
    study_id = storage.get_study_id_from_name(study.study_name)
    for t in trials:
        if t.state != TrialState.WAITING:
            continue
        log2_lr, group = grid_point(t)
        if (seed is not None and group != seed) or unfinished_below(trials, log2_lr, group):
            continue
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
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
    """Claim the first claimable trial of ``studies`` (in order; :func:`claim`). With heartbeats,
    when none is claimable but some run elsewhere, wait: one whose worker dies goes stale, is
    queued again, and is claimed here (and a group's next LR becomes claimable when the trial
    before it ends). None when nothing is claimable and (with heartbeats) nothing runs; on the
    journal a group's queued trials behind a running one are left to the worker training it."""
    while True:
        for spec, study in studies:
            if has_heartbeats(storage):
                fail_stale(study)
            if (claimed := claim(storage, study)) is not None:
                return spec, study, claimed
        running = any(study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)) for _, study in studies)
        interval = heartbeat_interval(storage)
        if interval is None or not running:
            return None
        time.sleep(interval)


@contextmanager
def heartbeats(storage: optuna.storages.BaseStorage, trial_id: int) -> Iterator[None]:
    """Record the heartbeat of the trial ``trial_id`` every interval while the block runs. Optuna's own heartbeat
    thread runs only inside ``study.optimize``; our workers claim queued trials themselves."""
    interval = heartbeat_interval(storage)
    if interval is None or not isinstance(storage, optuna.storages.RDBStorage):
        yield
        return
    stop = threading.Event()

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


def search_lock() -> RunLock:
    """One search at a time per state directory: what lets a restart on the journal storage fail
    its RUNNING trials (on an RDB storage their heartbeats say which workers died)."""
    return RunLock(state().root / "search")
