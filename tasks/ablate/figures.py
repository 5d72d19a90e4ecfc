"""The ablate stage's figures (PNG, matplotlib Agg, open offline): per family, the training loss
of each variant over the whole run and around the injected spike, the mean over seeds as a line
and the seeds' range as a band; for the stabilizer x LR family, final loss against LR per
stabilizer (the LR-sensitivity curve of Wortsman et al. 2023)."""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tasks.ablate.grid import FAMILIES
from tasks.ablate.stats import capped_loss
from tasks.config import Config
from tasks.spike.curves import trailing_mean

TITLES = {"block_warmup": "Block placement x warmup", "precision": "Precision", "beta2": "Adam β₂"}


def family_figures(cfg: Config, arms: Sequence[dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.png"):
        stale.unlink()
    paths = []
    for family in FAMILIES:
        members = [a for a in arms if family in a["families"]]
        if not members:
            continue
        path = out / f"{family}.png"
        if family == "stabilizer_lr":
            lr_sensitivity_figure(members, path)
        else:
            curves_figure(cfg, TITLES[family], members, path)
        paths.append(path)
    return paths


def _by_variant(arms: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for arm in arms:
        groups[arm["variant"]].append(arm)
    return groups


def _band(arms: Sequence[dict[str, Any]], length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per step: mean, min and max over the seeds that reached it (NaN where none did)."""
    table = np.full((len(arms), length), np.nan)
    for i, arm in enumerate(arms):
        for row in arm["rows"]:
            if row["loss"] is not None and row["step"] <= length:
                table[i, row["step"] - 1] = row["loss"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # steps no seed reached
        return np.nanmean(table, 0), np.nanmin(table, 0), np.nanmax(table, 0)


def curves_figure(cfg: Config, title: str, arms: Sequence[dict[str, Any]], path: Path) -> None:
    import matplotlib.pyplot as plt

    a = cfg.ablation
    steps = np.arange(1, a.steps + 1)
    fig, (whole, zoom) = plt.subplots(1, 2, figsize=(12, 4.2))
    lo, hi = max(1, a.inject_step - 20), min(a.steps, a.inject_step + 80)
    for variant, members in _by_variant(arms).items():
        mean, low, high = _band(members, a.steps)
        if np.isnan(mean).all():
            zoom.plot([], [], label=f"{variant}: no result ({len(members)} failed)")
            continue
        diverged = sum(1 for m in members if m["status"] in ("diverged", "failed"))
        label = f"{variant} ({len(members)} seeds" + (f", {diverged} diverged/failed)" if diverged else ")")
        smooth = [
            trailing_mean(np.nan_to_num(c, nan=np.nanmax(c)), cfg.recovery.smooth_steps) for c in (mean, low, high)
        ]
        for ax, window, (mid, bottom, top) in (
            (whole, slice(None), smooth),
            (zoom, slice(lo - 1, hi), (mean, low, high)),
        ):
            (line,) = ax.plot(steps[window], mid[window], lw=1.2, label=label)
            ax.fill_between(steps[window], bottom[window], top[window], color=line.get_color(), alpha=0.2, lw=0)
    for ax in (whole, zoom):
        ax.axvspan(
            a.inject_step,
            a.inject_step + a.inject_duration - 1,
            color="red",
            alpha=0.15,
            label=f"injected: {a.inject} x{a.inject_magnitude:g}, {a.inject_duration} steps",
        )
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (nats)")
        ax.grid(alpha=0.3)
    whole.set_title(
        f"{title}: whole run, {cfg.recovery.smooth_steps}-step trailing mean\n(mean over seeds, band = min..max)"
    )
    zoom.set_title(f"around the injected spike, every step (steps {lo}..{hi})")
    inits = [arm["metrics"]["init_loss"] for arm in arms if arm.get("metrics")]
    if inits:  # a diverging run would stretch the axis to its blow-up
        whole.set_ylim(top=min(max(inits) * 1.05, whole.get_ylim()[1]))
    zoom.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def lr_sensitivity_figure(arms: Sequence[dict[str, Any]], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    by_stabilizer: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    ran = [arm for arm in arms if arm.get("metrics")]  # a failed arm has no loss: left out, as in the findings
    for arm in ran:
        by_stabilizer[arm["factors"]["stabilizer"]][arm["factors"]["lr"]].append(capped_loss(arm["metrics"]))
    for stabilizer, by_lr in by_stabilizer.items():
        lrs = sorted(by_lr)
        means = [np.mean(by_lr[lr]) for lr in lrs]
        (line,) = ax.plot(lrs, means, marker="o", label=stabilizer)
        ax.fill_between(
            lrs, [min(by_lr[lr]) for lr in lrs], [max(by_lr[lr]) for lr in lrs], color=line.get_color(), alpha=0.2, lw=0
        )
    if ran:
        init = max(arm["metrics"]["init_loss"] for arm in ran)
        ax.axhline(init, color="gray", ls="--", lw=1, label="loss at init (cap; diverged runs sit here)")
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("final validation loss, capped (nats)")
    ax.set_title("LR sensitivity: final loss vs LR (mean over seeds, band = min..max)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
