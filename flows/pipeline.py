"""The study as one Prefect flow that drives DVC, one visible task per stage.

Each stage runs as ``dvc repro --single-item <stage>`` in topological order, so a run triggered
from the Prefect UI is cached and versioned exactly like ``dvc repro`` from a shell; its output
streams into the task's log line by line as DVC prints it. The stage's own flow run (started by
``spikelab run`` under DVC) is created as a child of that task, so the UI links the two.

``make demo`` and ``make repro`` run ``dvc repro`` itself, under one ``pipeline`` flow run
(``python -m flows.repro``, flows/repro.py): each stage's
``spikelab run`` adds its task run there (:func:`stage_task_run`) and runs as its child, so one
``make demo`` is one run in the Prefect UI with its stages below it, not one run per stage.

Values from the form are validated first (a bad value fails before anything is touched), then
written to ``params.yaml`` as ``dvc exp run -S`` would; when every stage succeeds the result is
saved as a named DVC experiment. When any stage fails, ``params.yaml``, ``dvc.lock`` and the
stage outputs are put back as they were (uncached outputs from a snapshot, cached ones with
``dvc checkout``) and the flow run fails with the stage's own error lines.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from prefect import flow, get_run_logger, task
from prefect.client.schemas.objects import FlowRun
from prefect.context import FlowRunContext, TaskRunContext

from flows.forms import KEEP, Overrides, ProfileChoice, check_from_outside, dotted
from flows.stages import STAGES
from model.typed_config import ConfigError
from tasks.config import project_config
from tasks.design.studies import STUDIES, read_studies
from tasks.runtime.artifacts import publish_pipeline_summary
from tasks.runtime.outputs import PRETRAIN_CHECKPOINTS
from tasks.runtime.paths import DVC_EXP_ENV, MLFLOW_PARENT_ENV, PARENT_TASK_RUN_ENV, PIPELINE_RUN_ENV, project_dir
from tasks.runtime.tracking import stage_run

ERROR_LINES = (re.compile(r"^(spikelab: error|ERROR)\b"), re.compile(r"error|exception|failed", re.IGNORECASE))
"""Where a stage's own error is, best first: the CLI's one-line message and DVC's verdict, else
any line that says error; else the last lines."""

if TYPE_CHECKING:  # the choices are built from STAGES when this runs: to a type checker, a name
    Target = str
else:
    Target = Literal[("all", *STAGES)]
    """What to reproduce: every stage, or one stage and the stages it depends on."""


def dvc_stages(project: Path) -> dict[str, dict[str, Any]]:
    stages: dict[str, dict[str, Any]] = yaml.safe_load((project / "dvc.yaml").read_text())["stages"]
    return stages


def this_flow_run() -> FlowRun:
    """The pipeline's flow run (its callers run inside :func:`pipeline_flow`)."""
    context = FlowRunContext.get()
    assert context is not None and context.flow_run is not None, "called outside a flow run"
    return context.flow_run


def _paths(entries: list) -> list[str]:
    return [e if isinstance(e, str) else next(iter(e)) for e in entries]


def _outs(spec: dict[str, Any]) -> list[str]:
    return _paths(spec.get("outs", []) + spec.get("metrics", []) + spec.get("plots", []))


def stage_order(stages: dict[str, dict[str, Any]], target: str = "all") -> list[str]:
    """Stages in dependency order (a stage after every stage whose outputs it reads); for a
    target, only it and its ancestors."""
    producer = {out: name for name, spec in stages.items() for out in _outs(spec)}
    upstream = {name: {producer[d] for d in _inputs(spec) if d in producer} for name, spec in stages.items()}
    order: list[str] = []

    def visit(name: str) -> None:
        for parent in sorted(upstream[name]):
            visit(parent)
        if name not in order:
            order.append(name)

    for name in [target] if target != "all" else stages:
        visit(name)
    return order


def _inputs(spec: dict[str, Any]) -> list[str]:
    """What a stage reads: its deps, and the params files it names (``{file: [keys]}`` entries;
    the ``params`` stage writes params/resolved.yaml, which the others read)."""
    files = [next(iter(p)) for p in spec.get("params", []) if isinstance(p, dict)]
    return [*spec.get("deps", []), *files]


def dvc_bin() -> str:
    return str(Path(sys.executable).with_name("dvc"))


# --------------------------------------------------------------------------------------------
# The workspace: overrides in, and back out on failure
# --------------------------------------------------------------------------------------------


def write_params(project: Path, sets: dict[str, Any]) -> None:
    """Set dotted keys in params.yaml, keeping its comments and layout (as ``dvc exp run -S``)."""
    from ruamel.yaml import YAML

    rt = YAML()
    path = project / "params.yaml"
    doc = rt.load(path.read_text())
    for key, value in sets.items():
        *parents, leaf = key.split(".")
        node = doc
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    with open(path, "w") as f:
        rt.dump(doc, f)


def snapshot_paths(project: Path) -> list[Path]:
    """What ``dvc checkout`` cannot restore: params, the lock file and the uncached outputs
    (metrics, curves, figures). Checkpoints are left out: many, large, and guarded by run
    identity (a failed run's checkpoints are never resumed as another run's)."""
    stages = dvc_stages(project)
    uncached = [
        next(iter(e))
        for spec in stages.values()
        for kind in ("outs", "metrics", "plots")
        for e in spec.get(kind, [])
        if isinstance(e, dict) and next(iter(e.values())).get("cache") is False
    ]
    kept = ("params.yaml", STUDIES.as_posix(), "dvc.lock", *uncached)
    return [project / p for p in kept if p != str(PRETRAIN_CHECKPOINTS)]


@contextmanager
def restored_on_failure(project: Path) -> Iterator[None]:
    """On any failure inside, put params, lock and every stage output back as they were."""
    with tempfile.TemporaryDirectory(prefix="spikelab-snapshot-") as snap:
        saved = []
        for path in snapshot_paths(project):
            if path.exists():
                copy = Path(snap) / path.relative_to(project)
                copy.parent.mkdir(parents=True, exist_ok=True)
                (shutil.copytree if path.is_dir() else shutil.copy2)(path, copy)
                saved.append(path)
        try:
            yield
        except BaseException:
            for path in snapshot_paths(project):
                if path.is_dir():
                    shutil.rmtree(path)
                elif path.exists() or path.is_symlink():
                    path.unlink()
            for path in saved:
                copy = Path(snap) / path.relative_to(project)
                (shutil.copytree if copy.is_dir() else shutil.copy2)(copy, path)
            subprocess.run([dvc_bin(), "checkout", "--force", "--quiet"], cwd=project, check=False)
            raise


# --------------------------------------------------------------------------------------------
# Stages as tasks
# --------------------------------------------------------------------------------------------


class StageFailed(RuntimeError):
    """A stage exited non-zero; the message carries its own error lines."""


def stage_env(mlflow_run_id: str) -> dict[str, str]:
    """What the stages inherit: this pipeline run's ids, for their lineage."""
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        PIPELINE_RUN_ENV: str(this_flow_run().id),
        MLFLOW_PARENT_ENV: mlflow_run_id,
    }


@task(task_run_name="{stage}", name="dvc-repro-stage")
def repro_stage(stage: str, env: dict[str, str]) -> None:
    """``dvc repro --single-item <stage>``, its output logged live; the stage's flow run becomes
    a child of this task run."""
    logger = get_run_logger()
    context = TaskRunContext.get()
    assert context is not None, "repro_stage runs as a Prefect task"
    env = {**env, PARENT_TASK_RUN_ENV: str(context.task_run.id)}
    command = [dvc_bin(), "repro", "--single-item", stage]
    logger.info("$ %s", " ".join(["dvc", *command[1:]]))
    tail: deque[str] = deque(maxlen=60)
    with subprocess.Popen(
        command, cwd=project_dir(), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    ) as proc:
        assert proc.stdout is not None  # stdout=PIPE
        for line in proc.stdout:
            line = line.rstrip()
            if line:
                logger.info(line)
                tail.append(line)
    if proc.returncode:
        raise StageFailed(f"stage {stage} failed (dvc exit {proc.returncode}): " + " | ".join(error_lines(tail)))


def error_lines(lines: Iterable[str], keep: int = 4) -> list[str]:
    lines = list(lines)
    for pattern in ERROR_LINES:
        found = [line for line in lines if pattern.search(line)]
        if found:
            return found[-keep:]
    return lines[-keep:]


def stage_task_run(stage: str) -> str | None:
    """The task run a stage's flow run is the child of: the pipeline flow's (:func:`repro_stage`),
    else a task run for ``stage`` added to the flow run :func:`repro_in_one_run` opened around
    ``dvc repro``; None outside a pipeline run. The server gives that task run its child's state."""
    from uuid import UUID

    from prefect import get_client
    from prefect.states import Pending

    if (parent := os.environ.get(PARENT_TASK_RUN_ENV)) or not (pipeline := os.environ.get(PIPELINE_RUN_ENV)):
        return parent
    with get_client(sync_client=True) as client:
        task_run = client.create_task_run(
            repro_stage.with_options(name=f"dvc-repro-{stage}"),
            flow_run_id=UUID(pipeline),
            dynamic_key=stage,
            name=stage,
            state=Pending(),
        )
    return str(task_run.id)


def save_experiment(project: Path, name: str) -> None:
    """Save the workspace as DVC experiment ``name`` (needs git; otherwise say why not)."""
    logger = get_run_logger()
    done = subprocess.run(
        [dvc_bin(), "exp", "save", "--name", name, "--force"], cwd=project, capture_output=True, text=True
    )
    if done.returncode:
        logger.warning("not saved as a DVC experiment: %s", (done.stderr or done.stdout).strip()[-300:])
    else:
        logger.info("saved as DVC experiment %s (dvc exp show)", name)


def experiment_name(with_values: bool) -> str | None:
    """A DVC experiment name for a run with form values: the Prefect flow run's name."""
    return f"ui-{this_flow_run().name}" if with_values else None


@flow(name="pipeline", log_prints=True)
def pipeline_flow(
    target: Target = "all",
    profile: ProfileChoice = KEEP,
    overrides: Overrides = Overrides(),  # noqa: B008 (Prefect builds the form from it)
    extra_overrides: dict[str, Any] | None = None,
) -> None:
    """Reproduce the study (or one stage and what it needs) through DVC, one task per stage.
    Form values are written to params.yaml (as `dvc exp run -S`); a failed run leaves params.yaml
    and every output as they were.

    Args:
        target: Every stage, or one stage (after the stages it needs, when they are stale).
        profile: The profile overlay from profiles/, or the one params.yaml names.
        overrides: The keys of an ablation arm, typed and documented; empty fields keep params.yaml.
        extra_overrides: Any other dotted key that is a number, a flag or a choice, e.g.
            {"filter.min_chars": 100}; `data.path` inside the project, outside its hidden
            folders, never a URL. Text keys that reach the file system or the network (storages,
            scheduler addresses) are refused, and so is `train.compile`.
    """
    project = project_dir()
    sets = {**({} if profile == KEEP else {"profile": profile}), **dotted(overrides, extra_overrides)}
    check_from_outside(sets, project)  # whoever triggered it, this runs as the project's owner
    chosen = sets.get("profile")  # the form's, or extra_overrides' (checked above): the one written
    cfg, _ = project_config(chosen, {k: v for k, v in sets.items() if k != "profile"})  # bad values fail here
    reproduce(project, cfg, target, (lambda: write_params(project, sets)) if sets else None)


def reproduce(project: Path, cfg: Any, target: str, write: Callable[[], None] | None) -> None:
    """``write`` the form's values (none: None), then each stage ``target`` needs through DVC; saved
    as a DVC experiment when something was written; the workspace put back on any failure."""
    experiment = experiment_name(bool(write))
    if experiment:
        os.environ[DVC_EXP_ENV] = experiment  # lineage of this run and its stages (a process of its own)
    stages = stage_order(dvc_stages(project), target)
    with stage_run(cfg, "pipeline") as run:
        with restored_on_failure(project):
            env = stage_env(run.info.run_id)
            if write:
                write()
            for stage in stages:
                repro_stage.with_options(name=f"dvc-repro-{stage}")(stage, env)
        if experiment:
            save_experiment(project, experiment)
        publish_pipeline_summary(run, stages, experiment)


@flow(name="study", log_prints=True)
def study_flow(family: str, factors: dict[str, list[Any]] | None = None) -> None:
    """Train and judge one family declared in studies.yaml, through DVC (the ablate and report
    stages, after any stage they need), its factor values from the form: written to studies.yaml
    as `dvc exp run -S` would; a failed run leaves studies.yaml and every output as they were.

    Args:
        family: The family's name in studies.yaml.
        factors: Each factor's values, e.g. {"optim.lr": [0.001, 0.003]}; a factor left out keeps
            its declared values. The same rules as the pipeline's overrides apply to each value.
    """
    project = project_dir()
    cfg, _ = project_config(None, {})
    declared = {d.name: d for d in read_studies(project, cfg)}
    if family not in declared:
        raise ConfigError(
            f"family: {family!r} is not declared in {STUDIES} (declared: {', '.join(declared) or 'none'})"
        )
    values = factors or {}
    for key, listed in values.items():
        if key not in declared[family].factors:
            raise ConfigError(f"factors.{key}: not a factor of {family} ({', '.join(declared[family].factors)})")
        if not isinstance(listed, list) or not listed:
            raise ConfigError(f"factors.{key}: a non-empty list of values, got {listed!r}")
        for value in listed:
            check_from_outside({key: value}, project)

    def write() -> None:
        write_factors(project, family, values)
        read_studies(project, cfg)  # the edited declaration is checked whole before any stage

    reproduce(project, cfg, "report", write if values else None)


def write_factors(project: Path, family: str, values: dict[str, list[Any]]) -> None:
    """Set a declared family's factor values in studies.yaml, keeping its comments and layout."""
    from ruamel.yaml import YAML
    from ruamel.yaml.comments import CommentedSeq

    rt = YAML()
    rt.width = 4096  # long questions and justifications stay on their line
    path = project / STUDIES
    doc = rt.load(path.read_text())
    factors = doc["families"][family]["factors"]
    for key, listed in values.items():
        node, leaf = factors, key
        if key not in factors:  # written nested, as {optim: {lr: [...]}}
            *parents, leaf = key.split(".")
            for part in parents:
                node = node[part]
        seq = CommentedSeq(listed)
        if getattr(node.get(leaf), "fa", None) is not None and node[leaf].fa.flow_style():
            seq.fa.set_flow_style()  # written as it was: [a, b]
        node[leaf] = seq
    with open(path, "w") as f:
        rt.dump(doc, f)
