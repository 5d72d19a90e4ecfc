"""The study's arms: which arms a config asks for, the config each trains with, where its result
lives, and what is read off its trace. Plain functions, no orchestration (flows/ablate.py fans the
arms out, tasks/ablate/arm.py is the command that trains one).

An arm is one training run from scratch, in its family's conditions (tasks/ablate/config.py). Its
cache key is its run identity (config, data, injection, probes) plus a digest of the training
code, so an arm reruns when and only when one of those changes: adding a value to a factor list
runs the new arms alone, and two families that ask for the same run (the overflow family's
clean twins are the precision family's arms) share it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from model.identity import run_identity
from tasks.ablate.config import AblationConfig
from tasks.ablate.declared import DeclaredFamily, variant_name
from tasks.config import Config

FAMILIES: dict[str, tuple[str, ...]] = {
    "xiong": ("block", "warmup", "lr"),
    "precision": ("precision",),
    "overflow": ("precision", "spike"),
    "beta2": ("beta2", "lr_mult"),
    "wortsman": ("stabilizer", "lr"),
}
"""Each family and the factors it crosses (times the seeds); the first value of each factor is the
family's base arm."""

SPIKES = ("none", "param")
"""The overflow family's spike factor: its clean twin, and the probe-sized weight excursion
(tasks/ablate/conditions.py: OverflowProbeSpike)."""

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
    names: tuple[str, ...] = ()
    """A declared family's factors, config keys (studies.yaml); a built-in family's are FAMILIES'."""

    @property
    def factors(self) -> dict[str, Any]:
        return dict(zip(self.names or FAMILIES[self.family], self.values))

    @property
    def variant(self) -> str:
        """Every factor, e.g. ``post_ln·warmup=0·lr=0.003`` (names alone for a built-in family's named
        variants; a declared family's as ``key=value``, its keys being config keys)."""
        if self.names:
            return variant_name(self.factors)
        return "·".join(v if isinstance(v, str) else f"{k}={v:g}" for k, v in self.factors.items())

    @property
    def name(self) -> str:
        return f"{self.family}/{self.variant}/s{self.seed}"

    @property
    def spike(self) -> str:
        """The spike the arm takes (``none``: a clean arm)."""
        spike: str = self.factors.get("spike", "none")
        return spike


def factor_values(a: AblationConfig) -> dict[str, dict[str, list[Any]]]:
    """Per family, each factor's values from the config."""
    return {
        "xiong": {"block": a.blocks, "warmup": a.xiong_warmups, "lr": a.xiong_lrs},
        "precision": {"precision": a.precisions},
        "overflow": {"precision": a.overflow_precisions, "spike": list(SPIKES)},
        "beta2": {"beta2": a.beta2s, "lr_mult": a.beta2_lr_mults},
        "wortsman": {"stabilizer": a.stabilizers, "lr": a.lrs},
    }


def expand(a: AblationConfig, declared: Sequence[DeclaredFamily] = ()) -> list[Arm]:
    """Every arm the config and the declared families (studies.yaml) ask for, family by family,
    each point of its grid once per seed (discovery, then confirmation)."""
    arms = []
    for family, factors in factor_values(a).items():
        for values in itertools.product(*factors.values()):
            arms += [Arm(family, values, seed) for seed in a.all_seeds]
    for d in declared:
        for values in itertools.product(*d.factors.values()):
            arms += [Arm(d.name, values, seed, tuple(d.factors)) for seed in d.all_seeds]
    return arms


def base_values(a: AblationConfig, family: str) -> dict[str, Any]:
    """The family's base arm: the first value of each of its factors."""
    return {k: v[0] for k, v in factor_values(a)[family].items()}


# ----------------------------------------------------------------------------------------------
# An arm's config: the arm scale, its family's conditions, its factors
# ----------------------------------------------------------------------------------------------


def overrides(
    arm: Arm, a: AblationConfig, loss_shift: int = 0, declared: DeclaredFamily | None = None
) -> dict[str, Any]:
    """The dotted keys that turn the study's config into this arm's (``loss_shift``: the precision
    and overflow families', tasks/ablate/conditions.py: loss_shift_probe; ``declared``: the
    arm's family when studies.yaml declares it). With them, ``python -m tasks.ablate.arm --set
    KEY=VALUE ...`` trains the arm by itself."""
    if declared:
        return declared.overrides(a, arm.factors, arm.seed)
    steps = family_steps(arm.family, a)
    keys = a.arm_scale(steps, arm.seed)
    family = CONDITIONS[arm.family](arm.factors, a, steps)
    if arm.family in ("precision", "overflow"):
        family["precision.loss_shift"] = loss_shift
    return keys | family


def _xiong(f: dict[str, Any], a: AblationConfig, steps: int) -> dict[str, Any]:
    # The paper's model: the original Transformer's init (SP, Xavier, unit-scale embeddings; μP's
    # zero-initialised readout and GPT-2's depth-scaled init both remove the large output-layer
    # gradients at init Xiong et al. describe), LayerNorm, a GELU feed-forward.
    return {
        **XIONG_MODEL,
        "model.n_layer": a.xiong_depth,
        "model.block": f["block"],
        "optim.lr": f["lr"],
        "schedule.warmup_steps": round(f["warmup"] * steps),
    }


def _precision(f: dict[str, Any], a: AblationConfig, steps: int) -> dict[str, Any]:
    # Every format through one numeric path (emulated matmul rounding), so formats differ and
    # nothing else does; fp32 under emulation rounds nothing.
    mode, scaled = ("fp16", False) if f["precision"] == "fp16_unscaled" else (f["precision"], True)
    return {
        "mup.parametrization": "sp",
        "optim.lr": a.sp_lr,
        "precision.mode": mode,
        "precision.loss_scaling": scaled,
        "precision.emulate": "always",
    }


def _beta2(f: dict[str, Any], a: AblationConfig, steps: int) -> dict[str, Any]:
    return {"optim.beta2": f["beta2"], "optim.lr": a.lr * f["lr_mult"], "train.batch_size": a.beta2_batch_size}


def _wortsman(f: dict[str, Any], a: AblationConfig, steps: int) -> dict[str, Any]:
    return {
        "mup.parametrization": "sp",
        "optim.lr": f["lr"],
        "optim.weight_decay_mode": "independent",
        "optim.weight_decay": a.independent_weight_decay,
        "model.qk_norm": f["stabilizer"] == "qk_norm",
        "model.z_loss": a.z_loss if f["stabilizer"] == "z_loss" else 0.0,
    }


XIONG_MODEL: dict[str, Any] = {
    "mup.parametrization": "sp",
    "model.init": "xavier",
    "model.norm": "layernorm",
    "model.mlp": "gelu",
}
"""The model Xiong et al. study, for the xiong arms and the depth probe (tasks/ablate/depth.py)."""

CONDITIONS = {"xiong": _xiong, "precision": _precision, "overflow": _precision, "beta2": _beta2, "wortsman": _wortsman}
"""Each family's conditions on top of the arm scale (the module doc of tasks/ablate/config.py)."""


def family_steps(family: str, a: AblationConfig) -> int:
    return {"xiong": a.xiong_steps, "beta2": a.beta2_steps, "wortsman": a.wortsman_steps}.get(family, a.steps)


def arm_config(cfg: Config, arm: Arm, loss_shift: int = 0, declared: DeclaredFamily | None = None) -> Config:
    return cfg.replace(**overrides(arm, cfg.ablation, loss_shift, declared))


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


def range_probe_every(arm: Arm, a: AblationConfig) -> int:
    """Steps between the fp16 range probe's measurements in this arm (0: none): the formats' families."""
    return a.range_probe_every if arm.family in ("precision", "overflow") else 0


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
    "spike.detect_zscore",
    "spike.detect_ratio",
)
"""Keys outside the run identity that still change an arm's result.json: when it stops as diverged,
how often its per-layer trajectories are sampled, and which steps its detector flags."""


def arm_key(cfg: Config, data: dict[str, str], code: str, spike: str, range_every: int) -> str:
    """The arm's cache key: its identity (config, data, spike, probe, code) and ``ARM_RESULT_KEYS``."""
    flat = cfg.to_flat_dict()
    injection = injection_spec(spike, cfg.ablation)
    extra = {"study": "ablate", "injection": injection, "range_probe_every": range_every, "code": code}
    return run_identity(cfg, data, None, extra | {"result": {k: flat[k] for k in ARM_RESULT_KEYS}}).digest


def data_hashes(manifest: Path) -> dict[str, str]:
    splits = json.loads(manifest.read_text())["splits"]
    return {s: splits[s]["sha256"] for s in ("train", "val")}


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
        **{k: result["stats"].get(k) for k in ("attn_logit_max", "logits_max", "log_z_max", "attn_entropy_min")},
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
