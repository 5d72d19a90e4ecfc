"""The spike stage as a Prefect flow: per seed of ``spike.seeds`` and ``spike.confirm_seeds``, an
origin run at the ablation arm scale and from its checkpoint a clean control and one branch per
cause (injection) and recovery policy (tasks/spike/study.py: run_seed). The seeds are fanned out as
one Prefect task each onto long-lived worker processes, as the ablate stage's arms are
(``spike.workers`` of a local cluster, or the Dask cluster at ``executor.scheduler``:
tasks/runtime/workers.py); a seed's numbers do not depend on the worker or the worker count.
Tracked as one parent MLflow run with a child per branch; post-mortems, figures and
``metrics/spike.json`` (the cause x policy x seed matrix) published (tasks/spike/postmortem.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
from mlflow.entities import Metric
from prefect import flow, get_run_logger, task
from prefect.futures import as_completed

from flows.forms import Profile
from model.data import open_split
from model.stops import MLFLOW_STATUS
from tasks.config import Config, project_config
from tasks.runtime.artifacts import publish_summary
from tasks.runtime.outputs import MANIFEST, POSTMORTEMS, SPIKE_FIGURES, SPIKE_METRICS, SPIKE_RUN
from tasks.runtime.progress import Progress, pace_record
from tasks.runtime.tracking import child_run, log_summary, run_url, stage_provenance, stage_run
from tasks.runtime.workers import clean_state, executor
from tasks.spike.config import OUTCOMES
from tasks.spike.postmortem import publish
from tasks.spike.study import Study, run_seed

CURVE = (("loss/train", "loss"), ("train/grad_norm", "grad_norm"), ("train/skipped", "skipped"))
"""A branch's per-step curve in its MLflow run: metric name, trace field."""


@task
def study_seed(cfg: Config, project: Path, seed: int) -> tuple[Study, float]:
    """One seed's origin run and every branch from it, in this worker, from a clean global state;
    with the seconds it took here (the progress line's ETA)."""
    clean_state()
    started = time.perf_counter()
    return run_seed(cfg, project, seed, project / SPIKE_RUN / f"seed_{seed}"), time.perf_counter() - started


def run_seeds(cfg: Config, project: Path) -> list[Study]:
    """Every seed's study on the executor's workers, one task per seed; in seed order."""
    seeds = cfg.spike.all_seeds
    units = executor(cfg, cfg.spike.workers, len(seeds))
    what = f"each an origin run, a control and {len(cfg.spike.kinds)} causes x {len(cfg.recovery.policies)} policies"
    record = pace_record("spike", cfg)
    progress = Progress("spike", "seed", len(seeds), get_run_logger(), workers=units.workers, what=what, record=record)
    done: dict[int, Study] = {}
    with units.runner() as runner, units.placement():
        futures = {
            runner.submit(
                study_seed.with_options(task_run_name=f"seed {seed}"), {"cfg": cfg, "project": project, "seed": seed}
            ): seed
            for seed in seeds
        }
        for future in as_completed(list(futures)):
            seed = futures[future]
            done[seed], seconds = future.result()
            progress.finished(str(seed), "completed", seconds=seconds)
    progress.close()
    return [done[seed] for seed in seeds]


def track_branch(study: Study, kind: str | None, policy: str) -> str:
    """A child run per branch: its per-step curve, scores and actions; returns where it is."""
    name = study.branch_name(kind, policy)
    branch = study.control if kind is None else study.branches[kind][policy]
    injection = study.injections[kind].spec() if kind else None
    tags = {
        "spikelab.branch": name,
        "spikelab.policy": policy,
        "spikelab.run_identity": study.identities[name],
        "spikelab.checkpoint": f"seed {study.seed}'s origin run at step {study.cfg.spike.origin_step}, "
        f"branches from step {study.fork_step}",
        "spikelab.seed": str(study.seed),
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
    """Train the origin runs, inject, detect, recover and write the post-mortems, per seed."""
    cfg, project = project_config(profile, overrides)
    numerics = stage_provenance(cfg)
    start = time.monotonic()
    with stage_run(cfg, "spike", numerics=numerics) as run:
        studies = run_seeds(cfg, project)
        uris = {}
        for study in studies:
            uris[study.branch_name(None, "continue")] = track_branch(study, None, "continue")
            for kind, by_policy in study.branches.items():
                for policy in by_policy:
                    uris[study.branch_name(kind, policy)] = track_branch(study, kind, policy)
        train = open_split(project / MANIFEST, "train")
        metrics = publish(project, studies, train, uris, numerics, time.monotonic() - start)
        log_summary({"false_positives": metrics["false_positives"], "cpu_seconds": metrics["cpu_seconds"]})
        mlflow.log_artifact(str(project / SPIKE_METRICS))
        mlflow.log_artifacts(str(project / POSTMORTEMS), artifact_path="postmortems")
        figures = sorted((project / SPIKE_FIGURES).glob("*.png"))
        for figure in figures:
            mlflow.log_artifact(str(figure), artifact_path="figures")
        publish_summary("spike", run, headline(studies), figures)


def headline(studies: list[Study]) -> dict[str, str]:
    """One line per cause and policy for the Prefect artifact: the outcome counts over seeds and the
    mean final gap of the branches that completed."""
    out = {
        "seeds": ", ".join(str(s.seed) for s in studies),
        "false alarms on the controls": str(sum(len(s.false_positives) for s in studies)),
    }
    for kind, by_policy in studies[0].scores.items():
        for policy in by_policy:
            scores = [s.scores[kind][policy] for s in studies]
            counts = ", ".join(f"{sum(x['outcome'] == o for x in scores)} {o}" for o in OUTCOMES)
            gaps = [x["final_gap"] for x in scores if x["final_gap"] is not None]
            out[f"{kind} / {policy}"] = f"{counts}; mean gap {np.mean(gaps):+.3f}" if gaps else counts
    return out
