"""The MLflow runs, by run ID with the server that held them (a link to 127.0.0.1 resolves only on
the machine that ran the study): each stage's run (:func:`runs_section`), and every arm's run with the
command that reproduces it on a page of its own, reports/report/arms.md (:func:`render_arms`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from tasks.report.sections.section import Section, table

ARMS_PAGE = Path("report/arms.md")
"""Every arm with its status, MLflow run and command, under reports/ (in the report stage's
``reports/report`` output): 300-odd rows that would bury REPORT.md."""

MLFLOW_RUN = re.compile(
    r"^(?P<server>https?://[^/#?]+)?.*?#/experiments/(?P<experiment>[^/?]+)/runs/(?P<run>[0-9a-f]+)"
)


def mlflow_run(ref: str | None) -> tuple[str | None, str | None, str] | None:
    """(server, experiment ID, run ID) of a run link (a UI URL or ``runs:/<id>``), or None."""
    if not ref:
        return None
    if ref.startswith("runs:/"):
        return None, None, ref.removeprefix("runs:/").split("/")[0]
    m = MLFLOW_RUN.match(ref)
    return (m["server"], m["experiment"], m["run"]) if m else None


def _where_runs_are(refs: list[tuple[str | None, str | None, str]]) -> str:
    """Where the runs ``refs`` live, in a sentence: run IDs resolve only in the store that holds them."""
    servers = sorted({s for s, _, _ in refs if s})
    experiments = sorted({e for _, e, _ in refs if e})
    held = f"the MLflow server at {', '.join(servers)} on the machine that ran it" if servers else "its tracking store"
    page = (
        f"`<MLflow URL>/#/experiments/{experiments[0]}/runs/<run ID>`"
        if len(experiments) == 1
        else "`<MLflow URL>/#/experiments/<experiment>/runs/<run ID>`"
    )
    return (
        f"The run IDs are those of the study's runs in {held}. On that machine (`spikelab services up`, then "
        f"`spikelab ui`), a run opens at {page}; another machine's MLflow does not hold them (its own `dvc repro` "
        "makes its own runs)."
    )


def runs_section(stage_runs: dict[str, str]) -> Section:
    """Each stage's MLflow run by run ID, with where it lives; the arms' runs are on the arms' page."""
    refs = {stage: mlflow_run(url) for stage, url in stage_runs.items()}
    found = [r for r in refs.values() if r]
    lines: list[str] = []
    if found:
        lines += [_where_runs_are(found), ""]
    lines += [f"- {stage}: run `{r[2]}`" if r else f"- {stage}: {stage_runs[stage]}" for stage, r in refs.items()]
    if not refs:
        lines.append(
            "- The tracking store this report was built against holds no finished run of the stages it reads "
            "(a report rebuilt from the committed metrics/*.json elsewhere)."
        )
    lines += [
        "",
        f"Each arm's run ID (a child run of the ablate stage's run) is in [{ARMS_PAGE.as_posix()}]"
        f"({ARMS_PAGE.as_posix()}), with the command that reproduces the arm.",
        "",
    ]
    return Section("MLflow runs", lines)


def render_arms(ablate: dict[str, Any]) -> str:
    """reports/report/arms.md: every arm, its status, its MLflow run ID and its command."""
    refs = [mlflow_run(a.get("mlflow")) for a in ablate["arms"]]
    found = [r for r in refs if r]
    lines = [
        "# The arms of the study",
        "",
        f"{len(ablate['arms'])} arms, each trained from scratch; each reproduces with its command, run from the "
        "project's root ([the report](../REPORT.md)).",
        "",
        *([_where_runs_are(found), ""] if found else []),
        *table(
            ["arm", "status", "MLflow run", "command"],
            [
                [a["name"], a["status"], f"`{r[2]}`" if r else str(a.get("mlflow") or "-"), f"`{a['command']}`"]
                for a, r in zip(ablate["arms"], refs)
            ],
        ),
    ]
    return "\n".join(lines) + "\n"
