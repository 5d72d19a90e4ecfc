"""The search stage's figures (matplotlib, Agg), drawn from its findings:

mu_transfer.png   validation loss vs log2 LR, one curve per width, SP and μP side by side,
                  the fitted optimum of each width marked (the μTransfer figure)
coord_check.png   mean |activation| per layer vs width after a few steps at one LR, SP and μP
transfer.png      the direct sweep at the target width, the transferred LR and its loss
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from model.config import Parametrization
from tasks.search.fit import Point, optima_per_seed


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _mean_curve(points: Sequence[Point]) -> tuple[list[float], list[float]]:
    """Seed-mean loss per LR over completed points."""
    lrs = sorted({p.log2_lr for p in points if p.status == "completed"})
    return lrs, [float(np.mean([p.value for p in points if p.log2_lr == lr and p.status == "completed"])) for lr in lrs]


def _failed_marks(ax, points: Sequence[Point], top: float, color) -> None:
    """Pruned and diverged points as crosses along the top edge."""
    lrs = sorted({p.log2_lr for p in points if p.status != "completed"})
    if lrs:
        ax.scatter(lrs, [top] * len(lrs), marker="x", color=color, clip_on=False)


def mu_transfer(
    by_parametrization: Mapping[Parametrization, dict[int, list[Point]]], path: Path, uniform: float
) -> Path:
    plt = _pyplot()
    names = list(by_parametrization)
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.5), sharey=True, squeeze=False)
    for ax, name in zip(axes[0], names):
        widths = sorted(by_parametrization[name])
        colors = plt.cm.viridis(np.linspace(0, 0.9, len(widths)))
        for color, width in zip(colors, widths):
            pts = by_parametrization[name][width]
            ax.plot(*_mean_curve(pts), "o-", color=color, label=f"width {width}")
            for opt in optima_per_seed(pts).values():
                ax.plot(opt.log2_lr, opt.loss, "*", color=color, markersize=14, markeredgecolor="k")
            _failed_marks(ax, pts, uniform, color)
        ax.set_title({"sp": "SP", "mup": "μP"}.get(name, name) + ": validation loss vs LR (★ fitted optimum)")
        ax.set_xlabel("log2 learning rate" + (" (at the base width)" if name == "mup" else ""))
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0][0].set_ylabel("validation loss (× pruned or diverged)")
    axes[0][0].set_ylim(top=uniform + 0.1)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def coord_check_figure(
    coords: Mapping[Parametrization, dict[str, list[float]]], widths: Sequence[int], lr: float, path: Path
) -> Path:
    """``coords``: per parametrization, model.coord_check's {layer: [value per width]}."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(coords), figsize=(6 * len(coords), 4.5), sharey=True, squeeze=False)
    for ax, (name, layers) in zip(axes[0], coords.items()):
        for layer, values in layers.items():
            if not layer.endswith(":update"):
                ax.plot(widths, values, "o-", label=layer)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{ {'sp': 'SP', 'mup': 'μP'}.get(name, name) }: mean |activation| after 5 steps at lr {lr:.3g}")
        ax.set_xlabel("width")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("mean |activation|")
    axes[0][-1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def transfer_figure(direct: Sequence[Point], transfer: Sequence[Point], check: dict, width: int, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for seed in sorted({p.seed for p in direct}):
        pts = [p for p in direct if p.seed == seed]
        ax.plot(*_mean_curve(pts), "o-", alpha=0.5, label=f"direct sweep, seed {seed}")
    ax.plot(*_mean_curve(direct), "k-", lw=2, label="direct sweep, seed mean")
    ax.scatter(
        [p.log2_lr for p in transfer],
        [p.value for p in transfer],
        marker="D",
        s=60,
        color="C3",
        zorder=5,
        label="transferred LR (one run per seed)",
    )
    ax.axvline(check["log2_lr"], color="C3", ls="--")
    if check["direct_log2_lr_opt"] is not None:
        ax.axvline(check["direct_log2_lr_opt"], color="k", ls=":", label="direct sweep's fitted optimum")
    gap = check["loss_gap"]
    ax.set_title(
        f"Transfer to width {width}: loss gap {gap:.3g}, compute ratio {check['compute_ratio']:.2g}"
        if gap is not None and check["compute_ratio"] is not None
        else f"Transfer to width {width}"
    )
    ax.set_xlabel("log2 learning rate")
    ax.set_ylabel("validation loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
