"""The ablate stage's figures (PNG, matplotlib Agg, open offline), one per family and two beside:

xiong.png         loss curves per (block, warmup) at each LR; final loss per variant and LR, seeds as dots
depth_probe.png   last-layer gradient norm at init vs depth, Pre-LN vs Post-LN; per-layer norms at the deepest
precision.png     loss curves per format; per layer the share of activation gradients below fp16's range
overflow.png      loss spiked vs clean for each format, the spike's window shaded
beta2.png         update RMS per β₂; loss with the detector's flags; natural spikes per 1,000 steps
wortsman.png      final loss vs LR per stabilizer (the LR-sensitivity curve of Wortsman et al. 2023)
trajectories.png  wortsman family: largest attention logit, output log Z, lowest attention entropy

Curves are the mean over seeds as a line and the seeds' min..max as a band. Every loss axis shows the
unigram baseline and the plateau threshold below it: a run above the threshold has learned no more
than unigram statistics and tests nothing (tasks/design/preregistration.yaml: plateau_margin).
Drawn on matplotlib's Figure directly (no pyplot state), so figures can be drawn from any thread.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.figure import Figure, FigureBase

from tasks.config import Config
from tasks.design.curves import trailing_mean
from tasks.design.families import DeclaredFamily, Gate, shown, variant_name
from tasks.design.stats import capped_loss, derived
from tasks.design.studies import builtin_families, builtin_names

Arm = dict[str, Any]
Trace = list[tuple[int, float | None]]
"""One arm's (step, value) pairs of one quantity; None where it was not finite."""

BLOCKS = {"pre_ln": "Pre-LN", "post_ln": "Post-LN"}
UNDERFLOW = "act_grad_below_subnormal"
"""The range probe's quantity (model/probes.py): the share of nonzero activation gradients below 2^-24."""
DPI = 90


@dataclasses.dataclass(frozen=True)
class LossAxes:
    """What every loss axis shows besides its curves, and how its curves are smoothed."""

    unigram: float | None
    plateau_margin: float
    smooth: int

    def finish(self, ax: Axes, arms: Sequence[Arm], ylabel: str = "training loss (nats)") -> None:
        """The unigram baseline, the plateau threshold, the label, and a top at the loss at init
        (a diverging run would stretch the axis to its blow-up)."""
        if self.unigram is not None:
            ax.axhline(self.unigram, color="k", lw=1, label=f"unigram baseline {self.unigram:.2f}")
            ax.axhline(self.unigram - self.plateau_margin, color="k", ls=":", lw=1, label="plateau threshold")
        init = _init_loss(arms)
        if init is not None:
            ax.set_ylim(top=min(init * 1.05, ax.get_ylim()[1]))
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)


def family_figures(
    cfg: Config,
    arms: Sequence[Arm],
    depth_probe: dict[str, Any] | None,
    unigram: float | None,
    out: Path,
    *,
    plateau_margin: float,
    underflow_threshold: float,
    declared: Sequence[DeclaredFamily] = (),
) -> list[Path]:
    """Every figure whose family has arms (the depth probe's: whose probe ran) into ``out``, the PNGs
    already there removed first, and one per declared family (studies.yaml); returns the paths
    written. ``plateau_margin`` and ``underflow_threshold`` are the pre-registered design's
    (plateau_margin, and the gate of findings.fp16's claim unscaled)."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.png"):
        stale.unlink()
    loss = LossAxes(unigram, plateau_margin, cfg.recovery.smooth_steps)
    family = {name: [arm for arm in arms if arm["family"] == name] for name in builtin_names()}
    gated = {f.name: f for f in builtin_families(cfg)}  # each figure draws its family's gates too
    figures: list[tuple[str, Any, Callable[[Path], Path]]] = [
        ("xiong", family["xiong"], partial(xiong_figure, family["xiong"], loss, family=gated.get("xiong"))),
        ("depth_probe", depth_probe, partial(depth_probe_figure, depth_probe or {})),  # drawn only if there is one
        (
            "precision",
            family["precision"],
            partial(precision_figure, family["precision"], loss, underflow_threshold, family=gated.get("precision")),
        ),
        (
            "overflow",
            family["overflow"],
            partial(overflow_figure, family["overflow"], loss, cfg, family=gated.get("overflow")),
        ),
        ("beta2", family["beta2"], partial(beta2_figure, family["beta2"], loss, family=gated.get("beta2"))),
        (
            "wortsman",
            family["wortsman"],
            partial(wortsman_figure, family["wortsman"], loss, family=gated.get("wortsman")),
        ),
        ("trajectories", family["wortsman"], partial(trajectories_figure, family["wortsman"])),
    ]
    for d in declared:
        members = [arm for arm in arms if arm["family"] == d.name]
        figures.append((d.name, members, partial(declared_figure, d, members, loss)))
    return [draw(out / f"{name}.png") for name, data, draw in figures if data]


# ----------------------------------------------------------------------------------------------
# Shared pieces: grouping, per-step tables, bands, seed dots
# ----------------------------------------------------------------------------------------------


def _groups(arms: Sequence[Arm], *factors: str) -> dict[tuple, list[Arm]]:
    """The arms by their values of ``factors``, in the grid's order (seeds of one point together)."""
    groups: dict[tuple, list[Arm]] = {}
    for arm in arms:
        groups.setdefault(tuple(arm["factors"][f] for f in factors), []).append(arm)
    return groups


def _values(arms: Sequence[Arm], factor: str) -> list[Any]:
    return list(dict.fromkeys(arm["factors"][factor] for arm in arms))


def _init_loss(arms: Sequence[Arm]) -> float | None:
    """The loss at init, ln V, from the arms that ran (a failed arm has no metrics)."""
    return max((arm["metrics"]["init_loss"] for arm in arms if arm["metrics"]), default=None)


def _row_trace(arm: Arm, key: str) -> Trace:
    return [(row["step"], row[key]) for row in arm["rows"]]


def _range_trace(arm: Arm, quantity: str, layer: str) -> Trace:
    return [(r["step"], r["share"]) for r in arm["ranges"] if r["quantity"] == quantity and r["layer"] == layer]


def _layer_trace(arm: Arm, key: str) -> Trace:
    """One trajectory (a per-layer statistic of one layer, or log Z) at the layer-stats steps."""
    return [(t["step"], t.get(key)) for t in arm["trajectories"]]


def _layer_keys(arms: Sequence[Arm], prefix: str) -> list[str]:
    """The trajectory keys under ``prefix`` (one per layer, or the key itself), in layer order."""
    keys = {k for a in arms for t in a["trajectories"] for k in t if k.startswith(prefix)}
    return sorted(keys, key=lambda k: (len(k), k))


def _table(traces: Sequence[Trace]) -> tuple[np.ndarray, np.ndarray]:
    """The steps any trace has, and a traces x steps table of values, NaN where one has none."""
    steps = np.array(sorted({step for trace in traces for step, _ in trace}), dtype=float)
    column = {step: i for i, step in enumerate(steps)}
    table = np.full((len(traces), len(steps)), np.nan)
    for i, trace in enumerate(traces):
        for step, value in trace:
            if value is not None:
                table[i, column[step]] = value
    return steps, table


def _band(ax: Axes, traces: Sequence[Trace], label: str | None, smooth: int = 1, **style: Any) -> None:
    """The mean over ``traces`` as a line and their min..max as a band, each a trailing mean over
    ``smooth`` points, at the steps some trace reached with a finite value (where every arm failed,
    only a legend entry that says so)."""
    steps, table = _table(traces)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # steps where no trace is finite
        mean, low, high = np.nanmean(table, 0), np.nanmin(table, 0), np.nanmax(table, 0)
    finite = np.isfinite(mean)
    if not finite.any():
        ax.plot([], [], label=f"{label}: no finished arm" if label else None, **style)
        return
    mean, low, high = (trailing_mean(curve[finite], smooth) for curve in (mean, low, high))
    seeds = int(np.isfinite(table).any(axis=1).sum())
    (line,) = ax.plot(steps[finite], mean, lw=1.2, label=f"{label} (n={seeds})" if label else None, **style)
    ax.fill_between(steps[finite], low, high, color=line.get_color(), alpha=0.2, lw=0)


def _seed_dots(
    ax: Axes, x: float, arms: Sequence[Arm], value: Callable[[dict], float | None], color: Any, spread: float = 0.04
) -> list[float]:
    """Each arm's ``value`` at ``x``, seeds ``spread`` apart sideways, diverged arms as crosses;
    returns the values drawn (a failed arm, with no metrics, has none)."""
    ran = [(arm, v) for arm in arms if arm["metrics"] and (v := value(arm["metrics"])) is not None]
    for i, (arm, v) in enumerate(ran):
        diverged = arm["metrics"]["diverged"]
        ax.plot(
            x + spread * (i - (len(ran) - 1) / 2),
            v,
            "x" if diverged else "o",
            color=color,
            ms=8 if diverged else 4,
            mew=2 if diverged else 1,
            alpha=0.8,
        )
    return [v for _, v in ran]


def _diverged_key(ax: Axes, label: str = "diverged (its loss counted as ln V)") -> None:
    ax.plot([], [], "kx", ms=8, mew=2, label=label)


def _strip(
    ax: Axes,
    arms: Sequence[Arm],
    cluster: str,
    hue: tuple[str, ...],
    value: Callable[[dict], float | None],
    labels: tuple[Callable[..., str], Callable[[Any], str]],
) -> None:
    """Each arm's ``value`` as a dot, in one cluster along x per value of the ``cluster`` factor and
    a color per point of the ``hue`` factors within it (colors ``C0``, ``C1``... in the grid's order,
    as the curves'); ``labels`` names a hue point and a cluster."""
    clusters, hues = _values(arms, cluster), list(_groups(arms, *hue))
    hue_label, cluster_label = labels
    for (c, *h), members in _groups(arms, cluster, *hue).items():
        i = hues.index(tuple(h))
        _seed_dots(ax, clusters.index(c) + 0.8 * (i + 0.5) / len(hues) - 0.4, members, value, f"C{i}")
    for i, point in enumerate(hues):
        ax.plot([], [], "o", color=f"C{i}", label=hue_label(*point))
    ax.set_xticks(range(len(clusters)), [cluster_label(c) for c in clusters])
    ax.grid(alpha=0.3)


def _save(fig: Figure, path: Path) -> Path:
    if not fig.subfigs:  # a figure of subfigures is laid out as it draws (constrained)
        fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    return path


# ----------------------------------------------------------------------------------------------
# The figures
# ----------------------------------------------------------------------------------------------


def _xiong_label(block: str, warmup: float) -> str:
    return f"{BLOCKS.get(block, block)}, " + (f"warmup {warmup:.0%}" if warmup else "no warmup")


def xiong_figure(arms: Sequence[Arm], loss: LossAxes, path: Path, family: DeclaredFamily | None = None) -> Path:
    """Xiong et al. 2020: loss curves per (block, warmup), one panel per LR; final loss per point."""
    lrs, variants = _values(arms, "lr"), list(_groups(arms, "block", "warmup"))
    fig, own = family_canvas(5 * len(lrs), 8.5, family, arms, loss)
    grid = own.add_gridspec(2, len(lrs))
    for column, lr in enumerate(lrs):
        ax = own.add_subplot(grid[0, column])
        at_lr = [a for a in arms if a["factors"]["lr"] == lr]
        for (block, warmup), members in _groups(at_lr, "block", "warmup").items():
            traces = [_row_trace(a, "loss") for a in members]
            color = f"C{variants.index((block, warmup))}"
            _band(ax, traces, _xiong_label(block, warmup), loss.smooth, color=color)
        ax.set(title=f"(a) training loss at LR {lr:g}", xlabel="step")
        loss.finish(ax, arms)
        ax.legend(fontsize=7, loc="upper right")
    ax = own.add_subplot(grid[1, :])
    _strip(ax, arms, "lr", ("block", "warmup"), capped_loss, (_xiong_label, lambda lr: f"LR {lr:g}"))
    _diverged_key(ax)
    ax.set_title("(b) final validation loss per seed")
    loss.finish(ax, arms, "final validation loss, capped at ln V (nats)")
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, path)


INIT_TITLES = {"xavier": "the paper's init (Xavier, unit-scale embeddings)", "gpt2": "this project's GPT-2 init"}


def depth_probe_figure(probe: dict[str, Any], path: Path) -> Path:
    """Xiong et al.'s Theorem 1 at init: the last block's gradient norm against depth, per block
    layout, under each init the probe ran (tasks/ablate/depth.py: INITS); and per block at the
    deepest depth under the paper's init."""
    inits = [i for i in INIT_TITLES if probe.get(i)]
    fig = Figure(figsize=(5.5 * (len(inits) + 1), 4.2))
    axes = fig.subplots(1, len(inits) + 1)
    deepest = max(probe["depths"])
    for ax, init in zip(axes, inits):
        for i, (block, norms) in enumerate(probe[init]["last_layer"].items()):
            depths = sorted(int(d) for d in norms)
            for d in depths:
                seeds = list(norms[str(d)].values())
                ax.plot([d] * len(seeds), seeds, "o", color=f"C{i}", alpha=0.5, ms=4)
            means = [np.mean(list(norms[str(d)].values())) for d in depths]
            ax.plot(depths, means, "-", color=f"C{i}", label=f"{BLOCKS.get(block, block)} (mean; dots: seeds)")
        ax.set(xscale="log", yscale="log", xlabel="depth (blocks)", ylabel="gradient norm of the last block")
        ax.set_xticks(probe["depths"], [str(d) for d in probe["depths"]])
        ax.set_xticks([], minor=True)
        ax.set_title(f"last block at init: {INIT_TITLES[init]}", fontsize=9)
    per_layer = axes[-1]
    for i, (block, by_depth) in enumerate(probe[inits[0]]["per_layer"].items()):
        layers = by_depth[str(deepest)]
        per_layer.plot(range(len(layers)), layers, "o-", color=f"C{i}", label=BLOCKS.get(block, block))
    per_layer.set(yscale="log", xlabel="block", ylabel="gradient norm (mean over seeds)")
    per_layer.set_title(f"per block at depth {deepest}: {INIT_TITLES[inits[0]]}", fontsize=9)
    for ax in axes:
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    return _save(fig, path)


def precision_figure(
    arms: Sequence[Arm], loss: LossAxes, threshold: float, path: Path, family: DeclaredFamily | None = None
) -> Path:
    """Micikevicius et al. 2017: loss per format; the activation gradients fp16 would flush to zero."""
    fig, own = family_canvas(12, 4.5, family, arms, loss)
    curves, shares = own.subplots(1, 2)
    for (precision,), members in _groups(arms, "precision").items():
        _band(curves, [_row_trace(a, "loss") for a in members], precision, loss.smooth)
    curves.set(title="training loss per format", xlabel="step")
    loss.finish(curves, arms)
    curves.legend(fontsize=7)
    probed = [a for a in arms if a["factors"]["precision"] in ("fp32", "fp16_unscaled")]
    layers = list(dict.fromkeys(r["layer"] for a in probed for r in a["ranges"] if r["quantity"] == UNDERFLOW))
    for (precision,), members in _groups(probed, "precision").items():
        for i, layer in enumerate(layers):
            style: dict[str, Any] = {"color": f"C{i % 10}", "ls": "-" if precision == "fp32" else "--", "marker": "."}
            _band(shares, [_range_trace(a, UNDERFLOW, layer) for a in members], f"{precision} {layer}", **style)
    shares.axhline(threshold, color="r", ls=":", label=f"precondition: {threshold:.0%} in some layer")
    shares.set(yscale="log", xlabel="step", ylabel="share of nonzero values below 2^-24")
    shares.set_title("activation gradients below fp16's smallest subnormal\n(solid: fp32, dashed: fp16 unscaled)")
    shares.grid(alpha=0.3, which="both")
    shares.legend(fontsize=6, ncol=2)
    return _save(fig, path)


def overflow_figure(
    arms: Sequence[Arm], loss: LossAxes, cfg: Config, path: Path, family: DeclaredFamily | None = None
) -> Path:
    """The probe-sized weight excursion per format against its clean twin: the whole run, then every
    step around the injection."""
    a = cfg.ablation
    precisions = _values(arms, "precision")
    fig, own = family_canvas(5.5 * len(precisions), 8, family, arms, loss)
    axes = own.subplots(2, len(precisions), squeeze=False)
    for column, precision in enumerate(precisions):
        members = [arm for arm in arms if arm["factors"]["precision"] == precision]
        for ax, smooth in ((axes[0, column], loss.smooth), (axes[1, column], 1)):
            for (spike,), twins in _groups(members, "spike").items():
                label = "clean" if spike == "none" else "block 0's weights x the probe's multiplier"
                _band(ax, [_row_trace(t, "loss") for t in twins], label, smooth)
            ax.axvline(a.inject_step, color="red", alpha=0.5, label=f"injection, step {a.inject_step}")
            loss.finish(ax, members)
            ax.set_xlabel("step")
        axes[0, column].set_title(f"{precision}: whole run ({loss.smooth}-step trailing mean)")
        axes[1, column].set_title(f"{precision}: around the spike, every step")
        axes[1, column].set_xlim(max(1, a.inject_step - 20), min(a.steps, a.inject_step + 80))
        axes[0, column].legend(fontsize=7)
    return _save(fig, path)


def beta2_figure(arms: Sequence[Arm], loss: LossAxes, path: Path, family: DeclaredFamily | None = None) -> Path:
    """Shazeer & Stern 2018, Wortsman et al. 2023b: update RMS and loss spikes per β₂, per LR multiple."""
    mults = _values(arms, "lr_mult")
    fig, own = family_canvas(5.5 * len(mults), 11, family, arms, loss)
    grid = own.add_gridspec(3, len(mults))
    for column, mult in enumerate(mults):
        at_mult = [a for a in arms if a["factors"]["lr_mult"] == mult]
        _beta2_curves(own.add_subplot(grid[0, column]), own.add_subplot(grid[1, column]), at_mult, loss)
    ax = own.add_subplot(grid[2, :])
    _strip(ax, arms, "lr_mult", ("beta2",), lambda m: m["spikes_per_1k"], (_beta2_label, lambda m: f"LR x{m:g}"))
    _diverged_key(ax, "diverged")
    ax.set(ylabel="spikes per 1,000 steps", title="natural loss spikes after warmup, per seed")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    return _save(fig, path)


def _beta2_label(beta2: float) -> str:
    return f"β₂ {beta2:g}"


def _beta2_curves(rms: Axes, curves: Axes, arms: Sequence[Arm], loss: LossAxes) -> None:
    """At one LR multiple: the update RMS per β₂, and the loss per β₂ with the detector's flags."""
    for i, ((beta2,), members) in enumerate(_groups(arms, "beta2").items()):
        _band(rms, [_row_trace(a, "update_rms") for a in members], _beta2_label(beta2), loss.smooth, color=f"C{i}")
        _band(curves, [_row_trace(a, "loss") for a in members], _beta2_label(beta2), loss.smooth, color=f"C{i}")
        flagged = [r for a in members for r in a["rows"] if r["flagged"] and r["loss"] is not None]
        curves.plot([r["step"] for r in flagged], [r["loss"] for r in flagged], "v", color=f"C{i}", ms=5)
    mult = arms[0]["factors"]["lr_mult"]
    rms.axhline(1, color="k", ls="--", lw=1, label="update RMS 1")
    rms.set(title=f"Adam update RMS, LR x{mult:g}", xlabel="step", ylabel="update RMS")
    rms.grid(alpha=0.3)
    rms.legend(fontsize=7)
    curves.set(title=f"training loss, LR x{mult:g} (▼ the detector's flags)", xlabel="step")
    loss.finish(curves, arms)
    curves.legend(fontsize=7, ncol=2)


def wortsman_figure(arms: Sequence[Arm], loss: LossAxes, path: Path, family: DeclaredFamily | None = None) -> Path:
    """Wortsman et al. 2023: final loss against LR per stabilizer, the LR-sensitivity curve."""
    fig, own = family_canvas(8, 5, family, arms, loss)
    ax = own.subplots()
    for i, ((stabilizer,), members) in enumerate(_groups(arms, "stabilizer").items()):
        lrs, means = [], []
        for (lr,), seeds in _groups(members, "lr").items():
            if values := _seed_dots(ax, lr, seeds, capped_loss, f"C{i}", spread=0):  # a log axis: no spread
                lrs.append(lr)
                means.append(np.mean(values))
        ax.plot(lrs, means, "-", color=f"C{i}", label=f"{stabilizer} (mean; dots: seeds)")
    init = _init_loss(arms)
    if init is not None:
        ax.axhline(init, color="gray", ls="--", lw=1, label=f"loss at init ln V = {init:.2f}")
    _diverged_key(ax)
    ax.set(xscale="log", xlabel="peak learning rate", title="LR sensitivity: final loss vs LR per stabilizer")
    loss.finish(ax, arms, "final validation loss, capped at ln V (nats)")
    ax.legend(fontsize=7)
    return _save(fig, path)


def declared_figure(family: DeclaredFamily, arms: Sequence[Arm], loss: LossAxes, path: Path) -> Path:
    return _save(declared_panels(family, arms, loss), path)


def declared_panels(family: DeclaredFamily, arms: Sequence[Arm], loss: LossAxes) -> Figure:
    """A declared family (studies.yaml): one panel per metric its claims or their gates read
    (:func:`metric_panel`), one above the other."""
    metrics = list(dict.fromkeys([*(c.metric for c in family.claims), *_gate_metrics(family)]))
    fig = Figure(figsize=(8, 4 * len(metrics)))
    for ax, metric in zip(fig.subplots(len(metrics), 1, squeeze=False)[:, 0], metrics):
        metric_panel(ax, family, arms, metric, loss)
    return fig


def metric_panel(ax: Axes, family: DeclaredFamily, arms: Sequence[Arm], metric: str, loss: LossAxes) -> None:
    """One metric of ``family``'s arms: each arm a dot per seed, clustered by the first factor a
    claim reads across (or the family's first factor), one colour per point of the other factors;
    each gate on the metric as dashed lines at its bounds (the verdict rests on it: a gate not met
    leaves its claims not tested), labelled with the claims it gates."""
    cluster = next((c.over for c in family.claims if c.over), None) or next(iter(family.factors))
    hue = tuple(k for k in family.factors if k != cluster)

    def value(m: dict[str, Any]) -> float | None:
        v = derived(m).get(metric)
        return float(v) if v is not None else None

    _strip(ax, arms, cluster, hue, value, (lambda *point: variant_name(dict(zip(hue, point))), shown))
    gates: list[tuple[Gate, list[str]]] = []  # claims sharing one gate share its lines
    for c in family.claims:
        if c.gate is not None and c.gate.metric == metric:
            same = next((names for gate, names in gates if gate == c.gate), None)
            same.append(c.name) if same is not None else gates.append((c.gate, [c.name]))
    claimed = any(c.metric == metric for c in family.claims)
    title = family.question if claimed else f"the gate of {', '.join(n for _, names in gates for n in names)}"
    ax.set(xlabel=cluster, ylabel=metric, title=f"{family.name}: {title}")
    ax.title.set_fontsize(9)
    if metric == "capped_loss":
        loss.finish(ax, arms, "final validation loss, capped at ln V (nats)")
    for gate, claims in gates:
        _gate_lines(ax, ", ".join(claims), gate, loss)
    _diverged_key(ax)
    ax.legend(fontsize=7)


def _gate_metrics(family: DeclaredFamily) -> list[str]:
    return list(dict.fromkeys(c.gate.metric for c in family.claims if c.gate is not None))


def _gate_lines(ax: Axes, claim: str, gate: Gate, loss: LossAxes) -> None:
    """Each bound of ``claim``'s gate as a dashed line (``on_plateau``: the plateau threshold)."""
    where = f" ({variant_name(gate.variant)})" if gate.variant else ""
    for bound, value in gate.bounds:
        if bound != "on_plateau":
            at = value
        elif loss.unigram is not None:
            at = loss.unigram - loss.plateau_margin
        else:
            continue  # no unigram baseline to place it by
        ax.axhline(at, color="firebrick", ls="--", lw=1.2, label=f"gate of {claim}{where}: {gate.needs}")


GATE_ROW_HEIGHT = 4.2
"""Inches of a built-in family's figure given to the row of its gates' panels."""


def family_canvas(
    width: float, height: float, family: DeclaredFamily | None, arms: Sequence[Arm], loss: LossAxes
) -> tuple[Figure, FigureBase]:
    """A built-in family's figure and the part of it its own panels go in: the whole figure, or,
    when the family's claims are gated, the part above a row with a panel per metric a gate reads
    (:func:`metric_panel`, as a declared family's figure draws it), since the verdict rests on them."""
    metrics = _gate_metrics(family) if family else []
    if not metrics:
        fig = Figure(figsize=(width, height))
        return fig, fig
    assert family is not None
    fig = Figure(figsize=(max(width, 6.5 * len(metrics)), height + GATE_ROW_HEIGHT), layout="constrained")
    own, gates = fig.subfigures(2, 1, height_ratios=[height, GATE_ROW_HEIGHT], squeeze=False)[:, 0]
    for ax, metric in zip(gates.subplots(1, len(metrics), squeeze=False)[0], metrics):
        metric_panel(ax, family, arms, metric, loss)
    return fig, own


TRAJECTORIES = (
    ("largest attention logit", "stats/attn_logit_max/", "log"),
    ("output log Z", "stats/logits/log_z", "linear"),
    ("attention entropy, nats", "stats/attn_entropy/", "linear"),
)
"""Each row of trajectories.png: its title, the trajectory key (or per-layer prefix), its y scale
(attention logits grow by orders of magnitude at high LR)."""
LAYER_STYLES = ("-", "--", ":", "-.")
"""Line style per layer (block0 solid, block1 dashed, ...): the colour is the LR."""


def trajectories_figure(arms: Sequence[Arm], path: Path) -> Path:
    """Wortsman et al. 2023's mechanisms over training, per layer: one panel per quantity x
    stabilizer, a colour per LR and a line style per layer (mean over seeds, band: their range)."""
    stabilizers, lrs = _values(arms, "stabilizer"), sorted(_values(arms, "lr"))
    colors = colormaps["viridis"](np.linspace(0, 0.9, len(lrs)))
    fig = Figure(figsize=(4.5 * len(stabilizers), 3.3 * len(TRAJECTORIES)))
    axes = fig.subplots(len(TRAJECTORIES), len(stabilizers), squeeze=False, sharex=True)
    for row, (title, prefix, scale) in enumerate(TRAJECTORIES):
        keys = _layer_keys(arms, prefix)
        for column, stabilizer in enumerate(stabilizers):
            ax = axes[row, column]
            stabilized = [a for a in arms if a["factors"]["stabilizer"] == stabilizer]
            for (lr,), members in _groups(stabilized, "lr").items():
                for layer, key in enumerate(keys):
                    label = f"LR {lr:g}" if layer == 0 else None
                    style = {"color": colors[lrs.index(lr)], "linestyle": LAYER_STYLES[layer % len(LAYER_STYLES)]}
                    _band(ax, [_layer_trace(a, key) for a in members], label, **style)
            layers = f" ({', '.join(k.rsplit('/', 1)[-1] for k in keys)}: {', '.join(LAYER_STYLES[: len(keys)])})"
            ax.set(yscale=scale, title=f"{stabilizer}: {title}" + (layers if len(keys) > 1 else ""))
            ax.title.set_fontsize(8)
            ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    axes[0, -1].legend(fontsize=7)
    return _save(fig, path)
