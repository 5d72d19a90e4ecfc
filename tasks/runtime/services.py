"""Start, stop and inspect the local Prefect and MLflow servers and optuna-dashboard (bound to
127.0.0.1; beyond loopback to ``SPIKELAB_HOST``, over HTTPS with a certificate every client
verifies: :func:`verified_status`, :func:`trust_servers_ca`, tasks/runtime/tls.py), prove which
checkout a running server belongs to, and point a stage at them (:func:`configure_environment`:
before ``prefect`` is imported, which reads its settings then).

Every server asks for the login of tasks/runtime/credentials.py: Prefect through its own auth
string (``PREFECT_SERVER_API_AUTH_STRING``), MLflow through its basic-auth app
(tasks/runtime/mlflow_app.py: artifacts confined, no assistant), optuna-dashboard behind a
basic-auth check (tasks/runtime/dashboard.py). The login reaches each server and every stage
through the environment; a server that refuses it stops the stage with an error naming the server
and the credentials file (:func:`check_login`), never a retry without it.

Both write their stores under the state directory (tasks/runtime/paths.py), run detached from the
terminal that started them, and log to ``<state>/services/<name>.log``. On a head node they keep
their stores in PostgreSQL instead (:data:`MLFLOW_DB_ENV`, :data:`PREFECT_DB_ENV`,
:data:`MLFLOW_ARTIFACTS_ENV`), and optuna-dashboard reads ``search.storage`` when it is a database
URL. Those URLs carry no password (refused): the servers' database clients, libpq (psycopg) and
asyncpg, read PGPASSWORD or ~/.pgpass themselves, so it reaches them through the environment,
never a command line or a log.

Ownership: ``up`` records each server in ``<state>/services/<name>.json`` (pid, process start
time, port) and starts it with ``SPIKELAB_STATE=<state>`` in its environment (:func:`start_recorded`).
A server *serves this checkout* only when that record names a live process with the same start
time (not a recycled pid) whose environment carries this state directory and whose command line
names the port (:func:`recorded_process`), and the port answers. Stages use only such servers;
``down`` stops only such processes (:func:`stop_group`). ``spikelab cluster`` records its Dask
processes the same way (tasks/runtime/cluster.py).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shlex
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from model.typed_config import ConfigError, UserError, no_password
from tasks.runtime import credentials, guard, paths, tls

STATE_ENV = paths.STATE_ENV
MLFLOW_DB_ENV = "SPIKELAB_MLFLOW_DB"
"""``postgresql://user@host:port/db``: the MLflow server's backend store (else ``<state>/mlflow.db``)."""
PREFECT_DB_ENV = "SPIKELAB_PREFECT_DB"
"""``postgresql://user@host:port/db``: the Prefect server's database (else SQLite under its home).
Not MLflow's: both keep an ``alembic_version`` table."""
MLFLOW_ARTIFACTS_ENV = "SPIKELAB_MLFLOW_ARTIFACTS"
"""Where the MLflow server stores artifacts (a shared path or URI), served to clients through the
server (``--artifacts-destination``), so workers on other nodes need no access to it."""


@dataclass(frozen=True)
class Service:
    name: str
    command: list[str]
    env: dict[str, str]
    port: int
    is_up: Callable[..., bool]
    """``is_up(timeout=0.5)``: its health check answers 2xx within ``timeout`` seconds."""
    url: str
    """The address of its UI."""


class UntrustedServer(UserError):
    """An HTTPS server whose certificate does not verify: it is never sent the login."""


def http_status(url: str, timeout: float = 0.5, auth: str | None = None) -> int | None:
    """The HTTP status ``url`` answers with (``auth``: ``user:password`` for basic auth), or None
    when nothing answers, or nothing this process trusts (:func:`verified_status`)."""
    try:
        return verified_status(url, timeout, auth)
    except UntrustedServer:
        return None


def verified_status(url: str, timeout: float = 0.5, auth: str | None = None, cafile: str | None = None) -> int | None:
    """:func:`http_status`, but an HTTPS server whose certificate does not verify against ``cafile``
    (default :func:`trusted_ca`'s) is an UntrustedServer: the handshake fails before a byte of the
    request, the login included, is sent."""
    request = urllib.request.Request(url, headers=credentials.basic_auth(auth) if auth is not None else {})
    context = None
    if url.startswith("https://"):
        cafile = cafile or trusted_ca()
        try:
            context = ssl.create_default_context(cafile=cafile)
        except OSError as e:  # a CA file named in the environment that is not there, or not PEM (ssl.SSLError)
            raise UserError(f"{url}: cannot read {cafile} to verify the server with ({e})") from None
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            status: int = response.status
            return status
    except urllib.error.HTTPError as e:
        return e.code
    except urllib.error.URLError as e:
        if isinstance(e.reason, ssl.SSLCertVerificationError):
            raise UntrustedServer(
                f"{url}: the server's certificate does not verify against {cafile or 'the system CAs'} "
                f"({e.reason.verify_message}), so it was not sent the login. A worker node verifies the head's servers "
                f"with its copy of the head's .spikelab/tls ({tls.TLS_DIR_ENV}), made again when the head's address changed"
            ) from None
        return None
    except OSError:
        return None


CLIENT_CA_ENVS = {"prefect": "PREFECT_API_SSL_CERT_FILE", "mlflow": "MLFLOW_TRACKING_SERVER_CERT_PATH"}
"""Each engine's own setting for the CA file its client verifies an HTTPS server with."""


def trusted_ca(name: str = "") -> str | None:
    """The CA file a client of the server ``name`` verifies it with: the engine's own setting where
    the user made one (:data:`CLIENT_CA_ENVS`), else the servers' CA where this node has it
    (tls.servers_ca), else None: the system's CAs."""
    if own := os.environ.get(CLIENT_CA_ENVS.get(name, ""), ""):
        return own
    ca = tls.servers_ca()
    return str(ca) if ca is not None else None


def trust_servers_ca(servers: dict[str, str]) -> None:
    """Point the engine's client of each HTTPS server in ``servers`` (name: URL) at the CA file to
    verify it with (:func:`trusted_ca`), in this process and what it starts (Dask workers)."""
    for name, url in servers.items():
        if url.startswith("https://") and (ca := trusted_ca(name)) is not None:
            os.environ[CLIENT_CA_ENVS[name]] = ca


def answers(url: str, timeout: float = 0.5, auth: str | None = None) -> bool:
    """True when an HTTP server answers 2xx at ``url`` (a short timeout: called at every stage start)."""
    status = http_status(url, timeout, auth)
    return status is not None and 200 <= status < 300


def dashboard_up(timeout: float = 0.5) -> bool:
    """The dashboard answers at all: every route asks for the login, so 401 counts as up."""
    return http_status(f"{paths.dashboard_url()}/api/meta", timeout) in (200, 401)


def prefect_up(timeout: float = 0.5) -> bool:
    return answers(f"{paths.prefect_url()}/health", timeout)


def mlflow_up(timeout: float = 0.5) -> bool:
    return answers(f"{paths.mlflow_url()}/health", timeout)


def database_url(env: str, driver: str) -> str | None:
    """The PostgreSQL URL in the environment variable ``env`` for SQLAlchemy's ``driver``
    (``postgresql+<driver>://``), or None when unset. The message of a bad one never repeats it."""
    url = os.environ.get(env, "")
    if not url:
        return None
    no_password(env, url)
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.split("+")[0] not in ("postgresql", "postgres"):
        raise ConfigError(f"{env}: must be a postgresql://user@host:port/database URL")
    return f"postgresql+{driver}://{rest}"


def prefect_database() -> dict[str, str]:
    url = database_url(PREFECT_DB_ENV, "asyncpg")
    return {"PREFECT_SERVER_DATABASE_CONNECTION_URL": url} if url else {}


def mlflow_stores() -> list[str]:
    """The MLflow server's store arguments: its backend and where its artifacts go."""
    s = paths.state()
    backend = database_url(MLFLOW_DB_ENV, "psycopg") or f"sqlite:///{s.mlflow_db}"
    if artifacts := os.environ.get(MLFLOW_ARTIFACTS_ENV):
        return ["--backend-store-uri", backend, "--artifacts-destination", artifacts]
    return [
        "--backend-store-uri",
        backend,
        "--default-artifact-root",
        s.mlflow_artifacts.as_uri(),
        "--no-serve-artifacts",
    ]


def dashboard_storage(search_storage: str) -> str:
    """optuna-dashboard's storage: ``search.storage`` when it is a database URL, else the journal
    file (the search's default), as ``journal:<path>``."""
    if search_storage and not search_storage.startswith("journal:"):
        no_password("search.storage", search_storage)
        return search_storage
    return "journal:" + (search_storage.removeprefix("journal:") or str(paths.state().optuna_journal))


def mlflow_auth(login: credentials.Credentials) -> dict[str, str]:
    """The MLflow server's basic-auth settings: its config file (users in ``<state>/mlflow-auth.db``;
    the admin is the login's user) and, through the environment only, the admin's password and the
    session key. Credential checks are cached for a minute: MLflow hashes the password (PBKDF2) on
    every request otherwise, and the admin is the only user."""
    s = paths.state()
    s.mlflow_auth_config.write_text(
        "[mlflow]\n"
        "default_permission = NO_PERMISSIONS\n"
        f"database_uri = sqlite:///{s.mlflow_auth_db}\n"
        f"admin_username = {login.username}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        "auth_cache_ttl_seconds = 60\n"
    )
    return {
        "MLFLOW_AUTH_CONFIG_PATH": str(s.mlflow_auth_config),
        "MLFLOW_AUTH_ADMIN_PASSWORD": login.password,
        "MLFLOW_FLASK_SERVER_SECRET_KEY": login.session_key,
        paths.MLFLOW_ARTIFACT_ROOTS_ENV: os.environ.get(MLFLOW_ARTIFACTS_ENV) or str(s.mlflow_artifacts),
    }


def mlflow_workers(cores: int | None = None) -> int:
    """MLflow's uvicorn workers: half the cores, 1 to 4 (MLflow's default, 4, took 1 GB on 2 cores).
    One worker serves requests concurrently (its Flask routes run in a thread pool): a process per
    core buys nothing for one user's UI and a study's few clients."""
    return min(4, max(1, (cores or os.cpu_count() or 1) // 2))


MLFLOW_WITHOUT_JOBS = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
"""The MLflow server without its job runner (GenAI jobs spikelab never submits): a huey consumer
process whose queue lived in a folder of /dev/shm, left behind at every start."""


def services(search_storage: str = "", login: credentials.Credentials | None = None) -> list[Service]:
    """The servers; ``search_storage`` is the search's ``search.storage``, which the dashboard reads.
    ``login``: the credentials the servers are started with (only ``up`` needs them)."""
    s = paths.state()
    bin_dir = Path(sys.executable).parent
    secrets = {credentials.PREFECT_SERVER_ENV: login.auth_string} if login else {}
    return [
        Service(
            "prefect",
            prefect_command(bin_dir),
            {
                "PREFECT_HOME": str(s.prefect_home),
                "PREFECT__SERVER_FINAL": "1",  # what `prefect server start` tells its app; uvicorn's factory reads it here
                # the UI's own calls go to this server's port, not to the default 4200
                "PREFECT_SERVER_API_HOST": paths.HOST,
                "PREFECT_SERVER_API_PORT": str(paths.prefect_port()),
                "PREFECT_UI_API_URL": paths.prefect_url(),
                **prefect_database(),
                **secrets,
            },
            paths.prefect_port(),
            prefect_up,
            paths.prefect_ui_url(),
        ),
        Service(
            "mlflow",
            [
                sys.executable,
                "-m",
                "tasks.runtime.mlflow_app",  # `mlflow server` that becomes its server (serve_in_place)
                "--host",
                paths.HOST,
                "--port",
                str(paths.mlflow_port()),
                "--app-name",
                "spikelab",
                "--workers",
                str(mlflow_workers()),
                *mlflow_stores(),
                *(["--uvicorn-opts", shlex.join(https_options("--ssl-"))] if paths.serves_https() else []),
            ],
            {**(mlflow_auth(login) if login else {}), **mlflow_address(), **MLFLOW_WITHOUT_JOBS},
            paths.mlflow_port(),
            mlflow_up,
            f"{paths.mlflow_url()}/#/?{paths.MLFLOW_TRAINING_VIEW}",
        ),
        Service(
            "dashboard",
            [
                sys.executable,
                "-m",
                "tasks.runtime.dashboard",
                "--host",
                paths.HOST,
                "--port",
                str(paths.dashboard_port()),
                "--artifact-dir",
                str(s.optuna_artifacts),
                *(https_options("--") if paths.serves_https() else []),
                dashboard_storage(search_storage),
            ],
            {},
            paths.dashboard_port(),
            dashboard_up,
            paths.dashboard_url(),
        ),
    ]


def prefect_command(bin_dir: Path) -> list[str]:
    """``prefect server start``, which serves plain HTTP only; for HTTPS, what it runs itself
    (Prefect's ``server start --background`` and its temporary server run this command): uvicorn on
    Prefect's app factory, told it is the process's last app (``PREFECT__SERVER_FINAL``), at the
    log level ``server start`` gives it (Prefect's server default); uvicorn's other defaults are
    Prefect's (keep-alive 5 s, websocket pings every 20 s)."""
    address = ["--host", paths.HOST, "--port", str(paths.prefect_port())]
    if not paths.serves_https():
        return [str(bin_dir / "prefect"), "server", "start", *address]
    app = ["-m", "uvicorn", "--factory", "prefect.server.api.server:create_app"]
    return [sys.executable, *app, *address, "--log-level", "warning", *https_options("--ssl-")]


def https_options(prefix: str) -> list[str]:
    """A server's options that serve HTTPS with the servers' certificate (tls.server_certificate):
    ``--ssl-certfile``/``--ssl-keyfile`` for uvicorn (prefix ``--ssl-``), ``--certfile``/``--keyfile``
    for the dashboard's gunicorn. Paths only: the key is in a file only its owner reads."""
    cert, key = tls.server_certificate()
    return [f"{prefix}certfile", str(cert), f"{prefix}keyfile", str(key)]


def mlflow_address() -> dict[str, str]:
    """Beyond loopback, MLflow's guards told the server's address: its host check (against DNS
    rebinding) takes only loopback names and private ranges by default, and its cross-origin check
    refuses its own UI's requests that change anything from any origin but loopback's."""
    if not paths.serves_https():
        return {}
    return {
        "MLFLOW_SERVER_ALLOWED_HOSTS": f"{paths.HOST}:{paths.mlflow_port()}",
        "MLFLOW_SERVER_CORS_ALLOWED_ORIGINS": paths.mlflow_url(),
    }


def service(name: str) -> Service:
    return next(svc for svc in services() if svc.name == name)


def _record_file(name: str) -> Path:
    return paths.state().services / f"{name}.json"


def started_process(name: str):
    """The live process ``up`` started for ``name`` in this state directory, or None."""
    return recorded_process(_record_file(name))


def recorded_process(record_file: Path):
    """The live process :func:`start_recorded` recorded in ``record_file``, or None (no network:
    the pid record, the process's start time, environment and command line)."""
    import psutil

    if not record_file.is_file():
        return None
    record = json.loads(record_file.read_text())
    try:
        proc = psutil.Process(record["pid"])
        same_process = abs(proc.create_time() - record["create_time"]) < 0.01
        if not same_process or proc.environ().get(STATE_ENV) != str(paths.state_dir()):
            return None
        return proc if names_port(proc.cmdline(), record["port"]) else None
    except (psutil.Error, KeyError):
        return None


def names_port(cmdline: list[str], port: int) -> bool:
    """The command line names ``port``: as an argument (``--port 4200``) or an address's (``tcp://host:8786``)."""
    return any(arg == str(port) or arg.endswith(f":{port}") for arg in cmdline)


def start_recorded(command: list[str], env: dict[str, str], log: Path, record_file: Path, port: int) -> int:
    """Start ``command`` detached (its own session and process group, output to ``log``) with this
    state directory in its environment, and record it as ours (:func:`recorded_process`). Its pid."""
    import psutil

    with open(log, "ab") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**env, STATE_ENV: str(paths.state_dir())},
            start_new_session=True,
        )
    record = {"pid": proc.pid, "create_time": psutil.Process(proc.pid).create_time(), "port": port}
    record_file.write_text(json.dumps(record))
    return proc.pid


def stop_group(proc, timeout: float = 30.0) -> None:
    """Stop ``proc`` (a psutil.Process that leads its process group) and everything it started:
    SIGTERM to the group, SIGKILL to what is left after ``timeout`` seconds."""
    import psutil

    os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(psutil.TimeoutExpired):
        proc.wait(timeout=timeout)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # a straggler of the group (a nanny's worker)


def listens_on(proc, port: int) -> bool:
    """``proc`` (a server ``up`` started) or a process it started listens on ``port``, so what
    answers there is this checkout's server. A health check cannot tell: another user who took the
    port first (while ours failed to bind) answers it too, and would be sent the login."""
    import psutil

    try:
        family = [proc, *proc.children(recursive=True)]
    except psutil.Error:  # the server itself is gone
        return False
    for member in family:
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in member.net_connections("tcp")):
                return True
        except psutil.Error:  # a worker that exited in between: the others may hold the port
            continue
    return False


def serves_this_checkout(name: str, patience: float = 0.0) -> bool:
    """The server is provably the one started for this state directory, holds its port and answers
    there (within ``patience`` seconds: one just started may take a while to serve its first requests)."""
    svc, own = service(name), started_process(name)
    return own is not None and answers_within(svc, patience) and listens_on(own, svc.port)


def answers_within(svc: Service, patience: float) -> bool:
    """``svc`` answers its health check, asking again until ``patience`` seconds have passed."""
    deadline = time.monotonic() + patience
    while True:
        remaining = deadline - time.monotonic()
        if svc.is_up(timeout=min(max(remaining, 0.5), 5.0)):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def listener(port: int) -> str:
    """Who answers on ``port``, in words (for ``spikelab status``)."""
    import psutil

    try:
        for conn in psutil.net_connections("tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                proc = psutil.Process(conn.pid)
                state = proc.environ().get(STATE_ENV, "unknown state")
                return f"pid {conn.pid}, state {state}"
    except psutil.Error:
        pass
    return "an unknown process"


def up(timeout: float = 180.0, search_storage: str = "") -> None:
    """Start whichever server does not serve this checkout; wait until all answer. The dashboard
    reads ``search_storage`` (``search.storage``). The login is made the first time
    (credentials.ensure) and every server is started with it. When any fails to come up, the ones
    this call started are stopped again: nothing is left holding a port."""
    login = credentials.ensure()
    started = services(search_storage, login)
    if (warning := paths.exposed_warning()) is not None:
        print(warning, file=sys.stderr)
    for folder in (paths.state().services, paths.state().mlflow_artifacts, paths.state().optuna_artifacts):
        folder.mkdir(parents=True, exist_ok=True)
    if paths.serves_https() and tls.ensure_server_certificate(paths.HOST):
        print(
            f"spikelab: made the servers' certificate for {paths.HOST}; worker nodes verify it with "
            f"{tls.tls_dir() / tls.SERVERS_CA}: copy it to each (docs/scaling.md)",
            file=sys.stderr,
        )
    mine = []
    try:
        for svc in started:
            if started_process(svc.name) is not None:
                print(f"{svc.name}: already started for this checkout ({svc.url})")
                continue
            if svc.is_up():
                raise SystemExit(
                    f"{svc.name}: port {svc.port} is taken by another checkout's server "
                    f"({listener(svc.port)}); set SPIKELAB_{svc.name.upper()}_PORT to another port"
                )
            log = paths.state().services / f"{svc.name}.log"
            start_recorded(svc.command, {**os.environ, **svc.env}, log, _record_file(svc.name), svc.port)
            mine.append(svc.name)
        for svc in started:
            wait_until_up(svc, timeout)
            check_login(svc.name, login.auth_string)
            print(f"{svc.name}: up at {svc.url}")
    except BaseException:
        down(only=mine)
        raise
    print(f"login: {credentials.where()}")


def wait_until_up(svc: Service, timeout: float) -> None:
    """Until the server ``up`` started for ``svc`` answers on its port, holding it; SystemExit
    (naming its log) when it exits first (a bad store; a port another process took) or ``timeout``
    seconds pass."""
    log = paths.state().services / f"{svc.name}.log"
    deadline = time.monotonic() + timeout
    while True:
        own = started_process(svc.name)
        if own is None:  # no point waiting
            taken = f" (port {svc.port} is held by {listener(svc.port)})" if svc.is_up() else ""
            raise SystemExit(f"{svc.name} exited before answering{taken}; see {log}")
        if svc.is_up() and listens_on(own, svc.port):
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"{svc.name} did not answer within {timeout:.0f} s; see {log}")
        time.sleep(0.5)


LOGIN_PROBES = {
    "prefect": "/admin/version",
    "mlflow": "/api/2.0/mlflow/experiments/search?max_results=1",
    "dashboard": "/api/meta",
}
"""A route of each server that asks for the login (its health check does not), below its base URL."""


def base_url(name: str) -> str:
    """This checkout's server ``name``: Prefect's API, MLflow's and the dashboard's root."""
    return {"prefect": paths.prefect_url, "mlflow": paths.mlflow_url, "dashboard": paths.dashboard_url}[name]()


def check_login(name: str, auth: str, base: str | None = None) -> None:
    """The server ``name`` (at ``base``, default this checkout's) asks for a login and takes ``auth``
    (``user:password``); else a UserError naming the server and where the login lives: never a
    retry without it, never a server that answers anyone (one an older spikelab started), and never
    an HTTPS server whose certificate does not verify (UntrustedServer: it gets no request at all)."""
    base = (base or base_url(name)).rstrip("/")
    cafile = trusted_ca(name)
    anyone = verified_status(base + LOGIN_PROBES[name], timeout=30.0, cafile=cafile)
    if anyone is None:
        return  # nothing answers: whoever needs the server says so (a stage falls back, a cluster refuses)
    if anyone not in (401, 403):
        raise UserError(
            f"{name} server at {base}: answers without a login, so any local user can use it (started by an "
            "older spikelab?); `spikelab services down` and `spikelab services up` start it with one"
        )
    status = verified_status(base + LOGIN_PROBES[name], timeout=30.0, auth=auth, cafile=cafile)
    if status in (401, 403):
        raise UserError(
            f"{name} server at {base}: refused the login (HTTP {status}) from "
            f"{credentials.credentials_file()} or the environment; use the head node's credentials file "
            f"({credentials.CREDENTIALS_ENV}) or restart the servers (spikelab services down; services up)"
        )


def info() -> list[str]:
    """Where each UI is and how to log in, in words, with no secret in them (``spikelab services info``)."""
    lines = [f"{svc.name:9} {svc.url}" for svc in services()]
    return [
        *lines,
        f"login: {credentials.where()}",
        "  Prefect UI: enter `spikelab:<password>` when it asks; MLflow and optuna-dashboard: the browser's "
        "login prompt, user spikelab",
        f"  worker nodes: copy the file and point {credentials.CREDENTIALS_ENV} at the copy (docs/services.md)",
        *(https_info() if paths.serves_https() else []),
    ]


def https_info() -> list[str]:
    """How a browser and a worker node trust the servers' HTTPS (``spikelab services info``)."""
    ca = tls.tls_dir() / tls.SERVERS_CA
    return [
        f"HTTPS: the servers' certificate comes from the CA in {ca}; a browser trusts it once you import that file",
        f"  worker nodes: copy {ca.parent} and point {tls.TLS_DIR_ENV} at the copy (docs/scaling.md)",
    ]


def down(only: list[str] | None = None) -> None:
    """Stop the servers ``up`` started for this state directory (their whole process groups), or
    only those named in ``only``; a server this checkout cannot prove it started is left alone."""
    for svc in services():
        if only is not None and svc.name not in only:
            continue
        proc = started_process(svc.name)
        if proc is None:
            if svc.is_up():
                print(f"{svc.name}: the server on port {svc.port} was not started by this checkout; left running")
            _record_file(svc.name).unlink(missing_ok=True)
            continue
        stop_group(proc)
        _record_file(svc.name).unlink(missing_ok=True)
        print(f"{svc.name}: stopped (pid {proc.pid})")


def status() -> dict[str, str]:
    """Each server in words: ours and up, someone else's, or down."""
    report = {}
    for svc in services():
        own = started_process(svc.name)
        if own is not None:
            report[svc.name] = (
                f"up at {svc.url} (this checkout)"
                if svc.is_up(timeout=3.0) and listens_on(own, svc.port)
                else f"started for this checkout (pid {own.pid}) but not answering on port {svc.port}"
            )
        elif svc.is_up():
            report[svc.name] = f"port {svc.port} answers but serves another checkout ({listener(svc.port)})"
        else:
            report[svc.name] = "down"
    return report


OWN_SERVER_PATIENCE_S = 30.0
"""How long a stage waits for a server this checkout provably started to answer (just started:
MLflow's workers take seconds to serve their first requests; or busy) before it falls back to
the local stores, saying so. A single short probe made whole test sessions log to SQLite."""


def configure_environment() -> dict[str, str]:
    """Point Prefect and MLflow at the servers that serve this checkout, else at the local stores.

    Explicit user settings (``PREFECT_API_URL``, ``MLFLOW_TRACKING_URI``) win. A server that
    answers but belongs to another checkout is never used (its store is not ours); that is said
    on stderr. This checkout's own server is waited for (:data:`OWN_SERVER_PATIENCE_S`), not
    dropped because one health check was slow. Returns what was chosen, for logging.
    """
    s = paths.state()
    os.environ.setdefault("PREFECT_HOME", str(s.prefect_home))
    # MLflow prints two "View run/experiment at" lines per run it ends: one per arm and trial.
    # The stages' progress lines and Prefect artifacts link the runs instead.
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    if "PREFECT_API_URL" not in os.environ and _use_server("prefect"):
        os.environ["PREFECT_API_URL"] = paths.prefect_url()
        os.environ.pop("PREFECT_API_KEY", None)  # Prefect Cloud's: it would take precedence over the auth string
    if "MLFLOW_TRACKING_URI" not in os.environ:
        use = _use_server("mlflow")
        os.environ["MLFLOW_TRACKING_URI"] = paths.mlflow_url() if use else f"sqlite:///{s.mlflow_db}"
    log_in_to_servers()
    return {
        "prefect": os.environ.get("PREFECT_API_URL", "temporary server"),
        "mlflow": os.environ["MLFLOW_TRACKING_URI"],
    }


def run_prefect_cli(arguments: list[str]) -> int:
    """``prefect ARGUMENTS`` against this checkout's Prefect server, logged in: the login reaches the
    CLI through its environment (``PREFECT_API_AUTH_STRING``), never its command line or output.
    A UserError when no server serves this checkout. The CLI's exit code."""
    if not configure_environment()["prefect"].startswith(("http://", "https://")):
        raise UserError("no Prefect server serves this checkout; start it with `spikelab services up`")
    return subprocess.run([str(Path(sys.executable).with_name("prefect")), *arguments], check=False).returncode


CLIENT_URL_ENVS = {"prefect": "PREFECT_API_URL", "mlflow": "MLFLOW_TRACKING_URI"}
"""The variable that points this process's client of each server at it."""


def log_in_to_servers() -> None:
    """Give this process (and what it starts) the login for the servers it uses, and check that
    each asks for it and takes it; the local stores need none, nor a Prefect Cloud workspace (its
    ``PREFECT_API_KEY`` is its login). A server ``up`` started for this checkout is guarded for
    the rest of this process (tasks/runtime/guard.py): once it no longer holds its port, a connect
    there is refused rather than sent the login. A server at another URL (one the user named,
    Prefect Cloud) is not this checkout's to guard."""
    prefect = "" if os.environ.get("PREFECT_API_KEY") else os.environ.get("PREFECT_API_URL", "")
    servers = {"prefect": prefect, "mlflow": os.environ["MLFLOW_TRACKING_URI"]}
    servers = {name: url for name, url in servers.items() if url.startswith(("http://", "https://"))}
    if not servers:
        return
    trust_servers_ca(servers)
    for key, value in credentials.client_env().items():
        os.environ.setdefault(key, value)
    auth = {
        "prefect": os.environ[credentials.PREFECT_CLIENT_ENV],
        "mlflow": f"{os.environ[credentials.MLFLOW_USER_ENV]}:{os.environ[credentials.MLFLOW_PASSWORD_ENV]}",
    }
    for name, url in servers.items():
        if url == base_url(name) and (own := started_process(name)) is not None:
            port = service(name).port
            guard.withhold_login(name, CLIENT_URL_ENVS[name], own.pid, functools.partial(listens_on, own, port))
            os.environ[WORKER_PRELOAD_ENV] = json.dumps([__name__])  # its Dask workers guard theirs (dask_setup)
        check_login(name, auth[name], url)


WORKER_PRELOAD_ENV = "DASK_DISTRIBUTED__WORKER__PRELOAD"
"""Dask's ``distributed.worker.preload``: the modules a worker runs ``dask_setup`` of as it starts."""


def dask_setup(worker: object) -> None:
    """A worker of a process guarded by :func:`log_in_to_servers` (a stage's local cluster, the
    workers ``spikelab cluster up`` starts) is a fresh interpreter that inherits the login but not
    the guard: it logs in and guards its own connects (an arm logs to MLflow from there)."""
    log_in_to_servers()


def _use_server(name: str) -> bool:
    svc = service(name)
    own = started_process(name)  # local evidence first: no network round trip for a foreign server
    if own is not None:
        if answers_within(svc, OWN_SERVER_PATIENCE_S) and listens_on(own, svc.port):
            return True
        print(
            f"spikelab: this checkout's {name} server (pid {own.pid}) did not answer on port {svc.port} "
            f"within {OWN_SERVER_PATIENCE_S:.0f} s; using local stores instead",
            file=sys.stderr,
        )
    elif svc.is_up():
        print(
            f"spikelab: the {name} server on {paths.HOST} answers but does not serve this checkout's state "
            f"({paths.state_dir()}); using local stores instead",
            file=sys.stderr,
        )
    return False
