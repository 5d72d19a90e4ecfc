"""Deployments and work pools on the project's own Prefect server, through Prefect's CLI as a user
runs it: ``spikelab serve``'s deployments listed, a process work pool created, the study's
pipeline deployed to it from the project's directory and listed, the pool deleted. Under fastapi
0.151+ the server answers the ``"limit": null`` bodies of Prefect 3.8.8's client with HTTP 422,
so every list here failed: constraints.txt pins fastapi 0.150.0."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from flows.stages import STAGES
from tests.smoke_study import DECLARED_STUDY, VENV_BIN, copy_project, serving

pytestmark = pytest.mark.e2e
POOL = "spikelab-test-pool"
DEPLOY = """
import sys
from prefect import flow

flow.from_source(source=sys.argv[1], entrypoint="flows/pipeline.py:pipeline_flow").deploy(
    name=sys.argv[2], work_pool_name=sys.argv[3], parameters={"target": "tokenize"}, print_next_steps=False
)
"""


def prefect(env: dict[str, str], *args: str) -> str:
    """A ``prefect`` CLI command that must exit 0; its output."""
    done = subprocess.run(["prefect", "--no-prompt", *args], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"prefect {' '.join(args)} exited {done.returncode}:\n{done.stdout}{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def env(live_services) -> dict[str, str]:
    # a wide terminal: the CLI's tables would otherwise wrap the names they list
    return {**live_services, "PATH": f"{VENV_BIN}{os.pathsep}{live_services['PATH']}", "COLUMNS": "250"}


def test_prefect_lists_the_deployments_spikelab_serve_registered(env, tmp_path):
    project = copy_project(tmp_path)
    (project / "studies.yaml").write_text(DECLARED_STUDY)  # each declared family: a deployment
    with serving(project, env) as server:
        expected = {"spikelab-pipeline", *(f"spikelab-{stage}" for stage in STAGES), "spikelab-study-qk_rescue"}
        deadline = time.monotonic() + 180
        while not all(name in (listed := prefect(env, "deployment", "ls")) for name in expected):
            assert server.poll() is None, f"spikelab serve exited with {server.returncode}"
            assert time.monotonic() < deadline, f"spikelab serve registered no deployments within 180 s:\n{listed}"
            time.sleep(2)


def test_a_work_pool_is_created_takes_the_pipeline_deployed_from_the_project_and_is_deleted(env, tmp_path):
    project = copy_project(tmp_path)
    prefect(env, "work-pool", "create", POOL, "--type", "process")
    try:
        assert POOL in prefect(env, "work-pool", "ls")
        deployed = subprocess.run(
            [sys.executable, "-c", DEPLOY, str(project), "on-a-pool", POOL],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert deployed.returncode == 0, deployed.stderr[-3000:]
        assert "pipeline/on-a-pool" in prefect(env, "deployment", "ls")
        inspected = prefect(env, "deployment", "inspect", "pipeline/on-a-pool")
        assert f"'work_pool_name': '{POOL}'" in inspected and "'target': 'tokenize'" in inspected, inspected
        prefect(env, "deployment", "delete", "pipeline/on-a-pool")
        prefect(env, "work-pool", "delete", POOL)
        assert POOL not in prefect(env, "work-pool", "ls")
    except BaseException:  # leave the session's server as it was
        for leftover in (["deployment", "delete", "pipeline/on-a-pool"], ["work-pool", "delete", POOL]):
            subprocess.run(["prefect", "--no-prompt", *leftover], env=env, capture_output=True, timeout=120)
        raise


def test_make_repro_publishes_the_deployments_and_runs_the_stages_as_children_of_one_pipeline_run(env, tmp_path):
    from tests.smoke_study import prefect as api

    project = copy_project(tmp_path)
    assert subprocess.run(["dvc", "init", "--no-scm", "-q"], cwd=project, env=env).returncode == 0
    done = subprocess.run(  # what `make repro` and `make demo` run, here for two stages
        [sys.executable, "-m", "flows.repro", "filter"], cwd=project, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    listed = {d["name"]: d["description"] for d in api(env, "deployments/filter", {})}
    assert {"spikelab-pipeline", *(f"spikelab-{stage}" for stage in STAGES)} <= set(listed), sorted(listed)
    assert "`spikelab serve`" in listed["spikelab-pipeline"], "it says what its runs wait for"
    run_id = done.stdout.split("/runs/flow-run/")[1].split()[0]
    (run,) = api(env, "flow_runs/filter", {"flow_runs": {"id": {"any_": [run_id]}}})
    assert run["state"]["type"] == "COMPLETED" and run["name"] == "dvc repro smoke", run["state"]
    children = api(env, "flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [run_id]}}})
    assert sorted(c["name"] for c in children) == ["filter smoke", "prepare smoke"]
    tasks = {t["id"]: t for t in api(env, "task_runs/filter", {"flow_runs": {"id": {"any_": [run_id]}}})}
    for child in children:
        task = tasks[child["parent_task_run_id"]]
        assert task["name"] == child["name"].split()[0] and task["state"]["type"] == "COMPLETED", task


def test_the_prefect_cli_through_spikelab_prefect_gets_in_and_without_it_gets_401(env):
    from tasks.runtime import credentials

    shell = {k: v for k, v in env.items() if k not in credentials.SECRET_ENVS and k != credentials.MLFLOW_USER_ENV}
    plain = subprocess.run(["prefect", "deployment", "ls"], env=shell, capture_output=True, text=True, timeout=120)
    assert plain.returncode != 0 and "401" in plain.stdout + plain.stderr, "the server answers no one without the login"
    shell.pop("PREFECT_API_URL")  # a fresh shell: spikelab finds this checkout's server itself
    done = subprocess.run(
        ["spikelab", "prefect", "deployment", "ls"], env=shell, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "spikelab-pipeline" in done.stdout  # published by the test above (or spikelab serve's)
    assert credentials.load().password not in done.stdout + done.stderr
