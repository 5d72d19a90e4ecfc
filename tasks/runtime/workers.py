"""Where the fan-out units (ablation arms, search trials) run: long-lived worker processes of a Dask
cluster, one thread each, behind Prefect's task runner (prefect-dask). A worker imports torch and
the project once and then trains unit after unit; each unit starts from a clean global state (the
trainer seeds every RNG; :func:`clean_state` sets the threads), so its result does not depend on
the worker, on what ran there before or on the order. A worker that dies (out of memory, killed) is
restarted by its Dask nanny; the scheduler gives its unit to a worker again, and it takes no other
unit's numbers with it.

Which cluster (:func:`executor`): by default a local one the stage starts and stops on loopback
(``ablation.workers`` / ``search.workers`` processes), with a TLS certificate of its own that no
other process holds; with ``executor.scheduler`` (or ``$SPIKELAB_SCHEDULER``) set to a ``tls://``
address, the workers of that running cluster (``spikelab cluster up|join``: tasks/runtime/cluster.py),
reached with the cluster's certificate (tasks/runtime/tls.py). The same task runs either way.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from model.typed_config import UserError
from tasks.runtime import services, tls
from tasks.runtime.config import LOCAL, check_scheduler

if TYPE_CHECKING:
    from tasks.config import Config

SCHEDULER_ENV = "SPIKELAB_SCHEDULER"
"""Where units run, for a user who does not edit params.yaml: wins over ``executor.scheduler``."""
CONNECT_TIMEOUT_S = 10
GPU = "GPU"
"""The Dask resource a GPU worker declares (``spikelab cluster up --gpus K``: one per device)."""

WORKER_ENVIRONMENT = {
    # One intra-op thread per worker: workers, not threads, use the cores (a unit's step is too
    # small to split), and no OpenMP team waits on a core another worker needs.
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    # glibc serves allocations above 128 kB with fresh mmaps and hands them back on free, so every
    # step page-faults its activations in again (an arm's 512 x 1024 logits: 545 faults per step,
    # ~15 % of its time, benchmarks/bench_arms.py). Keep freed memory in the heap instead; Dask's
    # own default (trim at 64 kB) is the opposite trade, made for dataframe workers.
    "MALLOC_MMAP_THRESHOLD_": str(32 * 2**20),
    "MALLOC_TRIM_THRESHOLD_": str(256 * 2**20),
    "DASK_LOGGING__DISTRIBUTED": "warning",
}
"""The environment every worker process starts with. OpenMP and glibc read it at process start,
so it goes in Dask's ``pre-spawn-environ`` (a Nanny's ``env`` is applied after the spawn)."""
HTTP_ROUTES = {
    # A Dask server's HTTP routes answer whoever reaches their port, with no TLS and no login: by
    # default task keys, tracebacks, worker logs, call stacks and a proxy. Health is enough here.
    "distributed.scheduler.http.routes": ["distributed.http.health"],
    "distributed.worker.http.routes": ["distributed.http.health"],
}
"""The Dask settings of every scheduler and worker the project starts (each stage's local cluster,
``spikelab cluster``)."""


def dask_environment(settings: dict[str, Any]) -> dict[str, str]:
    """Dask settings as the environment variables a ``dask scheduler``/``dask worker`` process reads."""
    return {"DASK_" + key.upper().replace(".", "__").replace("-", "_"): repr(value) for key, value in settings.items()}


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, which `taskset`, cgroups' cpusets and
    batch schedulers restrict), not the machine's count."""
    return len(os.sched_getaffinity(0))


def worker_count(requested: int, units: int) -> int:
    """``requested`` workers (0: one per available core), never more than there are units."""
    return max(1, min(requested or available_cores(), units))


def cluster_kwargs(workers: int) -> dict[str, Any]:
    """The local cluster: ``workers`` single-threaded processes on loopback, no dashboard, mutual
    TLS with a certificate made in memory for it alone (``Security.temporary``): another user who
    finds its port cannot connect. The scheduler's HTTP server (health routes only) on a loopback
    port the system picks: without a dashboard address Dask takes 8787 on every interface, and
    where another cluster holds it warns "Port 8787 is already in use" into the stage's output."""
    return {
        "n_workers": workers,
        "threads_per_worker": 1,
        "processes": True,
        "host": "127.0.0.1",
        "dashboard_address": None,
        "scheduler_kwargs": {"dashboard_address": "127.0.0.1:0"},
        "security": True,
    }


def configured_cluster() -> Any:
    """Dask settings for the clusters this process starts (a context manager): the workers'
    environment before they spawn, and no log line per worker started or stopped."""
    import dask

    quiet_logs()
    return dask.config.set({"distributed.nanny.pre-spawn-environ": WORKER_ENVIRONMENT, **HTTP_ROUTES})


def quiet_logs() -> None:
    import logging

    logging.getLogger("distributed").setLevel(logging.WARNING)
    # prefect-dask announces a dashboard URL even with none started (no dashboard_address)
    logging.getLogger("prefect.task_runner.dask").setLevel(logging.WARNING)


def scheduler(setting: str) -> str:
    """``$SPIKELAB_SCHEDULER`` when set, else ``setting`` (``executor.scheduler``): ``local`` or an address."""
    value = os.environ.get(SCHEDULER_ENV)
    if value is None:
        return setting
    check_scheduler(SCHEDULER_ENV, value)
    return value


@dataclass(frozen=True)
class Executor:
    """Where one fan-out runs its units."""

    address: str | None
    """A running Dask scheduler; None: a local cluster started for the fan-out."""
    workers: int
    """Units at a time: the local cluster's size, or the cluster's workers that can take a unit."""
    gpu: bool
    """A unit needs a GPU of its own (``train.device: cuda`` on a cluster): Dask resource ``GPU=1``."""

    def runner(self) -> Any:
        """Prefect's Dask task runner (a context manager). Local workers inherit
        ``PREFECT_API_URL`` and the tracking URI from this process (services.configure_environment);
        a cluster's were given them when they started (``spikelab cluster``), :func:`executor` checked."""
        from prefect_dask import DaskTaskRunner

        if self.address is not None:
            quiet_logs()
            return DaskTaskRunner(address=self.address, client_kwargs={"security": tls.security()})
        configured_cluster()  # process-wide: a nanny restarting a dead worker later spawns it the same way
        return DaskTaskRunner(cluster_class="distributed.LocalCluster", cluster_kwargs=cluster_kwargs(self.workers))

    def placement(self) -> AbstractContextManager:
        """Around ``runner.submit``: the resources a unit asks of the scheduler (one GPU, else none)."""
        import dask

        return dask.annotate(resources={GPU: 1}) if self.gpu else nullcontext()


def executor(cfg: Config, requested: int, units: int) -> Executor:
    """Where ``units`` units run: a local cluster of ``requested`` workers (0: one per core), or the
    cluster at ``executor.scheduler`` / ``$SPIKELAB_SCHEDULER``, checked first (:func:`check_cluster`)."""
    address = scheduler(cfg.executor.scheduler)
    if address == LOCAL:
        return Executor(None, worker_count(requested, units), gpu=False)
    gpu = cfg.train.device == "cuda"
    return Executor(address, check_cluster(address, gpu), gpu)


def check_cluster(address: str, gpu: bool) -> int:
    """Refuse a cluster whose task runs would be lost or never run; else the number of its workers
    that can take a unit. Its workers must report to a Prefect server that answers: a worker
    without ``PREFECT_API_URL`` starts a hidden server of its own, so the flow's server never sees
    its task runs. Raises UserError saying which check failed."""
    reporting_to(f"Dask scheduler {address}")
    from distributed import Client

    try:
        client = Client(address, security=tls.security(), timeout=CONNECT_TIMEOUT_S, set_as_default=False)
    except (OSError, TimeoutError) as e:
        raise UserError(
            f"Dask scheduler {address}: does not answer ({type(e).__name__}: {e}); start one with "
            f"`spikelab cluster up` or fix {SCHEDULER_ENV} / executor.scheduler. A scheduler that refuses "
            f"the handshake has another cluster's certificate: this node's are in {tls.tls_dir()} "
            f"({tls.TLS_DIR_ENV})"
        ) from None
    with client:
        workers = client.scheduler_info(n_workers=-1)["workers"]
        unreported = [w for w, url in client.run(prefect_api_url).items() if not url]
    if unreported:
        raise UserError(
            f"Dask scheduler {address}: workers {sorted(unreported)} have no PREFECT_API_URL; each would start a "
            f"hidden Prefect server and its task runs would never reach the flow's. Start workers with "
            f"`spikelab cluster up|join`"
        )
    able = [w for w in workers.values() if not gpu or w.get("resources", {}).get(GPU, 0) >= 1]
    if not able:
        need = "declares the GPU resource (spikelab cluster up --gpus K)" if gpu else "is connected"
        raise UserError(f"Dask scheduler {address}: no worker {need}; the units would wait forever")
    return len(able)


def prefect_api_url() -> str | None:
    """The Prefect server this process reports to (run on each worker by :func:`check_cluster`)."""
    return os.environ.get("PREFECT_API_URL")


def reporting_to(what: str) -> str:
    """The Prefect server this process reports to (``PREFECT_API_URL``), which must answer; else a
    UserError saying that ``what`` is refused, and why Dask needs one."""
    url = os.environ.get("PREFECT_API_URL")
    why = (
        "Dask workers without a reachable Prefect server each start a hidden one, and their task runs "
        "never reach the flow's server. Start this checkout's servers (`spikelab services up`) or set "
        "PREFECT_API_URL to the head node's"
    )
    if not url:
        raise UserError(f"{what}: refused, PREFECT_API_URL is not set. {why}")
    if not services.answers(f"{url.rstrip('/')}/health", timeout=5.0):
        raise UserError(f"{what}: refused, the Prefect server at {url} does not answer. {why}")
    return url


def clean_state() -> None:
    """What a unit resets before it starts in a worker that may have run others: one intra-op
    thread, and no deterministic-algorithms flag left set (the trainer seeds the RNGs itself)."""
    import torch

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(False)
