"""Group-sequential seeds (issue #47): a claim's seeds come in registered rounds, its per-seed values
are tested after each round, and seeding stops as soon as the claim is decided, with boundaries
that keep the error rates of the fixed design that tests once at the end.

Rounds are cumulative seed counts (``rounds: [4, 6, 8, 10, 12]``: look after 4 seeds, then 6, ...).
Looking five times at 5 % each would reject a true null far more often than 5 %, so each look tests
at a smaller nominal level, set by Lan-DeMets alpha spending: a spending function f(t) says how much
of a tail's level may be spent by information fraction t = n_k / n_max (f(1) = the whole level).
O'Brien-Fleming spends almost nothing early (a claim stops early only on an overwhelming effect and
the last look keeps nearly the fixed level); Pocock spends evenly (stops earlier, pays at the end).
The z boundary c_k of look k spends exactly f(t_k) - f(t_{k-1}) under the joint normal distribution
of the sequential z statistics (corr(Z_i, Z_j) = sqrt(n_i / n_j), n_i <= n_j), integrated by
scipy's multivariate normal CDF; look k's one-sided nominal level is then 1 - Φ(c_k), and the
t-test's one-sided p is compared with it (the standard small-sample adaptation). With a few seeds
per look that adaptation exceeds the level a little, because t statistics of nested seed sets are
less correlated than z statistics (each look estimates its own SD): by simulation
(tests/test_sequential.py) a one-sided 0.025 becomes 0.026-0.028 with rounds of 3 to 12 seeds,
0.0253 with rounds of 20 to 100. So that joint reading is ``combine: joint``, and the default,
``combine: bonferroni``, tests look k at the spending function's own increment f(t_k) - f(t_{k-1})
as its nominal level: by the union bound the looks together spend at most alpha whatever the
correlation and however few the seeds, at the price of a little power (the increments ignore that
an early crossing makes a later one less likely). An explicit ``nominal`` list of per-look
two-sided levels is the same rule with levels chosen by hand.

One claim's rule at each look mirrors tasks/report/verdict.py (a direction claim with registered
SESOI s >= 0 (at 0 nothing is negligible) and expected sign e; ``alpha`` two-sided, as ALPHA is):
  reproduced    H0: e·δ <= s rejected (one-sided, at the look's direction level): the one-sided
                interval clears +s on the expected side, as a fixed claim's 95 % interval must
  contradicted  H0: e·δ >= -s rejected the other way, at the same level
  negligible    both one-sided tests of |δ| >= s rejected at the look's equivalence level (TOST)
  continue      none of these: add the next round's seeds
  inconclusive  none of these at the last look
The three are disjoint (each needs the mean on its own side of ±s). The direction tests spend
alpha / 2 per tail, as the two-sided fixed test does. The equivalence tests spend their own alpha
per tail (not alpha / 2), because fixed TOST runs each one-sided test at alpha: negligible needs
both rejected, so by intersection-union its level is alpha with no split. Spending alpha per tail
by the same function (exact joint distribution again) is chosen over doubling the direction levels,
which only approximates it (Pocock's first look is the same; O'Brien-Fleming's early looks differ
severalfold, e.g. 6.9e-4 against 2.1e-4 at 4 of 12 seeds); with ``nominal`` levels, the equivalence
level of a look is exactly twice its direction level. Significant is p < level, strictly, as everywhere in the study; a look whose values have no
spread tests nothing (tasks/design/stats.py: paired), so it continues.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from scipy import optimize, stats

from tasks.ablate.config import MIN_FIRST_ROUND
from tasks.design.stats import ALPHA
from tasks.report.verdict import CONTRADICTED, INCONCLUSIVE, NEGLIGIBLE, REPRODUCED

CONTINUE = "continue"
OBRIEN_FLEMING, POCOCK, NOMINAL = "obrien_fleming", "pocock", "nominal"
SPENDINGS = (OBRIEN_FLEMING, POCOCK, NOMINAL)
OUTCOMES = (REPRODUCED, CONTRADICTED, NEGLIGIBLE, INCONCLUSIVE)
"""What a completed sequential test can end in (CONTINUE only while looks remain)."""

_CODES = (CONTINUE, CONTRADICTED, REPRODUCED, NEGLIGIBLE, INCONCLUSIVE)
"""Outcome by integer code in the vectorised looks (0: undecided so far)."""


_KEYS = ("rounds", "spending", "alpha", "nominal", "combine")
JOINT, BONFERRONI = "joint", "bonferroni"
COMBINES = (BONFERRONI, JOINT)
"""How a spending function's looks are combined: its increments as Bonferroni levels (keeps the
level at any n), or exact boundaries under the joint normal law of z statistics (tighter, but
t-tests at a few seeds overshoot it)."""
_MVN_ABSEPS = 1e-7
"""Absolute error of scipy's multivariate normal integral: far below the increments it resolves
(O'Brien-Fleming's second of five equal looks spends about 4e-4 of 0.025; the first look is exact, in 1D)."""


@dataclasses.dataclass(frozen=True)
class SequentialDesign:
    """A registered group-sequential design: cumulative seed counts at each look, the spending
    function (or explicit per-look two-sided levels, ``nominal``), and the two-sided level alpha."""

    rounds: tuple[int, ...]
    spending: str = OBRIEN_FLEMING
    alpha: float = ALPHA
    nominal: tuple[float, ...] | None = None
    combine: str = BONFERRONI

    def __post_init__(self) -> None:
        _check_rounds(self.rounds)
        _check_alpha(self.alpha)
        _check_spending(self.spending, self.nominal, len(self.rounds), self.alpha)
        if self.combine not in COMBINES:
            raise ValueError(f"sequential.combine: unknown {self.combine!r} (known: {', '.join(COMBINES)})")

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> SequentialDesign:
        """The design from a registration's ``sequential:`` section: lists become tuples, a
        ``nominal`` list without ``spending`` means spending ``nominal``; unknown keys are refused."""
        unknown = sorted(set(d) - set(_KEYS))
        if unknown:
            raise ValueError(f"sequential.{unknown[0]}: unknown key (known: {', '.join(_KEYS)})")
        if "rounds" not in d:
            raise ValueError("sequential.rounds: missing (cumulative seed counts at each look)")
        for key in ("rounds", "nominal"):
            if not isinstance(d.get(key, ()), list | tuple):
                raise ValueError(f"sequential.{key}: a list, one entry per look, got {d[key]!r}")
        nominal = d.get("nominal")
        return cls(
            rounds=tuple(d["rounds"]),
            spending=d.get("spending", NOMINAL if nominal is not None else OBRIEN_FLEMING),
            alpha=d.get("alpha", ALPHA),
            nominal=None if nominal is None else tuple(nominal),
            combine=d.get("combine", BONFERRONI),
        )

    @property
    def max_seeds(self) -> int:
        return self.rounds[-1]


def _check_rounds(rounds: tuple[int, ...]) -> None:
    if not isinstance(rounds, tuple) or not rounds:
        raise ValueError(f"sequential.rounds: at least one look is needed, got {rounds!r}")
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in rounds):
        raise ValueError(f"sequential.rounds: seed counts are integers, got {rounds!r}")
    if rounds[0] < MIN_FIRST_ROUND:
        raise ValueError(
            f"sequential.rounds: the first look needs >= {MIN_FIRST_ROUND} seeds (t-test df >= 2), got {rounds[0]}"
        )
    if any(b <= a for a, b in zip(rounds, rounds[1:])):
        raise ValueError(f"sequential.rounds: cumulative seed counts must strictly increase, got {list(rounds)}")


def _check_alpha(alpha: float) -> None:
    if not (isinstance(alpha, int | float) and 0 < alpha < 1):
        raise ValueError(f"sequential.alpha: a level in (0, 1), got {alpha!r}")


def _check_spending(spending: str, nominal: tuple[float, ...] | None, looks: int, alpha: float) -> None:
    if spending not in SPENDINGS:
        raise ValueError(f"sequential.spending: unknown {spending!r} (known: {', '.join(SPENDINGS)})")
    if spending != NOMINAL:
        if nominal is not None:
            raise ValueError(
                f"sequential.nominal: given with spending {spending!r}; nominal levels replace a spending function (spending: {NOMINAL})"
            )
        return
    if nominal is None or len(nominal) != looks:
        raise ValueError(f"sequential.nominal: one two-sided level per look ({looks}), got {nominal!r}")
    if not all(isinstance(x, int | float) and 0 < x < 1 for x in nominal):
        raise ValueError(f"sequential.nominal: each level in (0, 1), got {list(nominal)}")
    if math.fsum(nominal) > alpha * (1 + 1e-12):  # the tolerance forgives the rounding of a decimal split
        raise ValueError(
            f"sequential.nominal: the levels spend {math.fsum(nominal):g} in all, more than alpha {alpha:g}"
        )


# ----------------------------------------------------------------------------------------------
# Boundaries
# ----------------------------------------------------------------------------------------------


def spending_function(name: str, level: float) -> Callable[[float], float]:
    """Lan-DeMets spending of a one-sided ``level`` by information fraction t in (0, 1]; f(1) is
    ``level`` exactly, so a one-look design tests at the fixed level with no rounding."""
    if name == OBRIEN_FLEMING:
        z = float(stats.norm.isf(level / 2))
        return lambda t: level if t >= 1 else 2 * float(stats.norm.sf(z / math.sqrt(t)))
    if name == POCOCK:
        return lambda t: level if t >= 1 else level * math.log1p((math.e - 1) * t)
    raise ValueError(f"sequential.spending: no spending function {name!r} (known: {OBRIEN_FLEMING}, {POCOCK})")


def look_correlation(rounds: Sequence[int]) -> np.ndarray:
    """corr(Z_i, Z_j) = sqrt(n_i / n_j) for n_i <= n_j: the z statistics of nested seed sets."""
    n = np.asarray(rounds, dtype=float)
    return np.asarray(np.sqrt(np.minimum.outer(n, n) / np.maximum.outer(n, n)))


def boundaries(design: SequentialDesign) -> list[float]:
    """Per look, the one-sided nominal level of the direction tests (alpha / 2 spent per tail)."""
    return list(_levels(design, design.alpha / 2))


def equivalence_boundaries(design: SequentialDesign) -> list[float]:
    """Per look, the one-sided nominal level of each equivalence test (alpha spent per tail, as
    fixed TOST tests each side at alpha)."""
    return list(_levels(design, design.alpha))


@functools.lru_cache(maxsize=64)
def _levels(design: SequentialDesign, tail_level: float) -> tuple[float, ...]:
    if design.nominal is not None:
        share = tail_level / design.alpha  # 1/2 or 1: exact, so a look's two levels are exactly 1 : 2
        return tuple(x * share for x in design.nominal)
    spend = spending_function(design.spending, tail_level)
    if design.combine == BONFERRONI:
        spent = [spend(n / design.max_seeds) for n in design.rounds]
        return tuple(b - a for a, b in zip([0.0, *spent], spent))
    later = z_boundaries(design.rounds, spend)[1:]
    # The first look's level is what it spends, not 1 - Φ(Φ^-1(1 - spend)): exact, so a one-look design is the fixed test.
    return (spend(design.rounds[0] / design.max_seeds), *(float(stats.norm.sf(c)) for c in later))


def z_boundaries(rounds: Sequence[int], spend: Callable[[float], float]) -> list[float]:
    """The upper z boundaries c_1..c_K: look k spends f(t_k) - f(t_{k-1}), the probability of first
    crossing at look k under H0, from the joint normal distribution of the looks."""
    fractions = [n / rounds[-1] for n in rounds]
    cs = [float(stats.norm.isf(spend(fractions[0])))]
    for k in range(1, len(rounds)):
        spent, due = spend(fractions[k - 1]), spend(fractions[k])
        corr = look_correlation(rounds[: k + 1])

        def excess(c: float, corr: np.ndarray = corr, due: float = due, spent: float = spent) -> float:
            return first_crossing(cs + [c], corr) - (due - spent)

        # Crossing first at k is at most P(Z_k > c) and at least P(Z_k > c) - spent: c_k lies between.
        low, high = float(stats.norm.isf(due)) - 0.5, float(stats.norm.isf(due - spent)) + 0.5
        cs.append(float(optimize.brentq(excess, low, high, xtol=1e-10)))
    return cs


def first_crossing(cs: Sequence[float], corr: np.ndarray) -> float:
    """P(Z_1 <= c_1, ..., Z_{k-1} <= c_{k-1}, Z_k > c_k) for standard normal looks with ``corr``;
    a fixed generator makes the quasi-Monte Carlo integral a deterministic function of the c's."""
    k = len(cs)
    upper = np.r_[cs[:-1], np.inf]
    lower = np.r_[np.full(k - 1, -np.inf), cs[-1]]
    p = stats.multivariate_normal.cdf(
        upper, cov=corr, lower_limit=lower, abseps=_MVN_ABSEPS, rng=np.random.default_rng(0)
    )
    return float(p)


# ----------------------------------------------------------------------------------------------
# Decisions
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One claim's sequential result: the outcome, the look that decided it (0-based; for inconclusive
    the last look, for continue the last look made, None before the first), the seeds it used, and
    the one-sided nominal level of the boundary it crossed (None where none was)."""

    outcome: str
    look: int | None
    seeds: int
    boundary: float | None
    share: float = 1.0
    """The share of the design's α the claim was walked at: Holm's 1/r among the r claims of its
    finding not yet decided (tasks/report/declared.py: holm_walks); 1 for a lone claim."""


def shared(design: SequentialDesign, share: float) -> SequentialDesign:
    """The design at ``share`` of its α: the spending function re-drawn at α x share (nominal levels
    scaled alike), so the looks of a claim given Holm's share spend exactly that share."""
    if not 0 < share <= 1:
        raise ValueError(f"a share of alpha is in (0, 1], got {share!r}")
    if share == 1:
        return design
    nominal = None if design.nominal is None else tuple(x * share for x in design.nominal)
    return dataclasses.replace(design, alpha=design.alpha * share, nominal=nominal)


def run_sequential(
    values: Sequence[float],
    design: SequentialDesign,
    sesoi: float,
    expected: int,
    share: float = 1.0,
    equivalence_share: float = 1.0,
) -> Outcome:
    """Walk the looks over the first rounds[k] per-seed values and stop at the first decision;
    values that do not yet fill the next round leave the claim at CONTINUE. The direction
    boundaries spend ``share`` of α, the equivalence ones ``equivalence_share`` (Holm's shares:
    tasks/report/declared.py: holm_walks)."""
    x = _checked_values(values, sesoi, expected)
    if len(x) > design.max_seeds:
        raise ValueError(f"{len(x)} per-seed values, more than the design's last round ({design.max_seeds})")
    direction, equivalence = (
        boundaries(shared(design, share)),
        equivalence_boundaries(shared(design, equivalence_share)),
    )
    look: int | None = None
    for k, n in enumerate(design.rounds):
        if n > len(x):
            return Outcome(CONTINUE, look, 0 if look is None else design.rounds[look], None, share)
        look = k
        code = int(_decide(x[None, :n], sesoi, expected, direction[k], equivalence[k])[0])
        if code:
            crossed = equivalence[k] if _CODES[code] == NEGLIGIBLE else direction[k]
            return Outcome(_CODES[code], k, n, crossed, share)
    return Outcome(INCONCLUSIVE, look, design.max_seeds, None, share)


def fixed_decision(values: Sequence[float], sesoi: float, expected: int, alpha: float = ALPHA) -> Outcome:
    """The fixed design on equal terms: one look at len(values), direction tests at alpha / 2 per
    tail (the two-sided alpha test), equivalence tests at alpha (TOST)."""
    x = _checked_values(values, sesoi, expected)
    if len(x) < 2:
        raise ValueError(f"a t-test needs at least 2 per-seed values, got {len(x)}")
    code = int(_decide(x[None, :], sesoi, expected, alpha / 2, alpha)[0])
    if not code:
        return Outcome(INCONCLUSIVE, 0, len(x), None)
    return Outcome(_CODES[code], 0, len(x), alpha if _CODES[code] == NEGLIGIBLE else alpha / 2)


def _checked_values(values: Sequence[float], sesoi: float, expected: int) -> np.ndarray:
    if not (sesoi >= 0 and math.isfinite(sesoi)):
        raise ValueError(f"a direction claim's SESOI is >= 0 and finite, got {sesoi!r}")
    if expected not in (1, -1):
        raise ValueError(f"a direction claim expects +1 or -1, got {expected!r}")
    x = np.asarray(values, dtype=float)
    if x.ndim != 1 or not np.isfinite(x).all():
        raise ValueError("per-seed values are one finite number per seed (a diverged arm is capped: stats.capped_loss)")
    return x


def _decide(x: np.ndarray, sesoi: float, expected: int, direction: float, equivalence: float) -> np.ndarray:
    """Each row's code at one look (0 undecided; _CODES), rows being independent sets of per-seed
    values: a one-sided p below a level is the one-sided (1 - 2 level) t-interval clearing the bound,
    strictly, as verdict.py's ``_clears``."""
    n = x.shape[1]
    toward = expected * x.mean(axis=1)
    se = x.std(axis=1, ddof=1) / math.sqrt(n)
    tested = se > 0
    reach = float(stats.t.isf(direction, n - 1)) * se
    margin = float(stats.t.isf(equivalence, n - 1)) * se
    reproduced = tested & (toward - reach > sesoi)  # H0: e·δ <= s rejected
    contradicted = tested & (toward + reach < -sesoi)  # H0: e·δ >= -s rejected
    negligible = tested & (toward - margin > -sesoi) & (toward + margin < sesoi)  # both of |δ| >= s rejected
    return np.select([contradicted, reproduced, negligible], [1, 2, 3], default=0)


# ----------------------------------------------------------------------------------------------
# Simulation
# ----------------------------------------------------------------------------------------------


def simulate(
    design: SequentialDesign,
    effect_over_sd: float,
    sesoi_over_sd: float,
    expected: int,
    n_sims: int,
    rng: np.random.Generator,
) -> dict[str, float]:
    """Operating characteristics by simulation: each simulated claim draws all n_max per-seed values
    at once, normal with mean ``effect_over_sd`` (signed, δ) and SD 1, and walks the looks as
    run_sequential does. Returns each outcome's rate and the mean seeds used."""
    if n_sims < 1:
        raise ValueError(f"n_sims is at least 1, got {n_sims}")
    _checked_values([], sesoi_over_sd, expected)
    draws = rng.standard_normal((n_sims, design.max_seeds)) + effect_over_sd
    direction, equivalence = boundaries(design), equivalence_boundaries(design)
    codes = np.zeros(n_sims, dtype=int)
    seeds = np.full(n_sims, design.max_seeds)
    for k, n in enumerate(design.rounds):
        open_ = np.flatnonzero(codes == 0)
        decided = _decide(draws[open_, :n], sesoi_over_sd, expected, direction[k], equivalence[k])
        codes[open_] = decided
        seeds[open_[decided > 0]] = n
    codes[codes == 0] = _CODES.index(INCONCLUSIVE)
    rates = {name: float(np.mean(codes == _CODES.index(name))) for name in OUTCOMES}
    return {**rates, "mean_seeds": float(seeds.mean())}
