"""The search stage as a Prefect flow: the μP learning-rate search (Optuna studies per
parametrization × width on one storage, ``search.workers`` worker processes), the transfer of the
optimum to the target width checked against a direct sweep, and the LR pretrain takes. One MLflow
run for the stage, a child run per trial (opened by the workers)."""

from __future__ import annotations

import resource
import time

import mlflow
from prefect import flow

from tasks.paths import project_config
from tasks.search import publish, search
from tasks.stage_io import SEARCH_LR, SEARCH_METRICS
from tasks.tracking import stage_run


@flow(name="search")
def search_flow(profile: str | None = None) -> None:
    """Search the LR at the proxy widths for SP and μP, transfer it, write search/lr.yaml."""
    cfg, project = project_config(profile)
    started = time.perf_counter(), time.process_time()
    with stage_run(cfg, "search") as run:
        findings = search(cfg, project, run.info.run_id)
        findings.metrics["time"] = stage_time(*started)
        figures = publish(cfg, project, findings)
        mlflow.log_metrics(headline(findings.metrics))
        for path in (SEARCH_METRICS, SEARCH_LR):
            mlflow.log_artifact(str(project / path))
        for path in figures:
            mlflow.log_artifact(str(path), artifact_path="figures")


def stage_time(wall_start: float, cpu_start: float) -> dict[str, float]:
    """Wall and CPU seconds of the search so far, the workers' CPU included."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"wall_s": time.perf_counter() - wall_start,
            "cpu_s": time.process_time() - cpu_start + children.ru_utime + children.ru_stime}


def headline(metrics: dict) -> dict[str, float]:
    """The findings as flat MLflow metrics: slopes, transfer gap and compute ratio, trial counts."""
    out = {f"{p}/slope": metrics[p]["slope"] for p in ("sp", "mup") if p in metrics}
    out.update({f"transfer/{k}": metrics["transfer"][k] for k in ("log2_lr", "loss_gap", "compute_ratio")})
    out.update({f"trials/{k}": v for k, v in metrics["trials"].items()})
    out.update({f"time/{k}": v for k, v in metrics["time"].items()})
    return {k: float(v) for k, v in out.items() if v is not None}
