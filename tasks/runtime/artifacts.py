"""The Prefect artifact every stage publishes: a markdown summary of its key figures, with links
to its MLflow run and its figures, shown on the flow run's page."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from prefect.artifacts import create_markdown_artifact

from tasks.runtime.tracking import run_url


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def summary_markdown(stage: str, run: Any, figures: Mapping[str, Any], files: Iterable[Path] = ()) -> str:
    url = run_url(run)
    where = f"[{run.info.run_name}]({url})" if url else f"`{run.info.run_id}` (local store)"
    lines = [f"# {stage}", "", f"MLflow run: {where}", "", "| figure | value |", "|---|---|"]
    lines += [f"| {k} | {_cell(v)} |" for k, v in figures.items() if v is not None]
    files = list(files)
    if files:
        lines += ["", "Figures (PNG, also among the MLflow run's artifacts under `figures/`):", ""]
        lines += [
            f"- [{f.name}]({f.resolve().as_uri()})"
            + (f" · [in MLflow]({run_url(run, f'/artifacts/figures/{f.name}')})" if url else "")
            for f in files
        ]
    return "\n".join(lines) + "\n"


def publish_summary(stage: str, run: Any, figures: Mapping[str, Any], files: Iterable[Path] = ()) -> None:
    """The stage's markdown artifact; its key names the stage, so the latest is one click away."""
    create_markdown_artifact(
        summary_markdown(stage, run, figures, files),
        key=f"{stage}-summary",
        description=f"{stage}: key figures and links",
    )


def publish_pipeline_summary(run: Any, stages: list[str], dvc_exp: str | None) -> None:
    """The pipeline's artifact: each stage with the MLflow run it caused, nested under the
    pipeline's run (a stage DVC found up to date ran nothing)."""
    import mlflow

    children = mlflow.MlflowClient().search_runs(
        [run.info.experiment_id], f"tags.`mlflow.parentRunId` = '{run.info.run_id}'"
    )
    by_stage = {r.data.tags.get("spikelab.stage"): r for r in children}
    url = run_url(run)
    lines = [
        "# pipeline",
        "",
        f"MLflow run: [{run.info.run_name}]({url})" if url else f"MLflow run `{run.info.run_id}`",
        "",
        f"DVC experiment: `{dvc_exp}`" if dvc_exp else "Ran in the workspace (no form values).",
        "",
        "| stage | MLflow run | status |",
        "|---|---|---|",
    ]
    for stage in stages:
        child = by_stage.get(stage)
        child_url = run_url(child) if child else None
        cell = (
            (f"[{child.info.run_name}]({child_url})" if child_url else f"`{child.info.run_id}`")
            if child
            else "up to date: not run"
        )
        lines.append(f"| {stage} | {cell} | {child.info.status if child else '-'} |")
    create_markdown_artifact(
        "\n".join(lines) + "\n", key="pipeline-summary", description="pipeline: stages and their MLflow runs"
    )
