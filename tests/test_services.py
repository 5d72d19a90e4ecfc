"""Servers belong to a checkout: a stage uses a server only when it provably serves this
checkout's state directory, and ``services down`` stops only what it can prove it started."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def foreign_server(tmp_path):
    """Another checkout's server: something on the port that answers the health check."""
    (tmp_path / "www/api").mkdir(parents=True)
    (tmp_path / "www/api/health").write_text("true")
    (tmp_path / "www/health").write_text("OK")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        cwd=tmp_path / "www",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    from tasks.runtime.services import answers

    deadline = time.monotonic() + 30
    while not answers(f"http://127.0.0.1:{port}/api/health"):
        assert time.monotonic() < deadline, "test server did not start"
        time.sleep(0.1)
    yield port, proc
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture()
def checkout(tmp_path, monkeypatch, foreign_server):
    """This checkout: its own state directory, its ports pointing at the foreign server."""
    port, _ = foreign_server
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "PREFECT_HOME")}
    env.update(SPIKELAB_STATE=str(tmp_path / "state"), SPIKELAB_PREFECT_PORT=str(port), SPIKELAB_MLFLOW_PORT=str(port))
    monkeypatch.setattr(os, "environ", env)
    return tmp_path / "state"


def test_a_server_of_another_checkout_is_not_used_and_the_stage_says_so(checkout, capsys):
    from tasks.runtime import services

    chosen = services.configure_environment()
    assert chosen == {"prefect": "temporary server", "mlflow": f"sqlite:///{checkout / 'mlflow.db'}"}
    assert "answers but does not serve this checkout's state" in capsys.readouterr().err


def test_a_pid_record_of_another_process_proves_nothing(checkout, foreign_server):
    from tasks.runtime import services

    port, proc = foreign_server
    (checkout / "services").mkdir(parents=True)
    (checkout / "services/prefect.json").write_text(json.dumps({"pid": proc.pid, "create_time": 0.0, "port": port}))
    assert not services.serves_this_checkout("prefect")
    assert "serves another checkout" in services.status()["prefect"]


def test_down_leaves_a_server_it_did_not_start_running(checkout, foreign_server, capsys):
    from tasks.runtime import services

    _, proc = foreign_server
    services.down()
    assert proc.poll() is None
    assert "was not started by this checkout; left running" in capsys.readouterr().out


SLOW_SERVER = """
import http.server, sys, time
class Slow(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        time.sleep(1.0)  # a server that just started (MLflow's workers) or is busy: slower than one probe
        asks = not self.path.endswith("/health") and "Authorization" not in self.headers and sys.argv[2] != "open"
        try:
            self.send_response(401 if asks else 200)
            self.end_headers()
            self.wfile.write(b"OK")
        except OSError:  # the client gave up
            pass
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Slow).serve_forever()
"""


@pytest.fixture(params=["asks for the login"])
def own_slow_servers(tmp_path, monkeypatch, request):
    """This checkout's servers, started as ``services up`` records them, answering only after 1 s,
    asking for the login as ours do (or, ``open``, as an older spikelab's did)."""
    import psutil

    state = tmp_path / "state"
    (state / "services").mkdir(parents=True)
    ports = {"prefect": free_port(), "mlflow": free_port()}
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "PREFECT_HOME")}
    env.update(
        SPIKELAB_STATE=str(state),
        SPIKELAB_PREFECT_PORT=str(ports["prefect"]),
        SPIKELAB_MLFLOW_PORT=str(ports["mlflow"]),
    )
    procs = []
    for name, port in ports.items():
        command = [sys.executable, "-c", SLOW_SERVER, str(port), request.param]
        proc = subprocess.Popen(command, env=env, stderr=subprocess.DEVNULL)
        procs.append(proc)
        record = {"pid": proc.pid, "create_time": psutil.Process(proc.pid).create_time(), "port": port}
        (state / "services" / f"{name}.json").write_text(json.dumps(record))
    monkeypatch.setattr(os, "environ", env)
    from tasks.runtime import credentials
    from tasks.runtime.services import answers

    credentials.ensure()  # the login `up` would have made (these servers take any)
    deadline = time.monotonic() + 30
    while not all(answers(f"http://127.0.0.1:{port}/health", timeout=5) for port in ports.values()):
        assert time.monotonic() < deadline, "test servers did not start"
    yield ports
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_stage_waits_for_this_checkouts_own_server_when_it_answers_slowly(own_slow_servers, capsys):
    """One slow health check (a server just started, or busy) must not send a stage, or a whole
    test session, to the local stores: their runs would carry no links to the MLflow UI."""
    from tasks.runtime import paths, services

    chosen = services.configure_environment()
    assert chosen == {"prefect": paths.prefect_url(), "mlflow": paths.mlflow_url()}, capsys.readouterr().err
    assert services.serves_this_checkout("mlflow", patience=5)
    assert services.status()["mlflow"].endswith("(this checkout)")


@pytest.mark.parametrize("own_slow_servers", ["open"], indirect=True)
def test_a_server_of_this_checkout_that_answers_without_a_login_is_refused(own_slow_servers):
    """One an older spikelab started before servers asked for a login: any local user can use it,
    so a stage stops, saying how to restart it, rather than log to it."""
    from model.typed_config import UserError
    from tasks.runtime import services

    with pytest.raises(UserError, match="prefect server at .* answers without a login, so any local user can use it"):
        services.configure_environment()


@pytest.mark.e2e
def test_a_server_that_fails_to_start_leaves_none_of_the_others_holding_a_port(tmp_path, monkeypatch):
    """The dashboard's port is taken by a process that is no server of ours (it answers 404), so
    the dashboard exits; the Prefect and MLflow servers ``up`` started before it are stopped again."""
    import psutil

    from tasks.runtime import services

    ports = {"PREFECT": free_port(), "MLFLOW": free_port()}
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "PREFECT_HOME")}
    env.update({f"SPIKELAB_{name}_PORT": str(port) for name, port in ports.items()})
    env.update(SPIKELAB_STATE=str(tmp_path / "state"), SPIKELAB_DASHBOARD_PORT=str(squatter.getsockname()[1]))
    monkeypatch.setattr(os, "environ", env)
    try:
        with pytest.raises(SystemExit, match="dashboard"):
            services.up(timeout=240)
    finally:
        squatter.close()
    listening = {c.laddr.port for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    assert not listening & set(ports.values()) and not list((tmp_path / "state" / "services").glob("*.json"))


@pytest.mark.parametrize(("cores", "workers"), [(1, 1), (2, 1), (3, 1), (4, 2), (8, 4), (64, 4)])
def test_mlflow_takes_a_worker_per_two_cores_one_at_least_and_four_at_most(cores, workers):
    from tasks.runtime.services import mlflow_workers

    assert mlflow_workers(cores) == workers


def test_mlflow_serves_its_page_with_the_assistant_hidden_and_from_one_process_per_worker(live_services):
    import urllib.request

    from tasks.runtime import paths, services
    from tasks.runtime.credentials import basic_auth
    from tasks.runtime.mlflow_app import HIDDEN_ASSISTANT

    login = f"{live_services['MLFLOW_TRACKING_USERNAME']}:{live_services['MLFLOW_TRACKING_PASSWORD']}"
    request = urllib.request.Request(f"{paths.mlflow_url()}/", headers=basic_auth(login))
    with urllib.request.urlopen(request, timeout=30) as response:
        assert HIDDEN_ASSISTANT in response.read().decode()
    server = services.started_process("mlflow")
    assert "uvicorn" in server.cmdline(), "MLflow's CLI became its server: no supervisor beside it"
    workers = services.mlflow_workers()
    assert len(server.children()) == (0 if workers == 1 else workers + 1)  # uvicorn's workers, its resource tracker
