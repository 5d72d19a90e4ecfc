"""The statistics of the study: per variant the mean, SD and 95 % interval of each figure over
seeds; comparisons of two arms paired by seed, with the smallest difference they could detect;
equivalence tests (TOST) for "no effect" claims; divergence as a paired rate; LR sensitivity
(Wortsman et al. 2023). Tests, intervals and distributions are scipy's.

Arms that share a seed share init, data order and validation batches, so two arms are compared
through their per-seed differences, whose SD in this project's earlier study was 0.002-0.012 nats
against a between-seed SD of 0.03-0.04: an unpaired test on a few seeds misses what the paired one finds.

A diverged or non-finite run is a result, never dropped: its loss counts as the loss at
initialisation, ln(vocab), the ``min(loss, loss at init)`` cap Wortsman et al. put on every loss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from scipy import integrate, optimize, special, stats

from tasks.design.families import FIGURES

if TYPE_CHECKING:
    from _typeshed import SupportsRichComparison

Unit = TypeVar("Unit", bound="SupportsRichComparison")
"""A pairing unit: a seed, or a tuple (seed, free factors...); sortable, so pairs list in order."""

ALPHA = 0.05
"""Significance level of every test (two-sided); p equal to it is not significant."""

POWER = 0.8
"""Power at which the minimum detectable difference is given."""


def capped_loss(m: dict[str, Any]) -> float:
    """Final validation loss, capped at the loss at init; a diverged or non-finite run gets the cap."""
    loss: float | None = m.get("val_loss")
    cap: float = m["init_loss"]
    if m.get("diverged") or loss is None or not math.isfinite(loss):
        return cap
    return min(loss, cap)


def derived(m: dict[str, Any]) -> dict[str, Any]:
    """The arm's recorded figures with those read off them: the capped loss, divergence from the raw
    loss (version 3), and log Z's drift from its start."""
    if not m:
        return {}
    return {**m, "capped_loss": capped_loss(m), "diverged": failed_to_train(m), "log_z_drift": log_z_drift(m)}


def failed_to_train(m: dict[str, Any]) -> bool:
    """Diverged by the trainer's rule, non-finite, or a final validation loss above the loss at
    initialisation (ln V): an arm that ends worse than guessing uniformly did not train, whether or
    not a loss spike tripped the trainer (version 2 left fp16's unscaled arms at a raw 14.5-15.4
    nats, ln V 6.93, counted as trained; the cap hid them)."""
    loss = m.get("val_loss")
    return bool(m.get("diverged")) or loss is None or not math.isfinite(loss) or loss > m["init_loss"]


def log_z_drift(m: dict[str, Any]) -> float | None:
    """How far the output's mean log Z moved from the loss at initialisation (ln V, where near-zero
    logits put it), at its extremes over training: the output-logit divergence z-loss exists to
    stop (Wortsman et al. 2023). An arm that recorded only the maximum reads the upward drift."""
    ends = [m.get(k) for k in ("log_z_max", "log_z_min")]
    drifts = [abs(v - m["init_loss"]) for v in ends if v is not None and math.isfinite(v)]
    return max(drifts) if drifts else None


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
    """Per ``family/variant``: its factors, seeds, statuses and every FIGURES entry described over seeds."""
    table: dict[str, dict[str, Any]] = {}
    for arm in arms:
        entry = table.setdefault(
            f"{arm['family']}/{arm['variant']}",
            {"family": arm["family"], "factors": arm["factors"], "seeds": [], "status": [], "_m": []},
        )
        entry["seeds"].append(arm["seed"])
        entry["status"].append(arm["status"])
        entry["_m"].append(derived(arm.get("metrics") or {}))
    for entry in table.values():
        ms = [m for m in entry.pop("_m") if m]
        entry["diverged"] = sum(1 for m in ms if m["diverged"])
        entry["figures"] = {f: describe([m.get(f) for m in ms]) for f in FIGURES}
    return table


def mde_paired(n: int, sd: float, alpha: float = ALPHA, power: float = POWER) -> float | None:
    """Smallest true mean difference a two-sided paired t-test on ``n`` pairs whose differences have
    SD ``sd`` detects with probability ``power``; None below 2 pairs (no degrees of freedom)."""
    if n < 2:
        return None
    df, crit = n - 1, stats.t.ppf(1 - alpha / 2, n - 1)

    def power_minus_target(nc: float) -> float:
        # P(T < -crit | nc) as P(T > crit | -nc): scipy's nct.cdf returns nan far in the lower tail.
        return stats.nct.sf(crit, df, nc) + stats.nct.sf(crit, df, -nc) - power

    high = 10.0
    while power_minus_target(high) < 0:
        high *= 2
    return float(optimize.brentq(power_minus_target, 0.0, high) * sd / math.sqrt(n))


def paired(a: dict[Unit, float], b: dict[Unit, float]) -> dict[str, Any]:
    """Arm ``a`` against arm ``b`` over the units both ran (the seed: tasks/design/preregistration.yaml,
    ``method``): the per-unit differences a - b, their mean, SD, dz (mean / SD), the t-interval of the
    mean difference, the paired t-test's two-sided p and the smallest mean difference that test
    detects at ``POWER``: one test, so the estimate, its interval, p and the MDE describe one number.
    Where no test can run, ``test`` says why and p is None."""
    seeds = sorted(a.keys() & b.keys())
    diffs = [a[s] - b[s] for s in seeds]
    with np.errstate(invalid="ignore"):
        mean = float(np.mean(diffs)) if diffs else math.nan  # inf with one infinite side, nan with both
    out: dict[str, Any] = {
        "test": None,
        "n": len(seeds),
        "seeds": seeds,
        "missing": {"a": sorted(b.keys() - a.keys()), "b": sorted(a.keys() - b.keys())},
        "diffs": diffs,
        "mean_diff": None if math.isnan(mean) else mean,
        "estimate": None if math.isnan(mean) else mean,
        "sd_diff": None,
        "dz": None,
        "ci95": None,
        "ci95_method": None,
        "p": None,
        "mde": None,
    }
    nonfinite = [f"{side} at seed {s}" for s in seeds for side, x in (("a", a), ("b", b)) if not math.isfinite(x[s])]
    if nonfinite:
        out["test"] = "untested: a non-finite value (" + ", ".join(nonfinite) + ")"
        return out
    if len(seeds) < 2:
        out["test"] = "untested: fewer than 2 seeds in both arms"
        return out
    out["sd_diff"] = float(np.std(diffs, ddof=1))
    # Differences equal up to the rounding of a - b have no spread: a t-test would call them p ~ 1e-47.
    rounding = 4 * np.finfo(float).eps * max(abs(x[s]) for s in seeds for x in (a, b))
    if np.ptp(diffs) <= rounding:
        no_difference = all(d == 0 for d in diffs)
        out["test"] = "untested: " + (
            "no difference in any seed" if no_difference else "no spread in the per-seed differences"
        )
        out["sd_diff"] = 0.0
        return out
    out.update(_paired_test(diffs))
    return out


def _paired_test(diffs: list[float]) -> dict[str, Any]:
    n, mean, sd = len(diffs), float(np.mean(diffs)), float(np.std(diffs, ddof=1))
    result = stats.ttest_1samp(diffs, 0.0)  # = ttest_rel(a, b) on the same pairs
    return {
        "test": "paired t-test",
        "p": float(result.pvalue),
        "ci95": [float(x) for x in stats.t.interval(1 - ALPHA, n - 1, loc=mean, scale=sd / math.sqrt(n))],
        "ci95_method": "t-interval of the mean difference",
        "dz": mean / sd,
        "mde": mde_paired(n, sd),
    }


def seed_means(values: dict[Unit, float]) -> dict[tuple[Any, ...], float]:
    """Per seed, the mean over the other factors of its units (``(seed, lr, ...)`` keys): the seed
    is the unit of analysis, so a family crossing an LR grid is aggregated within each seed before
    any test (two LRs of one seed share its initialisation and data order: not independent)."""
    by_seed: dict[Any, list[float]] = {}
    for unit, value in values.items():
        seed = unit[0] if isinstance(unit, tuple) else unit
        by_seed.setdefault(seed, []).append(value)
    with np.errstate(invalid="ignore"):
        return {(seed,): float(np.mean(v)) for seed, v in sorted(by_seed.items())}


def tost_paired(diffs: Sequence[float], margin: float, alpha: float = ALPHA) -> dict[str, Any]:
    """Equivalence of the mean paired difference to 0 within ±``margin`` (two one-sided t-tests): p is
    the larger one-sided p, equivalent when p < alpha, i.e. when the (1 - 2 alpha) interval lies
    inside ±margin. The margin is fixed before the data are seen."""
    _require_positive(margin)
    d = np.asarray(diffs, dtype=float)
    if len(d) < 2:
        return _untested_tost("fewer than 2 pairs", len(d), margin)
    if not np.isfinite(d).all():
        return _untested_tost("a non-finite difference", len(d), margin)
    if np.ptp(d) == 0:
        return _untested_tost("no spread in the per-seed differences", len(d), margin, estimate=float(d[0]))
    return _tost("paired TOST", len(d), float(d.mean()), float(stats.sem(d)), len(d) - 1, margin, alpha)


def tost_power(n: int, sd: float, margin: float, delta: float = 0.0, alpha: float = ALPHA) -> float | None:
    """Power of :func:`tost_paired` on ``n`` pairs whose differences have SD ``sd`` and true mean
    ``delta``: the probability that the (1 - 2 alpha) t-interval lies inside ±``margin``. Exact
    (Owen 1965): given the sample SD s, the mean must fall in ±(margin - t s/√n), so the power is that
    normal probability integrated over s's scaled chi distribution; None below 2 pairs. An equivalence
    claim's power is this, not the direction test's MDE rule (version 2 used that rule, which asks
    several times the seeds: 128 against 36 at SD 1 and margin 0.5)."""
    _require_positive(margin)
    if n < 2:
        return None
    if sd == 0:
        return float(abs(delta) < margin)
    df, crit, se = n - 1, float(special.stdtrit(n - 1, 1 - alpha)), sd / math.sqrt(n)
    # u = s^2 df / sd^2 ~ chi2(df); the interval fits inside the margins only while crit * s/√n < margin.
    # Integrated over u's quantile q, so the integrand has no narrow peak at large df. The integrand
    # calls the special functions scipy.stats' t, chi2 and norm compute with (stdtrit, chdtr,
    # gammaincinv, ndtr), the same numbers without a distribution object's overhead per call: quad
    # evaluates it hundreds of times, and a report bisects this for every equivalence claim.
    q_max = float(special.chdtr(df, df * (margin / (crit * se)) ** 2))

    def inside(q: float) -> float:
        half = margin - crit * se * math.sqrt(2.0 * float(special.gammaincinv(df / 2.0, q)) / df)
        return max(0.0, float(special.ndtr((half - delta) / se) - special.ndtr((-half - delta) / se)))

    power, _ = integrate.quad(inside, 0.0, q_max, limit=200)
    return float(min(max(power, 0.0), 1.0))


def seeds_for_tost_power(sd: float, margin: float, power: float = POWER, most: int = 100_000) -> int | None:
    """The fewest pairs at which :func:`tost_power` (no true difference) reaches ``power``; None when
    not within ``most`` (bisection: power grows with n)."""
    if (tost_power(most, sd, margin) or 0.0) < power:
        return None
    low, high = 1, most  # power(low) < target <= power(high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if (tost_power(mid, sd, margin) or 0.0) < power else (low, mid)
    return high


def _require_positive(margin: float) -> None:
    if not margin > 0:
        raise ValueError(f"an equivalence margin must be positive, got {margin}")


def _tost(test: str, n: int, estimate: float, se: float, df: int, margin: float, alpha: float) -> dict[str, Any]:
    p_lower = float(stats.t.sf((estimate + margin) / se, df))  # H0: effect <= -margin
    p_upper = float(stats.t.cdf((estimate - margin) / se, df))  # H0: effect >= +margin
    return {
        "test": test,
        "n": n,
        "estimate": estimate,
        "margin": margin,
        "ci90": [float(v) for v in stats.t.interval(1 - 2 * alpha, df, loc=estimate, scale=se)],
        "p_lower": p_lower,
        "p_upper": p_upper,
        "p": max(p_lower, p_upper),
        "equivalent": max(p_lower, p_upper) < alpha,
    }


def _untested_tost(reason: str, n: int, margin: float, estimate: float | None = None) -> dict[str, Any]:
    return {
        "test": f"untested: {reason}",
        "n": n,
        "estimate": estimate,
        "margin": margin,
        "ci90": None,
        "p_lower": None,
        "p_upper": None,
        "p": None,
        "equivalent": False,
    }


def divergence_rates(a: dict[Unit, bool], b: dict[Unit, bool]) -> dict[str, Any]:
    """Divergence of arm ``a`` against arm ``b`` over the seeds both ran, as a rate (kept apart from
    the loss): events and rate per arm, the risk difference, and the exact McNemar test, a binomial
    test of the pairs where one arm diverged and the other did not. With k such pairs its smallest p
    is 2^(1-k): 3 seeds can never reach 0.05."""
    seeds = sorted(a.keys() & b.keys())
    n = len(seeds)
    events = [sum(bool(x[s]) for s in seeds) for x in (a, b)]
    only_a = sum(bool(a[s]) and not b[s] for s in seeds)
    only_b = sum(bool(b[s]) and not a[s] for s in seeds)
    out: dict[str, Any] = {
        "test": "exact McNemar",
        "n": n,
        "seeds": seeds,
        "missing": {"a": sorted(b.keys() - a.keys()), "b": sorted(a.keys() - b.keys())},
        "events": events,
        "rates": [e / n for e in events] if n else None,
        "risk_difference": (events[0] - events[1]) / n if n else None,
        "discordant": [only_a, only_b],
        "p": None,
    }
    if only_a + only_b == 0:
        out["test"] = "untested: no discordant pairs (in every seed both arms diverged or neither did)"
    else:
        out["p"] = float(stats.binomtest(only_a, only_a + only_b, 0.5).pvalue)
    return out


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (Holm 1979), in the order given: the i-th smallest p times
    (m - i + 1), made monotone by a running maximum and capped at 1. Rejecting where the adjusted p
    is below alpha keeps the family-wise error rate at alpha under any dependence between the
    tests; with one p it is that p."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted = [0.0] * len(p_values)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def lr_sensitivity(final_losses: dict[float, float], init_loss: float) -> float:
    """Wortsman et al. 2023 (§3.1): E over the LR grid of ``min(loss(η), loss at init) − ℓ*``,
    ℓ* the best capped loss on the grid; the expectation is the mean over the grid points
    (log-spaced), a diverged run's loss being the loss at init."""
    capped = [min(v, init_loss) if v is not None and math.isfinite(v) else init_loss for v in final_losses.values()]
    return float(np.mean(capped) - min(capped))
