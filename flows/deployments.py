"""Serve the study as Prefect deployments: ``spikelab-pipeline`` for every stage, one
``spikelab-<stage>`` per stage, and one ``spikelab-study-<family>`` per family studies.yaml
declares (its factor values as the form). All of them run through DVC (the pipeline flow with a target),
so a run from the UI is cached, versioned and never leaves the workspace half-changed; each has
the pipeline's typed form (profile as a choice, the ablation keys typed and documented).

``make demo`` and ``make repro`` publish them (:func:`publish`) without serving them, so the
Prefect UI's Deployments page lists them at once; a run of one starts while ``spikelab serve``
runs in the project (until then it waits, Scheduled), as each description says."""

from __future__ import annotations

from prefect import serve

from flows.pipeline import pipeline_flow, study_flow
from flows.stages import STAGES
from tasks.config import project_config
from tasks.design.studies import read_studies

THROUGH_DVC = (
    "Runs through DVC (`dvc repro --single-item`, one task per stage, logs live): cached and "
    "versioned. Form values are written to params.yaml as `dvc exp run -S` would and the run is "
    "saved as a DVC experiment; a failure puts params.yaml and every output back. "
    "Runs start only while `spikelab serve` runs in the project (until then they wait, Scheduled)."
)


def deployments() -> list:
    found = [
        pipeline_flow.to_deployment(
            name="spikelab-pipeline",
            parameters={"target": "all"},
            tags=["spikelab"],
            description=f"The whole study: {' -> '.join(STAGES)}. {THROUGH_DVC}",
        )
    ]
    found += [
        pipeline_flow.to_deployment(
            name=f"spikelab-{stage}",
            parameters={"target": stage},
            tags=["spikelab", stage],
            description=f"The {stage} stage, after the stages it needs when they are stale. {THROUGH_DVC}",
        )
        for stage in STAGES
    ]
    found += [
        study_flow.to_deployment(
            name=f"spikelab-study-{family.name}",
            parameters={"family": family.name, "factors": family.factors},
            tags=["spikelab", "study", family.name],
            description=f"{family.question} (studies.yaml: {family.name}). Its factor values are the form's. {THROUGH_DVC}",
        )
        for family in declared_families()
    ]
    return found


def declared_families() -> list:
    """The families studies.yaml declares (one deployment each)."""
    cfg, project = project_config(None, {})
    return read_studies(project, cfg)


def publish() -> list[str]:
    """Register every deployment with the Prefect server without serving them; their names."""
    found = deployments()
    for deployment in found:
        deployment.apply()  # created, or updated in place: a deployment's name is its identity
    return [deployment.name for deployment in found]


def serve_all() -> None:
    """Serve from this workspace, one run at a time: they all write the same params.yaml and
    outputs, so a second run waits for the first instead of racing it."""
    serve(*deployments(), limit=1)
