"""Arms and search trials on a real Dask cluster (``spikelab cluster up``: a ``dask scheduler`` and
``dask worker`` processes on 127.0.0.1, mutual TLS) against the real test servers: the cluster's
lifecycle, another user refused, per-arm numbers identical to the local runner's, a worker
SIGKILLed mid-grid, the stage's refusals (no Prefect server, a scheduler without the cluster's
certificate), the search's trials on the cluster, and one unit per GPU worker."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import optuna
import psutil
import pytest

pytest.importorskip("prefect_dask", reason="prefect-dask is not installed (pip install -e '.[cluster]')")
pytest.importorskip("distributed", reason="distributed is not installed (pip install -e '.[cluster]')")

from model.typed_config import UserError  # noqa: E402
from tasks.runtime import cluster as spikelab_cluster
from tasks.runtime import credentials, tls, workers  # noqa: E402
from tests.other_user import (  # noqa: E402
    DASK_HTTP_ROUTES,
    DASK_PROBES,
    dask_http_expected,
    dask_http_seen_by_other_user,
    other_user_has_distributed,
    run_as_other_user,
)
from tests.test_ablate_stage import on_test_servers, task_runs  # noqa: E402
from tests.test_arithmetic_check import study_project  # noqa: E402
from tests.test_search import finished, search_config, tiny_project  # noqa: E402
from tests.test_services import free_port  # noqa: E402

pytestmark = pytest.mark.scaleout

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
if not (BIN / "dask").is_file():
    pytest.skip(f"the dask CLI is not installed next to {sys.executable}", allow_module_level=True)

GRID = {
    "ablation.blocks": ["pre_ln"],
    "ablation.xiong_warmups": [0.2],
    "ablation.precisions": ["fp32"],
    "ablation.overflow_precisions": ["fp32"],
    "ablation.beta2s": [0.95],
    "ablation.stabilizers": ["none"],
    "ablation.lrs": [0.003],
    "ablation.seeds": [0],
    "ablation.confirm_seeds": [],
    "ablation.workers": 2,
    "ablation.retries": 1,
    "tracking.experiment": "cluster-test",
}
"""Six arms, five runs (the overflow family's clean twin is the precision family's fp32 arm)."""


def spikelab(*args: str, env: dict[str, str], cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "spikelab"), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def recorded(state: Path) -> list[psutil.Process]:
    """The processes ``spikelab cluster`` recorded under ``state``, with everything they started."""
    procs = []
    for record in (state / "cluster").glob("*.json"):
        try:
            proc = psutil.Process(json.loads(record.read_text())["pid"])
            procs += [proc, *proc.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    return procs


def gone(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def kill_recorded(state: Path) -> None:
    """What a failed ``down`` left: each recorded process group, by its leader's pid (the same
    process: its start time is the recorded one)."""
    for path in (state / "cluster").glob("*.json"):
        record = json.loads(path.read_text())
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if abs(psutil.Process(record["pid"]).create_time() - record["create_time"]) < 0.01:
                os.killpg(record["pid"], signal.SIGKILL)


class Cluster:
    """``spikelab cluster up`` in a state directory of its own; ``down`` (and a kill by pid) at exit."""

    def __init__(self, env: dict[str, str], state: Path, *up_args: str):
        self.env = {**env, "SPIKELAB_STATE": str(state)}  # PREFECT_API_URL/MLFLOW_TRACKING_URI: explicit
        self.state, self.cwd, self.port = state, state, free_port()
        self.up_args = ["cluster", "up", "--port", str(self.port), *up_args]
        host = up_args[up_args.index("--host") + 1] if "--host" in up_args else "127.0.0.1"
        self.address = f"tls://{host}:{self.port}"
        self.certificates = state / "tls"  # what `up` makes, and a worker node copies

    def __enter__(self) -> Cluster:
        self.state.mkdir(parents=True, exist_ok=True)
        done = spikelab(*self.up_args, env=self.env, cwd=self.cwd)
        if done.returncode:
            kill_recorded(self.state)
        assert done.returncode == 0, done.stderr[-3000:]
        assert self.address in done.stdout
        self.said = done.stderr
        return self

    def run(self, *args: str) -> subprocess.CompletedProcess:
        return spikelab("cluster", *args, env=self.env, cwd=self.cwd)

    def client(self):
        """A client with the cluster's certificate."""
        from distributed import Client

        return Client(self.address, security=tls.security(self.certificates), set_as_default=False)

    def reached(self) -> pytest.MonkeyPatch:
        """This process pointed at the cluster, with a copy of its certificates (as a head node's stage)."""
        patch = pytest.MonkeyPatch()
        patch.setenv(workers.SCHEDULER_ENV, self.address)
        patch.setenv(tls.TLS_DIR_ENV, str(self.certificates))
        return patch

    def __exit__(self, *exc) -> None:
        try:
            self.run("down")
        finally:
            kill_recorded(self.state)


@pytest.fixture(scope="module")
def cluster(live_services, tmp_path_factory):
    with Cluster(live_services, tmp_path_factory.mktemp("cluster-state"), "--workers", "2") as c:
        yield c


def run_ablate(project: Path, overrides: dict, on: Cluster | None = None):
    import flows.ablate as stage

    patch = on.reached() if on else pytest.MonkeyPatch()
    try:
        with on_test_servers(project):
            state = stage.ablate_flow(profile="smoke", overrides=overrides, return_state=True)
    finally:
        patch.undo()
    assert state.is_completed(), state.message
    return state, {a["name"]: a for a in json.loads((project / "metrics" / "ablate.json").read_text())["arms"]}


def numbers(arm: dict) -> dict:
    """An arm's metrics less its wall time (the one figure that depends on where it ran)."""
    return {k: v for k, v in arm["metrics"].items() if k != "wall_s"}


def stored(project: Path, arm: dict) -> dict:
    return json.loads((project / "runs" / "ablate" / "arms" / arm["key"] / "result.json").read_text())


# --------------------------------------------------------------------------------------------
# The cluster's lifecycle
# --------------------------------------------------------------------------------------------


def test_cluster_up_status_down_on_loopback_with_the_workers_environment(live_services, tmp_path):
    with Cluster(live_services, tmp_path / "state", "--workers", "2") as c:
        status = c.run("status")
        assert status.returncode == 0 and f"scheduler: {c.address} (2 workers connected)" in status.stdout
        assert f"SPIKELAB_SCHEDULER={c.address}" in status.stdout
        procs = recorded(c.state)
        assert len(procs) >= 3  # the scheduler, two nannies and their workers
        listening = {conn.laddr.ip for p in procs for conn in p.net_connections("tcp") if conn.status == "LISTEN"}
        assert listening == {"127.0.0.1"}
        expected = {
            "MALLOC_TRIM_THRESHOLD_": workers.WORKER_ENVIRONMENT["MALLOC_TRIM_THRESHOLD_"],  # not the nanny's 64 kB
            "OMP_NUM_THREADS": "1",
            "PREFECT_API_URL": live_services["PREFECT_API_URL"],
            "MLFLOW_TRACKING_URI": live_services["MLFLOW_TRACKING_URI"],
        }
        with c.client() as client:
            for key, value in expected.items():
                assert set(client.run(os.getenv, key).values()) == {value}, key
        down = c.run("down")
        assert down.returncode == 0 and down.stdout.count("cluster: stopped") == 3
        assert all(gone(p) for p in procs), [p.pid for p in procs if not gone(p)]
        assert "scheduler: not started for this checkout" in c.run("status").stdout


def test_cluster_up_refuses_another_user_and_keeps_its_key_from_them(cluster, tmp_path):
    """The review's probe against ``spikelab cluster up``: another user's client, without the
    certificate, with one of its own, or over plain TCP, never reaches the scheduler."""
    other_user_has_distributed()
    marker = tmp_path / "planted"  # a function that got in would write it as the scheduler's owner
    done = run_as_other_user(DASK_PROBES, cluster.address, str(marker))
    assert done.returncode == 0, done.stderr[-2000:]
    assert all(r.startswith("refused") for r in json.loads(done.stdout).values()), done.stdout
    assert not marker.exists()
    assert oct(cluster.certificates.stat().st_mode & 0o777) == "0o700"
    assert oct((cluster.certificates / "key.pem").stat().st_mode & 0o777) == "0o600"
    with cluster.client() as owner:  # the same request with the certificate
        assert owner.run_on_scheduler(os.getuid) == os.getuid()
        seen = dask_http_seen_by_other_user(owner)  # and the servers' HTTP ports say only "alive"
        assert seen == dask_http_expected(seen) and len(seen) == 3 * len(DASK_HTTP_ROUTES)
        # the scheduler runs no task, so it holds no login to the servers
        assert all(owner.run_on_scheduler(os.getenv, key) is None for key in credentials.SECRET_ENVS)


def test_a_stage_never_connects_to_a_scheduler_without_the_clusters_certificate(cluster, live_services, monkeypatch):
    """A scheduler another user runs (its own certificate) is refused in the handshake: the stage
    sends it nothing and unpickles nothing it returns."""
    from distributed import LocalCluster

    monkeypatch.setenv(tls.TLS_DIR_ENV, str(cluster.certificates))
    monkeypatch.setattr(workers, "CONNECT_TIMEOUT_S", 3)
    with LocalCluster(**workers.cluster_kwargs(1)) as theirs:  # TLS, but not this cluster's CA
        refused = pytest.raises(UserError, match=f"Dask scheduler {theirs.scheduler_address}: does not answer")
        with refused:
            workers.check_cluster(theirs.scheduler_address, gpu=False)


# --------------------------------------------------------------------------------------------
# Arms on the cluster
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def both_runs(cluster, tmp_path_factory):
    """The same grid on the local runner and on the 2-worker cluster, in two projects."""
    local = study_project(tmp_path_factory.mktemp("local"))
    on_dask = study_project(tmp_path_factory.mktemp("dask"))
    _, local_arms = run_ablate(local, GRID)
    state, dask_arms = run_ablate(on_dask, GRID, cluster)
    return (local, local_arms), (on_dask, dask_arms, state)


def test_arms_on_the_cluster_give_the_local_runners_numbers_exactly(both_runs):
    (local, local_arms), (on_dask, dask_arms, state) = both_runs
    assert set(dask_arms) == set(local_arms) and len(local_arms) == 6
    for name, arm in dask_arms.items():
        assert arm["status"] == "completed", (name, arm.get("error"))
        assert numbers(arm) == numbers(local_arms[name]), name
        mine, theirs = stored(on_dask, arm), stored(local, local_arms[name])
        assert mine["rows"] == theirs["rows"] and mine["weights_sha256"] == theirs["weights_sha256"], name
    # the workers report to the flow's server (not each to a hidden one of its own)
    runs = task_runs(state)
    assert len(runs) == 5 and {s for s, _ in runs.values()} == {"COMPLETED"}


def kill_a_busy_worker(cluster: Cluster, arms_dir: Path, seen: dict, timeout: float = 90) -> None:
    """SIGKILL the first worker seen training an arm; note which arms had finished by then."""
    deadline = time.monotonic() + timeout
    with cluster.client() as client:
        while time.monotonic() < deadline:
            busy = [w for w, tasks in client.processing().items() if tasks]
            if busy:
                pid = client.run(os.getpid, workers=busy[:1])[busy[0]]
                seen["finished"] = {p: p.stat().st_mtime_ns for p in arms_dir.glob("*/result.json")}
                os.kill(pid, signal.SIGKILL)
                seen["killed"] = pid
                return
            time.sleep(0.02)


def test_a_worker_killed_mid_grid_its_arm_trains_elsewhere_and_finished_arms_are_kept(both_runs, cluster):
    _, (on_dask, before, _) = both_runs
    seen: dict = {}
    arms_dir = on_dask / "runs" / "ablate" / "arms"
    killer = threading.Thread(target=kill_a_busy_worker, args=(cluster, arms_dir, seen), daemon=True)
    killer.start()
    state, arms = run_ablate(on_dask, {**GRID, "ablation.seeds": [0, 1]}, cluster)
    killer.join(timeout=5)
    assert "killed" in seen, "no worker was seen training an arm"
    assert len(arms) == 12 and {a["status"] for a in arms.values()} == {"completed"}
    assert {n for n, a in arms.items() if a["cached"]} == set(before), "seed 0's arms are not trained again"
    assert all(path.stat().st_mtime_ns == t for path, t in seen["finished"].items()), "a finished arm was retrained"
    runs = task_runs(state)
    assert len(runs) == 5 and {s for s, _ in runs.values()} == {"COMPLETED"}


# --------------------------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------------------------


def test_the_stage_refuses_a_cluster_when_no_prefect_server_answers(cluster, live_services, tmp_path):
    project = study_project(tmp_path / "project")
    env = {**live_services, workers.SCHEDULER_ENV: cluster.address}
    dead = {**env, "PREFECT_API_URL": f"http://127.0.0.1:{free_port()}/api"}
    done = spikelab("run", "ablate", "--profile", "smoke", env=dead, cwd=project, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"Dask scheduler {cluster.address}: refused, the Prefect server at {dead['PREFECT_API_URL']}" in done.stderr
    assert "hidden" in done.stderr and not (project / "metrics").exists()
    unset = {k: v for k, v in env.items() if k != "PREFECT_API_URL"} | {"SPIKELAB_STATE": str(tmp_path / "empty")}
    done = spikelab("run", "search", "--profile", "smoke", env=unset, cwd=project, timeout=120)
    assert done.returncode == 2 and "refused, PREFECT_API_URL is not set" in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize(
    ("setting", "key"),
    [({"SPIKELAB_SCHEDULER": "127.0.0.1:8786"}, "SPIKELAB_SCHEDULER"), ({}, "executor.scheduler")],
)
def test_a_malformed_scheduler_address_is_an_error_naming_its_key(live_services, tmp_path, setting, key):
    project = study_project(tmp_path / "project")
    env = {k: v for k, v in live_services.items() if k != workers.SCHEDULER_ENV} | setting
    args = [] if setting else ["--set", "executor.scheduler=tcp://nowhere"]
    done = spikelab("run", "ablate", "--profile", "smoke", *args, env=env, cwd=project, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith(f"spikelab: error: {key}: "), done.stderr[-2000:]


def test_a_scheduler_that_does_not_answer_is_named(live_services, monkeypatch, tmp_path):
    address = f"tls://127.0.0.1:{free_port()}"
    monkeypatch.setenv(tls.TLS_DIR_ENV, str(tls.ensure_certificates(tmp_path / "tls")))
    monkeypatch.setattr(workers, "CONNECT_TIMEOUT_S", 1)
    with pytest.raises(UserError, match=f"Dask scheduler {address}: does not answer"):
        workers.executor(search_config(tmp_path, **{"executor.scheduler": address}), 2, 4)


# --------------------------------------------------------------------------------------------
# Search trials, GPU workers
# --------------------------------------------------------------------------------------------


def test_search_trials_on_the_cluster_give_the_local_runners_values(cluster, tmp_path, monkeypatch):
    from tasks.search.queue import open_storage, optuna_storage
    from tasks.search.spec import sweep_specs
    from tasks.search.study import run_workers

    monkeypatch.setenv(tls.TLS_DIR_ENV, str(cluster.certificates))
    project = tiny_project(tmp_path / "project")
    results = {}
    for where in ("local", cluster.address):
        (tmp_path / f"journal-{len(results)}").mkdir()
        cfg = search_config(tmp_path / f"journal-{len(results)}", **{"search.workers": 2, "executor.scheduler": where})
        specs = sweep_specs(cfg, "d")
        run_workers(cfg, project, specs, None)
        storage = open_storage(optuna_storage(cfg))
        results[where] = {spec.name: finished(storage, spec) for spec in specs}
    assert results[cluster.address] == results["local"]
    assert all(len(trials) == 3 for trials in results["local"].values())


def kill_a_worker_holding_a_trial(
    cluster: Cluster, running: Callable[[], int], seen: dict, timeout: float = 90
) -> None:
    """SIGKILL a worker once both workers hold a RUNNING trial (so the one killed holds one)."""
    deadline = time.monotonic() + timeout
    with cluster.client() as client:
        while time.monotonic() < deadline:
            if running() == 2:
                busy = [w for w, tasks in client.processing().items() if tasks]
                seen["killed"] = client.run(os.getpid, workers=busy[:1])[busy[0]]
                os.kill(seen["killed"], signal.SIGKILL)
                return
            time.sleep(0.05)


def test_a_worker_killed_mid_trial_leaves_no_point_of_the_grid_untrained(cluster, tmp_path, monkeypatch):
    """Dask gives the dead worker's task to another worker, which claims the next point; the trial
    the dead one held stays RUNNING until the next round fails it and trains its point again."""
    from tasks.search.groups import grid_point
    from tasks.search.queue import open_storage, optuna_storage
    from tasks.search.spec import sweep_specs
    from tasks.search.study import run_workers

    monkeypatch.setenv(tls.TLS_DIR_ENV, str(cluster.certificates))
    project = tiny_project(tmp_path / "project")
    (tmp_path / "journal").mkdir()
    settings = {"search.workers": 2, "search.steps": 300, "executor.scheduler": cluster.address}
    cfg = search_config(tmp_path / "journal", **settings)
    specs = sweep_specs(cfg, "d")
    storage = open_storage(optuna_storage(cfg))

    def trials() -> list:
        return [t for spec in specs for t in optuna.load_study(study_name=spec.name, storage=storage).get_trials()]

    def running() -> int:
        try:
            return sum(t.state.name == "RUNNING" for t in trials())
        except KeyError:  # the studies are not created yet
            return 0

    seen: dict = {}
    killer = threading.Thread(target=kill_a_worker_holding_a_trial, args=(cluster, running, seen), daemon=True)
    killer.start()
    run_workers(cfg, project, specs, None)
    killer.join(timeout=5)
    assert "killed" in seen, "the two workers were never seen holding a trial each"
    done = sorted(grid_point(t) for t in trials() if t.state.name in ("COMPLETE", "PRUNED"))
    assert done == sorted(p for spec in specs for p in spec.points)  # every point once, none left RUNNING
    failed = [t for t in trials() if t.state.name == "FAIL"]
    assert len(failed) == 1 and failed[0].user_attrs["status"] == "interrupted"


def test_units_that_need_a_gpu_run_only_on_gpu_workers(live_services, tmp_path):
    """``--gpus 1`` declares the resource (the GPU itself is not needed to place units)."""
    from prefect import task

    @task
    def where() -> str:
        from distributed import get_worker

        return get_worker().name

    with Cluster(live_services, tmp_path / "state", "--gpus", "1") as c:
        joined = c.run("join", c.address, "--workers", "1")
        assert joined.returncode == 0, joined.stderr[-2000:]
        assert "2 workers connected, 1 with a GPU" in c.run("status").stdout
        units = workers.Executor(c.address, workers=1, gpu=True)
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(tls.TLS_DIR_ENV, str(c.certificates))
            with units.runner() as runner, units.placement():
                names = {runner.submit(where, {}).result() for _ in range(4)}
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("SPIKELAB_STATE", str(c.state))
            assert names == {spikelab_cluster.worker_name(0)}  # the GPU worker (the first recorded)


def test_a_head_on_another_interface_serves_workers_that_join_it_and_warns_it_is_exposed(live_services, tmp_path):
    """127.0.0.2 stands for a head node's private address (all of 127/8 is loopback on Linux): the
    scheduler listens there alone, ``up`` says the servers are reached from other machines, and workers
    started from another checkout's state (another node) join it with a copy of the head's
    certificates, and only with it."""
    import shutil

    with Cluster(live_services, tmp_path / "head", "--host", "127.0.0.2", "--workers", "1") as head:
        assert "127.0.0.2, not loopback: other machines reach them" in head.said
        node = Cluster(live_services, tmp_path / "node")
        node.state.mkdir()
        refused = node.run("join", head.address, "--workers", "1")  # no certificates on this node yet
        assert refused.returncode == 2 and "cluster TLS: ca.pem, cert.pem, key.pem not found" in refused.stderr
        copied = shutil.copytree(head.certificates, tmp_path / "copied-tls")
        joined = node.run("join", head.address, "--workers", "1", "--tls", str(copied))
        try:
            assert joined.returncode == 0, joined.stderr[-2000:]
            assert f"scheduler: {head.address} (2 workers connected)" in head.run("status").stdout
            scheduler = [p for p in recorded(head.state) if "scheduler" in " ".join(p.cmdline())]
            listening = {c.laddr.ip for p in scheduler for c in p.net_connections("tcp") if c.status == "LISTEN"}
            assert listening == {"127.0.0.2"}
        finally:
            node.run("down")
            kill_recorded(node.state)


def test_only_servers_beyond_loopback_are_warned_about():
    from tasks.runtime import paths

    assert paths.exposed_warning("127.0.0.1") is None
    assert "serve HTTPS" in paths.exposed_warning("10.0.0.5")
