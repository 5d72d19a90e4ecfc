"""The search stage as a Prefect flow: the μP learning-rate search (Optuna studies per
parametrization × width on one storage, ``search.workers`` worker processes), the transfer of the
optimum to the target width checked against a direct sweep, and the LR pretrain takes. One MLflow
run for the stage with a child run per trial (opened by the workers), the findings as summary
metrics, the figures as artifacts and in the stage's Prefect artifact; the numbers and figures also
on the transfer study in optuna-dashboard (tasks/search/dashboard.py)."""

from __future__ import annotations

import resource
import time
from typing import Any

import mlflow
from prefect import flow

from flows.forms import Profile
from tasks.config import project_config
from tasks.runtime.artifacts import publish_summary
from tasks.runtime.outputs import SEARCH_LR, SEARCH_METRICS
from tasks.runtime.tracking import log_summary, stage_provenance, stage_run
from tasks.search.dashboard import annotate
from tasks.search.findings import publish
from tasks.search.study import search


@flow(name="search")
def search_flow(profile: Profile | None = None, overrides: dict[str, Any] | None = None) -> None:
    """Search the LR at several widths for SP and μP, transfer μP's to the target width, check it
    against a direct sweep there, and write search/lr.yaml for pretrain."""
    cfg, project = project_config(profile, overrides)
    started, numerics = (time.perf_counter(), time.process_time()), stage_provenance(cfg)
    with stage_run(cfg, "search", numerics=numerics) as run:
        findings = search(cfg, project, run.info.run_id)
        findings.metrics["time"] = stage_time(*started)
        findings.metrics["provenance"] = numerics
        figures = publish(cfg, project, findings)
        annotate(cfg, findings, figures)
        key_figures = headline(findings.metrics)
        log_summary(key_figures)
        for path in (SEARCH_METRICS, SEARCH_LR):
            mlflow.log_artifact(str(project / path))
        for path in figures:
            mlflow.log_artifact(str(path), artifact_path="figures")
        publish_summary("search", run, key_figures, figures)


def stage_time(wall_start: float, cpu_start: float) -> dict[str, float]:
    """Wall and CPU seconds of the search so far, the workers' CPU included."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "wall_s": time.perf_counter() - wall_start,
        "cpu_s": time.process_time() - cpu_start + children.ru_utime + children.ru_stime,
    }


def headline(metrics: dict) -> dict[str, float]:
    """The findings in one flat table: slopes with their spread, the transfer's LR, loss gap and
    compute ratio, the trial counts, the steps pruning saved and the time taken."""
    out: dict[str, Any] = {}
    for p in ("sp", "mup"):
        if p in metrics:
            out.update({f"{p}/slope": metrics[p]["slope"], f"{p}/slope_std": metrics[p]["slope_std"]})
    transfer = metrics["transfer"]
    out.update({f"transfer/{k}": transfer[k] for k in ("lr", "loss_gap", "loss_gap_std", "compute_ratio")})
    out.update({f"trials/{k}": v for k, v in metrics["trials"].items()})
    pruning = metrics.get("pruning", {})
    out.update({f"pruning/{k}": pruning[k] for k in ("steps_saved", "steps_saved_share") if k in pruning})
    out.update({f"time/{k}": v for k, v in metrics["time"].items()})
    return {k: float(v) for k, v in out.items() if v is not None}
