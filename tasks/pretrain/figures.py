"""Figures the stages draw themselves, as PNG files that open anywhere (no network, no Vega).

Every quantity gets axes that fit its scale: one titled panel per quantity, a log axis for those
that span orders of magnitude (gradient and parameter norms, Adam's second moment, the update
ratio, activations). Drawn with matplotlib's Agg backend, imported only here.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

PANEL = tuple[str, Sequence[tuple[str, str]], bool]
"""(title, [(csv stem, column, or a column prefix ending in '*'), ...], log y axis)."""

PRETRAIN_FIGURES: dict[str, list[PANEL]] = {
    "loss.png": [("Loss (cross-entropy, nats)", [("train", "loss"), ("val", "loss")], False)],
    "optimizer.png": [
        ("Gradient norm before clipping", [("train", "grad_norm"), ("train", "grad_norm_max")], True),
        ("Update / parameter norm", [("train", "update_ratio")], True),
        ("Learning rate", [("train", "lr")], False),
    ],
    "stability.png": [
        ("Parameter norm", [("train", "param_norm")], False),
        ("Adam second-moment norm", [("train", "adam_v_norm")], True),
        ("Max attention logit per block", [("stats", "attn_logit_max/*")], False),
        ("Activation L2 per block", [("stats", "act_l2/*")], True),
    ],
}
"""Each figure of the pretrain stage: its panels."""


def read_curves(plots_dir: Path) -> dict[str, dict[str, list[float]]]:
    """``{csv stem: {column: values}}`` for every CSV in ``plots_dir``."""
    curves = {}
    for path in sorted(plots_dir.glob("*.csv")):
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        columns = rows[0].keys() if rows else []
        curves[path.stem] = {
            c: [float(r[c]) if r[c] not in ("", None) else float("nan") for r in rows] for c in columns
        }
    return curves


def _series(curves: dict[str, dict[str, list[float]]], stem: str, column: str):
    table = curves.get(stem, {})
    names = [c for c in table if c.startswith(column[:-1])] if column.endswith("*") else [column]
    for name in names:
        if name in table:
            label = name.split("/", 1)[1] if "/" in name else f"{stem} {name}".replace("_", " ")
            yield label, table["step"], table[name]


def draw(curves: dict[str, dict[str, list[float]]], panels: list[PANEL], path: Path, title: str) -> Path | None:
    """One figure, one panel per quantity; None when no panel has data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = []
    for panel in panels:
        series = [s for spec in panel[1] for s in _series(curves, *spec)]
        if series:
            drawn.append((panel, series))
    if not drawn:
        return None
    fig, axes = plt.subplots(1, len(drawn), figsize=(4.2 * len(drawn), 3.2), squeeze=False, dpi=90)
    for ax, ((panel_title, _, log), series) in zip(axes[0], drawn):
        for label, steps, values in series:
            ax.plot(steps, values, label=label, marker="o" if len(steps) < 8 else None, markersize=3)
        if log and all(v > 0 for _, _, values in series for v in values if v == v):
            ax.set_yscale("log")
        ax.set_title(panel_title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def pretrain_figures(plots_dir: Path, out_dir: Path, run_title: str) -> list[Path]:
    """The pretrain stage's figures from its CSV curves, into ``out_dir``."""
    curves = read_curves(plots_dir)
    return [
        p
        for name, panels in PRETRAIN_FIGURES.items()
        if (p := draw(curves, panels, out_dir / name, run_title)) is not None
    ]
