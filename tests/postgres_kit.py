"""A real PostgreSQL server for tests: a throwaway cluster in a temporary directory, on a free
loopback port, with a login role that authenticates by password (scram-sha-256) and a database
per use. Its unix socket lives in the temporary directory; the superuser logs in through it only
(``trust`` on the socket, which nobody else can reach); TCP clients must give the role's password,
as they would on a head node. ``initdb`` refuses root, so as root the cluster belongs to ``nobody``.

``postgres_server()`` is a context manager; ``tests/conftest.py`` exposes it as the session
fixture ``postgres``. Every command is bounded in time; the server is stopped (or killed by the
pid it wrote) on the way out.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.other_user import SESSION_ENV
from tests.test_services import free_port

HOST = "127.0.0.1"
ROLE = "spikelab"
SUPERUSER = "postgres"
COMMAND_TIMEOUT_S = 60


@dataclass(frozen=True)
class Postgres:
    """A running server: TCP on ``HOST:port`` for ``ROLE`` with ``password``; the socket for the superuser."""

    port: int
    socket_dir: Path
    password: str

    def env(self) -> dict[str, str]:
        """What a client process needs besides a URL: the password, where libpq and asyncpg look for it."""
        return {"PGPASSWORD": self.password}

    def url(self, database: str, scheme: str = "postgresql") -> str:
        """The database's URL for ``ROLE``, without the password."""
        return f"{scheme}://{ROLE}@{HOST}:{self.port}/{database}"

    def admin(self, database: str = "postgres"):
        """A superuser connection over the socket (autocommit), for set-up and for reading what clients wrote."""
        import psycopg

        return psycopg.connect(
            host=str(self.socket_dir), port=self.port, user=SUPERUSER, dbname=database, autocommit=True
        )

    def create_database(self, name: str) -> str:
        """A fresh database owned by ``ROLE``; returns its URL."""
        from psycopg import sql

        with self.admin() as conn:
            conn.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(name), sql.Identifier(ROLE)))
        return self.url(name)


def missing() -> str | None:
    """Why no server can be started here, or None."""
    for binary in ("initdb", "pg_ctl"):
        if shutil.which(binary) is None:
            return f"PostgreSQL's {binary} is not on PATH (Debian: apt-get install postgresql)"
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg 3 is not installed (pip install -e '.[cluster]')"
    return None


def as_cluster_owner(command: list[str]) -> list[str]:
    """``command`` as the user who owns the cluster: ``nobody`` when we are root (initdb refuses root)."""
    return ["runuser", "-u", "nobody", "--", *command] if os.geteuid() == 0 else command


def run(command: list[str]) -> None:
    subprocess.run(as_cluster_owner(command), check=True, capture_output=True, timeout=COMMAND_TIMEOUT_S)


@contextmanager
def postgres_server() -> Iterator[Postgres]:
    """Start a server in a fresh temporary directory; skip (saying why) when PostgreSQL is missing."""
    if reason := missing():
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix="postgres-", dir=os.environ[SESSION_ENV]))  # nobody passes through to it
    if os.geteuid() == 0:
        nobody = pwd.getpwnam("nobody")
        os.chown(root, nobody.pw_uid, nobody.pw_gid)
    data, port = root / "data", free_port()
    server = Postgres(port, root, secrets.token_urlsafe(24))
    try:
        run(["initdb", "-D", str(data), "-U", SUPERUSER, "-A", "trust", "--auth-host=scram-sha-256", "-E", "UTF8"])
        settings = f"-c listen_addresses={HOST} -c port={port} -c unix_socket_directories={root} -c fsync=off"
        run(["pg_ctl", "-D", str(data), "-l", str(root / "server.log"), "-o", settings, "-w", "-t", "30", "start"])
        create_role(server)
        yield server
    finally:
        _stop(data)
        shutil.rmtree(root, ignore_errors=True)


def create_role(server: Postgres) -> None:
    """``ROLE`` with the server's password, sent over the socket (never on a command line)."""
    from psycopg import sql

    with server.admin() as conn:
        conn.execute(
            sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(sql.Identifier(ROLE), sql.Literal(server.password))
        )


def _stop(data: Path) -> None:
    """Stop the server; kill its postmaster by the pid it recorded when ``pg_ctl stop`` does not."""
    pid_file = data / "postmaster.pid"
    if not pid_file.is_file():
        return
    try:
        run(["pg_ctl", "-D", str(data), "-m", "immediate", "-w", "-t", "30", "stop"])
    except (subprocess.SubprocessError, OSError):
        if pid_file.is_file():
            os.kill(int(pid_file.read_text().split()[0]), signal.SIGKILL)
