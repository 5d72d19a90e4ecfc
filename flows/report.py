"""The report stage as a Prefect flow: the findings (tasks/report/findings.py) and the report
(tasks/report/render.py, one module per part in tasks/report/sections/) from the stages' outputs,
written atomically, logged to MLflow and linked from the stage's Prefect artifact; ends by printing
where the report is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlflow
from prefect import flow

from flows.forms import Profile
from model.provenance import config_provenance
from model.typed_config import InputError
from tasks.config import project_config
from tasks.design.seed_registry import TRAINED_BY
from tasks.design.studies import builtin_families, read_studies
from tasks.params import RESOLVED
from tasks.report.arithmetic import committed_outputs, numeric_paths, of_the_same_design, warnings
from tasks.report.declared import declared_finding
from tasks.report.figures import forest_plot
from tasks.report.findings import evaluate, mark_fragile
from tasks.report.method import Finding
from tasks.report.render import render_html, render_markdown, report_json, report_sections
from tasks.report.sections.checks import shown_verdict
from tasks.report.sections.findings import forest_rows
from tasks.report.sections.history import reanalysis
from tasks.report.sections.method import provenance, stage_times
from tasks.report.sections.runs import ARMS_PAGE, render_arms
from tasks.report.sections.words import in_words
from tasks.report.versions import beside_earlier
from tasks.runtime.artifacts import publish_summary
from tasks.runtime.files import read_json, staged, write_json
from tasks.runtime.outputs import (
    ABLATE_METRICS,
    PRETRAIN_METRICS,
    REPORT_FOREST,
    REPORT_HTML,
    REPORT_MD,
    REPORT_METRICS,
    SEARCH_METRICS,
    SENSITIVITY_METRICS,
    SPIKE_METRICS,
)
from tasks.runtime.tracking import git_lineage, latest_stage_runs, log_summary, stage_run

STAGES_REPORTED = ["search", "pretrain", "spike", "ablate", "sensitivity"]


def optional(path: Path) -> dict[str, Any] | None:
    return read_json(path) if path.is_file() else None


def arithmetic_of(report: dict[str, Any], outputs: dict[str, dict[str, Any] | None]) -> dict[str, Any]:
    """The report's arithmetic (its own, its inputs' by numeric path, the committed outputs'),
    and what a reader must be warned of (tasks/report/arithmetic.py)."""
    used, committed = numeric_paths(outputs), numeric_paths(of_the_same_design(outputs, committed_outputs()))
    return {"report": report, "inputs": used, "committed": committed, "warnings": warnings(used, committed)}


@flow(name="report")
def report_flow(profile: Profile | None = None, overrides: dict[str, Any] | None = None) -> None:
    """Build reports/REPORT.md, reports/report.html and metrics/report.json from the stages' outputs."""
    cfg, project = project_config(profile, overrides)
    if not (project / ABLATE_METRICS).is_file():
        raise InputError(f"{project / ABLATE_METRICS}: missing; run the ablate stage first (dvc repro ablate)")
    ablate = read_json(project / ABLATE_METRICS)
    search, spike, pretrain = (optional(project / p) for p in (SEARCH_METRICS, SPIKE_METRICS, PRETRAIN_METRICS))
    sensitivity = optional(project / SENSITIVITY_METRICS)  # the sensitivity stage's, when it ran
    numerics = config_provenance(cfg)
    with stage_run(cfg, "report", numerics=numerics) as run:
        unigram = ablate.get("unigram_val_loss")
        declared = read_studies(project, cfg)
        findings = evaluate(cfg, ablate, search, spike, unigram) + [
            declared_finding(cfg, ablate, unigram, family) for family in declared
        ]
        mark_fragile(findings, cfg, sensitivity)  # the perturbed rerun, a registered replication
        trained = {"search": search, "spike": spike, "ablate": ablate, "sensitivity": sensitivity}
        origin = provenance(project, RESOLVED, git_lineage().get("mlflow.source.git.commit"), trained)
        origin["reanalysis"] = reanalysis({s: trained[s] for s in TRAINED_BY})  # the stages a registration labels
        worded = in_words(findings, builtin_families(cfg) + declared)  # the claims as a reader reads them
        arithmetic = arithmetic_of(numerics, {"search": search, "pretrain": pretrain, "spike": spike, "ablate": ablate})
        runs = latest_stage_runs(cfg.tracking.experiment, STAGES_REPORTED)
        with staged(project / REPORT_FOREST) as (forest,):
            forest_plot(forest_rows(worded), forest)
        times = stage_times(
            {"search": search, "pretrain": pretrain, "spike": spike, "ablate": ablate, "sensitivity": sensitivity}
        )
        compared = beside_earlier(project, cfg.profile, findings)  # version 3 beside this run, claim by claim
        sections = report_sections(
            cfg,
            project,
            findings,
            ablate,
            search,
            spike,
            pretrain,
            origin,
            runs,
            arithmetic,
            sensitivity,
            times,
            compared,
        )
        arms_page = (project / REPORT_MD).parent / ARMS_PAGE  # in the reports/report output
        with staged(project / REPORT_MD, project / REPORT_HTML, arms_page) as (md, page, arms):
            md.write_text(render_markdown(sections, project), encoding="utf-8")
            arms.write_text(render_arms(ablate), encoding="utf-8")
            page.write_text(render_html(sections, project), encoding="utf-8")
        summary = report_json(findings, ablate, arithmetic, times, origin, compared)
        add_claim_words(summary, worded)
        write_json(project / REPORT_METRICS, summary)
        log_summary({k.replace(" ", "_"): v for k, v in summary["counts"].items()})
        for path in (REPORT_MD, REPORT_HTML, REPORT_METRICS, REPORT_FOREST):
            mlflow.log_artifact(str(project / path))
        mlflow.log_artifact(str(arms_page))
        publish_summary(
            "report", run, {f.registered["claim"]: shown_verdict(f) for f in findings}, [project / REPORT_FOREST]
        )
    print(
        f"[spikelab] report: {project / REPORT_MD} and {project / REPORT_HTML} "
        f"({', '.join(f'{n} {v}' for v, n in summary['counts'].items())})"
    )


def add_claim_words(summary: dict[str, Any], worded: list[Finding]) -> None:
    """Each claim of metrics/report.json with ``words``: its name for a reader, as the report's
    first screen gives it (README's blocks quote it; ``what`` keeps the declared name)."""
    for f in worded:
        for claim, said in zip(summary["findings"].get(f.key, {}).get("claims") or [], f.claims, strict=False):
            claim["words"] = said.what
