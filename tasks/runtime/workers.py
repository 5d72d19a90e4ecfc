"""Where the fan-out units (ablation arms, search trials) run: long-lived worker processes of a Dask
cluster, one thread each, behind Prefect's task runner (prefect-dask). A worker imports torch and
the project once and then trains unit after unit; each unit starts from a clean global state (the
trainer seeds every RNG; :func:`clean_state` sets the threads), so its result does not depend on
the worker, on what ran there before or on the order. A worker that dies (out of memory, killed) is
restarted by its Dask nanny and takes no other unit's numbers with it.

The local cluster is the default; the scale-out issue points the same runner at a cluster's
scheduler instead. Nothing here listens beyond loopback.
"""

from __future__ import annotations

import os
from typing import Any

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


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, which `taskset`, cgroups' cpusets and
    batch schedulers restrict), not the machine's count."""
    return len(os.sched_getaffinity(0))


def worker_count(requested: int, units: int) -> int:
    """``requested`` workers (0: one per available core), never more than there are units."""
    return max(1, min(requested or available_cores(), units))


def cluster_kwargs(workers: int) -> dict[str, Any]:
    """The local cluster: ``workers`` single-threaded processes on loopback, no dashboard."""
    return {
        "n_workers": workers,
        "threads_per_worker": 1,
        "processes": True,
        "host": "127.0.0.1",
        "dashboard_address": None,
    }


def configured_cluster() -> Any:
    """Dask settings for the clusters this process starts (a context manager): the workers'
    environment before they spawn, and no log line per worker started or stopped."""
    import logging

    import dask

    logging.getLogger("distributed").setLevel(logging.WARNING)
    # prefect-dask announces a dashboard URL even with none started (no dashboard_address)
    logging.getLogger("prefect.task_runner.dask").setLevel(logging.WARNING)
    return dask.config.set({"distributed.nanny.pre-spawn-environ": WORKER_ENVIRONMENT})


def task_runner(workers: int) -> Any:
    """Prefect's Dask task runner on a local cluster of ``workers`` worker processes. Its workers
    inherit ``PREFECT_API_URL`` and the tracking URI from this process
    (services.configure_environment), so their task runs report to the flow's server."""
    from prefect_dask import DaskTaskRunner

    configured_cluster()  # process-wide: a nanny restarting a dead worker later spawns it the same way
    return DaskTaskRunner(cluster_class="distributed.LocalCluster", cluster_kwargs=cluster_kwargs(workers))


def clean_state() -> None:
    """What a unit resets before it starts in a worker that may have run others: one intra-op
    thread, and no deterministic-algorithms flag left set (the trainer seeds the RNGs itself)."""
    import torch

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(False)
