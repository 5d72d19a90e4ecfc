"""The one place that decides where state lives and how stages reach the services.

Two roots:
  project  the workspace a stage runs in (where ``params.yaml`` is). DVC outputs are relative to
           it, so a ``dvc exp run`` copy under ``.dvc/tmp/exps/`` writes its own outputs.
  state    absolute, shared by every copy: MLflow store and artifacts, Optuna storage, Prefect
           home, service logs. It is ``<repo>/.spikelab`` of the ORIGINAL repository (an experiment
           copy resolves back to it), or ``$SPIKELAB_STATE``.

Services: ``spikelab services up`` starts a Prefect server and an MLflow server on 127.0.0.1.
:func:`configure_environment` points this process at them when they provably serve this
checkout's state directory (tasks/services.py), and otherwise at the local stores (MLflow: SQLite
file; Prefect: a temporary server per process, slower), saying so.
It must run before ``prefect`` is imported, because Prefect reads its settings at import.
"""

from __future__ import annotations

import os
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from typing import Any

from model.config import Config, load_config

HOST = "127.0.0.1"
EXPS_MARKER = (".dvc", "tmp", "exps")

# What the pipeline flow tells the stages it runs under DVC (flows/pipeline.py):
PIPELINE_RUN_ENV = "SPIKELAB_PIPELINE_RUN"
"""The pipeline's Prefect flow-run id (an MLflow lineage tag of every stage run)."""
PARENT_TASK_RUN_ENV = "SPIKELAB_PARENT_TASK_RUN"
"""The pipeline task a stage's Prefect flow run is created under (``spikelab run``)."""
DVC_EXP_ENV = "SPIKELAB_DVC_EXP"
"""The DVC experiment the pipeline saves the run as (an MLflow lineage tag)."""
MLFLOW_PARENT_ENV = "SPIKELAB_MLFLOW_PARENT_RUN"
"""The pipeline's MLflow run: each stage's run is nested under it."""


def project_dir() -> Path:
    """The nearest directory at or above the working directory holding ``params.yaml``."""
    cwd = Path.cwd().resolve()
    for d in (cwd, *cwd.parents):
        if (d / "params.yaml").is_file():
            return d
    return cwd


def project_config(profile: str | None = None,
                   overrides: dict[str, Any] | None = None) -> tuple[Config, Path]:
    """The validated config of the project a stage runs in (``overrides``: dotted keys, highest
    precedence), and that project's directory."""
    project = project_dir()
    return load_config(project / "params.yaml", profile, overrides), project


def repo_root(project: Path | None = None) -> Path:
    """The original repository, also from inside a DVC experiment copy (``<repo>/.dvc/tmp/exps/...``)."""
    project = (project or project_dir()).resolve()
    parts = project.parts
    for i in range(len(parts) - len(EXPS_MARKER)):
        if parts[i:i + len(EXPS_MARKER)] == EXPS_MARKER:
            return Path(*parts[:i])
    return project


def state_dir() -> Path:
    path = Path(os.environ.get("SPIKELAB_STATE") or repo_root() / ".spikelab").resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass(frozen=True)
class StatePaths:
    """Absolute locations under :func:`state_dir`."""

    root: Path

    @property
    def mlflow_db(self) -> Path:
        return self.root / "mlflow.db"

    @property
    def mlflow_artifacts(self) -> Path:
        return self.root / "mlartifacts"

    @property
    def optuna_journal(self) -> Path:
        return self.root / "optuna.journal"

    @property
    def prefect_home(self) -> Path:
        return self.root / "prefect"

    @property
    def services(self) -> Path:
        """Pid and log files of the servers started by ``spikelab services up``."""
        return self.root / "services"


def state() -> StatePaths:
    return StatePaths(state_dir())


def optuna_storage(cfg: Config) -> str:
    """The LR search's Optuna storage: ``search.storage`` (any Optuna URL), else the journal file
    under the state directory as ``journal:<path>``."""
    return cfg.search.storage or f"journal:{state().optuna_journal}"


def prefect_port() -> int:
    return int(os.environ.get("SPIKELAB_PREFECT_PORT", "4200"))


def mlflow_port() -> int:
    return int(os.environ.get("SPIKELAB_MLFLOW_PORT", "5000"))


def dashboard_port() -> int:
    return int(os.environ.get("SPIKELAB_DASHBOARD_PORT", "8080"))


def prefect_url() -> str:
    return f"http://{HOST}:{prefect_port()}/api"


def prefect_ui_url() -> str:
    return prefect_url().removesuffix("/api")


def mlflow_url() -> str:
    return f"http://{HOST}:{mlflow_port()}"


def dashboard_url() -> str:
    """optuna-dashboard on the LR search's studies."""
    return f"http://{HOST}:{dashboard_port()}"


MLFLOW_TRAINING_VIEW = "workflowType=machine_learning"
"""Query string that opens MLflow 3's UI in its model-training view (the default view is GenAI;
the experiment's kind tag alone does not switch it). Every MLflow link spikelab prints has it."""


def answers(url: str, timeout: float = 0.5) -> bool:
    """True when an HTTP server answers 2xx at ``url`` (a short timeout: called at every stage start)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return 200 <= response.status < 300
    except OSError:
        return False


def dashboard_up(timeout: float = 0.5) -> bool:
    return answers(f"{dashboard_url()}/api/meta", timeout)


def prefect_up(timeout: float = 0.5) -> bool:
    return answers(f"{prefect_url()}/health", timeout)


def mlflow_up(timeout: float = 0.5) -> bool:
    return answers(f"{mlflow_url()}/health", timeout)


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
    s = state()
    os.environ.setdefault("PREFECT_HOME", str(s.prefect_home))
    for key in ("DO_NOT_TRACK", "MLFLOW_DISABLE_TELEMETRY"):  # no usage telemetry from study runs
        os.environ.setdefault(key, "true")
    if "PREFECT_API_URL" not in os.environ and _use_server("prefect"):
        os.environ["PREFECT_API_URL"] = prefect_url()
    if "MLFLOW_TRACKING_URI" not in os.environ:
        use = _use_server("mlflow")
        os.environ["MLFLOW_TRACKING_URI"] = mlflow_url() if use else f"sqlite:///{s.mlflow_db}"
    return {"prefect": os.environ.get("PREFECT_API_URL", "temporary server"),
            "mlflow": os.environ["MLFLOW_TRACKING_URI"]}


def _use_server(name: str) -> bool:
    from tasks.services import answers_within, service, started_process  # services builds on this module

    svc = service(name)
    own = started_process(name)  # local evidence first: no network round trip for a foreign server
    if own is not None:
        if answers_within(svc, OWN_SERVER_PATIENCE_S):
            return True
        print(f"spikelab: this checkout's {name} server (pid {own.pid}) did not answer within "
              f"{OWN_SERVER_PATIENCE_S:.0f} s; using local stores instead", file=sys.stderr)
    elif svc.is_up():
        print(f"spikelab: the {name} server on {HOST} answers but does not serve this checkout's state "
              f"({state_dir()}); using local stores instead", file=sys.stderr)
    return False
