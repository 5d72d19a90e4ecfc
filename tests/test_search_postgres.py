"""The LR search on a real PostgreSQL study (tests/postgres_kit.py): worker processes on one study
claim each queued grid point exactly once; a worker killed mid-trial leaves a trial whose heartbeat
goes stale, which the surviving worker fails and trains again, so the grid still completes once;
a storage URL carrying a password is refused.

The workers are plain subprocesses running the search's per-worker step
(``train_queued_group.fn``: the Prefect task's function, what a Dask worker runs: a group's
trials in LR order, each trial it trains printed) in a loop until a pass trains nothing; the password reaches them
through PGPASSWORD, never argv."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from model.typed_config import ConfigError
from tasks.search.queue import grid_point, prepare_study, study_storage
from tasks.search.spec import sweep_specs
from tasks.search.trial import trial_name
from tests.test_search import REPO, search_config, tiny_project

pytestmark = pytest.mark.scaleout

HEARTBEAT_S = 2  # stale after 4 s without one: short for the test, long enough for a loaded machine
WORKER_TIMEOUT_S = 240

WORKER = """
import json, pathlib, sys, time
from tasks.config import config_from_dict
from tasks.search import trial as trial_module
from tasks.search.spec import StudySpec
from tasks.search.trial import train_queued_group
trained, real_run_trial = [], trial_module.run_trial
def run_trial(study, trial, spec, *args):  # the real one, saying which trials this worker trained
    status = real_run_trial(study, trial, spec, *args)
    print(trial_module.trial_name(spec, *trial_module.suggest_point(trial)), status, sep=": ", flush=True)
    trained.append(status)
    return status
trial_module.run_trial = run_trial
cfg, project = config_from_dict(json.loads(sys.argv[1])), pathlib.Path(sys.argv[2])
specs = [StudySpec(**{**s, "points": tuple(map(tuple, s["points"]))}) for s in json.loads(sys.argv[3])]
ready = pathlib.Path(sys.argv[4])
ready.joinpath(sys.argv[5]).touch()
deadline = time.monotonic() + 120
while len(list(ready.iterdir())) < int(sys.argv[6]) and time.monotonic() < deadline:
    time.sleep(0.05)  # start claiming together (imports take seconds)
while True:  # until a group's pass trains nothing: none queued, or all held by others
    before = len(trained)
    train_queued_group.fn(cfg, project, specs, None)
    if len(trained) == before:
        break
"""


def start_workers(cfg, project: Path, specs, pg, ready: Path, names: list[str], together: int) -> dict:
    """Worker processes ``names`` on the study, the password in their environment only."""
    ready.mkdir(exist_ok=True)
    env = {**os.environ, **pg.env(), "OMP_NUM_THREADS": "1"}
    args = [json.dumps(dataclasses.asdict(cfg)), str(project), json.dumps([dataclasses.asdict(s) for s in specs])]
    return {
        name: subprocess.Popen(
            [sys.executable, "-c", WORKER, *args, str(ready), name, str(together)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for name in names
    }


def finish(procs: dict) -> dict[str, list[str]]:
    """Each worker's printed trials, once it exits by itself (within the bound); killed otherwise."""
    out = {}
    try:
        for name, proc in procs.items():
            out[name] = proc.communicate(timeout=WORKER_TIMEOUT_S)[0].splitlines()
            assert proc.returncode in (0, -signal.SIGKILL), f"worker {name} failed ({proc.returncode})"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return out


@pytest.fixture
def pg_search(postgres, tmp_path, monkeypatch, request):
    """A search config on a fresh PostgreSQL database, this process's PGPASSWORD set, the project."""
    monkeypatch.setenv("PGPASSWORD", postgres.password)
    url = postgres.create_database(f"search_{request.node.name[-20:].lower()}_{os.getpid()}")
    cfg = search_config(
        tmp_path,
        **{"search.storage": url, "search.heartbeat_s": HEARTBEAT_S, "search.seeds": [0, 1], "search.steps": 30},
    )
    specs = sweep_specs(cfg, "d")[:1]
    return cfg, tiny_project(tmp_path / "project"), specs, study_storage(cfg)


def trials_by_point(storage, spec) -> dict[tuple, Counter]:
    trials = optuna.load_study(study_name=spec.name, storage=storage).get_trials(deepcopy=False)
    by_point: dict[tuple, Counter] = {}
    for t in trials:
        by_point.setdefault(grid_point(t), Counter())[t.state.name] += 1
    return by_point


def test_two_workers_on_one_postgres_study_train_every_grid_point_exactly_once(pg_search, postgres, tmp_path):
    # Trials of 30 steps: long enough that on a loaded machine one worker cannot finish all six
    # before the other, released by the same barrier, makes its first claim.
    cfg, project, specs, storage = pg_search
    assert prepare_study(storage, specs[0]) == 6
    out = finish(start_workers(cfg, project, specs, postgres, tmp_path / "ready", ["a", "b"], together=2))

    assert trials_by_point(storage, specs[0]) == {p: Counter(COMPLETE=1) for p in specs[0].points}
    assert all(out.values()), f"both workers should have claimed trials: {out}"
    assert sorted(line for lines in out.values() for line in lines) == sorted(
        f"{trial_name(specs[0], lr, seed)}: completed" for lr, seed in specs[0].points
    )


def test_a_worker_killed_mid_trial_goes_stale_and_the_other_worker_trains_its_point_again(
    pg_search, postgres, tmp_path
):
    cfg, project, specs, storage = pg_search
    cfg = cfg.replace(**{"search.steps": 60})  # trials long enough to be killed inside one
    prepare_study(storage, specs[0])
    study = optuna.load_study(study_name=specs[0].name, storage=storage)
    victim = start_workers(cfg, project, specs, postgres, tmp_path / "ready-a", ["a"], together=1)
    try:
        deadline = time.monotonic() + 120
        while not study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            assert time.monotonic() < deadline, "worker a never claimed a trial"
            time.sleep(0.05)
    finally:
        os.killpg(victim["a"].pid, signal.SIGKILL)  # mid-trial: its heartbeat stops
        victim["a"].wait()
    (killed,) = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    # On a loaded machine the poll above can wake after a finished a trial and claimed the next.
    done_by_a = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))

    out = finish(start_workers(cfg, project, specs, postgres, tmp_path / "ready-b", ["b"], together=1))

    trials = optuna.load_study(study_name=specs[0].name, storage=storage).get_trials(deepcopy=False)
    (failed,) = [t for t in trials if t.state == TrialState.FAIL]
    assert failed.number == killed.number
    retried = [t for t in trials if t.system_attrs.get("failed_trial") == killed.number]
    assert [(grid_point(t), t.state) for t in retried] == [(grid_point(killed), TrialState.COMPLETE)]
    assert trials_by_point(storage, specs[0]) == {
        p: Counter(COMPLETE=1, **({"FAIL": 1} if p == grid_point(killed) else {})) for p in specs[0].points
    }
    assert len(out["b"]) == 6 - done_by_a  # the survivor trained the rest of the grid, the killed point included
    assert prepare_study(storage, specs[0]) == 0  # finished: nothing queued again


def test_a_storage_url_with_a_password_is_refused_naming_the_key_and_where_the_password_goes(tmp_path):
    with pytest.raises(ConfigError, match=r"^search\.storage: .*PGPASSWORD.*pgpass") as refused:
        search_config(tmp_path, **{"search.storage": "postgresql://spikelab:hunter2@127.0.0.1:5432/optuna"})
    assert "hunter2" not in str(refused.value)
    search_config(tmp_path, **{"search.storage": "postgresql://spikelab@127.0.0.1:5432/optuna"})  # no password: fine
