"""The data stages as Prefect flows, one per DVC stage: prepare -> filter -> tokenize.

``dvc.yaml`` runs each with ``spikelab run <stage>``; the Prefect UI runs them through DVC (the
pipeline flow's deployments). Wiring only: load the config, open the stage's MLflow run, run the
tasks on staged (temporary) output paths that are published only when every task succeeded,
then record the outputs (counts, report, dataset digest) in MLflow and publish a summary.
These stages never import torch, and each imports only its own tasks (the filter's MinHash and
scipy, the tokenizer's library): a stage process pays for what it runs.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.forms import Profile
from flows.stages import STAGES
from tasks.config import project_config
from tasks.runtime.artifacts import publish_summary
from tasks.runtime.files import staged
from tasks.runtime.outputs import CLEAN_DIR, FILTER_REPORT, MANIFEST, POISON_DIR, RAW_DIR, SOURCE_FILE, TOKENS_DIR
from tasks.runtime.tracking import record_outputs, stage_run


@flow(name="prepare")
def prepare_flow(profile: Profile | None = None, overrides: dict[str, Any] | None = None) -> None:
    """Read the configured corpus into data/raw."""
    from tasks.data.shards import resumable, scratch
    from tasks.data.sources import read_corpus, source_identity

    cfg, project = project_config(profile, overrides)
    with stage_run(cfg, "prepare") as run:
        work = scratch(project / RAW_DIR.parent, "prepare", cfg.data, source_identity(cfg.data, project))
        with resumable(work), staged(project / RAW_DIR) as (raw,):
            counts = read_corpus(cfg.data, project, raw, work)
        digest = record_outputs(run.info.run_id, project, list(STAGES["prepare"].outs), counts, [RAW_DIR / SOURCE_FILE])
        publish_summary("prepare", run, {**counts, "dataset digest": digest[:16]})


@flow(name="filter")
def filter_flow(profile: Profile | None = None, overrides: dict[str, Any] | None = None) -> None:
    """Filter the shards of data/raw into data/clean, the poison pool and the filter report."""
    from tasks.data.filters import REMOVED_SAMPLES, filter_shards
    from tasks.data.shards import listing, resumable, scratch

    cfg, project = project_config(profile, overrides)
    with stage_run(cfg, "filter") as run:
        work = scratch(project / RAW_DIR.parent, "filter", cfg.filter, listing(project / RAW_DIR))
        outputs = (project / CLEAN_DIR, project / POISON_DIR, project / FILTER_REPORT)
        with resumable(work), staged(*outputs) as (clean, poison, report):
            metrics = filter_shards(
                cfg.filter, cfg.data, cfg.executor.scheduler, project / RAW_DIR, work, (clean, poison, report)
            )
        removed = POISON_DIR / REMOVED_SAMPLES
        digest = record_outputs(
            run.info.run_id, project, list(STAGES["filter"].outs), metrics, [FILTER_REPORT, removed]
        )
        publish_summary("filter", run, {**metrics, "dataset digest": digest[:16]})


@flow(name="tokenize")
def tokenize_flow(profile: Profile | None = None, overrides: dict[str, Any] | None = None) -> None:
    """Train the BPE on a sample of data/clean and write the token files and manifest to data/tokens."""
    from tasks.data.shards import listing, resumable, scratch
    from tasks.data.tokenize import tokenize_shards

    cfg, project = project_config(profile, overrides)
    with stage_run(cfg, "tokenize") as run:
        d = cfg.data
        inputs = (listing(project / CLEAN_DIR), listing(project / POISON_DIR))
        split = (d.seed, d.val_fraction, d.tokenizer_sample_bytes)
        work = scratch(project / TOKENS_DIR.parent, "tokenize", cfg.tokenizer, split, inputs)
        with resumable(work), staged(project / TOKENS_DIR) as (tokens,):
            metrics = tokenize_shards(
                cfg.tokenizer, d, cfg.executor.scheduler, project / CLEAN_DIR, project / POISON_DIR, tokens, work
            )
        digest = record_outputs(run.info.run_id, project, list(STAGES["tokenize"].outs), metrics, [MANIFEST])
        publish_summary("tokenize", run, {**metrics, "dataset digest": digest[:16]})
