"""The smoke study the end-to-end tests share: a copy of the project, a family declared in YAML,
``spikelab serve`` publishing its deployments, and the pipeline deployment run once from scratch.

The whole smoke pipeline is the suite's most expensive step (minutes on 2 cores), so it runs once
per session: the UI tests read the served project, and the pipeline tests continue from a copy
taken as the run left it, before any other test changes the served one. Registered as a pytest
plugin in conftest.py; the helpers are imported by the tests that drive the project themselves."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tasks.runtime.credentials import basic_auth

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
PROJECT_FILES = ["flows", "tasks", "model", "profiles", "params.yaml", "studies.yaml", "dvc.yaml", ".dvcignore"]
TRIGGER = Path(__file__).with_name("trigger_deployment.py")
TYPED_OVERRIDE = {"overrides": {"optim": {"beta2": 0.98}}}  # not lr: pretrain takes the searched LR

DECLARED_STUDY = """\
families:
  qk_rescue:
    question: Does qk-norm lower the final loss of an arm trained without warmup?
    factors:
      model: {qk_norm: [false, true]}
      optim: {lr: [0.003, 0.3]}
    fixed: {model.block: post_ln}
    warmup_fraction: 0.0
    claims:
      lower_loss:
        kind: contrast
        metric: capped_loss
        a: {model.qk_norm: true}
        b: {model.qk_norm: false}
        expected: -1
        sesoi: 0.05
        justification: a twentieth of a nat is the least that would make anyone add qk-norm
"""
"""A family and claim declared in studies.yaml alone (tasks/design/studies.py), as docs/ablate.md shows."""


def copy_project(dest: Path, profile: str = "smoke") -> Path:
    """The project's code, params and pipeline, set to ``profile``."""
    for name in PROJECT_FILES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, dest / name)
    params = dest / "params.yaml"
    params.write_text(params.read_text().replace("profile: default", f"profile: {profile}", 1))
    return dest


def run(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    env = {**env, "PATH": f"{VENV_BIN}{os.pathsep}{env['PATH']}"}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def git_project(dest: Path, env: dict[str, str]) -> Path:
    """A fresh clone as a user has it: the code committed in git, DVC initialised."""
    project = copy_project(dest)
    (project / "studies.yaml").write_text(DECLARED_STUDY)  # a family of the user's own, served as a deployment
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


def trigger(served: tuple[Path, dict[str, str]], deployment: str, parameters: dict) -> dict:
    """Run ``deployment`` as the UI's Run button does and wait for it: the flow run's id, state, message."""
    project, env = served
    done = subprocess.run(
        [sys.executable, str(TRIGGER), deployment, json.dumps(parameters)],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def prefect(env: dict[str, str], path: str, body: dict) -> list[dict]:
    """POST ``body`` to the Prefect API at ``path``, logged in."""
    headers = {"Content-Type": "application/json", **basic_auth(env["PREFECT_API_AUTH_STRING"])}
    request = urllib.request.Request(
        f"{env['PREFECT_API_URL']}/{path}", data=json.dumps(body).encode(), headers=headers
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


def flow_run_output(env: dict[str, str], flow_run_id: str) -> str:
    """Every line a flow run logged, its tasks' included, oldest first (the API pages by 200)."""
    lines: list[str] = []
    while page := prefect(
        env,
        "logs/filter",
        {"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "sort": "TIMESTAMP_ASC", "offset": len(lines), "limit": 200},
    ):
        lines += [log["message"] for log in page]
    return "\n".join(lines)


def pipeline_mlflow_runs(client, flow_run_id: str):
    """The pipeline flow run's MLflow run and its stage runs, by stage."""
    experiment = client.get_experiment_by_name("spikelab-smoke").experiment_id
    (parent,) = client.search_runs([experiment], f"tags.`prefect.flow_run_id` = '{flow_run_id}'")
    children = client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    return parent, {c.data.tags["spikelab.stage"]: c for c in children}


@dataclass(frozen=True)
class SmokeStudy:
    project: Path
    """The served project: the UI tests run more deployments in it."""
    env: dict[str, str]
    flow_run: dict
    """The pipeline deployment's flow run (id, state, message), triggered with TYPED_OVERRIDE."""
    as_left: Path
    """A copy of the project as that run left it, for tests that change it themselves."""


@pytest.fixture(scope="session")
def smoke_study(live_services, tmp_path_factory) -> Iterator[SmokeStudy]:
    project = git_project(tmp_path_factory.mktemp("served"), live_services)
    env = {**live_services, "PATH": f"{VENV_BIN}{os.pathsep}{live_services['PATH']}"}
    with serving(project, env):
        flow_run = trigger((project, env), "pipeline/spikelab-pipeline", TYPED_OVERRIDE)
        assert flow_run["state"] == "Completed", flow_run
        as_left = tmp_path_factory.mktemp("as-left") / "project"
        shutil.copytree(project, as_left, symlinks=True)
        yield SmokeStudy(project, env, flow_run, as_left)


@pytest.fixture(scope="session")
def served(smoke_study: SmokeStudy) -> tuple[Path, dict[str, str]]:
    """The project with ``spikelab serve`` publishing its deployments (the pipeline already run)."""
    return smoke_study.project, smoke_study.env


@pytest.fixture(scope="session")
def pipeline_run(smoke_study: SmokeStudy) -> dict:
    """The pipeline deployment triggered from scratch with a typed form value."""
    return smoke_study.flow_run
