"""The pretrain stage as a Prefect flow: bf16 pretraining with scheduled checkpoints at the LR the
search stage transferred, tracked in one MLflow run (params, telemetry every ``train.log_every``
steps, summary, curves)."""

from __future__ import annotations

import mlflow
from prefect import flow

from tasks.paths import project_config
from tasks.stage_io import PRETRAIN_METRICS, PRETRAIN_PLOTS
from tasks.tracking import stage_run
from tasks.train import pretrain, pretrain_config


@flow(name="pretrain")
def pretrain_flow(profile: str | None = None) -> None:
    """Train the target-width model on data/tokens; resumes from runs/pretrain/checkpoints."""
    cfg, project = project_config(profile)
    cfg = pretrain_config(cfg, project)
    with stage_run(cfg, "pretrain"):
        pretrain(cfg, project)
        mlflow.log_artifact(str(project / PRETRAIN_METRICS))
        mlflow.log_artifacts(str(project / PRETRAIN_PLOTS), artifact_path="plots")
