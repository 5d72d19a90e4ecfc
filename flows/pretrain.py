"""The pretrain stage as a Prefect flow: bf16 pretraining with scheduled checkpoints at the LR the
search stage transferred (tasks/pretrain/train.py: pretrain_config), tracked in one MLflow run named by the run identity (params, telemetry every ``train.log_every`` steps, the
token shards as its dataset input, summary metrics, curves and figures, the weights as a model)."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import mlflow
from prefect import flow, task

from flows.forms import Profile
from model.provenance import config_provenance
from tasks.config import project_config
from tasks.pretrain.figures import pretrain_figures
from tasks.pretrain.train import pretrain, pretrain_config, pretrain_identity, read_manifest
from tasks.runtime.artifacts import publish_summary
from tasks.runtime.outputs import MANIFEST, PRETRAIN_METRICS, PRETRAIN_MODEL, PRETRAIN_PLOTS, PRETRAIN_REPORTS
from tasks.runtime.tracking import log_summary, stage_run

SUMMARY_FIGURES = ("steps", "final_loss", "val_loss", "tokens_per_s", "wall_s", "skipped", "precision")
"""What the Prefect artifact shows of the summary."""


def log_token_shards(project: Path, manifest: dict[str, Any]) -> None:
    """The token shards as the run's training dataset, identified by their content hashes."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset

    digest = "-".join(manifest["splits"][s]["sha256"][:8] for s in ("train", "val"))
    with warnings.catch_warnings():  # a local path matches the "file" and "" schemes: same source class
        warnings.simplefilter("ignore", UserWarning)
        source = resolve_dataset_source(str((project / MANIFEST).parent.resolve()))
    dataset = MetaDataset(source, name="tokens", digest=digest)  # type: ignore[abstract]  # mlflow's Dataset marks `profile` abstract but is no ABC: MetaDataset's is None
    mlflow.log_input(dataset, context="training")


@task(name="log-model")
def log_pretrained_model(weights: Path, cfg) -> None:
    """The exported weights as an MLflow PyTorch model (the module pickled with ``model/`` as code)."""
    import mlflow.pytorch
    import torch

    from model.gpt import GPT

    net = GPT(cfg.model, cfg.mup, cfg.tokenizer.vocab_size)
    net.load_state_dict(torch.load(weights, weights_only=True)["model"])
    logging.getLogger("mlflow.pytorch").setLevel(logging.ERROR)  # the pickle caveat: our own code, our own store
    mlflow.pytorch.log_model(
        net,
        name="model",
        serialization_format="pickle",
        code_paths=[str(Path(__file__).parents[1] / "model")],
        pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"],
    )


@flow(name="pretrain")
def pretrain_flow(profile: Profile | None = None, overrides: dict[str, Any] | None = None) -> None:
    """Train the target-width model on data/tokens; resumes from runs/pretrain/checkpoints.
    Runs this stage directly, outside DVC (``dvc repro`` and the pipeline flow call it)."""
    cfg, project = project_config(profile, overrides)
    cfg = pretrain_config(cfg, project)
    manifest = read_manifest(project, cfg)
    identity = pretrain_identity(cfg, manifest).digest
    with stage_run(cfg, "pretrain", identity, config_provenance(cfg)) as run:
        log_token_shards(project, manifest)
        summary = pretrain(cfg, project)
        figures = pretrain_figures(project / PRETRAIN_PLOTS, project / PRETRAIN_REPORTS, run.info.run_name)
        log_summary(summary)
        mlflow.log_artifact(str(project / PRETRAIN_METRICS))
        mlflow.log_artifacts(str(project / PRETRAIN_PLOTS), artifact_path="plots")
        for figure in figures:
            mlflow.log_artifact(str(figure), artifact_path="figures")
        log_pretrained_model(project / PRETRAIN_MODEL, cfg)
        publish_summary("pretrain", run, {k: summary.get(k) for k in SUMMARY_FIGURES}, figures)
