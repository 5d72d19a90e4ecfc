"""The study's arms: which arms a config asks for, the config each trains with, where its result
lives, and what is read off its trace. Plain functions, no orchestration (flows/ablate.py fans the
arms out, tasks/ablate/arm.py is the command that trains one).

An arm is one training run from scratch, in the conditions its family declares (tasks/design/families.py). Its
cache key is its run identity (config, data, injection, probes) plus a digest of the training
code, so an arm reruns when and only when one of those changes: adding a value to a factor list
runs the new arms alone, and two families that ask for the same run (the overflow family's
clean twins are the precision family's arms) share it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from model.identity import run_identity
from model.typed_config import ConfigError
from tasks.ablate.config import AblationConfig
from tasks.config import Config
from tasks.design.families import DeclaredFamily, variant_name
from tasks.design.studies import builtin_families

CODE_ROOT = Path(__file__).resolve().parents[2]
"""The checkout this module runs from (tasks/ablate/grid.py is two folders below it)."""
ARM_CODE = ("model", "tasks/ablate/arm.py", "tasks/ablate/conditions.py")
"""The code an arm trains with, besides its config and data: a change here reruns every arm (how
results are read, tasks/ablate/grid.py and the stage, can change without retraining)."""


@dataclasses.dataclass(frozen=True)
class Arm:
    """One run of a family: its factor values (in the family's order) and its seed."""

    family: str
    values: tuple[Any, ...]
    seed: int
    names: tuple[str, ...]
    """The family's factors, in its declaration's order."""
    spike: str = "none"
    """The spike the arm takes (``none``: a clean arm; tasks/design/families.py: an injection factor)."""

    @property
    def factors(self) -> dict[str, Any]:
        return dict(zip(self.names, self.values))

    @property
    def variant(self) -> str:
        """Every factor, e.g. ``post_ln·warmup=0·lr=0.003`` or ``model.qk_norm=true·optim.lr=0.003``."""
        return variant_name(self.factors)

    @property
    def name(self) -> str:
        return f"{self.family}/{self.variant}/s{self.seed}"


def families(cfg: Config, declared: Sequence[DeclaredFamily] = ()) -> dict[str, DeclaredFamily]:
    """Every family of the study by name: the built-in ones (tasks/design/preregistration.yaml),
    then those studies.yaml declares."""
    return {f.name: f for f in [*builtin_families(cfg), *declared]}


def trained(cfg: Config, declared: Sequence[DeclaredFamily] = ()) -> dict[str, DeclaredFamily]:
    """The families whose arms the study trains: those ``ablation.families`` names, in the study's
    order, or every family when it names none; a name that is no family is a ConfigError naming
    them all."""
    every = families(cfg, declared)
    chosen = cfg.ablation.families
    if unknown := [name for name in chosen if name not in every]:
        raise ConfigError(f"ablation.families: {unknown[0]!r} is not a family of the study ({', '.join(every)})")
    return {name: f for name, f in every.items() if not chosen or name in chosen}


def check_family(name: str, cfg: Config, declared: Sequence[DeclaredFamily] = ()) -> None:
    """``name`` is a family of the study (``spikelab run ablate --family NAME``); else a
    ConfigError that names them all."""
    every = families(cfg, declared)
    if name not in every:
        raise ConfigError(f"--family: {name!r} is not a family of the study ({', '.join(every)})")


def expand(cfg: Config, declared: Sequence[DeclaredFamily] = ()) -> list[Arm]:
    """Every arm of every family the study trains (:func:`trained`: of the built-in ones and
    ``declared``), family by family, each point of its grid once per seed (discovery, then
    confirmation)."""
    return [
        family_arm(family, seed, **variant)
        for family in trained(cfg, declared).values()
        for variant in family.variants()
        for seed in family.all_seeds
    ]


def family_arm(family: DeclaredFamily, seed: int, **factors: Any) -> Arm:
    """The arm of ``family`` at ``factors`` (every factor named) and ``seed``."""
    values = tuple(factors[k] for k in family.factors)
    return Arm(family.name, values, seed, tuple(family.factors), family.spike(factors))


def arm_config(cfg: Config, arm: Arm, family: DeclaredFamily, loss_shift: int = 0) -> Config:
    """The arm's config: the study's, with the family's keys for this arm (``loss_shift``: the
    precision probe's, tasks/ablate/conditions.py: loss_shift_probe). With the same keys,
    ``python -m tasks.ablate.arm --set KEY=VALUE ...`` trains the arm by itself."""
    return cfg.replace(**family.overrides(cfg.ablation, arm.factors, arm.seed, loss_shift))


def injection_spec(kind: str, a: AblationConfig) -> dict[str, Any] | None:
    """The injection an arm takes (model/spike/injections.py: Injection's fields), None for a clean
    arm (``none``): block 0's weights once at ``inject_step``, by a multiplier the arm measures then
    (``magnitude`` 0: sized by the probe, tasks/ablate/conditions.py: OverflowProbeSpike)."""
    if kind == "none":
        return None
    return {
        "kind": kind,
        "start": a.inject_step,
        "position": a.inject_step - 1,
        "duration": 1,
        "magnitude": 0.0,
        "param_block": 0,
        "tied_to": "once",
    }


def code_digest() -> str:
    """sha256 over the arm's code (ARM_CODE, in the checkout this module runs from), file by file."""
    h = hashlib.sha256()
    for entry in ARM_CODE:
        path = CODE_ROOT / entry
        for f in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            h.update(str(f.relative_to(CODE_ROOT)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


ARM_RESULT_KEYS = (
    "train.diverge_after",
    "train.diverge_loss",
    "train.layer_stats_every",
    "spike.detect_window",
    "spike.detect_warmup",
    "ablation.detect_zscore",
    "spike.detect_ratio",
)
"""Keys outside the run identity that still change an arm's result.json: when it stops as diverged,
how often its per-layer trajectories are sampled, and which steps its detector flags."""


def arm_key(cfg: Config, data: dict[str, str], code: str, spike: str, range_every: int, policy: str = "none") -> str:
    """The arm's cache key: its identity (config, data, spike, probe, code) and ``ARM_RESULT_KEYS``;
    with a recovery policy attached (:func:`policy_spec`), the policy and its settings too. An arm
    with none keeps the key it always had: the natural-spike analysis's continue is the beta2
    family's own arm, the same run (tests/test_natural.py)."""
    flat = cfg.to_flat_dict()
    injection = injection_spec(spike, cfg.ablation)
    extra = {"study": "ablate", "injection": injection, "range_probe_every": range_every, "code": code}
    if policy != "none":
        extra["policy"] = policy_spec(policy, cfg)
    return run_identity(cfg, data, None, extra | {"result": {k: flat[k] for k in ARM_RESULT_KEYS}}).digest


def policy_spec(policy: str, cfg: Config) -> dict[str, Any]:
    """A policy attached to an arm's detector and the recovery settings it reads (ablation.natural_policies)."""
    r = cfg.recovery
    return {"kind": policy, "lr_factor": r.lr_factor, "max_consecutive_vetoes": r.max_consecutive_vetoes}


def data_hashes(manifest: Path) -> dict[str, str]:
    """The train and val splits' hashes; with a perturbed copy's (tasks/data/perturb.py) its
    perturbation too, so no arm on it shares a key with one on the full data, even at share 0."""
    info = json.loads(manifest.read_text())
    splits, perturbation = info["splits"], info.get("perturbation")
    hashes = {s: splits[s]["sha256"] for s in ("train", "val")}
    if perturbation is not None:
        hashes["perturbation"] = json.dumps(
            {k: perturbation[k] for k in ("kind", "drop_share", "seed")}, sort_keys=True
        )
    return hashes


def read_result(directory: Path) -> dict[str, Any] | None:
    """An arm's finished result, or None (never run, crashed, or an unreadable file)."""
    try:
        result: dict[str, Any] = json.loads((directory / "result.json").read_text())
        return result
    except (OSError, ValueError):
        return None


# ----------------------------------------------------------------------------------------------
# What is read off an arm's trace
# ----------------------------------------------------------------------------------------------


def natural_spikes(rows: Sequence[dict[str, Any]], after: int, skip: range = range(0)) -> list[int]:
    """Steps the detector flagged from step ``after`` on (the schedule's warmup excluded), outside
    ``skip`` (an injection and the recovery it causes)."""
    return [r["step"] for r in rows if r["flagged"] and r["step"] >= after and r["step"] not in skip]


def _finite_mean(values: Sequence[float | None]) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.mean(finite)) if values and len(finite) == len(values) else None


def arm_metrics(result: dict[str, Any], cfg: Config) -> dict[str, Any]:
    """The figures the study compares, from an arm's result (tasks/ablate/arm.py writes it), ``cfg``
    being the arm's own config: the final loss is the mean of the last ``recovery.smooth_steps``
    steps, and an injection's window is extended by as many steps before natural spikes count."""
    rows, summary, smooth = result["rows"], result["summary"], cfg.recovery.smooth_steps
    warmup = cfg.schedule.warmup_steps
    injection = result.get("injection")
    skip = range(injection["start"], injection["start"] + injection["duration"] + smooth) if injection else range(0)
    spikes = natural_spikes(rows, warmup + 1, skip)
    after_warmup = [r for r in rows if r["step"] > warmup]
    update_rms = [r["update_rms"] for r in after_warmup if r.get("update_rms") is not None]
    return {
        "status": summary["status"],
        "diverged": summary["status"] == "diverged",
        "diverged_at": summary["diverged_at"],
        "final_loss": _finite_mean([r["loss"] for r in rows[-smooth:]]),
        "val_loss": summary["val_loss"],
        "init_loss": result["init_loss"],
        "nonfinite_steps": sum(1 for row in rows if row["loss"] is None or row["grad_norm"] is None),
        "skipped": summary["skipped"],
        "overflows": summary["overflows"],
        "natural_spikes": len(spikes),
        "spikes_per_1k": 1000 * len(spikes) / max(1, len(after_warmup)),
        "update_rms_max": max(update_rms) if update_rms else None,
        "update_rms_mean": float(np.mean(update_rms)) if update_rms else None,
        **{
            k: result["stats"].get(k)
            for k in ("attn_logit_max", "logits_max", "log_z_max", "log_z_min", "attn_entropy_min")
        },
        **range_extremes(result.get("ranges", [])),
        **{f"collapse_{k}": v for k, v in result.get("collapse", {}).items()},
        "wall_s": summary["wall_s"],
        "precision_path": summary["precision"],
        "injected_multiplier": result.get("injected_multiplier"),
    }


def range_extremes(rows: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """From the range probe's rows (model/probes.py: QUANTITIES): the largest per-layer share of
    activation gradients below fp16's smallest subnormal (mean over probe steps, then the layer where
    it is largest), and the largest share of activations above fp16's largest finite value (block
    outputs or MLP pre-activations) at any probe."""
    if not rows:
        return {"grad_underflow_share": None, "act_overflow_share": None}
    by_layer: dict[str, list[float]] = {}
    overflow = 0.0
    for row in rows:
        if row["share"] is None or not math.isfinite(row["share"]):  # nothing nonzero (JSON null: NaN)
            continue
        if row["quantity"] == "act_grad_below_subnormal":
            by_layer.setdefault(row["layer"], []).append(row["share"])
        elif row["quantity"] in ("act_above_max", "mlp_pre_above_max"):
            overflow = max(overflow, row["share"])
    underflow = max((float(np.mean(v)) for v in by_layer.values()), default=None)
    return {"grad_underflow_share": underflow, "act_overflow_share": overflow}
