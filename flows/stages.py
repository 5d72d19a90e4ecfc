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
