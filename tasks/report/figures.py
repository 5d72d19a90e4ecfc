"""The report's forest plot (PNG, matplotlib Agg, opens offline): every pre-registered claim's
estimate with its 95 % interval, grouped by finding. Each row is badged by its claim's own outcome
(holds, negligible, not shown, contradicted, not tested), so a claim that holds reads HOLDS inside an
inconclusive finding; the finding's plain name and its verdict head its group.

Claims are in different units (nats, log ratios, spikes per 1,000 steps, log₂ LR per doubling), so
each claim gets its own x-axis, symmetric about 0 so the sign reads at a glance; the rows share
nothing but the layout.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.transforms import Transform, blended_transform_factory

BADGES = {
    "holds": ("#2e7d32", "white"),
    "fragile": ("#ef6c00", "white"),  # held on the full data only
    "reproduced": ("#2e7d32", "white"),
    "contradicted": ("#c62828", "white"),
    "negligible": ("#1565c0", "white"),
    "not shown": ("#f9a825", "black"),
    "inconclusive": ("#f9a825", "black"),
    "not tested": ("#9e9e9e", "white"),
    "check passed": ("#2e7d32", "white"),
    "check failed": ("#c62828", "white"),
    "not run at this size": ("#9e9e9e", "white"),
}
"""Each claim outcome's (and verdict's) badge: box and text colors."""
PREDICTION = {1: "predicted > 0 →", -1: "← predicted < 0"}
CLAIM_IN, HEADER_IN = 0.8, 0.3
"""Heights in inches of a claim's row and of a finding's header row."""
TEXT_X, AXIS_LEFT, AXIS_RIGHT, BADGE_X = 0.01, 0.42, 0.83, 0.85
"""Figure fractions: where the claim text starts, the axes' span, where the badge starts."""


def forest_plot(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """One row per claim (``rows`` in the report's order: finding, claim, estimate, ci95, expected,
    kind, margin, verdict (the finding's), unit, and optionally label (the finding in words) and
    outcome (the claim's own; its badge, else the verdict's)), a bold header where a new finding
    starts, alternate findings on a shaded background; writes ``path``."""
    layout = _layout(rows)
    heights = [HEADER_IN if isinstance(item, str) else CLAIM_IN for item in layout]
    fig = Figure(figsize=(13, sum(heights) + 1.5))
    axes = fig.subplots(len(layout), 1, gridspec_kw={"height_ratios": heights})
    inch = 1 / fig.get_figheight()
    fig.subplots_adjust(left=AXIS_LEFT, right=AXIS_RIGHT, top=1 - 0.75 * inch, bottom=0.45 * inch, hspace=1.2)
    for ax, item in zip(axes, layout):
        if isinstance(item, str):
            ax.axis("off")
            ax.text(TEXT_X, 0.2, item, transform=_left_of(fig, ax), fontsize=10, fontweight="bold")
        else:
            _claim(fig, ax, item)
    _shade_alternate_findings(fig, [ax for ax, item in zip(axes, layout) if isinstance(item, str)])
    fig.suptitle(
        "Pre-registered claims: estimate and 95 % interval, each on its own axis, each badged by its own outcome",
        fontsize=11,
    )
    fig.savefig(path, dpi=100, format="png")  # the report stages it under a temporary name
    return path


def _layout(rows: Sequence[dict[str, Any]]) -> list[str | dict[str, Any]]:
    """The claims, each finding's header (its name in words and its verdict) before its first claim."""
    layout: list[str | dict[str, Any]] = []
    for i, row in enumerate(rows):
        if i == 0 or row["finding"] != rows[i - 1]["finding"]:
            layout.append(f"{row.get('label') or row['finding']} — finding {row['verdict'].upper()}")
        layout.append(row)
    return layout


def _left_of(fig: Figure, ax: Axes) -> Transform:
    """x in figure fractions, y in the axes': text beside an axes, outside it."""
    return blended_transform_factory(fig.transFigure, ax.transAxes)


def _claim(fig: Figure, ax: Axes, row: dict[str, Any]) -> None:
    beside = _left_of(fig, ax)
    ax.text(TEXT_X, 0.5, textwrap.fill(row["claim"], 62), transform=beside, va="center", fontsize=8)
    outcome = row.get("outcome") or row["verdict"]
    face, ink = BADGES[outcome]
    badge = {"boxstyle": "round,pad=0.4", "facecolor": face, "edgecolor": "none"}
    text = f"[{outcome.upper()}]"
    ax.text(BADGE_X, 0.5, text, transform=beside, va="center", fontsize=9, color=ink, fontweight="bold", bbox=badge)
    ax.set_yticks([])
    ax.set_ylim(-1, 1)
    if row["estimate"] is None:
        ax.set_xticks([])
        ax.text(0.5, 0, "no estimate", ha="center", va="center", style="italic", color="0.4")
        return
    _estimate(ax, row)


def _estimate(ax: Axes, row: dict[str, Any]) -> None:
    """The point estimate and its interval on an axis symmetric about 0, the equivalence band or the
    smallest effect of interest the interval must clear (dashed, on the predicted side), and above
    the axis its unit and the prediction."""
    estimate, (lo, hi) = row["estimate"], row["ci95"] or (row["estimate"], row["estimate"])
    margin = row["margin"] if row["kind"] == "equivalence" else None
    sesoi = row.get("sesoi") or 0.0
    reach = 1.25 * max(abs(estimate), abs(lo), abs(hi), margin or 0, sesoi) or 1.0
    ax.set_xlim(-reach, reach)
    ax.axvline(0, color="0.3", lw=1)
    if margin:
        ax.axvspan(-margin, margin, color="#2e7d32", alpha=0.15)
    elif sesoi:
        ax.axvline(row["expected"] * sesoi, color="#2e7d32", lw=1, ls="--")
    prediction = f"equivalent: within ±{margin:g}" if margin else PREDICTION.get(row["expected"], "")
    ax.text(0, 1.04, row["unit"], transform=ax.transAxes, fontsize=7, color="0.3")
    ax.text(1, 1.04, prediction, transform=ax.transAxes, ha="right", fontsize=7, color="0.3")
    ax.errorbar(estimate, 0, xerr=[[estimate - lo], [hi - estimate]], fmt="o", color="k", capsize=4, ms=5)
    ax.tick_params(axis="x", labelsize=7)


def _shade_alternate_findings(fig: Figure, headers: list[Axes]) -> None:
    """A grey band behind every second finding, from its header's top to the next header's."""
    tops = [ax.get_position().y1 for ax in headers] + [0.0]
    for top, bottom in list(zip(tops, tops[1:]))[1::2]:
        fig.add_artist(Rectangle((0, bottom), 1, top - bottom, transform=fig.transFigure, color="0.93", zorder=-1))
