"""``spikelab cluster``: a Dask scheduler and single-threaded workers, started with Dask's own CLI
(``dask scheduler``, ``dask worker``), for the fan-out stages to run their units on
(``executor.scheduler`` or ``$SPIKELAB_SCHEDULER``: tasks/runtime/workers.py).

``up`` starts a scheduler (no dashboard) and its workers on this machine, on 127.0.0.1 unless
``--host`` names an interface other nodes reach; ``join`` starts workers here for a scheduler
elsewhere (a head node's). Every worker gets the project's worker environment
(workers.WORKER_ENVIRONMENT, through Dask's ``pre-spawn-environ`` so that its nanny's own defaults
do not replace ours), and ``PREFECT_API_URL`` and ``MLFLOW_TRACKING_URI`` of the servers this
checkout uses (services.configure_environment): without a Prefect server answering, nothing starts.
``--gpus K`` starts K workers, worker i seeing only GPU i and declaring the resource ``GPU=1``.

Every process talks mutual TLS (tasks/runtime/tls.py): ``up`` makes the cluster's CA and
certificate once into ``<state>/tls/`` and gives them to the scheduler and its workers; ``join``
reads a copy of that folder (``--tls DIR`` or ``$SPIKELAB_TLS_DIR``). Addresses are ``tls://``.

Each process is recorded and owned as ``spikelab services`` records its servers
(services.start_recorded, ``<state>/cluster/``); ``down`` stops only those, process group and all.
"""

from __future__ import annotations

import hashlib
import os
import socket
import sys
import time
from pathlib import Path

from model.typed_config import UserError
from tasks.runtime import credentials, paths, services, tls
from tasks.runtime.workers import (
    GPU,
    HTTP_ROUTES,
    WORKER_ENVIRONMENT,
    available_cores,
    dask_environment,
    reporting_to,
)

SCHEDULER_PORT = 8786
"""Dask's own default."""
START_TIMEOUT_S = 120.0
SCHEDULER = "scheduler"


def no_dashboard(host: str | None) -> list[str]:
    """Without a dashboard a Dask server still serves its HTTP routes (``/health`` only here:
    workers.HTTP_ROUTES), on every interface unless told otherwise: on the server's own interface
    here (loopback by default)."""
    return ["--no-dashboard", "--dashboard-address", f"{host or paths.HOST}:0"]


def records() -> Path:
    return paths.state().cluster


def _dask() -> str:
    return str(Path(sys.executable).parent / "dask")


def scheduler_address() -> str | None:
    """The address of the scheduler ``up`` started for this checkout, when it runs."""
    record = records() / f"{SCHEDULER}.json"
    proc = services.recorded_process(record)
    return _address_of(proc.cmdline()) if proc is not None else None


def _address_of(cmdline: list[str]) -> str:
    return f"tls://{cmdline[cmdline.index('--host') + 1]}:{cmdline[cmdline.index('--port') + 1]}"


def up(workers: int = 0, gpus: int = 0, port: int = SCHEDULER_PORT, host: str = paths.HOST) -> str:
    """Start a scheduler on ``host:port`` and its workers (``workers``, 0: one per core; or one per
    GPU for ``gpus``); returns its address once every worker has connected."""
    if (running := scheduler_address()) is not None:
        raise UserError(f"cluster: already up at {running} for this checkout; `spikelab cluster down` first")
    environment = worker_environment("spikelab cluster up")
    if (warning := paths.exposed_warning(host)) is not None:
        print(warning, file=sys.stderr)
    if not _free(host, port):
        raise UserError(f"cluster: port {port} on {host} is taken; choose another with --port")
    records().mkdir(parents=True, exist_ok=True)
    certificates = tls.ensure_certificates()
    command = [_dask(), "scheduler", "--host", host, "--port", str(port), "--protocol", "tls", *no_dashboard(host)]
    command += tls.cli_arguments(certificates)
    services.start_recorded(command, scheduler_environment(), _log(SCHEDULER), records() / f"{SCHEDULER}.json", port)
    address = f"tls://{host}:{port}"
    try:
        start_workers(address, workers, gpus, environment, host=host, certificates=certificates)
    except BaseException:
        down()
        raise
    return address


def join(
    address: str, workers: int = 0, gpus: int = 0, host: str | None = None, certificates: Path | None = None
) -> None:
    """Start workers on this machine for the scheduler at ``address`` (a head node's). They report
    to the servers this process is pointed at: set ``PREFECT_API_URL`` and ``MLFLOW_TRACKING_URI``
    to the head node's (and the login: tasks/runtime/credentials.py). ``host``: the interface they
    listen on (default: the one that reaches the scheduler). ``certificates``: the folder holding
    a copy of the head's ``<state>/tls`` (default :func:`tls.tls_dir`)."""
    from tasks.runtime.config import check_scheduler

    check_scheduler("cluster join ADDRESS", address)
    certificates = tls.check_certificates(certificates)
    environment = worker_environment(f"spikelab cluster join {address}")
    records().mkdir(parents=True, exist_ok=True)
    start_workers(address, workers, gpus, environment, host=host, certificates=certificates)


def worker_environment(command: str) -> dict[str, str]:
    """What every worker starts with: this process's environment pointed at this checkout's
    servers, a Prefect server that answers (else UserError: ``command`` refused), the project's
    worker settings through Dask's config."""
    services.configure_environment()
    reporting_to(command)
    return {
        **os.environ,
        **dask_environment({"distributed.nanny.pre-spawn-environ": WORKER_ENVIRONMENT, **HTTP_ROUTES}),
        "DASK_LOGGING__DISTRIBUTED": WORKER_ENVIRONMENT["DASK_LOGGING__DISTRIBUTED"],
    }


def scheduler_environment() -> dict[str, str]:
    """The scheduler's: this process's without the servers' login (it runs no task, so it needs
    none), with the project's Dask settings."""
    own = {k: v for k, v in os.environ.items() if k not in credentials.SECRET_ENVS}
    return {**own, **dask_environment(HTTP_ROUTES)}


def start_workers(
    address: str, workers: int, gpus: int, environment: dict[str, str], host: str | None, certificates: Path
) -> None:
    """``workers`` CPU workers (0: one per core) or, with ``gpus``, one worker per GPU, presenting the
    certificate in ``certificates``; wait until all have connected to ``address``."""
    if workers and gpus:
        raise UserError("cluster: give --workers or --gpus, not both (--gpus K starts K workers, one per GPU)")
    from distributed.system import MEMORY_LIMIT

    count = gpus or workers or available_cores()
    port = int(address.rsplit(":", 1)[1])
    names = []
    for i in range(count):
        name, index = _next_worker()
        command = [
            _dask(),
            "worker",
            address,
            "--nthreads",
            "1",
            "--nworkers",
            "1",
            "--name",
            name,
            *no_dashboard(host),
            "--memory-limit",
            str(MEMORY_LIMIT // count),  # the machine's memory shared out, as a LocalCluster does
            *(["--host", host] if host else []),
            *(["--resources", f"{GPU}=1"] if gpus else []),
            *tls.cli_arguments(certificates),
        ]
        env = {**environment, **({"CUDA_VISIBLE_DEVICES": str(i)} if gpus else {})}
        services.start_recorded(command, env, _log(f"worker-{index}"), records() / f"worker-{index}.json", port)
        names.append(name)
    wait_for_workers(address, names, certificates)


def _next_worker() -> tuple[str, int]:
    """The next worker's name and its record's index."""
    index = 0
    while (records() / f"worker-{index}.json").exists():
        index += 1
    return worker_name(index), index


def worker_name(index: int) -> str:
    """Unique among a scheduler's workers, which refuses a second worker of one name: the host, the
    state directory (two checkouts on one host may join one scheduler) and the index."""
    checkout = hashlib.sha256(str(paths.state_dir()).encode()).hexdigest()[:6]
    return f"{socket.gethostname()}-{checkout}-{index}"


def wait_for_workers(address: str, names: list[str], certificates: Path, timeout: float = START_TIMEOUT_S) -> None:
    """Until the scheduler at ``address`` lists every worker of ``names``; else UserError."""
    from distributed import Client

    deadline = time.monotonic() + timeout
    try:
        with Client(address, security=tls.security(certificates), timeout=timeout, set_as_default=False) as client:
            while not set(names) <= {w["name"] for w in client.scheduler_info()["workers"].values()}:
                if time.monotonic() > deadline:
                    raise UserError(f"cluster: workers {names} did not connect to {address} within {timeout:.0f} s")
                time.sleep(0.3)
    except (OSError, TimeoutError) as e:
        raise UserError(f"cluster: scheduler {address} does not answer ({e}); see {records()}/*.log") from None


def down() -> list[str]:
    """Stop the workers and the scheduler ``up``/``join`` started for this checkout (their process
    groups), workers first; what was stopped, in words. Others' processes are left alone."""
    stopped = []
    for record in sorted(records().glob("worker-*.json")) + sorted(records().glob(f"{SCHEDULER}.json")):
        proc = services.recorded_process(record)
        if proc is not None:
            services.stop_group(proc)
            stopped.append(f"{record.stem} (pid {proc.pid})")
        record.unlink(missing_ok=True)
    return stopped


def status() -> list[str]:
    """What runs for this checkout, in words, and the address to give the fan-out stages."""
    lines = []
    address = scheduler_address()
    live = [
        (record.stem, proc)
        for record in sorted(records().glob("worker-*.json"))
        if (proc := services.recorded_process(record)) is not None
    ]
    if address is None:
        lines.append("scheduler: not started for this checkout")
    else:
        lines.append(f"scheduler: {address} ({connected(address)})")
    lines += [f"{name}: pid {proc.pid}, for {_scheduler_of(proc.cmdline())}" for name, proc in live]
    if address is not None:
        lines.append(f"use it: SPIKELAB_SCHEDULER={address} (or executor.scheduler: {address} in params.yaml)")
    return lines


def _scheduler_of(cmdline: list[str]) -> str:
    return cmdline[cmdline.index("worker") + 1]


def connected(address: str) -> str:
    """The scheduler's workers in words, or that it does not answer."""
    from distributed import Client

    try:
        with Client(address, security=tls.security(), timeout=5, set_as_default=False) as client:
            workers = client.scheduler_info()["workers"].values()
    except (OSError, TimeoutError):
        return "not answering"
    gpus = sum(w.get("resources", {}).get(GPU, 0) >= 1 for w in workers)
    return f"{len(workers)} workers connected" + (f", {gpus} with a GPU" if gpus else "")


def _free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _log(name: str) -> Path:
    return records() / f"{name}.log"
