"""The spike stage as a Prefect flow: from each pretrain milestone in ``spike.origins``, a clean control
and one branch per injection and recovery policy (tasks/spike/study.py), tracked as one parent MLflow
run with a child per branch; post-mortems, figures and ``metrics/spike.json`` published
(tasks/spike/postmortem.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
from mlflow.entities import Metric
from prefect import flow, task

from flows.forms import Profile
from model.checkpoint import checkpoint_path
from model.data import open_split
from model.provenance import config_provenance
from model.stops import MLFLOW_STATUS
from model.typed_config import InputError
from tasks.config import project_config
from tasks.runtime.artifacts import publish_summary
from tasks.runtime.outputs import MANIFEST, POSTMORTEMS, PRETRAIN_MILESTONES, SPIKE_FIGURES, SPIKE_METRICS, SPIKE_RUN
from tasks.runtime.tracking import child_run, log_summary, run_url, stage_run
from tasks.spike.postmortem import publish
from tasks.spike.study import Study, run_study

CURVE = (("loss/train", "loss"), ("train/grad_norm", "grad_norm"), ("train/skipped", "skipped"))
"""A branch's per-step curve in its MLflow run: metric name, trace field."""


def milestone_file(project: Path, step: int) -> Path:
    path = checkpoint_path(project / PRETRAIN_MILESTONES, step)
    if not path.is_file():
        raise InputError(
            f"{path}: missing; run the pretrain stage with spike.origins step {step} among "
            f"checkpoint.milestones (dvc repro pretrain)"
        )
    return path


@task(name="spike-study")
def study_task(cfg, project: Path) -> list[Study]:
    """Per origin: warm-up, control, every injection x policy branch, replays (one process: runs set
    global RNG and thread state, and branches are short)."""
    milestones = {step: milestone_file(project, step) for step in cfg.spike.origins}
    return run_study(cfg, project, milestones, project / SPIKE_RUN)


def track_branch(study: Study, kind: str | None, policy: str) -> str:
    """A child run per branch: its per-step curve, scores and actions; returns where it is."""
    name = study.branch_name(kind, policy)
    branch = study.control if kind is None else study.branches[kind][policy]
    injection = study.injections[kind].spec() if kind else None
    tags = {
        "spikelab.branch": name,
        "spikelab.policy": policy,
        "spikelab.run_identity": study.identities[name],
        "spikelab.checkpoint": f"pretrain milestone {study.milestone}, origin step {study.origin_step}",
        "spikelab.injection": json.dumps(injection) if injection else "none",
    }
    with child_run(name, tags) as run:
        now = int(time.time() * 1000)
        curve = [Metric(key, float(row[field]), now, int(row["step"])) for row in branch.rows for key, field in CURVE]
        client = mlflow.MlflowClient()
        for i in range(0, len(curve), 900):  # MLflow takes at most 1000 metrics per batch
            client.log_batch(run.info.run_id, metrics=curve[i : i + 900])
        scores = study.scores[kind][policy] if kind else {"val_loss": branch.val_loss}
        log_summary({k: v for k, v in scores.items() if v is not None})
        mlflow.log_dict(
            {
                "actions": branch.actions,
                "detections": branch.detections,
                "status": branch.status,
                "stop_reason": branch.stop_reason,
            },
            "branch.json",
        )
    if branch.status != "completed":  # the branch's own stop kind (gave up: stopped; diverged: FAILED)
        mlflow.MlflowClient().set_terminated(run.info.run_id, MLFLOW_STATUS[branch.status])
    return run_url(run) or f"runs:/{run.info.run_id}"


@flow(name="spike")
def spike_flow(profile: Profile | None = None, overrides: dict[str, Any] | None = None) -> None:
    """Inject, detect, recover and write the post-mortems, from the milestones ``spike.origins``."""
    cfg, project = project_config(profile, overrides)
    numerics = config_provenance(cfg)
    with stage_run(cfg, "spike", numerics=numerics) as run:
        studies = study_task(cfg, project)
        uris = {}
        for study in studies:
            uris[study.branch_name(None, "continue")] = track_branch(study, None, "continue")
            for kind, by_policy in study.branches.items():
                for policy in by_policy:
                    uris[study.branch_name(kind, policy)] = track_branch(study, kind, policy)
        metrics = publish(project, studies, open_split(project / MANIFEST, "train"), uris, numerics)
        log_summary({"false_positives": metrics["false_positives"], "cpu_seconds": metrics["cpu_seconds"]})
        mlflow.log_artifact(str(project / SPIKE_METRICS))
        mlflow.log_artifacts(str(project / POSTMORTEMS), artifact_path="postmortems")
        figures = sorted((project / SPIKE_FIGURES).glob("*.png"))
        for figure in figures:
            mlflow.log_artifact(str(figure), artifact_path="figures")
        publish_summary("spike", run, headline(studies), figures)


def headline(studies: list[Study]) -> dict[str, str]:
    """One line per injection and policy for the Prefect artifact: types and mean scores over origins."""
    out = {
        "origins": ", ".join(str(s.milestone) for s in studies),
        "false alarms on the controls": str(sum(len(s.false_positives) for s in studies)),
    }
    first = studies[0]
    for kind, by_policy in first.scores.items():
        out[f"{kind}: replay"] = "spiked (data)" if first.replays[kind]["spiked"] else "no spike (data and state)"
        for policy in by_policy:
            scores = [s.scores[kind][policy] for s in studies]
            out[f"{kind} / {policy}"] = (
                f"types {[s['type'] for s in scores]}, mean gap {np.mean([s['final_gap'] for s in scores]):+.3f}, "
                f"mean excess {np.mean([s['excess_area'] for s in scores]):.2f} nat·steps"
            )
    return out
