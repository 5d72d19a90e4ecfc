"""The statistics of the study: per variant the mean, SD and 95 % interval of each figure over
seeds; comparisons of two groups with an effect size and a significance test; LR sensitivity
(Wortsman et al. 2023). Tests and intervals are scipy's.

A diverged or non-finite run is a result, never dropped: its loss counts as the loss at
initialisation, ln(vocab), the ``min(loss, loss at init)`` cap Wortsman et al. put on every loss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import stats

ALPHA = 0.05
"""Significance level of every test (two-sided)."""

FIGURES = (
    "final_loss",
    "val_loss",
    "capped_loss",
    "peak_ratio",
    "recovery_steps_censored",
    "natural_spikes",
    "nonfinite_steps",
    "skipped",
    "overflows",
    "attn_logit_max",
    "logits_max",
    "log_z_max",
    "attn_entropy_min",
)
"""Per-arm figures summarised per variant (tasks/ablate/grid.py: arm_metrics, plus the derived ones)."""


def capped_loss(m: dict[str, Any]) -> float:
    """Final validation loss, capped at the loss at init; a diverged or non-finite run gets the cap."""
    loss = m.get("val_loss")
    if m.get("diverged") or loss is None or not math.isfinite(loss):
        return m["init_loss"]
    return min(loss, m["init_loss"])


def recovery_censored(m: dict[str, Any]) -> float | None:
    """Recovery steps, a run that never recovered counted as the steps it had left (a lower bound)."""
    if m.get("recovery_steps") is not None:
        return float(m["recovery_steps"])
    return float(m["censored_at"]) if m.get("censored_at") is not None else None


def derived(m: dict[str, Any]) -> dict[str, Any]:
    if not m:
        return {}
    return {**m, "capped_loss": capped_loss(m), "recovery_steps_censored": recovery_censored(m)}


def describe(values: Sequence[float | None]) -> dict[str, Any]:
    """n, mean, SD (ddof 1) and the t-based 95 % interval of the mean (None where n < 2);
    missing and infinite values are counted apart and left out of the moments."""
    finite = [float(v) for v in values if v is not None and math.isfinite(v)]
    out: dict[str, Any] = {
        "n": len(finite),
        "missing": len(values) - len(finite),
        "mean": float(np.mean(finite)) if finite else None,
        "sd": float(np.std(finite, ddof=1)) if len(finite) > 1 else None,
        "ci95": None,
    }
    if len(finite) > 1:
        sem = stats.sem(finite)
        out["ci95"] = (
            [out["mean"], out["mean"]]
            if sem == 0
            else [float(x) for x in stats.t.interval(1 - ALPHA, len(finite) - 1, loc=out["mean"], scale=sem)]
        )
    return out


def variant_table(arms: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per variant: its factors, seeds, statuses and every FIGURES entry described over seeds."""
    table: dict[str, dict[str, Any]] = {}
    for arm in arms:
        entry = table.setdefault(
            arm["variant"],
            {"factors": arm["factors"], "families": arm["families"], "seeds": [], "status": [], "_m": []},
        )
        entry["seeds"].append(arm["seed"])
        entry["status"].append(arm["status"])
        entry["_m"].append(derived(arm.get("metrics") or {}))
    for entry in table.values():
        ms = [m for m in entry.pop("_m") if m]
        entry["diverged"] = sum(1 for m in ms if m["diverged"])
        entry["figures"] = {f: describe([m.get(f) for m in ms]) for f in FIGURES}
    return table


def compare(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    """Group ``a`` against group ``b``: the mean difference a - b, Hedges' g (pooled SD, small-sample
    corrected), and Welch's t-test (unequal variances), two-sided. With no spread in either group
    (every seed the same value) the test is undefined and p is None, as with an infinite value (a
    spike whose loss never came back finite), which leaves only the sign of the difference."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    with np.errstate(invalid="ignore"):
        diff = float(a.mean() - b.mean())  # inf where one side has an infinite value, nan where both
    out: dict[str, Any] = {
        "test": "Welch t-test",
        "n": [len(a), len(b)],
        "mean_a": float(a.mean()),
        "mean_b": float(b.mean()),
        "diff": None if math.isnan(diff) else diff,
        "hedges_g": None,
        "t": None,
        "p": None,
    }
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        out["test"] = "none (a non-finite value: no t-test)"
        return out
    if len(a) < 2 or len(b) < 2:
        out["test"] = "none (fewer than 2 seeds a side)"
        return out
    if np.ptp(a) == 0 and np.ptp(b) == 0:  # every seed the same value on both sides (e.g. all at the cap)
        out["test"] = "none (no spread between seeds: no t-test)"
        return out
    pooled = math.sqrt(((len(a) - 1) * a.var(ddof=1) + (len(b) - 1) * b.var(ddof=1)) / (len(a) + len(b) - 2))
    correction = 1 - 3 / (4 * (len(a) + len(b)) - 9)
    out["hedges_g"] = diff / pooled * correction
    result = stats.ttest_ind(a, b, equal_var=False)
    out["t"], out["p"] = float(result.statistic), float(result.pvalue)
    return out


def fisher(events_a: int, n_a: int, events_b: int, n_b: int) -> dict[str, Any]:
    """Fisher's exact test of two event counts (diverged runs), two-sided."""
    odds, p = stats.fisher_exact([[events_a, n_a - events_a], [events_b, n_b - events_b]])
    return {
        "test": "Fisher exact",
        "events": [events_a, events_b],
        "n": [n_a, n_b],
        "odds_ratio": float(odds),
        "p": float(p),
    }


def slope_test(x: Sequence[float], y: Sequence[float]) -> dict[str, Any]:
    """Least-squares slope of y on x with its 95 % interval and the t-test of slope = 0 (scipy linregress)."""
    fit = stats.linregress(x, y)
    half = stats.t.ppf(1 - ALPHA / 2, len(x) - 2) * fit.stderr
    return {
        "test": "linear regression, t-test of slope = 0",
        "n": len(x),
        "slope": float(fit.slope),
        "ci95": [float(fit.slope - half), float(fit.slope + half)],
        "p": float(fit.pvalue),
    }


def lr_sensitivity(final_losses: dict[float, float], init_loss: float) -> float:
    """Wortsman et al. 2023 (§3.1): E over the LR grid of ``min(loss(η), loss at init) − ℓ*``,
    ℓ* the best capped loss on the grid; the expectation is the mean over the grid points
    (log-spaced), a diverged run's loss being the loss at init."""
    capped = [min(v, init_loss) if v is not None and math.isfinite(v) else init_loss for v in final_losses.values()]
    return float(np.mean(capped) - min(capped))
