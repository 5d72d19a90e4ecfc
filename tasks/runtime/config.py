"""The ``tracking`` and ``executor`` sections of the study config: where every stage records its
runs, and where the fan-out stages (ablate, search) run their units."""

from __future__ import annotations

import re
from dataclasses import dataclass

from model.typed_config import ConfigError, Section

LOCAL = "local"
SCHEDULER_ADDRESS = re.compile(r"(?P<scheme>[a-z]+)://(?P<host>\[[0-9A-Fa-f:]+\]|[A-Za-z0-9.-]+):(?P<port>\d{1,5})")
"""A Dask scheduler's address as ``dask scheduler`` prints it: ``tls://host:port`` (or an
``[IPv6]`` host)."""


@dataclass(frozen=True)
class TrackingConfig(Section):
    experiment: str = "spikelab"
    """MLflow experiment (one per study)."""
    async_logging: bool = True
    """Log metrics to MLflow from a background thread so the training loop never waits on it."""


@dataclass(frozen=True)
class ExecutorConfig(Section):
    """Where the ablation arms and the search's trials run. Not a DVC param of any stage: where a
    unit runs does not change its numbers (tests/test_cluster.py checks that per arm)."""

    scheduler: str = LOCAL
    """``local``: a Dask cluster of ``ablation.workers`` / ``search.workers`` processes started by
    the stage on this machine; or a running Dask scheduler's address, ``tls://host:port``
    (``spikelab cluster up`` prints it), whose workers run the units; the stage connects with the
    cluster's certificate (tasks/runtime/tls.py). The environment variable ``SPIKELAB_SCHEDULER``
    wins over this key (tasks/runtime/workers.py: scheduler)."""

    def check(self) -> None:
        check_scheduler("executor.scheduler", self.scheduler)


def check_scheduler(key: str, value: str) -> None:
    """``value`` is ``local`` or a ``tls://host:port`` address; else a ConfigError naming ``key``.
    A plain ``tcp://`` scheduler is refused: it runs whatever any process that reaches it sends."""
    match = SCHEDULER_ADDRESS.fullmatch(value)
    if value == LOCAL:
        return
    if not (match and 0 < int(match["port"]) < 65536 and match["scheme"] in ("tls", "tcp")):
        raise ConfigError(f"{key}: {value!r} is neither 'local' nor a Dask scheduler address tls://host:port")
    if match["scheme"] == "tcp":
        raise ConfigError(
            f"{key}: {value!r} is a plain-TCP scheduler, refused: any process that reaches it runs code as its "
            "owner. Use a TLS cluster, `spikelab cluster up` (it prints a tls:// address), whose certificates "
            "the stage reads from <state>/tls or SPIKELAB_TLS_DIR"
        )
