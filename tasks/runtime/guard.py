"""Withhold the login from whatever takes a server's port after a process started using the server.

A process (a stage, ``spikelab serve``) is given the login for this checkout's Prefect and MLflow
servers once, at start, after proving that the server on each port is the one ``services up``
started (tasks/runtime/services.py). Its clients connect again later (a pool that dropped an idle
connection, a retry) and send the login with every request. Should the server die, another local
user may bind its port in the meantime and be sent the login. So each connect of this process to a
guarded server's port first checks, without the network, that the server it was started with still
holds the port, and is refused otherwise (:class:`LoginWithheld`), that connect and every later one
to that port, saying why on stderr once: the stage fails rather than send the login to another
process. A server ``services up`` started again since is no exception: its process is not the one
the stage proved its own. A refused MLflow call fails the stage at once; Prefect's clients report
task runs, events and logs from background threads that log a failure and go on, so a stage that
lost its Prefect server fails when its flow run ends, as it did with the server down before.

The check hangs on the ``socket.connect`` audit event (PEP 578), which every connect through
Python's socket module raises, in whichever library and thread: requests/urllib3 (MLflow),
httpx/httpcore sync and async over anyio and asyncio (Prefect), websockets (Prefect's events). A
client that connects in C raises none (uvloop, libcurl, libpq): none talks to these servers here.
The hook lives as long as the process: a process started anew has none until it installs its own
(a Dask worker does, through services.dask_setup; a flow run that ``spikelab serve`` starts does not).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn
from urllib.parse import urlsplit


class LoginWithheld(RuntimeError):
    """A connect to a guarded server's port refused: the server no longer holds it. Not an
    OSError, which the clients take for a server restarting and retry with back-off (Prefect's for
    about a minute, MLflow's for four), refused each time: this one ends the request at once."""


@dataclass(frozen=True)
class Guard:
    server: str
    url_env: str
    """The variable that points this process's clients at the server (``PREFECT_API_URL``)."""
    url: str
    pid: int
    """The server's process, as proven when the login was handed out."""
    port: int
    addresses: frozenset[str]
    """The IP addresses the URL's host resolves to: what a connect names."""
    holds_port: Callable[[], bool]
    """That process, or one it started, still listens on the port (no network)."""

    def covers(self, host: object) -> bool:
        """A connect to ``host`` on this port goes to the server while this process is pointed at
        it: a test that put its environment back is done with the server it had started."""
        return host in self.addresses and os.environ.get(self.url_env) == self.url

    def refusal(self) -> str:
        return (
            f"spikelab: the {self.server} server (pid {self.pid}) no longer holds port {self.port} on "
            f"{urlsplit(self.url).hostname}; every connect there is refused rather than send the login to another "
            "process, and the stage fails (`spikelab services up` starts the servers again)"
        )


_guards: dict[int, Guard] = {}
"""The guarded servers by port."""
_refused: set[Guard] = set()
"""The guards that refused a connect: they refuse every later one (the server is gone for good)."""
_refusing = threading.Lock()


def withhold_login(server: str, url_env: str, pid: int, holds_port: Callable[[], bool]) -> None:
    """From now on, a connect of this process to the server at ``os.environ[url_env]`` is refused
    unless ``holds_port()`` (the server ``pid``, which this process was just given the login for,
    still holds the URL's port). The audit hook is added once per process."""
    url = os.environ[url_env]
    where = urlsplit(url)
    port = where.port or 80
    found = socket.getaddrinfo(where.hostname, port, type=socket.SOCK_STREAM)
    if not _guards:
        sys.addaudithook(_on_audit_event)
    _guards[port] = Guard(server, url_env, url, pid, port, frozenset(str(info[4][0]) for info in found), holds_port)


def _on_audit_event(event: str, args: tuple[Any, ...]) -> None:
    """Called for every audited event of the process (opens, imports, ...): return at once unless a connect."""
    if event == "socket.connect":
        _check_connect(args[1])


def _check_connect(address: object) -> None:
    """``address``: what ``socket.connect`` was given (a path for a Unix socket, ``(host, port, ...)``)."""
    if not isinstance(address, tuple) or len(address) < 2:
        return
    guard = _guards.get(address[1])
    if guard is not None and guard.covers(address[0]) and (guard in _refused or not guard.holds_port()):
        _refuse(guard)


def _refuse(guard: Guard) -> NoReturn:
    message = guard.refusal()
    with _refusing:
        first = guard not in _refused
        _refused.add(guard)
    if first:
        print(message, file=sys.stderr, flush=True)
    raise LoginWithheld(message)
