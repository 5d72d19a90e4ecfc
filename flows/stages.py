"""The one registry of the pipeline's stages: each stage's name, the flow that runs it and the
outputs it writes. The CLI (``spikelab run <stage>``), the pipeline flow, the deployments and
the output bookkeeping read it; ``dvc.yaml`` declares the same stages in the same order (after
``params``, which has no flow) with the same outputs, and a test keeps the two equal.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model.typed_config import UserError
from tasks.runtime import outputs as o


@dataclass(frozen=True)
class Stage:
    name: str
    flow: str
    """``module:attribute`` of its Prefect flow, imported only when the stage runs."""
    outs: tuple[Path, ...]
    """Everything it writes, relative to the project (DVC outs and metrics)."""
    fans_out: bool = False
    """Runs its units on the executor (``executor.scheduler``: tasks/runtime/workers.py)."""

    @property
    def versioned(self) -> tuple[Path, ...]:
        """Its outputs kept in git (``cache: false`` and ``persist: true`` in dvc.yaml, neither
        cached nor resume state): ``spikelab run`` sets them aside while the flow runs and puts
        them back when it does not complete (tasks/runtime/outputs.py: KeptOutputs)."""
        return tuple(p for p in self.outs if p not in o.RESUMED and p not in o.CACHED)

    def load_flow(self) -> Any:
        module, attribute = self.flow.split(":")
        return getattr(importlib.import_module(module), attribute)


PARAMS_STAGE = "params"
"""The first DVC stage: it resolves and checks the config (tasks/params.py) and runs no flow."""

STAGES = {
    stage.name: stage
    for stage in (
        Stage("prepare", "flows.data:prepare_flow", (o.RAW_DIR,)),
        Stage("filter", "flows.data:filter_flow", (o.CLEAN_DIR, o.POISON_DIR, o.FILTER_REPORT)),
        Stage("tokenize", "flows.data:tokenize_flow", (o.TOKENS_DIR,)),
        Stage("search", "flows.search:search_flow", (o.SEARCH_LR, o.SEARCH_METRICS, o.SEARCH_REPORTS), fans_out=True),
        Stage(
            "pretrain",
            "flows.pretrain:pretrain_flow",
            (
                o.PRETRAIN_CHECKPOINTS,
                o.PRETRAIN_MODEL,
                o.PRETRAIN_MILESTONES,
                o.PRETRAIN_METRICS,
                o.PRETRAIN_PLOTS,
                o.PRETRAIN_REPORTS,
            ),
        ),
        Stage("spike", "flows.spike:spike_flow", (o.SPIKE_METRICS, o.SPIKE_FIGURES, o.POSTMORTEMS), fans_out=True),
        Stage("ablate", "flows.ablate:ablate_flow", (o.ABLATE_ARMS, o.ABLATE_METRICS, o.ABLATE_FIGURES), fans_out=True),
        Stage(
            "sensitivity",
            "flows.sensitivity:sensitivity_flow",
            (o.PERTURBED_DIR, o.SENSITIVITY_ARMS, o.SENSITIVITY_METRICS),
            fans_out=True,
        ),
        Stage("report", "flows.report:report_flow", (o.REPORT_MD, o.REPORT_HTML, o.REPORT_METRICS, o.REPORT_FIGURES)),
    )
}
"""Stage name -> stage, in pipeline order. dvc.yaml calls ``spikelab run <name>`` for each."""


def tracked_by_repro() -> tuple[Path, ...]:
    """What ``dvc repro`` changes that git tracks: dvc.lock, the params stage's resolved config and
    every stage's versioned outputs (``make repro`` puts them back as they were when stopped)."""
    from tasks.params import RESOLVED

    return (Path("dvc.lock"), RESOLVED, *(out for stage in STAGES.values() for out in stage.versioned))


def inputs(project: Path, stage: str) -> dict[Path, str]:
    """What ``stage`` reads that another stage makes: each ``deps`` entry of the project's dvc.yaml
    that is (or lies inside) a registered stage's output, with that stage's name; empty without a
    dvc.yaml (a project that runs its stages by hand alone)."""
    import yaml

    path = project / "dvc.yaml"
    declared = (yaml.safe_load(path.read_text()) or {}).get("stages", {}) if path.is_file() else {}
    makers = {out: other.name for other in STAGES.values() if other.name != stage for out in other.outs}
    found = {}
    for dep in map(Path, (declared.get(stage) or {}).get("deps") or []):
        maker = next((name for out, name in makers.items() if dep == out or out in dep.parents), None)
        if maker:
            found[dep] = maker
    return found


def require_inputs(project: Path, stage: str) -> None:
    """Refuse to run ``stage`` while an input another stage makes is missing (a fresh clone, before
    ``dvc repro``), naming it, the stage that makes it and the command that runs that stage: one
    line, before any server, engine or flow starts (else the flow fails deep inside, twice logged)."""
    missing: dict[str, list[str]] = {}
    for dep, maker in inputs(project, stage).items():
        if not (project / dep).exists():
            missing.setdefault(maker, []).append(str(dep))
    if missing:
        missing = {maker: missing[maker] for maker in STAGES if maker in missing}  # pipeline order
        needs = "; ".join(f"{', '.join(paths)}, which the {maker} stage makes" for maker, paths in missing.items())
        raise UserError(f"{stage} needs {needs}: run `dvc repro {' '.join(missing)}` (or `make repro`)")
