"""The pretrain stage's work: train on the token shards with scheduled checkpoints, export the
final weights, metrics and curves. Checkpoints persist across ``dvc repro`` (``persist: true``) so
a preempted run resumes; a changed training config or dataset starts over instead of resuming
a stranger."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from prefect import task

from model.callbacks import CSVLogger, ProgressBar
from model.config import Config, InputError
from model.data import open_split
from model.identity import RunIdentity, run_identity
from model.train import Trainer
from tasks.stage_io import (MANIFEST, PRETRAIN_CHECKPOINTS, PRETRAIN_METRICS, PRETRAIN_MODEL, PRETRAIN_PLOTS,
                            read_json, staged, write_json)
from tasks.tracking import MLflowMetrics

TRAINING_SECTIONS = ("tokenizer", "model", "mup", "optim", "schedule", "precision", "train")
"""Config sections that define a run: checkpoints saved under other values are not resumed."""
IDENTITY_FILE = "run.json"
"""Beside the checkpoints: the run they belong to (see :func:`claim_checkpoints`)."""


def read_manifest(project: Path, cfg: Config) -> dict[str, Any]:
    """The tokenize stage's manifest, checked against the config the model is built from."""
    path = project / MANIFEST
    if not path.is_file():
        raise InputError(f"{path}: missing; run the tokenize stage first (dvc repro tokenize)")
    manifest = read_json(path)
    if manifest["vocab_size"] != cfg.tokenizer.vocab_size:
        raise InputError(f"{path}: vocab_size {manifest['vocab_size']} differs from "
                         f"tokenizer.vocab_size={cfg.tokenizer.vocab_size}; re-run tokenize")
    return manifest


def pretrain_identity(cfg: Config, manifest: dict[str, Any]) -> RunIdentity:
    """The pretrain run's identity: its training config on the exact token shards."""
    return run_identity(cfg, {split: manifest["splits"][split]["sha256"] for split in ("train", "val")})


def claim_checkpoints(checkpoint_dir: Path, identity: dict[str, Any]) -> None:
    """Resume only the same run: checkpoints written under another config or other data (a new
    LR, a re-filtered corpus) belong to a different experiment, so they are discarded and the run
    starts fresh. The identity is stored beside the checkpoints."""
    marker = checkpoint_dir / IDENTITY_FILE
    owner = read_json(marker) if marker.is_file() else None
    if checkpoint_dir.is_dir() and any(checkpoint_dir.iterdir()) and owner != json.loads(json.dumps(identity)):
        print(f"spikelab: {checkpoint_dir} holds a run with other (or unrecorded) settings or data; "
              f"starting fresh", file=sys.stderr)
        shutil.rmtree(checkpoint_dir)
    if not marker.is_file():
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        with staged(marker) as (tmp,):
            write_json(tmp, identity)


@task(name="pretrain")
def pretrain(cfg: Config, project: Path) -> dict[str, Any]:
    """Train (resuming if possible), then publish weights, metrics and curves atomically."""
    manifest = read_manifest(project, cfg)
    train_tokens, val_tokens = (open_split(project / MANIFEST, split) for split in ("train", "val"))
    checkpoints = project / PRETRAIN_CHECKPOINTS
    claim_checkpoints(checkpoints, pretrain_identity(cfg, manifest).spec)
    callbacks = [MLflowMetrics(cfg.tracking.async_logging), CSVLogger(project / PRETRAIN_PLOTS), ProgressBar()]
    trainer = Trainer(cfg, train_tokens, val_tokens, callbacks, checkpoints)
    trainer.resume()
    summary = trainer.run()
    with staged(project / PRETRAIN_MODEL, project / PRETRAIN_METRICS) as (weights, metrics):
        torch.save({"model": trainer.model.state_dict(), "config": dataclasses.asdict(cfg),
                    "step": trainer.step}, weights)
        write_json(metrics, json.loads(json.dumps(summary, default=str)))
    return summary
