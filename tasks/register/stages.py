"""Which stages a registration covers (issue 60): a study registers only the stages it runs.

The gpu study trains the ablate stage's arms alone (tasks/gpu_study/), so its registration covers
ablate: its seeds, the families the profile trains and their gates. A finding another stage decides
(μ-transfer: search; the spike finding: spike) is neither checked nor registered, and that stage,
run under the profile, runs exploratory (:func:`stage_state`). A record from before stages were
named covers every stage that trains study seeds, as it did when it was written.

This wraps the question every training stage asks (tasks/design/registration.py: state_of) rather
than changing it: that file is design code, and a byte of it would move the design hash every
existing registration holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from model.typed_config import ConfigError
from tasks.config import Config
from tasks.design.registration import CONFIRMATORY, EXPLORATORY, State, load_records, state_of
from tasks.design.seed_registry import TRAINED_BY

EVERY = tuple(TRAINED_BY)
"""The stages that train study seeds (ablate, spike, search): a registration's default."""


def chosen(asked: Sequence[str] | None) -> list[str]:
    """The stages ``spikelab register --stages`` names, in :data:`EVERY`'s order; every one when
    none is named. An unknown stage is refused, naming it."""
    if not asked:
        return list(EVERY)
    for stage in asked:
        if stage not in EVERY:
            raise ConfigError(f"--stages: {stage!r} is not a stage that trains study seeds (one of {', '.join(EVERY)})")
    return [stage for stage in EVERY if stage in asked]


def covered_by(record: Mapping[str, Any]) -> list[str]:
    """The stages a registration covers (a record without ``stages`` predates them: every one)."""
    return list(record.get("stages", EVERY))


def stage_state(stage: str, cfg: Config, project: Path) -> State:
    """:func:`state_of` for ``stage``: confirmatory only where the profile's last registration
    holds this design and covers the stage; a stage it leaves out runs exploratory, saying so."""
    state = state_of(cfg, project)
    if state.state != CONFIRMATORY:
        return state
    stages = covered_by(load_records(project, cfg.profile)[-1])
    if stage in stages:
        return state
    why = f"{state.record} registers stage{'s' if len(stages) > 1 else ''} {', '.join(stages)}, not {stage}"
    return State(EXPLORATORY, state.record, state.hashes, why)
