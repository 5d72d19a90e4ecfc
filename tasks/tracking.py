"""MLflow conventions: one experiment per study, a parent run per stage execution, nested runs per
trial / arm / policy; tags carry git commit, the digest of the stage's DVC inputs, profile and stage.

Artifacts always go to ``<state>/mlartifacts`` by absolute path, with or without the MLflow
server (the server runs with ``--no-serve-artifacts``), so runs logged either way stay readable.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlflow
import yaml

from model.config import Config
from tasks.paths import project_dir, repo_root, state


def experiment_id(name: str) -> str:
    """Get or create the study's experiment with an absolute artifact location."""
    found = mlflow.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    location = (state().mlflow_artifacts / name).as_uri()
    return mlflow.create_experiment(name, artifact_location=location)


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo_root(), capture_output=True,
                             text=True, timeout=5, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=project_dir(),
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def dvc_inputs_digest(stage: str) -> str:
    """sha256 over the stage's deps as DVC records them: upstream outs by their ``dvc.lock`` md5,
    other files by content, plus the params the stage reads. Identical inputs, identical digest."""
    root = project_dir()
    pipeline = root / "dvc.yaml"
    spec = (yaml.safe_load(pipeline.read_text()) or {}).get("stages", {}).get(stage) if pipeline.is_file() else None
    if spec is None:
        return "not-a-dvc-stage"
    lock_path = root / "dvc.lock"
    lock = yaml.safe_load(lock_path.read_text()).get("stages", {}) if lock_path.is_file() else {}
    out_md5 = {o["path"]: o["md5"] for s in lock.values() for o in s.get("outs", [])}
    h = hashlib.sha256()
    for dep in sorted(spec.get("deps", [])):
        h.update(dep.encode())
        h.update((out_md5.get(dep) or _content_md5(root / dep)).encode())
    params = yaml.safe_load((root / "params.yaml").read_text())
    for key in sorted(_param_keys(spec.get("params", []))):
        h.update(f"{key}={json.dumps(_lookup(params, key), sort_keys=True, default=str)}".encode())
    return h.hexdigest()[:16]


def _content_md5(path: Path) -> str:
    h = hashlib.md5()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        if f.is_file() and "__pycache__" not in f.parts:
            h.update(f.read_bytes())
    return h.hexdigest()


def _param_keys(entries: list) -> list[str]:
    """dvc.yaml ``params`` items are keys of params.yaml, or ``{file: [keys]}`` mappings."""
    keys: list[str] = []
    for entry in entries:
        if isinstance(entry, str):
            keys.append(entry)
        else:
            for file_keys in entry.values():
                keys.extend(file_keys)
    return keys


def _lookup(tree: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree.get(part, {}) if isinstance(tree, dict) else None
    return tree


@contextmanager
def stage_run(cfg: Config, stage: str) -> Iterator[mlflow.ActiveRun]:
    """The parent MLflow run of one stage execution, with the resolved config as params."""
    mlflow.set_experiment(experiment_id=experiment_id(cfg.tracking.experiment))
    tags = {"stage": stage, "profile": cfg.profile, "git_commit": git_commit(),
            "dvc_inputs": dvc_inputs_digest(stage)}
    with mlflow.start_run(run_name=stage, tags=tags) as run:
        log_params(cfg.to_flat_dict())
        yield run


def log_params(params: dict[str, Any]) -> None:
    """MLflow params are strings of at most 6000 characters; lists become JSON."""
    mlflow.log_params({key: _param_value(value) for key, value in params.items()})


def _param_value(value: Any) -> Any:
    if isinstance(value, (list, dict)):
        value = json.dumps(value)
    return value[:6000] if isinstance(value, str) else value


class MLflowMetrics:
    """Trainer callback: metrics to the active MLflow run, asynchronously, once per log interval.

    ``synchronous=False`` queues the batch on MLflow's logging thread, so the training loop never
    waits on the tracking store (a synchronous call costs ~13-15 ms on local SQLite).
    """

    def __init__(self, asynchronous: bool = True):
        self.asynchronous = asynchronous

    def on_log(self, step: int, metrics: dict[str, float]) -> None:
        mlflow.log_metrics(metrics, step=step, synchronous=not self.asynchronous)

    def on_train_end(self, *_: Any, **__: Any) -> None:
        if self.asynchronous:
            mlflow.flush_async_logging()
