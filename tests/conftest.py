"""Shared fixtures. ``live_services`` runs a real Prefect server and a real MLflow server on
loopback ports of their own, with all state in a temporary directory, once per test session."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TEST_PORTS = {
    "SPIKELAB_PREFECT_PORT": os.environ.get("SPIKELAB_TEST_PREFECT_PORT", "4299"),
    "SPIKELAB_MLFLOW_PORT": os.environ.get("SPIKELAB_TEST_MLFLOW_PORT", "5099"),
    "SPIKELAB_DASHBOARD_PORT": os.environ.get("SPIKELAB_TEST_DASHBOARD_PORT", "8099"),
}
"""Ports of the test servers: set SPIKELAB_TEST_PREFECT_PORT / SPIKELAB_TEST_MLFLOW_PORT /
SPIKELAB_TEST_DASHBOARD_PORT when several checkouts run their suites on one machine."""


@pytest.fixture(scope="session")
def live_services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Environment of a session with both servers up; subprocesses inherit it."""
    state = tmp_path_factory.mktemp("state")
    saved = dict(os.environ)
    os.environ.update({"SPIKELAB_STATE": str(state), **TEST_PORTS})
    for key in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "PREFECT_HOME"):
        os.environ.pop(key, None)
    from tasks.runtime import paths, services

    services.up(timeout=240)
    chosen = services.configure_environment()
    assert chosen == {"prefect": paths.prefect_url(), "mlflow": paths.mlflow_url()}, (
        f"stages must use the running servers, not the local stores: {chosen}"
    )
    try:
        yield dict(os.environ)
    finally:
        services.down()
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL server for the session (tests/postgres_kit.py); skips, saying why, without one."""
    from tests.postgres_kit import postgres_server

    with postgres_server() as server:
        yield server
