"""One run identity, computed here and nowhere else.

A run's identity is what determines its numbers: the training sections of the config (less log
cadence, worker and thread counts), the exact data it reads, the checkpoint it started from, and
any intervention a caller adds (a spike injection, a recovery policy). It names the run: every
checkpoint carries it and is checked on load, the checkpoint folder of an old identity is moved
aside under its digest, and the stages tag their MLflow runs with it.

Which keys may differ between a checkpoint and the run that loads it is declared here too:
``RESUMABLE`` for an automatic resume (same identity by construction), ``LOADABLE`` for an
explicit start from another run's checkpoint (``init_from``): anything that keeps the tensors'
shapes and meaning, not the architecture.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from model.config import TrainingConfig
from model.typed_config import ConfigError, flatten

IDENTITY_SECTIONS = ("tokenizer", "model", "mup", "optim", "schedule", "precision", "train")
"""Config sections that shape a training run's numbers."""

NOT_IDENTITY = frozenset(
    {
        "train.log_every",
        "train.layer_stats_every",
        "train.eval_every",
        "train.num_workers",
        "train.pin_memory",
        "train.cpu_threads",
        "train.diverge_after",
        "train.diverge_loss",
    }
)
"""Inside those sections, keys that change how often a run is observed, how fast it runs, or when
it is declared diverged, never what a step computes: a change of these resumes the run."""

RESUMABLE = tuple(sorted(NOT_IDENTITY))
"""Keys that may differ when a run resumes its own checkpoint (the identity fixes the rest)."""

LOADABLE = (
    "optim.*",
    "schedule.*",
    "precision.*",
    "train.*",
    "model.z_loss",
    "model.dropout",
    "mup.input_alpha",
    "mup.output_alpha",
)
"""Keys that may differ between a checkpoint and a run started from it with ``init_from``
(glob patterns over dotted keys). The architecture (layers, widths, block, norm, vocabulary,
parametrization) may not: its tensors would not mean the same."""


@dataclass(frozen=True)
class RunIdentity:
    """``digest``: 16 hex characters naming the run; ``spec``: what was hashed, for humans."""

    digest: str
    spec: dict[str, Any]


def identity_config(cfg: TrainingConfig) -> dict[str, Any]:
    """The flat config keys that are part of the identity, sorted."""
    flat = cfg.to_flat_dict()
    return {k: flat[k] for k in sorted(flat) if k.split(".", 1)[0] in IDENTITY_SECTIONS and k not in NOT_IDENTITY}


def run_identity(
    cfg: TrainingConfig, data: Mapping[str, str], parent: str | None = None, extra: Mapping[str, Any] | None = None
) -> RunIdentity:
    """The identity of a run of ``cfg`` on ``data`` (split -> content hash), started from the
    checkpoint whose identity is ``parent`` (None: from scratch), with ``extra`` interventions."""
    spec = {
        "config": identity_config(cfg),
        "data": dict(sorted(data.items())),
        "parent": parent,
        "extra": dict(extra or {}),
    }
    blob = json.dumps(spec, sort_keys=True, default=str).encode()
    return RunIdentity(hashlib.sha256(blob).hexdigest()[:16], json.loads(json.dumps(spec, default=str)))


def differing_keys(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Dotted keys whose values differ between two flat configs (keys of either side)."""
    return sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))


def check_loadable(
    saved_config: Mapping[str, Any], cfg: TrainingConfig, source: str, allowed: Iterable[str] = LOADABLE
) -> list[str]:
    """Refuse to start ``cfg`` from a checkpoint whose config (nested, as saved) differs in a key
    outside ``allowed``; returns the allowed differences (for the run's log)."""
    saved = flatten(dict(saved_config))
    current = cfg.to_flat_dict()
    changed = [k for k in differing_keys(saved, current) if k.split(".", 1)[0] in IDENTITY_SECTIONS]
    refused = [k for k in changed if not any(fnmatch.fnmatchcase(k, p) for p in allowed)]
    if refused:
        detail = ", ".join(f"{k} ({saved.get(k)!r} -> {current.get(k)!r})" for k in refused)
        raise ConfigError(f"{source}: cannot start this run from it; these keys differ and must match: {detail}")
    return changed
