"""`spikelab services up` on a real PostgreSQL (tests/postgres_kit.py): MLflow's backend store,
Prefect's database and optuna-dashboard's storage are databases there, MLflow's artifacts go to a
shared path through the server; a flow run and an MLflow run land as rows in PostgreSQL; and the
password, given only as PGPASSWORD, appears in no log, command line, run record, resolved config
or command output. A URL in the environment carrying a password is refused, naming the variable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tasks.runtime.credentials import MLFLOW_USER_ENV, SECRET_ENVS
from tests.postgres_kit import free_port

pytestmark = pytest.mark.scaleout

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

STAGE_LIKE_RUN = """
import os, sys, mlflow
from prefect import flow

@flow(name="stage-like")
def stage(storage: str) -> str:
    mlflow.set_experiment("pg-test")
    with mlflow.start_run(run_name="stage-like run") as run:
        mlflow.log_params({"search.storage": storage, "train.steps": 3})
        mlflow.set_tag("spikelab.dvc_stage", "search")
        mlflow.log_metric("loss/val", 1.5, step=3)
        mlflow.log_text("shared artifact", "notes.txt")
        return run.info.run_id

print(stage(sys.argv[1]))
"""


def run(command: list[str], env: dict[str, str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """A command, bounded in time, its whole process group killed if it overruns."""
    proc = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def client_login(state: Path) -> dict[str, str]:
    """What a client of the servers of ``state`` sets: the login in the credentials file ``up`` made."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPIKELAB_STATE", str(state))
        from tasks.runtime import credentials

        return credentials.load().client_env()


def server_command_lines(records: Path) -> list[str]:
    """The command lines of the servers `up` recorded and of all their children (gunicorn/uvicorn
    workers). A server must be alive; a child that exits between the listing and the read (a
    short-lived helper a server spawned: CI met one) has no command line left to leak into."""
    lines = []
    for record in records.glob("*.json"):
        server = psutil.Process(json.loads(record.read_text())["pid"])
        lines.append(" ".join(server.cmdline()))
        for child in server.children(recursive=True):
            try:
                lines.append(" ".join(child.cmdline()))
            except psutil.NoSuchProcess:
                continue
    return lines


@pytest.fixture
def head_node(postgres, tmp_path):
    """A project whose search storage is a PostgreSQL database, and the environment a head node
    sets: the servers' database URLs and artifact destination, the password as PGPASSWORD only."""
    project = tmp_path / "project"
    project.mkdir()
    optuna_url = postgres.create_database("optuna_services")
    (project / "params.yaml").write_text(f"search:\n  storage: {optuna_url}\n")
    unset = ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "PREFECT_HOME", MLFLOW_USER_ENV, *SECRET_ENVS)
    env = {k: v for k, v in os.environ.items() if k not in unset}  # not the test session's servers or login
    env.update(
        {
            "PATH": f"{BIN}{os.pathsep}{env['PATH']}",
            "PYTHONPATH": str(REPO),
            "SPIKELAB_STATE": str(tmp_path / "state"),
            "SPIKELAB_PREFECT_PORT": str(free_port()),
            "SPIKELAB_MLFLOW_PORT": str(free_port()),
            "SPIKELAB_DASHBOARD_PORT": str(free_port()),
            "SPIKELAB_MLFLOW_DB": postgres.create_database("mlflow_services"),
            "SPIKELAB_PREFECT_DB": postgres.create_database("prefect_services"),
            "SPIKELAB_MLFLOW_ARTIFACTS": str(tmp_path / "shared" / "mlartifacts"),
            **postgres.env(),
        }
    )
    return project, env, optuna_url


def test_services_keep_their_stores_in_postgres_and_the_password_appears_nowhere(head_node, postgres, tmp_path):
    project, env, optuna_url = head_node
    outputs = []
    try:
        up = run(["spikelab", "services", "up"], env, project)
        outputs.append(up)
        assert up.returncode == 0, up.stderr
        servers = server_command_lines(tmp_path / "state" / "services")
        params = run([sys.executable, "-m", "tasks.params"], env, project, timeout=120)
        client_env = {
            **env,
            "PREFECT_API_URL": f"http://127.0.0.1:{env['SPIKELAB_PREFECT_PORT']}/api",
            "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{env['SPIKELAB_MLFLOW_PORT']}",
            **client_login(tmp_path / "state"),
        }
        stage = run([sys.executable, "-c", STAGE_LIKE_RUN, optuna_url], client_env, project, timeout=240)
        outputs += [params, stage]
        assert params.returncode == 0 and stage.returncode == 0, params.stderr + stage.stderr
        run_id = stage.stdout.split()[-1]

        with postgres.admin("mlflow_services") as db:
            assert db.execute("SELECT name FROM runs WHERE run_uuid = %s", (run_id,)).fetchall() == [
                ("stage-like run",)
            ]
            assert ("search.storage", optuna_url) in db.execute("SELECT key, value FROM params").fetchall()
        with postgres.admin("prefect_services") as db:
            assert db.execute("SELECT state_type FROM flow_run").fetchall() == [("COMPLETED",)]
        assert list((tmp_path / "shared" / "mlartifacts").rglob("notes.txt")), "MLflow's artifact went elsewhere"
        dashboard = f"http://127.0.0.1:{env['SPIKELAB_DASHBOARD_PORT']}/api/studies"
        with_login = ["curl", "-sf", "-K", "-", dashboard]  # the login on stdin, never on curl's command line
        auth = client_env["PREFECT_API_AUTH_STRING"]
        opened = subprocess.run(with_login, input=f'user = "{auth}"\n', capture_output=True, text=True, timeout=30)
        assert opened.returncode == 0  # it opened the database
        assert run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", dashboard], env, project).stdout == "401"

        import mlflow

        with pytest.MonkeyPatch.context() as patch:  # this head's login, not the test session's
            for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
                patch.setenv(key, client_env[key])
            record = mlflow.MlflowClient(client_env["MLFLOW_TRACKING_URI"]).get_run(run_id).data
        secret = postgres.password
        assert secret not in repr(record.params) + repr(record.tags)
        assert secret not in (project / "params" / "resolved.yaml").read_text()
        assert optuna_url in (project / "params" / "resolved.yaml").read_text()
        for log in (tmp_path / "state" / "services").glob("*.log"):
            assert secret not in log.read_text(errors="replace"), log.name
        assert len(servers) >= 3 and all(secret not in line for line in servers)
        assert all(secret not in " ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"]))
    finally:
        outputs.append(run(["spikelab", "services", "down"], env, project, timeout=120))
    for result in outputs:
        assert secret not in result.stdout + result.stderr, result.args[:3]


def test_a_database_url_with_a_password_in_the_environment_is_refused_naming_the_variable(tmp_path):
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),
        "SPIKELAB_STATE": str(tmp_path / "state"),
        "SPIKELAB_MLFLOW_DB": "postgresql://mlflow:hunter2@127.0.0.1:5432/mlflow",
    }
    (tmp_path / "params.yaml").write_text("search:\n  workers: 0\n")
    refused = run(["spikelab", "services", "up"], env, tmp_path, timeout=120)
    assert refused.returncode != 0 and "SPIKELAB_MLFLOW_DB: the URL carries a password" in refused.stderr
    assert "hunter2" not in refused.stdout + refused.stderr
    assert not list((tmp_path / "state").glob("services/*.json")), "nothing may start"
