"""A stage checks, at every connect, that the server it was given the login for still holds its port
(tasks/runtime/guard.py). The attack: this checkout's server dies while a stage runs, another local
user (``nobody``) binds its port, and the stage's clients, reconnecting, send it the login. Each
client is refused instead, saying why, and the impostor is never sent the login; while the server
holds its port the same requests go through."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.other_user import PORT_SQUATTER, skip_reason, start_as_other_user

ROOT = Path(__file__).resolve().parents[1]
PORTS = range(47100, 47200)
"""Ports other test runs on this machine leave alone."""


def on_given_port(code: str) -> str:
    """:data:`PORT_SQUATTER`'s server bound to the port in its first argument, not any free one."""
    any_port = '("127.0.0.1", 0)'
    assert any_port in code, "PORT_SQUATTER no longer binds where this test expects"
    return code.replace(any_port, '("127.0.0.1", int(sys.argv[1]))')


SERVER = on_given_port(PORT_SQUATTER)
"""A server that asks for the login: this checkout's stand-in, or run as ``nobody`` an impostor
that prints ``sent a login`` for each it gets."""

STAGE = """
import asyncio, json, os, sys, time, traceback
import httpx, requests
from tasks.runtime import services

SERVER_PORTS = {int(os.environ["SPIKELAB_PREFECT_PORT"]), int(os.environ["SPIKELAB_MLFLOW_PORT"])}
connects = [0]

def count_connects(event, args):  # added before the guard's hook, so it sees the connects the guard refuses
    if event == "socket.connect" and isinstance(args[1], tuple) and len(args[1]) >= 2 and args[1][1] in SERVER_PORTS:
        connects[0] += 1

sys.addaudithook(count_connects)
services.configure_environment()
prefect, mlflow = os.environ["PREFECT_API_URL"], os.environ["MLFLOW_TRACKING_URI"]
prefect_login = tuple(os.environ["PREFECT_API_AUTH_STRING"].split(":", 1))
mlflow_login = (os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"])
session = requests.Session()  # MLflow's client: a requests session, basic auth
client = httpx.Client(auth=prefect_login)  # Prefect's: httpx, sync and async

async def prefect_async():
    async with httpx.AsyncClient(auth=prefect_login) as async_client:
        return await async_client.get(prefect + "/flows/filter")

def mlflow_client():
    from mlflow import MlflowClient
    return MlflowClient().search_experiments()

def prefect_client():
    from prefect.client.orchestration import get_client
    with get_client(sync_client=True) as prefect_client:
        return prefect_client.hello()

RAW = {
    "mlflow (requests)": lambda: session.get(mlflow + "/api/2.0/mlflow/experiments/search", auth=mlflow_login),
    "prefect (httpx)": lambda: client.get(prefect + "/flows/filter"),
    "prefect (httpx, async)": lambda: asyncio.run(prefect_async()),
}
ENGINES = {"mlflow (its client)": mlflow_client, "prefect (its client)": prefect_client}

def outcome(call):
    started, connects[0] = time.monotonic(), 0
    try:
        said = call().status_code
    except Exception as e:
        said = "".join(traceback.format_exception(e))
    return {"said": said, "connects": connects[0], "seconds": time.monotonic() - started}

print(json.dumps({name: outcome(call) for name, call in RAW.items()}), flush=True)
sys.stdin.readline()  # the servers are gone and their ports taken meanwhile
print(json.dumps({name: outcome(call) for name, call in {**RAW, **ENGINES}.items()}), flush=True)
"""
"""A stage's side: configured against this checkout's servers, it sends each the login the way
MLflow's and Prefect's clients do, then, once told, again, and with the engines' own clients.
Prints what each request got (a status, or the error's traceback), how many connects it made to
the servers' ports and how long it took (for the reader: the test asserts on the connects)."""


def serve_on_a_free_port(taken: set[int], env: dict[str, str]) -> tuple[int, subprocess.Popen]:
    """:data:`SERVER` listening on the first port of :data:`PORTS` it can take (a port another
    process takes between a check and the server's listen is skipped, not a failure)."""
    for port in sorted(set(PORTS) - taken):
        proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], env=env, stdout=subprocess.PIPE, text=True)
        if listening := proc.stdout.readline():
            assert int(listening) == port
            return port, proc
        proc.wait(timeout=10)  # the port was taken: the server said so on stderr and ended
    pytest.skip(f"no free port in {PORTS}")


@pytest.fixture()
def own_servers(tmp_path, monkeypatch):
    """This checkout's Prefect and MLflow servers as ``up`` records them (stand-ins asking for the
    login), and the environment of a stage pointed at them."""
    import psutil

    if reason := skip_reason():
        pytest.skip(reason)
    state = tmp_path / "state"
    (state / "services").mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "PREFECT_HOME")}
    env["SPIKELAB_STATE"] = str(state)
    ports: dict[str, int] = {}
    servers = {}
    for name in ("prefect", "mlflow"):
        ports[name], servers[name] = serve_on_a_free_port(set(ports.values()), env)
    env |= {f"SPIKELAB_{name.upper()}_PORT": str(p) for name, p in ports.items()}
    for name, port in ports.items():
        record = {
            "pid": servers[name].pid,
            "create_time": psutil.Process(servers[name].pid).create_time(),
            "port": port,
        }
        (state / "services" / f"{name}.json").write_text(json.dumps(record))
    monkeypatch.setattr(os, "environ", env)
    from tasks.runtime import credentials

    credentials.ensure()  # the login `up` made
    yield ports, servers, env
    for proc in servers.values():
        proc.kill()
        proc.wait(timeout=10)


def test_a_port_another_user_took_after_the_server_died_is_never_sent_the_login(own_servers):
    from tasks.runtime import paths

    ports, servers, env = own_servers
    stage = subprocess.Popen(
        [sys.executable, "-c", STAGE],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    impostors = []
    try:
        first = json.loads(stage.stdout.readline() or "null")
        assert first is not None, stage.communicate(timeout=30)[1][-3000:]
        assert {name: got["said"] for name, got in first.items()} == dict.fromkeys(first, 200)  # the server holds it
        for proc in servers.values():
            proc.kill()
            proc.wait(timeout=10)
        for port in ports.values():
            impostors.append(start_as_other_user(SERVER, str(port)))
            assert int(impostors[-1].stdout.readline()) == port  # nobody holds the port now
        stage.stdin.write("go\n")
        stage.stdin.flush()
        second = json.loads(stage.stdout.readline() or "null")
        _, said = stage.communicate(timeout=60)
        assert second is not None, said[-3000:]
    finally:
        stage.kill()
        for impostor in impostors:
            impostor.kill()
    refusals = {
        name: f"the {name} server (pid {servers[name].pid}) no longer holds port {port} on {paths.HOST}; "
        "every connect there is refused rather than send the login to another process, and the stage fails"
        for name, port in ports.items()
    }
    for request, got in second.items():
        assert refusals[request.split()[0]] in str(got["said"]), (request, got["said"])
        assert got["connects"] == 1, (
            f"{request}: {got['connects']} connects ({got['seconds']:.0f} s), retried instead of stopping at the first"
        )
    assert [line for line in said.splitlines() if "no longer holds port" in line] == [
        f"spikelab: {refusals['mlflow']} (`spikelab services up` starts the servers again)",
        f"spikelab: {refusals['prefect']} (`spikelab services up` starts the servers again)",
    ]  # once per server, however many connects were refused
    for impostor in impostors:
        assert "sent a login" not in impostor.communicate(timeout=10)[0]


WORKERS = """
import json
from tasks.runtime import services
services.configure_environment()
from distributed import Client, LocalCluster
from tasks.runtime.workers import cluster_kwargs, configured_cluster

def guarded_ports():
    from tasks.runtime import guard
    return sorted(guard._guards)

with configured_cluster(), LocalCluster(**cluster_kwargs(1)) as cluster, Client(cluster) as client:
    print(json.dumps(list(client.run(guarded_ports).values())))
"""
"""A stage's own Dask cluster, started after the stage was given the login: the ports each worker guards."""


def test_a_stages_dask_workers_guard_their_connects_as_the_stage_does(own_servers):
    ports, _, env = own_servers
    done = subprocess.run(
        [sys.executable, "-c", WORKERS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == [sorted(ports.values())]
