"""MLflow conventions: one experiment per study (opened in the UI as model training), a parent run
per stage execution (:func:`stage_run`) and nested runs per trial / arm / policy
(:func:`child_run`), each named for what ran and tagged with its lineage (:func:`lineage_tags`).

A run ends with the status of how it stopped (``model.stops.MLFLOW_STATUS``): FINISHED, FAILED
(divergence or an exception) or KILLED (preempted, or interrupted: SIGTERM, SIGINT). A stage run
that ends other than FINISHED closes its child runs still RUNNING as KILLED (a trial or arm whose
worker went down with it). Every run records the process that owns it, so a run left RUNNING by a
killed process is closed as KILLED when a stage next starts here.

Artifacts always go to ``<state>/mlartifacts`` by absolute path, with or without the MLflow
server (the server runs with ``--no-serve-artifacts``), so runs logged either way stay readable.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlflow
import yaml
from mlflow.entities import Metric, RunTag
from prefect import task
from prefect.exceptions import TerminationSignal

from model.provenance import config_provenance
from model.stops import MLFLOW_STATUS, RunEnded
from model.typed_config import flatten
from tasks.runtime.files import digest
from tasks.runtime.paths import (
    DVC_EXP_ENV,
    MLFLOW_PARENT_ENV,
    MLFLOW_TRAINING_VIEW,
    PIPELINE_RUN_ENV,
    REGISTRATION_ENV,
    own_checkout_env,
    prefect_ui_url,
    project_dir,
    state,
)

if TYPE_CHECKING:
    from tasks.config import Config

EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
"""Opens the experiment in MLflow 3's model-training view (runs, charts), not the GenAI one."""
CODE_PATHS = ("*.py", "pyproject.toml", "dvc.yaml", "profiles")
"""What counts as code for ``spikelab.code_changed`` (params.yaml and outputs do not)."""


def experiment_id(name: str) -> str:
    """Get or create the study's experiment (absolute artifact location, model-training kind)."""
    client = mlflow.MlflowClient()
    found = client.get_experiment_by_name(name)
    if found is None:
        location = (state().mlflow_artifacts / name).as_uri()
        return client.create_experiment(name, artifact_location=location, tags=EXPERIMENT_KIND)
    for key, value in EXPERIMENT_KIND.items():
        if found.tags.get(key) != value:
            client.set_experiment_tag(found.experiment_id, key, value)
    return found.experiment_id


# --------------------------------------------------------------------------------------------
# Lineage
# --------------------------------------------------------------------------------------------


def git_output(*args: str, own_checkout: bool = False) -> str | None:
    """``git ARGS``'s output in the project (None where git fails); ``own_checkout``: only where the
    project is a git checkout itself, never through a repository above it (``make demo``'s copy
    sits in the checkout's ignored .spikelab/, and the checkout's HEAD is not the copy's)."""
    env = own_checkout_env(project_dir()) if own_checkout else None
    try:
        done = subprocess.run(["git", *args], cwd=project_dir(), capture_output=True, text=True, timeout=5, env=env)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def code_commit() -> dict[str, Any]:
    """The commit the code came from (DVC's baseline inside an experiment; None outside a git
    checkout) and the code files changed since (params and outputs are not code). A stage keeps
    it in its metrics (:func:`stage_provenance`), so the report can name the commit that trained
    its arms, which is not the commit the report was built at once stage code moves on."""
    commit = os.environ.get("DVC_EXP_BASELINE_REV") or git_output("rev-parse", "HEAD", own_checkout=True)
    changed = (
        git_output("status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS, own_checkout=True)
        if commit
        else None
    )
    return {"commit": commit, "changed": [line[3:] for line in (changed or "").splitlines()]}


def git_lineage() -> dict[str, str]:
    """:func:`code_commit` as MLflow tags: the commit, and the changed code files only when there are any."""
    code = code_commit()
    if code["commit"] is None:
        return {}
    tags = {"mlflow.source.git.commit": code["commit"]}
    if code["changed"]:
        tags["spikelab.code_changed"] = " ".join(code["changed"])[:5000]
    return tags


def stage_provenance(cfg: Config) -> dict[str, Any]:
    """What a stage that trains records beside its numbers (its metrics' ``provenance``): the
    arithmetic of its runs (model/provenance.py) and, under ``code``, the :func:`code_commit` it ran."""
    return {**config_provenance(cfg), "code": code_commit()}


def dvc_inputs_digest(stage: str, cfg: Config) -> str | None:
    """sha256 over the stage's deps as DVC records them (upstream outs by their ``dvc.lock`` md5,
    other files by content) and the values of the params it reads *as resolved* (profile and
    overrides applied). Identical inputs, identical digest; None for what is not a DVC stage."""
    root = project_dir()
    pipeline = root / "dvc.yaml"
    spec = (_load_yaml(pipeline) or {}).get("stages", {}).get(stage) if pipeline.is_file() else None
    if spec is None:
        return None
    lock_path = root / "dvc.lock"
    lock = _load_yaml(lock_path).get("stages", {}) if lock_path.is_file() else {}
    out_md5 = {o["path"]: o["md5"] for s in lock.values() for o in s.get("outs", [])}
    h = hashlib.sha256()
    for dep in sorted(spec.get("deps", [])):
        h.update(dep.encode())
        h.update((out_md5.get(dep) or _content_md5(root / dep)).encode())
    for whole in sorted(_whole_files(spec.get("params", []))):  # e.g. studies.yaml: every key of it
        h.update(whole.encode() + _content_md5(root / whole).encode())
    resolved = cfg.to_flat_dict()
    for key in sorted(_param_keys(spec.get("params", []))):
        values = {k: v for k, v in resolved.items() if k == key or k.startswith(key + ".")}
        h.update(f"{key}={json.dumps(values, sort_keys=True, default=str)}".encode())
    return h.hexdigest()[:16]


def _load_yaml(path: Path) -> Any:
    """Safe-load with libyaml when PyYAML has it (a tenth of the pure-Python parser's CPU on
    dvc.lock, read at every stage start), else the pure-Python loader; same values either way."""
    return yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def _content_md5(path: Path) -> str:
    h = hashlib.md5()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        if f.is_file() and "__pycache__" not in f.parts:
            h.update(f.read_bytes())
    return h.hexdigest()


def _param_keys(entries: list) -> list[str]:
    """dvc.yaml ``params`` items are keys of params.yaml, or ``{file: [keys]}`` mappings (``{file:
    None}``: the whole file, :func:`_whole_files`)."""
    keys: list[str] = []
    for entry in entries:
        if isinstance(entry, str):
            keys.append(entry)
        else:
            for file_keys in entry.values():
                keys.extend(file_keys or [])
    return keys


def _whole_files(entries: list) -> list[str]:
    """The params files a stage reads whole (``{file:}`` with no keys in dvc.yaml)."""
    return [name for entry in entries if isinstance(entry, dict) for name, keys in entry.items() if keys is None]


def prefect_lineage() -> dict[str, str]:
    """The Prefect flow run this process executes (and the pipeline run that caused it)."""
    from prefect.context import FlowRunContext

    tags = {}
    ctx = FlowRunContext.get()
    if ctx is not None and ctx.flow_run is not None:
        tags["prefect.flow_run_id"] = str(ctx.flow_run.id)
        if os.environ.get("PREFECT_API_URL"):  # a temporary server's links die with the process
            tags["prefect.flow_run_url"] = f"{prefect_ui_url()}/runs/flow-run/{ctx.flow_run.id}"
    if os.environ.get(PIPELINE_RUN_ENV):
        tags["prefect.pipeline_run_id"] = os.environ[PIPELINE_RUN_ENV]
    return tags


def dvc_lineage() -> dict[str, str]:
    """The DVC experiment the run belongs to: ``dvc exp run`` sets ``DVC_EXP_NAME``; the pipeline
    flow names the experiment it saves; a plain ``dvc repro`` runs in the workspace."""
    return {
        "spikelab.dvc_exp": os.environ.get("DVC_EXP_NAME") or os.environ.get(DVC_EXP_ENV) or "workspace",
        **({"spikelab.dvc_stage": os.environ["DVC_STAGE"]} if os.environ.get("DVC_STAGE") else {}),
    }


def owner_tags() -> dict[str, str]:
    """This process, so a later stage can tell whether a RUNNING run still has a live owner."""
    import psutil

    me = psutil.Process()
    return {
        "spikelab.host": socket.gethostname(),
        "spikelab.pid": str(me.pid),
        "spikelab.pid_started": f"{me.create_time():.2f}",
    }


def numerics_tags(record: dict[str, Any] | None) -> dict[str, str]:
    """The arithmetic a run used (a model/provenance.py record) as ``spikelab.numerics.<field>``
    tags, so runs filter by it in the UI: ``tags.`spikelab.numerics.numeric_path` = '...'``."""
    arithmetic = {k: v for k, v in (record or {}).items() if k != "code"}  # the commit: git_lineage's tags
    return {f"spikelab.numerics.{key}": _tag_text(value) for key, value in flatten(arithmetic).items()}


def _tag_text(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value)) or "none"
    return "none" if value is None else str(value)


def lineage_tags(cfg: Config, stage: str, identity: str | None = None) -> dict[str, str]:
    """Where a stage run came from; nested under the pipeline's run when a pipeline ran it."""
    optional = {
        "mlflow.parentRunId": os.environ.get(MLFLOW_PARENT_ENV),
        "spikelab.dvc_inputs": dvc_inputs_digest(stage, cfg),
        "spikelab.run_identity": identity,
        "spikelab.registration": os.environ.get(REGISTRATION_ENV),
    }
    return {
        "mlflow.source.name": f"spikelab {stage}",
        "spikelab.stage": stage,
        "spikelab.profile": cfg.profile,
        **{k: v for k, v in optional.items() if v},
        **git_lineage(),
        **dvc_lineage(),
        **prefect_lineage(),
        **owner_tags(),
    }


# --------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------


def run_name(stage: str, cfg: Config, identity: str | None = None) -> str:
    """What ran, told apart from its siblings: ``pretrain smoke 3f9a1c2e`` (run identity) or
    ``filter default 11-04 09:12`` (start time) for stages without one."""
    return f"{stage} {cfg.profile} {identity[:8] if identity else time.strftime('%m-%d %H:%M')}"


def close_orphaned_runs(experiment: str) -> list[str]:
    """Runs still RUNNING whose owning process on this host is gone (killed): mark them KILLED."""
    import psutil

    client = mlflow.MlflowClient()
    host = socket.gethostname()
    orphans = []
    for run in client.search_runs([experiment], f"attributes.status = 'RUNNING' and tags.`spikelab.host` = '{host}'"):
        pid, started = int(run.data.tags.get("spikelab.pid", 0)), run.data.tags.get("spikelab.pid_started")
        try:
            alive = f"{psutil.Process(pid).create_time():.2f}" == started
        except psutil.Error:
            alive = False
        if not alive:
            client.set_terminated(run.info.run_id, "KILLED")
            orphans.append(run.info.run_id)
    return orphans


INTERRUPTS = (KeyboardInterrupt, TerminationSignal)
"""How SIGINT and SIGTERM arrive in a stage: Python's KeyboardInterrupt (and the CLI's own
subclass for SIGTERM outside a flow: flows/__main__.py), Prefect's TerminationSignal inside one."""


def end_status(exc: BaseException | None) -> str:
    """The MLflow status of a run that ended with ``exc`` (None: it completed)."""
    if exc is None:
        return "FINISHED"
    if isinstance(exc, RunEnded):
        return MLFLOW_STATUS[exc.status]
    return "KILLED" if isinstance(exc, INTERRUPTS) else "FAILED"


@contextmanager
def _ends_with_its_status(run_id: str) -> Iterator[None]:
    """End the active run (``run_id``) as the way it stopped: FINISHED, MLFLOW_STATUS of a typed
    stop, KILLED on an interrupt, FAILED on any other exception; when it did not finish, its
    child runs still RUNNING end KILLED first."""
    try:
        yield
    except BaseException as e:
        status = end_status(e)
        kill_running_children(run_id)
        mlflow.end_run(status)
        raise
    mlflow.end_run("FINISHED")


def kill_running_children(run_id: str) -> list[str]:
    """Mark the runs nested under ``run_id`` (at any depth) that are still RUNNING as KILLED: the
    trials, arms or branches of a stage that stopped, whose workers stopped with it (a worker that
    still finishes its unit later ends its run FINISHED over it). Returns their ids; a store that
    does not answer is said on stderr, never raised over the stop being handled."""
    killed: list[str] = []
    try:
        client = mlflow.MlflowClient()
        experiment = client.get_run(run_id).info.experiment_id
        parents = [run_id]
        while parents:
            query = f"tags.`mlflow.parentRunId` = '{parents.pop()}' and attributes.status = 'RUNNING'"
            for child in client.search_runs([experiment], query):
                client.set_terminated(child.info.run_id, "KILLED")
                killed.append(child.info.run_id)
                parents.append(child.info.run_id)
    except Exception as e:
        print(f"spikelab: could not close the child runs of MLflow run {run_id}: {e}", file=sys.stderr)
    return killed


@contextmanager
def stage_run(
    cfg: Config, stage: str, identity: str | None = None, numerics: dict[str, Any] | None = None
) -> Iterator[mlflow.ActiveRun]:
    """The parent MLflow run of one stage execution (the trials, arms or policies it launches are
    :func:`child_run`, and inherit its tags): named for what ran, lineage tags, the arithmetic of
    a stage that trains or computes statistics (``numerics``, a model/provenance.py record), the
    resolved config as params."""
    experiment = experiment_id(cfg.tracking.experiment)
    for run_id in close_orphaned_runs(experiment):
        print(f"spikelab: MLflow run {run_id} was left RUNNING by a killed process; marked KILLED")
    run = mlflow.start_run(
        experiment_id=experiment,
        run_name=run_name(stage, cfg, identity),
        tags={**lineage_tags(cfg, stage, identity), **numerics_tags(numerics)},
    )
    with _ends_with_its_status(run.info.run_id):
        log_params(cfg.to_flat_dict())
        yield run


@contextmanager
def child_run(
    name: str, tags: dict[str, str] | None = None, parent_id: str | None = None
) -> Iterator[mlflow.ActiveRun]:
    """A nested run under the active stage run (a trial, an arm, a policy): it inherits the
    parent's lineage tags, adds ``tags``, and ends with its own status. ``parent_id``: the stage
    run when it is active in another process (a worker process of the LR search)."""
    parent = mlflow.get_run(parent_id) if parent_id else mlflow.active_run()
    if parent is None:
        raise RuntimeError("child_run needs an active stage_run")
    inherited = {
        k: v for k, v in parent.data.tags.items() if k.startswith(("spikelab.", "prefect.", "mlflow.source.git"))
    }
    # In the parent's experiment: stage_run names it on its own run only, not as the active one.
    run = mlflow.start_run(
        experiment_id=parent.info.experiment_id,
        run_name=name,
        nested=True,
        tags={**inherited, **owner_tags(), **(tags or {}), "mlflow.parentRunId": parent.info.run_id},
    )
    with _ends_with_its_status(run.info.run_id):
        yield run


def log_params(params: dict[str, Any]) -> None:
    """MLflow params are strings of at most 6000 characters; lists become JSON."""
    mlflow.log_params({key: _param_value(value) for key, value in params.items()})


def _param_value(value: Any) -> Any:
    if isinstance(value, (list, dict)):
        value = json.dumps(value)
    return value[:6000] if isinstance(value, str) else value


def log_summary(summary: dict[str, Any]) -> None:
    """A stage's summary figures as metrics (``summary/<key>``), so runs compare in the table."""
    mlflow.log_metrics(
        {
            f"summary/{k}": float(v)
            for k, v in summary.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v
        }
    )


def run_url(run: mlflow.ActiveRun | Any, page: str = "") -> str | None:
    """A page of the run in the MLflow UI (model-training view), when a server holds it;
    ``page`` e.g. ``/artifacts/figures/loss.png``."""
    uri = mlflow.get_tracking_uri()
    if not uri.startswith("http"):
        return None
    return f"{uri}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}{page}?{MLFLOW_TRAINING_VIEW}"


def metric_name(name: str) -> str:
    """Losses first: ``train/loss`` and ``val/loss`` become ``loss/train`` and ``loss/val``, so the
    UI (which groups charts by the prefix and orders groups by name) shows them before ``stats/``."""
    namespace, _, leaf = name.partition("/")
    return f"loss/{namespace}" if leaf == "loss" else name


class MLflowMetrics:
    """Trainer callback: metrics to the active MLflow run, asynchronously, once per log interval.

    ``synchronous=False`` queues the batch on MLflow's logging thread, so the training loop never
    waits on the tracking store (a synchronous call costs ~13-15 ms on local SQLite).
    """

    def __init__(self, asynchronous: bool = True):
        self.asynchronous = asynchronous

    def on_log(self, step: int, metrics: dict[str, float]) -> None:
        mlflow.log_metrics(
            {metric_name(k): v for k, v in metrics.items()}, step=step, synchronous=not self.asynchronous
        )

    def on_train_end(self, *_: Any, **__: Any) -> None:
        if self.asynchronous:
            mlflow.flush_async_logging()


def latest_stage_runs(experiment: str, stages: list[str]) -> dict[str, str]:
    """The newest finished run of each stage in ``experiment``, as a UI link (or ``runs:/<id>``)."""
    client = mlflow.MlflowClient()
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return {}
    out = {}
    for stage in stages:
        runs = client.search_runs(
            [found.experiment_id],
            f"tags.`spikelab.stage` = '{stage}' and attributes.status = 'FINISHED'",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        if runs:
            out[stage] = run_url(runs[0]) or f"runs:/{runs[0].info.run_id}"
    return out


@task(name="record-outputs")
def record_outputs(
    run_id: str, project: Path, outputs: list[Path], metrics: Mapping[str, float], artifacts: list[Path]
) -> str:
    """Log a stage's counts, its report files and the digest of its outputs to its MLflow run."""
    client = mlflow.MlflowClient()
    dataset_digest = digest(project, outputs)
    now = int(time.time() * 1000)
    client.log_batch(
        run_id,
        metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()],
        tags=[RunTag("dataset_digest", dataset_digest)],
    )
    for path in artifacts:
        client.log_artifact(run_id, str(project / path))
    return dataset_digest
