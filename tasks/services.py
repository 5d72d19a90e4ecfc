"""Start, stop and inspect the local Prefect and MLflow servers (bound to 127.0.0.1).

Both write their stores under the state directory (tasks/paths.py), run detached from the
terminal that started them, and log to ``<state>/services/<name>.log``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tasks import paths


@dataclass(frozen=True)
class Service:
    name: str
    command: list[str]
    env: dict[str, str]
    is_up: Callable[[], bool]
    url: str


def services() -> list[Service]:
    s = paths.state()
    s.mlflow_artifacts.mkdir(parents=True, exist_ok=True)
    bin_dir = Path(sys.executable).parent
    return [
        Service("prefect", [str(bin_dir / "prefect"), "server", "start", "--host", paths.HOST,
                            "--port", str(paths.prefect_port())],
                {"PREFECT_HOME": str(s.prefect_home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"},
                paths.prefect_up, paths.prefect_url().removesuffix("/api")),
        Service("mlflow", [str(bin_dir / "mlflow"), "server", "--host", paths.HOST,
                           "--port", str(paths.mlflow_port()),
                           "--backend-store-uri", f"sqlite:///{s.mlflow_db}",
                           "--default-artifact-root", s.mlflow_artifacts.as_uri(),
                           "--no-serve-artifacts"],
                {}, paths.mlflow_up, paths.mlflow_url()),
    ]


def _pid_file(name: str) -> Path:
    return paths.state().services / f"{name}.pid"


def up(timeout: float = 180.0) -> None:
    """Start whichever server is not answering; wait until both answer."""
    paths.state().services.mkdir(parents=True, exist_ok=True)
    for svc in services():
        if svc.is_up():
            print(f"{svc.name}: already up at {svc.url}")
            continue
        log = open(paths.state().services / f"{svc.name}.log", "ab")
        proc = subprocess.Popen(svc.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **svc.env}, start_new_session=True)
        _pid_file(svc.name).write_text(str(proc.pid))
    deadline = time.monotonic() + timeout
    for svc in services():
        while not svc.is_up():
            if time.monotonic() > deadline:
                raise SystemExit(f"{svc.name} did not answer within {timeout:.0f} s; "
                                 f"see {paths.state().services / (svc.name + '.log')}")
            time.sleep(0.5)
        print(f"{svc.name}: up at {svc.url}")


def down() -> None:
    """Stop the servers this module started (their whole process groups)."""
    for svc in services():
        pid_file = _pid_file(svc.name)
        if not pid_file.is_file():
            continue
        pid = int(pid_file.read_text())
        try:
            os.killpg(pid, signal.SIGTERM)
            print(f"{svc.name}: stopped (pid {pid})")
        except ProcessLookupError:
            pass
        pid_file.unlink()


def status() -> dict[str, bool]:
    return {svc.name: svc.is_up() for svc in services()}
