"""The ablation grid: which arms a config asks for, the config each arm trains with, where its
result lives, and what is read off its trace. Plain functions, no orchestration (flows/ablate.py
fans the arms out, tasks/ablate/arm.py is the process that trains one).

An arm is one training run from scratch at the arm scale (``ablation.d_model`` ...) that takes
one injected spike (``ablation.inject*``). Its cache key is its run identity (config, data,
injection) plus a digest of the training code, so an arm reruns when and only when one of those
changes: adding a value to a factor list runs the new arms alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from model.identity import run_identity
from tasks.ablate.config import AblationConfig
from tasks.config import Config
from tasks.spike.curves import trailing_mean

FAMILIES = {
    "block_warmup": ("block", "warmup"),
    "precision": ("precision",),
    "beta2": ("beta2",),
    "stabilizer_lr": ("stabilizer", "lr"),
}
"""Each family and the factors it varies from the base arm (tasks/ablate/config.py: AblationConfig)."""

FACTOR_LISTS = {
    "block": "blocks",
    "precision": "precisions",
    "beta2": "beta2s",
    "warmup": "warmups",
    "stabilizer": "stabilizers",
    "lr": "lrs",
}
"""Factor -> its list in ``ablation``."""

CODE_ROOT = Path(__file__).resolve().parents[2]
"""The checkout this module runs from (tasks/ablate/grid.py is two folders below it)."""
ARM_CODE = ("model", "tasks/ablate/arm.py")
"""The code an arm trains with, besides its config and data: a change here reruns every arm (how
results are read, tasks/ablate/grid.py and the stage, can change without retraining)."""


@dataclasses.dataclass(frozen=True)
class Arm:
    """One point of the grid and one seed."""

    block: str
    precision: str
    beta2: float
    warmup: int
    stabilizer: str
    lr: float
    seed: int
    families: tuple[str, ...] = ()

    @property
    def factors(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in FACTOR_LISTS}

    def variant(self, base: Arm) -> str:
        """The factors that differ from the base arm, e.g. ``post_ln·warmup=0`` (``base``: none)."""
        parts = [
            (str(v) if k in ("block", "precision", "stabilizer") else f"{k}={v:g}")
            for k, v in self.factors.items()
            if v != base.factors[k]
        ]
        return "·".join(parts) or "base"

    def name(self, base: Arm) -> str:
        return f"{self.variant(base)}/s{self.seed}"


def base_arm(a: AblationConfig, seed: int) -> Arm:
    return Arm(a.blocks[0], a.precisions[0], a.beta2s[0], a.warmups[0], a.stabilizers[0], a.lr, seed)


def expand(a: AblationConfig) -> list[Arm]:
    """Every arm the config asks for, once each, in family order then seed: the base arm and each
    family's variations of it (an arm in several families lists them all)."""
    arms: dict[tuple, Arm] = {}
    for family, factors in FAMILIES.items():
        lists = [getattr(a, FACTOR_LISTS[f]) for f in factors]
        for values in _product(lists):
            for seed in a.seeds:
                arm = dataclasses.replace(base_arm(a, seed), **dict(zip(factors, values)))
                key = (*arm.factors.values(), seed)
                held = arms.get(key, arm)
                arms[key] = dataclasses.replace(held, families=(*held.families, family))
    return list(arms.values())


def _product(lists: Sequence[Sequence[Any]]) -> Iterable[tuple]:
    if not lists:
        yield ()
        return
    for head in lists[0]:
        for rest in _product(lists[1:]):
            yield (head, *rest)


def overrides(arm: Arm, a: AblationConfig) -> dict[str, Any]:
    """The dotted keys that turn the study's config into this arm's: the arm scale, its factors,
    one thread, evaluation at the end, checkpoints for a retry to resume from. With them,
    ``python -m tasks.ablate.arm --set KEY=VALUE ...`` trains the arm by itself."""
    precision, scaled = ("fp16", False) if arm.precision == "fp16_unscaled" else (arm.precision, True)
    return {
        "model.d_model": a.d_model,
        "model.n_layer": a.n_layer,
        "model.n_head": a.n_head,
        "model.seq_len": a.seq_len,
        "train.batch_size": a.batch_size,
        "train.grad_accum": 1,
        "train.steps": a.steps,
        "train.seed": arm.seed,
        "train.eval_every": a.steps,
        "train.cpu_threads": 1,
        "model.block": arm.block,
        "precision.mode": precision,
        "precision.loss_scaling": scaled,
        "optim.beta2": arm.beta2,
        "schedule.warmup_steps": arm.warmup,
        "optim.lr": arm.lr,
        "model.qk_norm": arm.stabilizer == "qk_norm",
        "model.z_loss": a.z_loss if arm.stabilizer == "z_loss" else 0.0,
        "checkpoint.every_steps": max(1, a.steps // 4),
        "checkpoint.keep_last": 1,
        "checkpoint.milestones": [],
        "checkpoint.every_minutes": 0.0,
        "spike.kinds": [],  # the arm's injection is ablation.inject*, not the spike stage's
    }


def arm_config(cfg: Config, arm: Arm) -> Config:
    return cfg.replace(**overrides(arm, cfg.ablation))


def injection_spec(a: AblationConfig) -> dict[str, Any]:
    """The injection every arm takes (model/spike.py: Injection's fields)."""
    return {
        "kind": a.inject,
        "start": a.inject_step,
        "position": a.inject_step - 1,
        "duration": a.inject_duration,
        "magnitude": a.inject_magnitude,
        "param_block": 0,
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
    "spike.detect_window",
    "spike.detect_warmup",
    "spike.detect_zscore",
    "spike.detect_ratio",
)
"""Keys outside the run identity that still change an arm's result.json: when it stops as diverged,
and which steps its detector flags."""


def arm_key(cfg: Config, data: dict[str, str], code: str) -> str:
    """The arm's cache key: its identity (config, data, injection, code) and ``ARM_RESULT_KEYS``."""
    flat = cfg.to_flat_dict()
    return run_identity(
        cfg,
        data,
        None,
        {
            "study": "ablate",
            "injection": injection_spec(cfg.ablation),
            "code": code,
            "result": {k: flat[k] for k in ARM_RESULT_KEYS},
        },
    ).digest


def data_hashes(manifest: Path) -> dict[str, str]:
    splits = json.loads(manifest.read_text())["splits"]
    return {s: splits[s]["sha256"] for s in ("train", "val")}


def read_result(directory: Path) -> dict[str, Any] | None:
    """An arm's finished result, or None (never run, crashed, or an unreadable file)."""
    try:
        return json.loads((directory / "result.json").read_text())
    except (OSError, ValueError):
        return None


# ----------------------------------------------------------------------------------------------
# What is read off an arm's trace
# ----------------------------------------------------------------------------------------------


def spike_response(
    rows: Sequence[dict[str, Any]], start: int, duration: int, smooth: int, epsilon: float, end: int
) -> dict[str, Any]:
    """How the arm took its injected spike, against its own loss just before it:

      pre_spike_loss   mean loss of the ``smooth`` steps before ``start``
      peak_ratio       highest loss of the ``duration + smooth`` steps from ``start``, over
                       pre_spike_loss
      recovery_steps   steps from ``start`` until the ``smooth``-step trailing mean is back within
                       ``epsilon`` (relative) of pre_spike_loss; None if never within the run
                       (then ``recovered`` is false)
      censored_at      the steps from ``start`` to ``end``, the run's planned last step: what a run
                       that never recovered counts as (a run that diverged early stopped logging,
                       and must not look quick to recover for it)

    A non-finite loss after ``start`` gives peak_ratio inf and no recovery."""
    steps = np.array([r["step"] for r in rows])
    loss = np.array([np.nan if r["loss"] is None else r["loss"] for r in rows], dtype=float)
    before = loss[(steps >= start - smooth) & (steps < start)]
    after_mask = steps >= start
    after = loss[after_mask]
    censored_at = end - start + 1
    if not len(before) or not len(after) or not np.isfinite(before).all():
        return {
            "pre_spike_loss": None,
            "peak_ratio": None,
            "recovery_steps": None,
            "recovered": False,
            "censored_at": censored_at,
        }
    pre = float(before.mean())
    if not np.isfinite(after).all():
        return {
            "pre_spike_loss": pre,
            "peak_ratio": float("inf"),
            "recovery_steps": None,
            "recovered": False,
            "censored_at": censored_at,
        }
    smoothed = trailing_mean(np.concatenate([before, after]), smooth)[len(before) :]
    back = np.flatnonzero((smoothed <= pre * (1 + epsilon)) & (np.arange(len(after)) >= duration))
    return {
        "pre_spike_loss": pre,
        "peak_ratio": float(after[: duration + smooth].max() / pre),
        "recovery_steps": int(back[0]) if len(back) else None,
        "recovered": bool(len(back)),
        "censored_at": censored_at,
    }


def natural_spikes(rows: Sequence[dict[str, Any]], start: int, window: int) -> list[int]:
    """Steps the detector flagged outside ``[start, start + window)`` (the injection and the
    recovery it causes)."""
    return [r["step"] for r in rows if r["flagged"] and not start <= r["step"] < start + window]


def arm_metrics(result: dict[str, Any], cfg: Config) -> dict[str, Any]:
    """The figures the study compares, from an arm's result (tasks/ablate/arm.py writes it)."""
    a, r = cfg.ablation, cfg.recovery
    rows = result["rows"]
    response = spike_response(rows, a.inject_step, a.inject_duration, r.smooth_steps, r.recover_epsilon, end=a.steps)
    summary = result["summary"]
    finals = [row["loss"] for row in rows[-r.smooth_steps :]]
    final = float(np.mean(finals)) if finals and all(v is not None for v in finals) else None
    return {
        "status": summary["status"],
        "diverged": summary["status"] == "diverged",
        "diverged_at": summary["diverged_at"],
        "final_loss": final,
        "val_loss": summary["val_loss"],
        "init_loss": result["init_loss"],
        "nonfinite_steps": sum(1 for row in rows if row["loss"] is None or row["grad_norm"] is None),
        "skipped": summary["skipped"],
        "overflows": summary["overflows"],
        "natural_spikes": len(natural_spikes(rows, a.inject_step, a.inject_duration + r.recover_steps)),
        **response,
        **{k: result["stats"].get(k) for k in ("attn_logit_max", "logits_max", "log_z_max", "attn_entropy_min")},
        **{f"collapse_{k}": v for k, v in result.get("collapse", {}).items()},
        "wall_s": summary["wall_s"],
        "precision_path": summary["precision"],
    }
