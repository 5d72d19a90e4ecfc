"""What the LR search found, from its trials: the optimum per width (a parabola in log2 LR through
the best grid point and its grid neighbours), its spread over seeds, the slope of log2 η* against
log2 width per parametrization, and the transfer check. Plain numpy/scipy over plain records.

A point is ``(log2_lr, seed, value, status, flops)``; only ``completed`` points enter the fits
(pruned ones have no final loss, diverged ones the loss of a uniform guess). An optimum is
CENSORED (version 4, issue 59), a bound and not a point, when the best completed LR is at the
grid's end or next to a grid LR the pruner stopped: a stopped trial was losing at the step it was
stopped, not at the end, so the optimum may lie at or past it. A diverged neighbour brackets the
optimum (it is known worse), though no parabola runs through it. Version 3 read a best point next
to a stopped one as inside the grid and fitted its parabola across the gap; 3 of its 12 SP optima
were such bounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats


@dataclass(frozen=True)
class Point:
    log2_lr: float
    seed: int
    value: float | None  # final validation loss; None when pruned
    status: str  # completed | diverged | pruned
    flops: float

    @property
    def completed_value(self) -> float:
        """The final validation loss of a completed point, which always has one."""
        assert self.status == "completed" and self.value is not None, f"a {self.status} point read as completed"
        return self.value


@dataclass(frozen=True)
class Optimum:
    log2_lr: float  # vertex of the parabola, or the best grid point where no parabola is fitted
    loss: float  # the parabola's value there (or the best grid loss)
    censored: str | None = None  # why the optimum is a bound, not a point (:func:`censoring`); None: a point


GRID_TOL = 1e-9
"""Two log2 LRs closer than this are the same grid point."""

AT_GRID_END, NEXT_TO_STOPPED = "at the grid's end", "next to an LR the pruner stopped"


def censoring(best: float, grid: Sequence[float], completed: Sequence[float], diverged: Sequence[float]) -> str | None:
    """Why the optimum at grid LR ``best`` is a bound: AT_GRID_END when it is the grid's smallest or
    largest LR, NEXT_TO_STOPPED when a grid neighbour neither completed nor diverged; None when both
    neighbours ran to the end or diverged."""
    swept = sorted(grid)
    i = min(range(len(swept)), key=lambda k: abs(swept[k] - best))
    if i in (0, len(swept) - 1):
        return AT_GRID_END
    ran = [*completed, *diverged]
    if any(all(abs(n - x) > GRID_TOL for x in ran) for n in (swept[i - 1], swept[i + 1])):
        return NEXT_TO_STOPPED
    return None


def fit_optimum(
    log2_lrs: Sequence[float],
    losses: Sequence[float],
    grid: Sequence[float] | None = None,
    diverged: Sequence[float] = (),
) -> Optimum:
    """The optimum of one seed from its completed points (``log2_lrs``, ``losses``): the vertex of
    the parabola through the best point and its two grid neighbours when both completed and the
    three curve upwards, else the best point. ``grid``: every LR swept (default: the completed and
    ``diverged`` ones); a censored optimum (:func:`censoring`) is the best point, as a bound."""
    order = np.argsort(log2_lrs)
    x, y = np.asarray(log2_lrs, float)[order], np.asarray(losses, float)[order]
    best = int(np.argmin(y))
    swept = list(grid) if grid is not None and len(grid) else [*x, *diverged]
    why = censoring(float(x[best]), swept, list(x), list(diverged))
    point = Optimum(float(x[best]), float(y[best]), why)
    if why is not None or best in (0, len(x) - 1) or not _grid_neighbours(x, best, swept):
        return point
    a, b, c = np.polyfit(x[best - 1 : best + 2], y[best - 1 : best + 2], 2)
    if a <= 0:
        return point
    return Optimum(float(-b / (2 * a)), float(c - b * b / (4 * a)))


def _grid_neighbours(x: np.ndarray, best: int, grid: Sequence[float]) -> bool:
    """Whether the completed points either side of ``x[best]`` are its grid neighbours (no grid LR
    between: a diverged one there brackets the optimum but has no loss to fit)."""
    between = [g for g in grid if x[best - 1] + GRID_TOL < g < x[best + 1] - GRID_TOL]
    return len(between) == 1


def optima_per_seed(points: Sequence[Point], grid: Sequence[float] | None = None) -> dict[int, Optimum]:
    """One optimum per seed, from that seed's completed points (at least one needed), censored
    against ``grid``, the LRs swept (default: every LR of that seed's points, whatever their status)."""
    out = {}
    for seed in sorted({p.seed for p in points}):
        done = [p for p in points if p.seed == seed and p.status == "completed"]
        diverged = [p.log2_lr for p in points if p.seed == seed and p.status == "diverged"]
        swept = grid if grid is not None else [p.log2_lr for p in points if p.seed == seed]
        if done:
            out[seed] = fit_optimum([p.log2_lr for p in done], [p.completed_value for p in done], swept, diverged)
    return out


def spread(values: Sequence[float]) -> float:
    """Sample standard deviation over seeds (0 for one seed)."""
    return float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def width_summary(points: Sequence[Point], grid: Sequence[float] | None = None) -> dict:
    """Optimum (mean over seeds of the fitted log2 η*, bounds included: the LR the search hands on)
    and its spread at one width, and which seeds' optima are censored and why
    (:func:`optima_per_seed`)."""
    optima = optima_per_seed(points, grid)
    lrs = [o.log2_lr for o in optima.values()]
    return {
        "log2_lr_opt": float(np.mean(lrs)) if lrs else None,
        "log2_lr_opt_std": spread(lrs),
        "lr_opt": float(2 ** np.mean(lrs)) if lrs else None,
        "loss_opt": float(np.mean([o.loss for o in optima.values()])) if optima else None,
        "censored": {str(s): o.censored for s, o in optima.items() if o.censored},
        "per_seed": {str(s): o.log2_lr for s, o in optima.items()},
    }


def slope(by_width: dict[int, dict]) -> dict:
    """log2 η* against log2 width: the slope of the seed means and each seed's own slope, with
    their SD over seeds and the standard error of their mean (SD / √seeds): the seed is the unit,
    so the error is the seeds' (the fit through 3 seed-mean points has an error that ignores them).
    The per-seed slopes leave out a seed censored at any width (:func:`censored_seeds`).
    SP is expected near -1 (η* halves per doubling), μP near 0."""
    widths = sorted(w for w, s in by_width.items() if s["log2_lr_opt"] is not None)
    if len(widths) < 2:
        return {"slope": None, "slope_std": None, "slope_sem": None}
    x = np.log2(widths)
    fit = stats.linregress(x, [by_width[w]["log2_lr_opt"] for w in widths])
    seeds = set.intersection(*(set(by_width[w]["per_seed"]) for w in widths)) - censored_seeds(by_width)
    per_seed = [stats.linregress(x, [by_width[w]["per_seed"][s] for w in widths]).slope for s in sorted(seeds)]
    return {
        "slope": float(fit.slope),
        "slope_std": spread(per_seed),
        "slope_sem": spread(per_seed) / np.sqrt(len(per_seed)) if len(per_seed) > 1 else None,
        "slope_per_seed": [float(v) for v in per_seed],
    }


def censored_seeds(by_width: dict[int, dict]) -> set[str]:
    """The seeds whose optimum is censored at some width: a slope through a bound is no slope."""
    return {seed for summary in by_width.values() for seed in summary.get("censored", {})}


def transferred_log2_lr(by_width: dict[int, dict], proxies: Sequence[int]) -> float:
    """μTransfer: the optimum found at the proxy widths, taken as is (mean over proxies of the
    seed-mean optima): under μP it does not move with width, so no extrapolation is needed."""
    return float(np.mean([by_width[w]["log2_lr_opt"] for w in proxies]))


def transfer_check(direct: Sequence[Point], transfer: Sequence[Point], proxy_flops: float, log2_lr: float) -> dict:
    """The transferred LR at the target against the direct sweep there: the loss gap per seed (loss
    at the transferred LR minus the sweep's best completed loss; positive: the transfer did worse),
    its mean and spread, and the compute ratio (FLOPs of the proxy studies over those of the direct
    sweep). The per-seed gaps are what the report's non-inferiority test reads; a seed whose direct
    optimum is censored (its points, pruned ones included) has none: the sweep's true best may lie
    below its best completed loss, which would favour the transfer."""
    summary = width_summary(direct)
    best: dict[int, float] = {}
    for p in direct:
        if p.status == "completed" and str(p.seed) not in summary["censored"]:
            best[p.seed] = min(best.get(p.seed, np.inf), p.completed_value)
    gaps = {p.seed: p.value - best[p.seed] for p in transfer if p.value is not None and p.seed in best}
    direct_opt = summary["log2_lr_opt"]
    direct_flops = sum(p.flops for p in direct)
    return {
        "log2_lr": log2_lr,
        "lr": 2.0**log2_lr,
        "loss": float(np.mean([p.value for p in transfer])) if transfer else None,
        "direct_log2_lr_opt": direct_opt,
        "log2_lr_error": log2_lr - direct_opt if direct_opt is not None else None,
        "direct_best_loss": float(np.mean(list(best.values()))) if best else None,
        "gap_per_seed": {str(seed): float(gap) for seed, gap in sorted(gaps.items())},
        "direct_censored": summary["censored"],
        "loss_gap": float(np.mean(list(gaps.values()))) if gaps else None,
        "loss_gap_std": spread(list(gaps.values())),
        "proxy_flops": proxy_flops,
        "direct_flops": direct_flops,
        "compute_ratio": proxy_flops / direct_flops if direct_flops else None,
    }


def counts(points: Sequence[Point], retried: int) -> dict:
    statuses = [p.status for p in points]
    return {
        "run": len(points),
        "completed": statuses.count("completed"),
        "pruned": statuses.count("pruned"),
        "diverged": statuses.count("diverged"),
        "retried": retried,
    }
