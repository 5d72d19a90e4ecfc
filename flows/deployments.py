"""Serve every flow as a Prefect deployment: each appears in the Prefect UI with a parameter form
(profile; for the pipeline also dotted-key overrides) and runs in this project's workspace."""

from __future__ import annotations

from prefect import serve

from flows.__main__ import STAGES, load_flow
from flows.pipeline import pipeline_flow


def serve_all() -> None:
    deployments = [pipeline_flow.to_deployment(name="spikelab-pipeline")]
    deployments += [load_flow(stage).to_deployment(name=f"spikelab-{stage}") for stage in STAGES]
    serve(*deployments)
