"""The one place that decides where state lives, and the ports and URLs of the services.

Two roots:
  project  the workspace a stage runs in (where ``params.yaml`` is). DVC outputs are relative to
           it, so a ``dvc exp run`` copy under ``.dvc/tmp/exps/`` writes its own outputs.
  state    absolute, shared by every copy: MLflow store and artifacts, Optuna storage, Prefect
           home, service logs. It is ``<repo>/.spikelab`` of the ORIGINAL repository (an experiment
           copy resolves back to it), or ``$SPIKELAB_STATE``.

Ports and URLs of this checkout's servers on 127.0.0.1. Which server a stage uses (its own, or
the local stores) is decided in tasks/runtime/services.py. A leaf: imports nothing of the project.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from model.typed_config import UserError

HOST = os.environ.get("SPIKELAB_HOST", "127.0.0.1")
"""The interface the servers (``spikelab services``, ``spikelab cluster``) bind and their URLs name:
loopback unless ``SPIKELAB_HOST`` names one that other nodes reach (a head node's private
address). Every server asks for the login (tasks/runtime/credentials.py) and Dask talks mutual
TLS (tasks/runtime/tls.py) on either, but their traffic is plain HTTP: a private network only."""
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def exposed_warning(host: str = HOST) -> str | None:
    """What to tell a user whose servers listen on ``host`` beyond loopback, or None."""
    if host in LOOPBACK:
        return None
    return (
        f"spikelab: servers listen on {host}, not loopback; they ask for the login, but Prefect's, "
        "MLflow's and the dashboard's traffic (the login included) is unencrypted HTTP: a private network only"
    )


EXPS_MARKER = (".dvc", "tmp", "exps")

# What the pipeline flow tells the stages it runs under DVC (flows/pipeline.py):
PIPELINE_RUN_ENV = "SPIKELAB_PIPELINE_RUN"
"""The pipeline's Prefect flow-run id (an MLflow lineage tag of every stage run)."""
PARENT_TASK_RUN_ENV = "SPIKELAB_PARENT_TASK_RUN"
"""The pipeline task a stage's Prefect flow run is created under (``spikelab run``)."""
DVC_EXP_ENV = "SPIKELAB_DVC_EXP"
"""The DVC experiment the pipeline saves the run as (an MLflow lineage tag)."""
MLFLOW_ARTIFACT_ROOTS_ENV = "SPIKELAB_MLFLOW_ARTIFACT_ROOTS"
"""The folders the MLflow server may read artifacts from (``os.pathsep``-separated): set by
``services up``, read by tasks/runtime/mlflow_app.py."""
MLFLOW_PARENT_ENV = "SPIKELAB_MLFLOW_PARENT_RUN"
"""The pipeline's MLflow run: each stage's run is nested under it."""


def project_dir() -> Path:
    """The nearest directory at or above the working directory holding ``params.yaml``."""
    cwd = Path.cwd().resolve()
    for d in (cwd, *cwd.parents):
        if (d / "params.yaml").is_file():
            return d
    return cwd


def repo_root(project: Path | None = None) -> Path:
    """The original repository, also from inside a DVC experiment copy (``<repo>/.dvc/tmp/exps/...``)."""
    project = (project or project_dir()).resolve()
    parts = project.parts
    for i in range(len(parts) - len(EXPS_MARKER)):
        if parts[i : i + len(EXPS_MARKER)] == EXPS_MARKER:
            return Path(*parts[:i])
    return project


def state_dir() -> Path:
    """Created 0700, and made so when another mode let other users in: it holds the login, the
    cluster's keys and every store. One another user owns (made before us, say under /tmp) is
    refused, root's own runs included: its owner could read the stores and swap the records, the
    keys and the servers' settings that this process then trusts."""
    path = Path(os.environ.get("SPIKELAB_STATE") or repo_root() / ".spikelab").resolve()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid():
        raise UserError(
            f"state directory {path}: owned by another user (uid {info.st_uid}); choose another SPIKELAB_STATE"
        )
    if info.st_mode & 0o077:
        path.chmod(0o700)
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
    def optuna_artifacts(self) -> Path:
        """Files attached to Optuna studies (the search's figures), served by optuna-dashboard."""
        return self.root / "optuna-artifacts"

    @property
    def mlflow_auth_db(self) -> Path:
        """MLflow's users (its basic-auth app): the admin, whose password is the login's."""
        return self.root / "mlflow-auth.db"

    @property
    def mlflow_auth_config(self) -> Path:
        """MLflow's basic-auth settings (no secret: the password reaches it through the environment)."""
        return self.root / "mlflow-auth.ini"

    @property
    def credentials(self) -> Path:
        """The login to the servers (tasks/runtime/credentials.py), mode 0600."""
        return self.root / "credentials.json"

    @property
    def tls(self) -> Path:
        """The cluster's CA, certificate and key (tasks/runtime/tls.py): copied to worker nodes."""
        return self.root / "tls"

    @property
    def prefect_home(self) -> Path:
        return self.root / "prefect"

    @property
    def services(self) -> Path:
        """Pid and log files of the servers started by ``spikelab services up``."""
        return self.root / "services"

    @property
    def cluster(self) -> Path:
        """Pid and log files of the Dask scheduler and workers started by ``spikelab cluster``."""
        return self.root / "cluster"


def state() -> StatePaths:
    return StatePaths(state_dir())


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
