"""Act as another local user of the machine: code run by the system's Python 3 as ``nobody``, with
none of the owner's environment (no login, no certificate), the way a colleague on a shared lab
server would probe the owner's servers. Needs root (to change user) and a Python 3 the other user
can run; each test skips, saying why, where either is missing.

The other user imports ``distributed`` (the cluster's own version) from a world-readable copy of
it and what it needs, made from this checkout's site-packages, which may lie in a folder the other
user cannot enter (a clone under a 0700 temporary directory).
"""

from __future__ import annotations

import functools
import os
import pwd
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

import pytest

OTHER = "nobody"
SESSION_ENV = "SPIKELAB_TEST_SESSION"
"""The test session's own folder (tests/conftest.py): only its owner lists or writes it, anyone
may pass through it to a folder whose name they are given."""
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")


def skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "acting as another user needs root (to change user); these tests run as root in CI"
    try:
        pwd.getpwnam(OTHER)
    except KeyError:
        return f"no user {OTHER!r} on this machine"
    if SYSTEM_PYTHON is None:
        return "no system python3 in /usr/bin for the other user"
    return None


def give_to(path: Path, owner: str | None) -> int:
    """Make ``path`` ``owner``'s (None: leave it this user's); the uid that owns it now. Skips,
    saying why, where another user cannot be acted as."""
    if owner is None:
        return os.getuid()
    if reason := skip_reason():
        pytest.skip(reason)
    uid = pwd.getpwnam(owner).pw_uid
    os.chown(path, uid, -1)
    return uid


def run_as_other_user(code: str, *args: str, stdin: str = "", timeout: float = 120) -> subprocess.CompletedProcess:
    """``code`` run by the system Python as ``nobody`` with ``args``, from ``/``, with a bare
    environment; what it prints comes back. ``stdin``: what the code reads (a login, never on its
    command line)."""
    return subprocess.run(
        [SYSTEM_PYTHON, "-c", code, *args], input=stdin, capture_output=True, timeout=timeout, **_as_other_user()
    )


def start_as_other_user(code: str, *args: str) -> subprocess.Popen:
    """``code`` started as :func:`run_as_other_user` runs it, left running; its output on pipes."""
    return subprocess.Popen(
        [SYSTEM_PYTHON, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, **_as_other_user()
    )


def _as_other_user() -> dict:
    if reason := skip_reason():
        pytest.skip(reason)
    user = pwd.getpwnam(OTHER)
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": str(readable_packages("distributed", "cryptography"))}
    return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": [], "cwd": "/", "env": env, "text": True}


@functools.cache
def readable_packages(*roots: str) -> Path:
    """A folder every user can read holding the installed distributions ``roots`` and everything
    they require (markers evaluated without extras), copied from this environment; removed at exit."""
    import atexit
    import importlib.metadata as metadata

    from packaging.requirements import Requirement

    folder = Path(tempfile.mkdtemp(prefix="other-user-", dir=os.environ[SESSION_ENV]))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    folder.chmod(0o755)
    site = Path(sysconfig.get_paths()["purelib"])
    todo, seen = list(roots), set()
    while todo:
        name = todo.pop()
        if name.lower().replace("_", "-") in seen:
            continue
        seen.add(name.lower().replace("_", "-"))
        dist = metadata.distribution(name)
        for file in dist.files or []:
            source = Path(dist.locate_file(file))
            if source.is_file() and source.resolve().is_relative_to(site.resolve()):
                target = folder / source.resolve().relative_to(site.resolve())
                target.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
                shutil.copy(source, target)
        for requirement in map(Requirement, dist.requires or []):
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    for path in folder.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return folder


def other_user_has_distributed() -> None:
    """Skip, saying why, where the other user cannot import ``distributed``."""
    done = run_as_other_user("import distributed")
    if done.returncode:
        pytest.skip(f"{OTHER} cannot import distributed from a copy of this environment's: {done.stderr[-300:]}")


DASK_PROBES = """
import json, sys
from distributed import Client
from distributed.security import Security

address, marker = sys.argv[1], sys.argv[2]

def plant():  # what the attacker wants run as the cluster's owner
    open(marker, "w").write("owned")
    return "ran"

results = {}
attempts = {
    "no certificate": lambda: Client(address, timeout=5, set_as_default=False),
    "a certificate of its own": lambda: Client(address, security=Security.temporary(), timeout=5, set_as_default=False),
    "plain tcp": lambda: Client(address.replace("tls://", "tcp://"), timeout=5, set_as_default=False),
}
for name, connect in attempts.items():
    try:
        client = connect()
        results[name] = client.run_on_scheduler(plant)
    except Exception as e:
        results[name] = "refused: " + type(e).__name__
print(json.dumps(results))
"""
"""Every way another user might reach a Dask scheduler and run code on it (``sys.argv``: the
address and the file its code would write). Prints what each attempt got."""


HTTP_PROBES = """
import json, sys, urllib.error, urllib.request
results = {}
for url in sys.argv[1:]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            results[url] = r.status
    except urllib.error.HTTPError as e:
        results[url] = e.code
    except OSError as e:
        results[url] = "no answer: " + type(e).__name__
print(json.dumps(results))
"""
"""GET each URL in ``sys.argv``; prints the status each answered with."""

DASK_HTTP_ROUTES = {"/health": 200, "/info/main/workers.html": 404, "/json/counts.json": 404, "/metrics": 404}
"""What a Dask scheduler's or worker's HTTP port may tell anyone who reaches it: that it is alive.
Dask's defaults there show task keys, tracebacks, worker logs and call stacks."""


def dask_http_seen_by_other_user(client) -> dict[str, int | str]:
    """The status each of :data:`DASK_HTTP_ROUTES` answers another user with, on the HTTP ports of
    the scheduler and every worker behind ``client`` (a Dask client of the owner's)."""
    import json

    ports = [client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.http_server.port)]
    ports += client.run(lambda dask_worker: dask_worker.http_server.port).values()
    urls = [f"http://127.0.0.1:{port}{route}" for port in ports for route in DASK_HTTP_ROUTES]
    done = run_as_other_user(HTTP_PROBES, *urls)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def dask_http_expected(seen: dict[str, int | str]) -> dict[str, int | str]:
    """:data:`DASK_HTTP_ROUTES`' statuses for the URLs in ``seen``."""
    return {url: DASK_HTTP_ROUTES["/" + url.split("/", 3)[3]] for url in seen}


PORT_SQUATTER = """
import http.server, sys
class Impostor(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # answers like one of the owner's servers, and keeps any login it is sent
        login = self.headers.get("Authorization")
        if login:
            print("sent a login", flush=True)
        self.send_response(200 if login or self.path.endswith("/health") else 401)
        self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Impostor)
print(server.server_address[1], flush=True)
server.serve_forever()
"""
"""Another user's server on a port the owner's server wanted (taken first, while the owner's
failed to bind): answers the health check as a server of the owner's would, asks for the login,
and prints ``sent a login`` for each it gets. Prints its port first."""
