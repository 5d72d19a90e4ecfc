"""The pretrain stage's work: train on the token shards with scheduled checkpoints, export the
final weights, metrics and curves.

The run directory (``runs/pretrain``) has one writer at a time (a lock). Its checkpoints persist
across ``dvc repro`` (``persist: true``) so a preempted run resumes; they carry the run identity
(model/identity.py), and when the identity changes (another training config or dataset) the old
folder is moved aside under its identity, never deleted, and only once the new config has been
validated and its device found. Only a completed run publishes weights; a diverged or stopped one
writes its metrics with its status and fails the stage.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from prefect import task

from model.callbacks import CSVLogger, ProgressBar
from model.checkpoint import RunLock, checkpoint_path, list_checkpoints, load_latest, remove_orphans
from model.data import open_split
from model.identity import RunIdentity, run_identity
from model.provenance import provenance
from model.stops import raise_for_status
from model.train import Trainer, resolve_device
from model.typed_config import InputError
from tasks.config import Config
from tasks.runtime.files import read_json, staged, write_json
from tasks.runtime.outputs import (
    MANIFEST,
    PRETRAIN_CHECKPOINTS,
    PRETRAIN_METRICS,
    PRETRAIN_MILESTONES,
    PRETRAIN_MODEL,
    PRETRAIN_PLOTS,
    PRETRAIN_RUN,
    PRETRAIN_SET_ASIDE,
    SEARCH_LR,
)
from tasks.runtime.tracking import MLflowMetrics

IDENTITY_FILE = "run.json"
"""Beside the checkpoints: the identity of the run they belong to (digest and what was hashed), and
the arithmetic of every process that trained a segment of it (``provenance``: one record per
numeric path, so a run resumed on another kind of machine lists both)."""
SUMMARY_FILE = "summary.json"
"""Beside the checkpoints: the summary of the run that wrote the newest one, so rerunning a
finished run republishes its figures instead of those of a zero-step pass."""


def read_manifest(project: Path, cfg: Config) -> dict[str, Any]:
    """The tokenize stage's manifest, checked against the config the model is built from."""
    path = project / MANIFEST
    if not path.is_file():
        raise InputError(f"{path}: missing; run the tokenize stage first (dvc repro tokenize)")
    manifest = read_json(path)
    if manifest["vocab_size"] != cfg.tokenizer.vocab_size:
        raise InputError(
            f"{path}: vocab_size {manifest['vocab_size']} differs from "
            f"tokenizer.vocab_size={cfg.tokenizer.vocab_size}; re-run tokenize"
        )
    return manifest


def pretrain_config(cfg: Config, project: Path) -> Config:
    """The config pretrain trains with: ``optim.lr`` is the search stage's transferred LR
    (search/lr.yaml, a DVC dependency of pretrain) when ``search.transfer_lr`` is true. The one
    place that file is read; the LR then flows into the run identity, MLflow params and metrics."""
    if not cfg.search.transfer_lr:
        return cfg
    path = project / SEARCH_LR
    if not path.is_file():
        raise InputError(
            f"{path}: missing; run the search stage first (dvc repro search), "
            f"or set search.transfer_lr: false to train with optim.lr"
        )
    lr = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("optim", {}).get("lr")
    if not isinstance(lr, float) or not lr > 0:
        raise InputError(f"{path}: optim.lr must be a positive number, got {lr!r}")
    return cfg.replace(**{"optim.lr": lr})


def pretrain_identity(cfg: Config, manifest: dict[str, Any]) -> RunIdentity:
    """The pretrain run's identity: its training config on the exact token shards."""
    return run_identity(cfg, {split: manifest["splits"][split]["sha256"] for split in ("train", "val")})


def claim_checkpoints(checkpoint_dir: Path, identity: RunIdentity, set_aside: Path) -> Path | None:
    """Make ``checkpoint_dir`` this run's: a folder of another (or an unrecorded) identity is moved
    to ``set_aside/<its identity>`` and an empty one takes its place. Returns where it went."""
    marker = checkpoint_dir / IDENTITY_FILE
    owner = read_json(marker).get("digest") if marker.is_file() else None
    moved = None
    if owner != identity.digest and checkpoint_dir.is_dir() and any(checkpoint_dir.iterdir()):
        moved = set_aside / (owner or f"unrecorded-{time.strftime('%Y%m%d-%H%M%S')}")
        if moved.exists():
            moved = moved.with_name(f"{moved.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        moved.parent.mkdir(parents=True, exist_ok=True)
        os.replace(checkpoint_dir, moved)
        print(
            f"spikelab: {checkpoint_dir} held run {owner or '(unrecorded)'}; moved it to {moved} "
            f"and starting run {identity.digest}",
            file=sys.stderr,
        )
    if owner != identity.digest or not marker.is_file():
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        with staged(marker) as (tmp,):
            write_json(tmp, {"digest": identity.digest, **identity.spec})
    return moved


def record_arithmetic(marker: Path, arithmetic: dict[str, Any]) -> None:
    """Add this process's arithmetic to the run's identity record, unless its numeric path is there."""
    record = read_json(marker)
    seen = record.get("provenance", [])
    if arithmetic["numeric_path"] not in {p["numeric_path"] for p in seen}:
        with staged(marker) as (tmp,):
            write_json(tmp, {**record, "provenance": [*seen, arithmetic]})


def backfill_milestones(cfg: Config, train_tokens, val_tokens, checkpoint_dir: Path, identity: str) -> list[int]:
    """Milestones added after the run passed them: replay from the newest checkpoint before the
    first missing one (or from scratch) to the last missing one, saving only milestones. The run is
    deterministic, so each equals what the original run would have saved."""
    saved = {step for step, _ in list_checkpoints(checkpoint_dir)}
    latest = max(saved, default=0)
    missing = sorted(m for m in cfg.checkpoint.milestones if m < latest and m not in saved)
    if not missing:
        return []
    replay_cfg = cfg.replace(**{"checkpoint.every_steps": 0, "checkpoint.every_minutes": 0.0})
    trainer = Trainer(replay_cfg, train_tokens, val_tokens, [], checkpoint_dir, identity)
    base = load_latest(checkpoint_dir, identity, before=missing[0])
    if base is not None:
        trainer.load(base[1], base[0])
    print(f"spikelab: producing milestones {missing} by replaying from step {trainer.step}", file=sys.stderr)
    trainer.run(until=missing[-1])
    return missing


@task(name="pretrain")
def pretrain(cfg: Config, project: Path) -> dict[str, Any]:
    """Train (resuming if possible), then publish weights, metrics and curves atomically."""
    resolve_device(cfg.train.device)  # fail before anything on disk changes
    manifest = read_manifest(project, cfg)
    identity = pretrain_identity(cfg, manifest)
    train_tokens, val_tokens = (open_split(project / MANIFEST, split) for split in ("train", "val"))
    checkpoints = project / PRETRAIN_CHECKPOINTS
    with RunLock(project / PRETRAIN_RUN):
        claim_checkpoints(checkpoints, identity, project / PRETRAIN_SET_ASIDE)
        remove_orphans(checkpoints)
        backfill_milestones(cfg, train_tokens, val_tokens, checkpoints, identity.digest)
        callbacks = [MLflowMetrics(cfg.tracking.async_logging), CSVLogger(project / PRETRAIN_PLOTS), ProgressBar()]
        trainer = Trainer(cfg, train_tokens, val_tokens, callbacks, checkpoints, identity.digest)
        trainer.resume()
        arithmetic = provenance(trainer.precision)
        record_arithmetic(checkpoints / IDENTITY_FILE, arithmetic)
        summary = _with_previous_figures({**trainer.run(), "provenance": arithmetic}, checkpoints / SUMMARY_FILE)
        publish(project, trainer, summary)
    raise_for_status(summary)
    return summary


def _with_previous_figures(summary: dict[str, Any], stored: Path) -> dict[str, Any]:
    """A rerun of a finished run trains nothing: keep the figures of the run that did the work."""
    if summary["steps"] == summary["start_step"] and stored.is_file():
        previous = read_json(stored)
        if previous.get("identity") == summary["identity"] and previous.get("steps") == summary["steps"]:
            return previous
    with staged(stored) as (tmp,):
        write_json(tmp, summary)
    return summary


def publish(project: Path, trainer: Trainer, summary: dict[str, Any]) -> None:
    """Metrics always (strict JSON with the status); weights only for a completed run."""
    if summary["status"] != "completed":
        with staged(project / PRETRAIN_METRICS) as (metrics,):
            write_json(metrics, summary)
        return
    with staged(project / PRETRAIN_MODEL, project / PRETRAIN_MILESTONES, project / PRETRAIN_METRICS) as (
        weights,
        milestones,
        metrics,
    ):
        torch.save(
            {
                "model": trainer.model.state_dict(),
                "config": dataclasses.asdict(trainer.cfg),
                "step": trainer.step,
                "identity": trainer.identity,
            },
            weights,
        )
        export_milestones(project / PRETRAIN_CHECKPOINTS, trainer.cfg.checkpoint.milestones, milestones)
        write_json(metrics, summary)


def export_milestones(checkpoints: Path, steps: list[int], out_dir: Path) -> None:
    """Copy the milestone checkpoints and their sidecars (the run keeps them: never pruned)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for step in steps:
        path = checkpoint_path(checkpoints, step)
        for source in (path, path.with_name(path.name + ".sha256")):
            shutil.copy2(source, out_dir / source.name)
