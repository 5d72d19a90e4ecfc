"""The data stages as Prefect flows, one per DVC stage: prepare -> filter -> tokenize.

``dvc.yaml`` runs each with ``spikelab run <stage>``; the Prefect UI can trigger them with a
profile. Wiring only: load the config, open the stage's MLflow run, run the tasks on staged
(temporary) output paths that are published only when every task succeeded, then record the
outputs (counts, report, dataset digest) in MLflow.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from prefect import flow

from tasks.data_filters import drop_perplexity_outliers, screen_documents
from tasks.data_sources import read_corpus
from tasks.data_tokenize import encode_shards, train_tokenizer
from tasks.paths import project_config
from tasks.stage_io import (CLEAN_DIR, FILTER_REPORT, MANIFEST, POISON_DIR, RAW_DIR, SOURCE_FILE, STAGE_OUTS,
                            TOKENS_DIR, record_outputs, staged)
from tasks.tracking import stage_run


@flow(name="prepare")
def prepare_flow(profile: str | None = None) -> None:
    """Read the configured corpus into data/raw."""
    cfg, project = project_config(profile)
    with stage_run(cfg, "prepare") as run:
        with staged(project / RAW_DIR) as (raw,):
            counts = read_corpus(cfg.data, project, raw)
        record_outputs(run.info.run_id, project, STAGE_OUTS["prepare"], counts, [RAW_DIR / SOURCE_FILE])


@flow(name="filter")
def filter_flow(profile: str | None = None) -> None:
    """Filter data/raw into data/clean, the poison pool and the filter report."""
    cfg, project = project_config(profile)
    with stage_run(cfg, "filter") as run:
        with staged(project / CLEAN_DIR, project / POISON_DIR, project / FILTER_REPORT) as (clean, poison, report), \
                tempfile.TemporaryDirectory(prefix=".filter-", dir=project / RAW_DIR.parent) as work:
            counts = screen_documents(cfg.filter, project / RAW_DIR, poison, Path(work))
            metrics = drop_perplexity_outliers(cfg.filter, counts, project / RAW_DIR, Path(work),
                                               clean, poison, report)
        record_outputs(run.info.run_id, project, STAGE_OUTS["filter"], metrics, [FILTER_REPORT])


@flow(name="tokenize")
def tokenize_flow(profile: str | None = None) -> None:
    """Train the BPE on data/clean and write the token shards and manifest to data/tokens."""
    cfg, project = project_config(profile)
    with stage_run(cfg, "tokenize") as run:
        with staged(project / TOKENS_DIR) as (tokens,):
            tokenizer = train_tokenizer(cfg.tokenizer, cfg.data, project / CLEAN_DIR, tokens)
            metrics = encode_shards(cfg.tokenizer, cfg.data, tokenizer, project / CLEAN_DIR, project / POISON_DIR)
        record_outputs(run.info.run_id, project, STAGE_OUTS["tokenize"], metrics, [MANIFEST])
