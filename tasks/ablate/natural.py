"""The arms of the spike finding's secondary analysis (tasks/report/natural.py scores them): the
beta2 family's arm in the registered condition (findings.spike.secondary.condition: β₂ = 0.999 at
4 x LR), whose spikes are natural, retrained on the first round's seeds with each policy of
``ablation.natural_policies`` attached to its detector. Continue is the family's own arm on each
seed (no policy: the same cache key), never trained again. The sensitivity stage does not retrain
these arms (they are no family's)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tasks.ablate.grid import Arm, families, family_arm
from tasks.config import Config
from tasks.design.families import matches
from tasks.design.preregistration import design
from tasks.design.stats import capped_loss

FAMILY = "beta2"
CONTINUE = "continue"


def condition() -> dict[str, Any]:
    """The beta2 family's factor values the analysis reads, as registered."""
    registered: dict[str, Any] = design()["findings"]["spike"]["secondary"]["condition"]
    return registered


def natural_arms(cfg: Config) -> list[tuple[Arm, str]]:
    """Each (arm, policy) to train: the condition's arm per first-round seed per policy; none where
    the profile's beta2 grid does not cross the condition (the smoke profile) or names no policy."""
    family = families(cfg)[FAMILY]
    variants = family.variants(condition())
    if not variants or not cfg.ablation.natural_policies:
        return []
    (variant,) = variants
    return [
        (family_arm(family, seed, **variant), policy)
        for seed in cfg.ablation.seeds
        for policy in cfg.ablation.natural_policies
    ]


def is_control(row: dict[str, Any], seeds: Sequence[int]) -> bool:
    """A row of the ablate stage that is continue's run: the condition's arm on a first-round seed."""
    return row["family"] == FAMILY and row["seed"] in seeds and matches(row["factors"], condition())


def run_record(row: dict[str, Any]) -> dict[str, Any]:
    """One run as the analysis reads it: its capped final validation loss, flags, what its policy did."""
    m, result = row.get("metrics") or {}, row.get("result") or {}
    return {
        "status": row.get("status"),
        "capped_loss": capped_loss(m) if m else None,
        "val_loss": m.get("val_loss"),
        "natural_spikes": m.get("natural_spikes"),
        "flagged": sum(1 for r in result.get("rows", []) if r["flagged"]),
        "actions": result.get("actions", []),
        "key": row["key"],
        "wall_s": m.get("wall_s"),
        "mlflow": row.get("mlflow"),
    }


def natural_record(
    cfg: Config, rows: Sequence[dict[str, Any]], policy_rows: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """metrics/ablate.json's ``natural``: the condition, seeds and policies, and per policy
    (continue: the family's own arms) each seed's run; a failed run is left out of its policy's."""
    seeds = list(cfg.ablation.seeds)
    runs: dict[str, dict[str, Any]] = {CONTINUE: {}, **{p: {} for p in cfg.ablation.natural_policies}}
    for row in rows:
        if is_control(row, seeds) and row.get("status") != "failed":
            runs[CONTINUE][str(row["seed"])] = run_record(row)
    for row in policy_rows:
        if row.get("status") != "failed":
            runs[row["policy"]][str(row["seed"])] = run_record(row)
    return {
        "condition": condition(),
        "family": FAMILY,
        "seeds": seeds,
        "policies": list(cfg.ablation.natural_policies),
        "runs": runs,
    }
