"""The study as a user meets it in the UIs, against real servers: the pipeline deployment triggered
through the Prefect API with a typed override, then a failing one; the Prefect UI, the MLflow UI
and every figure opened in a real (headless) browser."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from flows.stages import STAGES
from tests.test_pipeline import VENV_BIN, copy_project, run

pytestmark = pytest.mark.e2e
TRIGGER = Path(__file__).with_name("trigger_deployment.py")
TYPED_OVERRIDE = {"overrides": {"optim": {"beta2": 0.98}}}  # not lr: pretrain takes the searched LR
FAILING_OVERRIDE = {"extra_overrides": {"data.source": "jsonl", "data.path": "corpus/missing.jsonl"}}


def git_project(dest: Path, env: dict[str, str]) -> Path:
    """A fresh clone as a user has it: the code committed in git, DVC initialised."""
    project = copy_project(dest)
    for cmd in (
        ["git", "init", "-q"],
        ["git", "add", "-A"],
        ["dvc", "init", "-q"],
        ["git", "add", "-A"],
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init"],
    ):
        done = run(cmd, project, env)
        assert done.returncode == 0, done.stderr
    return project


@pytest.fixture(scope="module")
def served(live_services, tmp_path_factory):
    """The project with ``spikelab serve`` publishing its deployments."""
    project = git_project(tmp_path_factory.mktemp("served"), live_services)
    env = {**live_services, "PATH": f"{VENV_BIN}{os.pathsep}{live_services['PATH']}"}
    with serving(project, env):
        yield project, env


@contextlib.contextmanager
def serving(project: Path, env: dict[str, str]) -> Iterator[subprocess.Popen]:
    """``spikelab serve`` publishing the project's deployments; stopped, process group and all, at exit."""
    server = subprocess.Popen(
        ["spikelab", "serve"],
        cwd=project,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        yield server
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)


def trigger(served, deployment: str, parameters: dict) -> dict:
    project, env = served
    done = subprocess.run(
        [sys.executable, str(TRIGGER), deployment, json.dumps(parameters)],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def prefect(env: dict[str, str], path: str, body: dict) -> list[dict]:
    request = urllib.request.Request(
        f"{env['PREFECT_API_URL']}/{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


@pytest.fixture(scope="module")
def pipeline_run(served) -> dict:
    """The pipeline deployment triggered from scratch with a typed form value."""
    flow_run = trigger(served, "pipeline/spikelab-pipeline", TYPED_OVERRIDE)
    assert flow_run["state"] == "Completed", flow_run
    return flow_run


@pytest.fixture(scope="module")
def mlflow_client(live_services):
    import mlflow

    return mlflow.MlflowClient(live_services["MLFLOW_TRACKING_URI"])


def pipeline_mlflow_runs(client, flow_run_id: str):
    experiment = client.get_experiment_by_name("spikelab-smoke").experiment_id
    (parent,) = client.search_runs([experiment], f"tags.`prefect.flow_run_id` = '{flow_run_id}'")
    children = client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    return parent, {c.data.tags["spikelab.stage"]: c for c in children}


def test_the_pipeline_shows_one_task_per_stage_with_live_logs_and_each_stage_flow_run_linked_to_it(
    served, pipeline_run
):
    _, env = served
    tasks = prefect(env, "task_runs/filter", {"flow_runs": {"id": {"any_": [pipeline_run["id"]]}}})
    assert sorted(t["name"] for t in tasks) == sorted(["params", *STAGES])  # params: DVC only, no flow
    children = prefect(
        env,
        "flow_runs/filter",
        {"flow_runs": {"parent_flow_run_id": {"operator": "and_", "any_": [pipeline_run["id"]]}}},
    )
    assert sorted(c["name"] for c in children) == sorted(f"{s} smoke" for s in STAGES)
    by_task = {t["id"]: t["name"] for t in tasks}
    assert all(by_task[c["parent_task_run_id"]] == c["name"].split()[0] for c in children)
    assert all(c["parameters"]["profile"] == "smoke" for c in children)
    pretrain = next(t["id"] for t in tasks if t["name"] == "pretrain")
    logs = prefect(env, "logs/filter", {"logs": {"task_run_id": {"any_": [pretrain]}}, "sort": "TIMESTAMP_ASC"})
    assert any("Running stage 'pretrain'" in log["message"] for log in logs)
    stamps = sorted({log["timestamp"] for log in logs})
    assert len(stamps) > len(logs) // 2, "lines are logged as they arrive, not all at the end"


def test_every_stage_publishes_a_summary_linking_its_mlflow_runs_and_fan_out_stages_their_progress(
    served, pipeline_run
):
    _, env = served
    children = prefect(
        env,
        "flow_runs/filter",
        {"flow_runs": {"parent_flow_run_id": {"operator": "and_", "any_": [pipeline_run["id"]]}}},
    )
    ids = [pipeline_run["id"], *(c["id"] for c in children)]
    artifacts = prefect(env, "artifacts/filter", {"artifacts": {"flow_run_id": {"any_": ids}}})
    progress = [a for a in artifacts if a["type"] == "progress"]
    summaries = [a for a in artifacts if a["type"] != "progress"]
    assert sorted(a["key"] for a in summaries) == sorted(["pipeline-summary", *(f"{s}-summary" for s in STAGES)])
    # the fan-out stages count their units; the search has two rounds (sweeps, then the transfer)
    assert {a["key"] for a in progress} == {"search-progress", "spike-progress", "ablate-progress"}
    assert all(float(a["data"]) == 100.0 and " done" in a["description"] for a in progress)
    mlflow_ui = env["MLFLOW_TRACKING_URI"]
    unlinked = [
        a["key"] for a in summaries if f"]({mlflow_ui}/#/experiments/" not in a["data"] or a["type"] != "markdown"
    ]
    assert not unlinked, f"artifacts without an MLflow link: {unlinked}"
    pretrain = next(a["data"] for a in artifacts if a["key"] == "pretrain-summary")
    assert "| final_loss |" in pretrain and "loss.png" in pretrain and "/artifacts/figures/loss.png" in pretrain


def test_mlflow_nests_each_stage_run_under_the_pipeline_run_with_its_lineage(served, pipeline_run, mlflow_client):
    project, env = served
    parent, children = pipeline_mlflow_runs(mlflow_client, pipeline_run["id"])
    assert sorted(children) == sorted(STAGES)
    commit = run(["git", "rev-parse", "HEAD"], project, env).stdout.strip()
    experiment = parent.data.tags["spikelab.dvc_exp"]
    assert experiment.startswith("ui-")
    for stage, child in children.items():
        tags = child.data.tags
        assert child.info.status == "FINISHED" and child.info.run_name.startswith(f"{stage} smoke ")
        assert tags["mlflow.source.git.commit"] == commit and "spikelab.code_changed" not in tags
        assert tags["spikelab.dvc_exp"] == experiment and tags["spikelab.profile"] == "smoke"
        assert tags["prefect.pipeline_run_id"] == pipeline_run["id"]
        assert tags["prefect.flow_run_url"].startswith(env["PREFECT_API_URL"].removesuffix("/api") + "/runs/flow-run/")
        assert len(tags["spikelab.dvc_inputs"]) == 16
    assert children["pretrain"].data.params["optim.beta2"] == "0.98", "the typed form value reached the stage"
    assert experiment in run(["dvc", "exp", "list", "--names-only"], project, env).stdout


def tree_digest(project: Path, *paths: str) -> dict[str, str]:
    files = sorted(
        f
        for p in paths
        for f in ([project / p] if (project / p).is_file() else (project / p).rglob("*"))
        if f.is_file()
    )
    return {str(f.relative_to(project)): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


def test_a_failing_override_fails_with_the_stages_error_and_leaves_the_workspace_byte_identical(served, pipeline_run):
    project, env = served
    watched = ("params.yaml", "dvc.lock", "models", "metrics", "data/raw", "reports")
    before = tree_digest(project, *watched)
    flow_run = trigger(served, "pipeline/spikelab-pipeline", FAILING_OVERRIDE)
    assert flow_run["state"] == "Failed"
    assert (
        "stage prepare failed" in flow_run["message"]
        and "data.path:" in flow_run["message"]
        and "corpus/missing.jsonl does not exist" in flow_run["message"]
    ), flow_run["message"]
    assert tree_digest(project, *watched) == before
    assert "up to date" in run(["dvc", "status"], project, env).stdout


# --------------------------------------------------------------------------------------------
# In a real browser
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    try:
        from tests import browser as kit
    except ImportError as e:
        pytest.skip(f"selenium is not installed ({e})")
    if reason := kit.missing():
        pytest.skip(reason)
    driver = kit.chrome()
    try:
        yield driver
    finally:
        driver.quit()


def test_the_prefect_ui_lists_the_deployments_and_shows_a_pipeline_run_with_its_stages(served, pipeline_run, browser):
    from tests.browser import wait_for_text

    ui = served[1]["PREFECT_API_URL"].removesuffix("/api")
    browser.get(f"{ui}/deployments")
    wait_for_text(browser, "spikelab-pipeline", *(f"spikelab-{s}" for s in STAGES))
    browser.get(f"{ui}/runs/flow-run/{pipeline_run['id']}")
    text = wait_for_text(browser, "spikelab-pipeline", "Completed", "$ dvc repro --single-item prepare")
    assert "Can't connect to Server API" not in text


def test_the_mlflow_ui_opens_the_experiment_for_model_training_with_stage_runs_nested(
    served, pipeline_run, browser, mlflow_client
):
    from tests.browser import wait_for_text

    parent, children = pipeline_mlflow_runs(mlflow_client, pipeline_run["id"])
    ui = served[1]["MLFLOW_TRACKING_URI"]
    browser.get(f"{ui}/#/experiments/{parent.info.experiment_id}?workflowType=machine_learning")
    text = wait_for_text(browser, "Model training", parent.info.run_name)
    assert "Token Usage" not in text, "the GenAI overview opened instead of the runs"
    child = children["pretrain"]
    browser.get(f"{ui}/#/experiments/{child.info.experiment_id}/runs/{child.info.run_id}?workflowType=machine_learning")
    wait_for_text(browser, child.info.run_name, "Parent run", parent.info.run_name, "tokens")


def test_every_figure_under_reports_opens_offline(served, pipeline_run, browser):
    from tests.browser import image_loads

    figures = sorted((served[0] / "reports").rglob("*.png"))
    assert {"pretrain/loss.png", "pretrain/optimizer.png", "pretrain/stability.png", "search/mu_transfer.png"} <= {
        f.relative_to(served[0] / "reports").as_posix() for f in figures
    }
    assert all(image_loads(browser, f.as_uri()) for f in figures)
