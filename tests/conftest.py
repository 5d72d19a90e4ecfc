"""Shared fixtures. ``live_services`` runs a real Prefect server and a real MLflow server on
loopback ports of their own, with all state in a temporary directory, once per test session.

The session's temporary folders (pytest's ``tmp_path`` and every engine's scratch: TMPDIR, DVC's
site cache, Dask's, torch's) live in one folder made for it alone: ``mkdtemp`` in the machine's
temporary folder (``SPIKELAB_TEST_TMPDIR``, default /tmp: an unpredictable name, that only its
owner can list or write), not in the checkout, where a test's project would find the checkout's
``params.yaml`` above it. When the session ends, any new entry this user made in a shared folder
(/tmp, /var/tmp, /dev/shm; POSIX semaphores aside) fails the run, naming it: a new engine's scratch
that is not private yet.

``python -m pytest -n 2`` runs the suite on two worker processes (pytest-xdist): a test file
is one unit of work, so its module fixtures run once, and each group of files in :data:`GROUPS` is
one (the shared smoke pipeline's readers, so it runs once; the files that plant one machine-wide
name, so neither meets the other's plant). Each worker has a folder of its own below the session's and
its own test servers (``live_services``, on ports :data:`WORKER_PORT_STEP` apart); the shared-folder
check runs once, in the process that started the workers, after they have all finished. ``make test``
runs two workers; ``python -m pytest`` alone runs one process, as before."""

from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.other_user import SESSION_ENV  # noqa: E402  (found through ROOT)

pytest_plugins = ["tests.smoke_study"]  # the smoke pipeline the end-to-end tests share

SHARED_FOLDERS = ("/tmp", "/var/tmp", "/dev/shm")
SEMAPHORES = "/dev/shm/sem."
"""glibc's POSIX semaphores (multiprocessing, loky): random names made with ``O_EXCL``, nothing
moves them, and a worker killed by a test may leave its own behind (scripts/trace_shared_paths.py)."""


def owned_entries(folders: tuple[str, ...] = SHARED_FOLDERS) -> set[str]:
    """The entries this user owns right inside ``folders``, semaphores aside."""
    found = set()
    for folder in map(Path, folders):
        for entry in folder.iterdir() if folder.is_dir() else []:
            try:
                if entry.lstat().st_uid == os.getuid() and not str(entry).startswith(SEMAPHORES):
                    found.add(str(entry))
            except FileNotFoundError:  # removed while listed
                continue
    return found


WORKER = os.environ.get("PYTEST_XDIST_WORKER")
"""This process's xdist worker id (gw0, gw1, ...); None in a run without workers, and in the
process that starts them."""
SMOKE_GROUP = ("test_pipeline.py", "test_ui.py")
"""The files whose tests read the shared smoke pipeline (tests/smoke_study.py): one unit of work."""
PLANTING_GROUP = ("test_private_env.py", "test_run_dirs.py")
"""The files whose tests plant the one machine-wide name /tmp/torchinductor_<user> as another user
(and skip when it exists): one unit of work, so neither finds the other's plant and skips."""
GROUPS = {name: group[0] for group in (SMOKE_GROUP, PLANTING_GROUP) for name in group}


def pytest_configure(config: pytest.Config) -> None:
    from tasks.runtime.private_env import use_private_env

    if WORKER:  # below the folder the starting process made (its environment is the worker's)
        session_root = Path(os.environ[SESSION_ENV]) / WORKER
        session_root.mkdir(mode=0o711)
        os.environ[SESSION_ENV] = str(session_root)  # what each worker's tests make there is its own
    else:
        config.stash[SHARED_BEFORE] = owned_entries()
        session_root = Path(
            tempfile.mkdtemp(prefix="spikelab-tests-", dir=os.environ.get("SPIKELAB_TEST_TMPDIR", "/tmp"))
        )
        session_root.chmod(0o711)  # the other user's copy of the packages is reached by its name (tests/other_user.py)
        os.environ[SESSION_ENV] = str(session_root)
    use_private_env(session_root / "scratch")
    if config.option.basetemp is None:
        config.option.basetemp = str(session_root / "pytest")


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Each test file one unit of work (its module fixtures run once, its tests in order), each of
    :data:`GROUPS`' groups one: xdist's file scheduling with a group's files as one scope."""
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return GROUPS.get(Path(path).name, path)

    return FileScheduling(config, log)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Fail a session that left a new entry of this user's in a shared folder, naming it; else
    remove the session's folder (kept after a failure, for its tests' files). A worker leaves both
    to the process that started it."""
    if WORKER:
        return
    session_root = os.environ[SESSION_ENV]
    new = owned_entries() - session.config.stash[SHARED_BEFORE] - {session_root}
    if new:
        lines = [
            f"{path} (mode {stat.S_IMODE(os.lstat(path).st_mode):04o})" for path in sorted(new) if os.path.lexists(path)
        ]
        print(
            "\nthe session left these in shared folders (make them private: tasks/runtime/private_env.py):",
            *lines,
            sep="\n  ",
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if session.exitstatus == pytest.ExitCode.OK:
        shutil.rmtree(session_root, ignore_errors=True)
    else:
        print(f"\nthe session's temporary files: {session_root}")


SHARED_BEFORE = pytest.StashKey[set]()

WORKER_PORT_STEP = 100
"""Worker gwN's test servers listen N x this above the ports below."""


def server_port(name: str, default: int) -> str:
    """A test server's port: ``$SPIKELAB_TEST_<name>_PORT`` (else ``default``), this worker's step up."""
    step = int(WORKER.removeprefix("gw")) * WORKER_PORT_STEP if WORKER else 0
    return str(int(os.environ.get(f"SPIKELAB_TEST_{name}_PORT", default)) + step)


TEST_PORTS = {
    "SPIKELAB_PREFECT_PORT": server_port("PREFECT", 4299),
    "SPIKELAB_MLFLOW_PORT": server_port("MLFLOW", 5099),
    "SPIKELAB_DASHBOARD_PORT": server_port("DASHBOARD", 8099),
}
"""Ports of the test servers: set SPIKELAB_TEST_PREFECT_PORT / SPIKELAB_TEST_MLFLOW_PORT /
SPIKELAB_TEST_DASHBOARD_PORT when several checkouts run their suites on one machine (each
worker takes its own step above them: :data:`WORKER_PORT_STEP`)."""


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
