"""The one place that decides where state lives, and the ports and URLs of the services.

Two roots:
  project  the workspace a stage runs in (where ``params.yaml`` is). DVC outputs are relative to
           it, so a ``dvc exp run`` copy under ``.dvc/tmp/exps/`` writes its own outputs.
  state    absolute, shared by every copy: MLflow store and artifacts, Optuna storage, Prefect
           home, service logs. It is ``<repo>/.spikelab`` of the ORIGINAL repository (an experiment
           copy resolves back to it), or ``$SPIKELAB_STATE``.

Ports and URLs of this checkout's servers (on 127.0.0.1 unless ``SPIKELAB_HOST`` says otherwise).
Which server a stage uses (its own, or the local stores) is decided in tasks/runtime/services.py.
Where the state directory is and how folders are made private: model/private.py (shared with the
bare entry points, which run without this package); the names are re-exported here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from model.private import STATE_ENV, UnsafeFolder, private_folder, project_dir, repo_root, state_dir

__all__ = ["STATE_ENV", "UnsafeFolder", "private_folder", "project_dir", "repo_root", "state_dir"]

HOST = os.environ.get("SPIKELAB_HOST", "127.0.0.1")
"""The interface the servers (``spikelab services``, ``spikelab cluster``) bind and their URLs name:
loopback unless ``SPIKELAB_HOST`` names one that other nodes reach (a head node's private
address). Every server asks for the login (tasks/runtime/credentials.py) and Dask talks mutual
TLS (tasks/runtime/tls.py) on either; beyond loopback Prefect, MLflow and the dashboard serve
HTTPS too (:func:`serves_https`)."""
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def serves_https(host: str | None = None) -> bool:
    """The servers on ``host`` (default :data:`HOST`) serve HTTPS, with a certificate their clients
    verify (tasks/runtime/tls.py): beyond loopback the login crosses a network in every request's
    basic-auth header. Loopback traffic never leaves the machine, so there it stays plain HTTP."""
    return (host or HOST) not in LOOPBACK


def exposed_warning(host: str | None = None) -> str | None:
    """What to tell a user whose servers listen on ``host`` (default :data:`HOST`) beyond loopback, or None."""
    host = host or HOST
    if not serves_https(host):
        return None
    return (
        f"spikelab: servers listen on {host}, not loopback: other machines reach them. They ask for the login; "
        "Prefect, MLflow and the dashboard serve HTTPS and Dask talks mutual TLS, with certificates a worker node "
        "verifies against its copy of the head's .spikelab/tls (docs/scaling.md)"
    )


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
REGISTRATION_ENV = "SPIKELAB_REGISTRATION"
"""``spikelab run``'s registration state for the stage it runs (confirmatory or exploratory:
tasks/design/registration.py), the ``spikelab.registration`` tag of its runs."""


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


def server_url(port: int) -> str:
    """This checkout's server on ``port``: ``https://`` beyond loopback (:func:`serves_https`)."""
    return f"{'https' if serves_https() else 'http'}://{HOST}:{port}"


def prefect_url() -> str:
    return f"{server_url(prefect_port())}/api"


def prefect_ui_url() -> str:
    return prefect_url().removesuffix("/api")


def mlflow_url() -> str:
    return server_url(mlflow_port())


def dashboard_url() -> str:
    """optuna-dashboard on the LR search's studies."""
    return server_url(dashboard_port())


MLFLOW_TRAINING_VIEW = "workflowType=machine_learning"
"""Query string that opens MLflow 3's UI in its model-training view (the default view is GenAI;
the experiment's kind tag alone does not switch it). Every MLflow link spikelab prints has it."""


def own_checkout_env(project: Path) -> dict[str, str]:
    """The environment for a git command that reads ``project`` as a checkout only where it is one:
    git's search for a repository stops before ``project``'s parent."""
    return {**os.environ, "GIT_CEILING_DIRECTORIES": str(project.resolve().parent)}
