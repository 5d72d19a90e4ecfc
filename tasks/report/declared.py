"""The findings of the declared families (studies.yaml, tasks/design/studies.py): each family one
finding, each of its claims tested by the study's one method and judged by its one verdict rule
(tasks/report/verdict.py), exactly as the built-in findings are.

The seed is the unit. Every claim reads the family's arms keyed by (seed, the factors it leaves
free), pairs them unit by unit, and averages within each seed before the paired t-test, pooled over
every seed and within each registered half (tasks/report/method.py: pooled_and_halves):

  contrast     metric(a) − metric(b); the predicted sign (``expected``) beyond ±SESOI.
  equivalence  metric(a) − metric(b) within ±SESOI: two one-sided t-tests.
  interaction  (a − b at across[0]) − (a − b at across[1]).
  sensitivity  per seed, over the ``over`` grid: the mean of metric minus its best (lowest), for
               a and for b (Wortsman et al.'s LR sensitivity when metric is the capped loss and
               ``over`` the LR); then a − b.
  slope        per seed, the least-squares slope of metric on ``over`` (on log ``over`` with
               ``log: true``) within a (every arm, when a names nothing); tested against 0.

A claim is not tested when a compared variant ends on the unigram plateau (those declared in
``may_fail`` aside) or when its mechanism gate is not met: the mechanism did not occur.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import numpy as np
from scipy import stats as scipy_stats

from tasks.ablate.rounds import reachable_rounds
from tasks.config import Config
from tasks.design.families import DeclaredClaim, DeclaredFamily, matches, shown, variant_name
from tasks.design.preregistration import design
from tasks.design.stats import derived, seed_means, tost_paired
from tasks.design.studies import STUDIES
from tasks.report.method import (
    Arms,
    Finding,
    Halves,
    claims_numbers,
    decide,
    equivalence_power,
    halves_for,
    halves_of,
    plateau_gate,
    pooled_and_halves,
    smaller_than,
    subtract,
)
from tasks.report.sequential import Outcome, SequentialDesign, run_sequential
from tasks.report.verdict import EQUIVALENCE, Claim


def declared_finding(
    cfg: Config,
    ablate: dict[str, Any],
    unigram: float | None,
    family: DeclaredFamily,
    key: str | None = None,
    notes: tuple[str, dict[str, Any]] = ("", {}),
) -> Finding:
    """The family's finding: its claims tested on its arms, its verdict by the one rule. A built-in
    family's finding is ``key`` (its pre-registration the registered design) with its ``notes``
    (the numbers beside its claims, and under ``failed`` a registered condition its probe did not
    reach: tasks/report/findings.py)."""
    arms, halves = Arms(ablate), halves_for(family.seeds, family.confirm_seeds)
    tested = {c.statement: test(arms, family, c, halves) for c in family.claims}
    claims = [to_claim(c, tested[c.statement], halves, arms, family) for c in family.claims]
    if (rounds := looks(cfg, family)) is not None:
        for claim, declared in zip(claims, family.claims):
            claim.sequential = dataclasses.asdict(walk(per_seed(arms, family, declared), family, declared, rounds))
    text, details = notes
    measured = {c.name: gate_value(arms, family, c, unigram) for c in family.claims if c.gate}
    failed = next(
        (why for c in family.claims if (why := gates(arms, family, c, unigram, measured.get(c.name)))),
        details.pop("failed", None),
    )
    compared = {c.statement: sides(arms, family, c) for c in family.claims}
    lines = [
        claims_numbers({c.statement: tested[c.statement]}, c.unit) + side_text(compared[c.statement])
        for c in family.claims
    ]
    lines += [gate_text(c, measured[c.name]) for c in family.claims if c.gate]
    numbers = "; ".join(filter(None, [*lines, text]))
    details = {**tested, **details, "sides": compared, "gates": measured}
    names = [a["name"] for a in arms.select(family.name)]
    finding = decide(
        key or family.name,
        claims,
        numbers,
        names,
        failed,
        base_loss(arms, family),
        details=details,
        halves=halves_of(tested),
    )
    if key is None:
        finding.declared = registration(family)
    return finding


def looks(cfg: Config, family: DeclaredFamily) -> SequentialDesign | None:
    """The registered group-sequential design of a family that trains in rounds: ``ablation.rounds``
    with preregistration.yaml's ``sequential`` spending over the looks the study's cap reaches
    (tasks/ablate/rounds.py: reachable_rounds), for a family whose seeds fill the last round (tasks/design/studies.py refuses any other); None for the fixed design (no rounds)."""
    rounds = reachable_rounds(cfg.ablation.rounds, cfg.ablation.budget_seeds)
    if not rounds:
        return None
    return SequentialDesign.from_mapping({"rounds": list(rounds), **design()["sequential"]})


def walk(values: dict[tuple, float], family: DeclaredFamily, claim: DeclaredClaim, rounds: SequentialDesign) -> Outcome:
    """The claim's sequential outcome over its per-seed values in the family's seed order, up to the
    first seed with none (a failed arm ends the walk there: the next look is never full). An
    equivalence claim is walked as expecting +1: negligible is what it predicts, beyond ±SESOI on
    either side contradicts it."""
    seeds = family.all_seeds[: rounds.max_seeds]  # seeds past the looks the budget reaches are no part of the test
    ordered = list(itertools.takewhile(lambda v: v is not None, (values.get((s,)) for s in seeds)))
    expected = 1 if claim.kind == "equivalence" else claim.expected
    return run_sequential([float(v) for v in ordered if v is not None], rounds, claim.sesoi, expected)


def sides(arms: Arms, family: DeclaredFamily, claim: DeclaredClaim) -> dict[str, float | None]:
    """What the claim compares, each side's mean over seeds: the metric of a and of b (a
    contrast), a − b at each ``across`` value (an interaction), each side's spread over the grid
    and its best point (a sensitivity); nothing for a slope."""

    def mean(values: dict[tuple, float]) -> float | None:
        return float(np.mean(list(values.values()))) if values else None

    values = lambda **fixed: _finite(arms.values(family.name, claim.metric, **fixed))  # noqa: E731
    if claim.kind in ("contrast", "equivalence"):
        return {variant_name(side): mean(values(**side)) for side in (claim.a, claim.b)}
    if claim.kind == "interaction":
        ((factor, levels),) = claim.across.items()
        at = {v: subtract(values(**claim.a, **{factor: v}), values(**claim.b, **{factor: v})) for v in levels}
        return {f"a − b at {factor}={shown(v)}": mean(seed_means(d)) for v, d in at.items()}
    if claim.kind == "sensitivity":
        out: dict[str, float | None] = {}
        for side in (claim.a, claim.b):
            out[f"{variant_name(side)} spread"] = mean(spread(arms, family, claim, side))
            best = best_point(arms, family, family.variants(side))[0]
            out[f"{variant_name(side)} best {claim.over}"] = best.get(claim.over or "")
        return out
    return {}


def side_text(values: dict[str, Any]) -> str:
    return (
        " (" + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items()) + ")"
        if values
        else ""
    )


def gate_value(arms: Arms, family: DeclaredFamily, claim: DeclaredClaim, unigram: float | None) -> dict[str, Any]:
    """The gate's measured value beside its threshold, and whether it is met: the mean of its metric
    over its variant's arms, or with ``at_some`` the mean at each level of that factor (``levels``)
    and, as ``measured``, the first level's that meets the gate, else the one nearest to it."""
    gate = claim.gate
    assert gate is not None
    margin = design()["plateau_margin"]
    levels = family.factors[gate.at_some] if gate.at_some else [None]
    if gate.trained:  # only where the variant left the plateau
        levels = [lv for lv in levels if trained_at(arms, family, gate.variant, gate.at_some, lv, unigram, margin)]
    means = {level: _mean_at(arms, family, gate.metric, gate.variant, gate.at_some, level) for level in levels}
    met = [level for level, m in means.items() if gate.met(m, unigram, margin)]
    finite = [(level, m) for level, m in means.items() if m is not None]
    lowest_wanted = gate.bounds[0][0] == "at_most"
    nearest = [(min if lowest_wanted else max)(finite, key=lambda lm: lm[1])] if finite else []
    chosen = [(met[0], means[met[0]])] if met else nearest  # (level, mean), or none at all
    needs = gate.needs
    if any(b == "on_plateau" for b, _ in gate.bounds) and unigram is not None:
        needs += f" (at least {unigram - margin:.4g})"
    return {
        "metric": gate.metric,
        "variant": variant_name(gate.variant),
        "measured": chosen[0][1] if chosen else None,
        "at": {gate.at_some: chosen[0][0]} if gate.at_some and chosen else None,
        "levels": {str(lv): m for lv, m in means.items()} if gate.at_some else None,
        "needs": needs,
        "met": bool(met),
    }


def trained_at(
    arms: Arms,
    family: DeclaredFamily,
    variant: dict[str, Any],
    factor: str | None,
    level: Any,
    unigram: float | None,
    margin: float,
) -> bool:
    """The variant at ``level`` of ``factor`` ended past the plateau, as a mean over its seeds."""
    loss = _mean_at(arms, family, "capped_loss", variant, factor, level)
    return loss is not None and unigram is not None and loss <= unigram - margin


def _mean_at(
    arms: Arms, family: DeclaredFamily, metric: str, variant: dict[str, Any], factor: str | None, level: Any
) -> float | None:
    at = variant if factor is None else {**variant, factor: level}
    values = [v for _, v in _arm_values(arms, family, metric, at)]
    return float(np.mean(values)) if values else None


def gate_text(claim: DeclaredClaim, g: dict[str, Any]) -> str:
    value = "-" if g["measured"] is None else f"{g['measured']:.4g}"
    at = "".join(f" at {k} {shown(v)}" for k, v in (g.get("at") or {}).items())
    return f"gate of {claim.name}: {g['metric']} of {g['variant']}{at} {value} ({g['needs']})"


def base_loss(arms: Arms, family: DeclaredFamily) -> float | None:
    """The base arm's mean capped loss over seeds: ``family.base``'s values, the factors it leaves
    free at their best grid point; each factor's first value when it names none."""
    if not family.base:
        return arms.mean(family.name, "capped_loss", **{k: v[0] for k, v in family.factors.items()})
    return best_point(arms, family, family.variants(family.base))[1]


def best_point(
    arms: Arms, family: DeclaredFamily, variants: list[dict[str, Any]]
) -> tuple[dict[str, Any], float | None]:
    """Of ``variants``, the one with the lowest mean capped loss over seeds (the first on a tie) and that loss."""
    means = [(v, arms.mean(family.name, "capped_loss", **v)) for v in variants]
    finite = [(v, m) for v, m in means if m is not None]
    return min(finite, key=lambda vm: vm[1]) if finite else (variants[0] if variants else {}, None)


def test(arms: Arms, family: DeclaredFamily, claim: DeclaredClaim, halves: Halves) -> dict[str, Any]:
    """The claim's per-seed values, tested against 0 pooled and within each half."""
    return pooled_and_halves(per_seed(arms, family, claim), halves)


def per_seed(arms: Arms, family: DeclaredFamily, claim: DeclaredClaim) -> dict[tuple, float]:
    """The claim's value per seed (a one-tuple key), from the arms that ran."""
    values = lambda **fixed: _finite(arms.values(family.name, claim.metric, **fixed))  # noqa: E731
    if claim.kind in ("contrast", "equivalence"):
        return seed_means(subtract(values(**claim.a), values(**claim.b)))
    if claim.kind == "interaction":
        ((factor, (first, second)),) = claim.across.items()
        at = {v: subtract(values(**claim.a, **{factor: v}), values(**claim.b, **{factor: v})) for v in (first, second)}
        return seed_means(subtract(at[first], at[second]))
    if claim.kind == "sensitivity":
        return seed_means(subtract(spread(arms, family, claim, claim.a), spread(arms, family, claim, claim.b)))
    return slopes(arms, family, claim, claim.over or "")


def spread(arms: Arms, family: DeclaredFamily, claim: DeclaredClaim, variant: dict[str, Any]) -> dict[tuple, float]:
    """Per (seed, other free factors): the mean of the metric over the ``over`` grid minus its lowest,
    where every point of the grid ran."""
    grid = family.factors[claim.over or ""]
    by_unit: dict[tuple, dict[Any, float]] = {}
    for arm, value in _arm_values(arms, family, claim.metric, variant):
        unit = (arm["seed"], *(v for k, v in sorted(arm["factors"].items()) if k not in variant and k != claim.over))
        by_unit.setdefault(unit, {})[arm["factors"][claim.over]] = value
    return {u: float(np.mean(list(v.values())) - min(v.values())) for u, v in by_unit.items() if len(v) == len(grid)}


def slopes(arms: Arms, family: DeclaredFamily, claim: DeclaredClaim, over: str) -> dict[tuple, float]:
    """Per seed, the least-squares slope of the metric on ``over`` (log ``over`` with ``log``), the
    other free factors averaged at each point first."""
    points: dict[int, dict[float, list[float]]] = {}
    for arm, value in _arm_values(arms, family, claim.metric, claim.a):
        x = float(arm["factors"][over])
        points.setdefault(arm["seed"], {}).setdefault(math.log(x) if claim.log else x, []).append(value)
    out = {}
    for seed, by_x in sorted(points.items()):
        if len(by_x) >= 2:
            xs = sorted(by_x)
            out[(seed,)] = float(scipy_stats.linregress(xs, [np.mean(by_x[x]) for x in xs]).slope)
    return out


def _arm_values(arms: Arms, family: DeclaredFamily, metric: str, variant: dict[str, Any]) -> list[tuple[dict, float]]:
    """Each arm of ``variant`` that ran, with its finite ``metric``."""
    out = []
    for arm in arms.select(family.name, **variant):
        value = derived(arm.get("metrics") or {}).get(metric)
        if value is not None and math.isfinite(float(value)):
            out.append((arm, float(value)))
    return out


def _finite(values: dict[tuple, Any]) -> dict[tuple, float]:
    return {u: float(v) for u, v in values.items() if v is not None and math.isfinite(float(v))}


def to_claim(claim: DeclaredClaim, tested: dict[str, Any], halves: Halves, arms: Arms, family: DeclaredFamily) -> Claim:
    halves_est = {h: c.get("estimate") for h, c in tested.get("halves", {}).items()}
    if claim.kind == "equivalence":
        diffs = list(per_seed(arms, family, claim).values())
        p = tost_paired(diffs, claim.sesoi).get("p") if len(diffs) > 1 else None
        return Claim(
            claim.statement,
            tested.get("estimate"),
            p,
            0,
            kind=EQUIVALENCE,
            sesoi=claim.sesoi,
            ci95=tested.get("ci95"),
            halves=halves_est,
            mde=tested.get("mde"),
            unit=claim.unit,
            **equivalence_power(tested, claim.sesoi),
        )
    return Claim(
        claim.statement,
        tested.get("estimate"),
        tested.get("p"),
        claim.expected,
        sesoi=claim.sesoi,
        ci95=tested.get("ci95"),
        halves=halves_est,
        mde=tested.get("mde"),
        unit=claim.unit,
        tost_p=smaller_than(tested, claim.sesoi),
    )


def gates(
    arms: Arms, family: DeclaredFamily, claim: DeclaredClaim, unigram: float | None, g: dict[str, Any] | None
) -> str | None:
    """Why the claim cannot be tested: a compared variant (each grid point it reads, mean over its
    seeds) on the plateau, ``may_fail`` aside, as for the built-in findings; or its mechanism gate
    not met (``g``: the gate's measured value, :func:`gate_value`). None when it can."""
    compared = compared_variants(family, claim)
    if claim.kind == "sensitivity":  # it reads the whole grid, whose worst points are its effect
        compared = best_per_slice(arms, family, claim, compared)
    for variant in compared:
        if any(matches(variant, exempt) for exempt in claim.may_fail):
            continue
        loss = arms.mean(family.name, "capped_loss", **variant)
        if failed := plateau_gate(loss, unigram, f"the compared variant {variant_name(variant)}"):
            return failed
    gate = claim.gate
    if gate is None or g is None:
        return None
    if not g["met"]:
        measured = "no finite value" if g["measured"] is None else f"{g['measured']:.4g}"
        at = "".join(f" (at {k} {shown(v)}, the nearest)" for k, v in (g.get("at") or {}).items())
        return (
            f"{claim.name}: the mechanism did not occur: {gate.metric} of {variant_name(gate.variant)} was "
            f"{measured}{at}, {g['needs']} needed ({gate.justification})"
        )
    return None


def best_per_slice(
    arms: Arms, family: DeclaredFamily, claim: DeclaredClaim, compared: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """A sensitivity's gated points: of each side, in each slice of the factors it leaves free
    besides ``over`` (one slice when there are none), the grid point with the lowest loss."""
    slices: dict[tuple, list[dict[str, Any]]] = {}
    for side_index, side in enumerate((claim.a, claim.b)):
        for v in compared:
            if matches(v, side):
                rest = tuple((k, x) for k, x in v.items() if k != claim.over and k not in side)
                slices.setdefault((side_index, rest), []).append(v)
    return [best_point(arms, family, points)[0] for points in slices.values()]


def compared_variants(family: DeclaredFamily, claim: DeclaredClaim) -> list[dict[str, Any]]:
    """Every point of the family's grid the claim reads: those matching ``a`` or ``b`` (only ``a``
    for a slope), at the ``across`` values for an interaction."""
    sides = [claim.a] if claim.kind == "slope" else [claim.a, claim.b]
    across = {k: set(v) for k, v in claim.across.items()}
    return [
        v
        for v in family.variants()
        if any(matches(v, side) for side in sides) and all(v[k] in values for k, values in across.items())
    ]


def registration(family: DeclaredFamily) -> dict[str, Any]:
    """The family as the report shows a registered finding (the keys of preregistration.yaml's)."""
    return {
        "claim": family.question,
        "source": f"declared in {STUDIES} (family {family.name})",
        "arms": f"family {family.name}: "
        + " x ".join(f"{k} [{', '.join(map(shown, v))}]" for k, v in family.factors.items())
        + (f"; fixed {variant_name(family.fixed)}" if family.fixed else "")
        + f"; {family.steps} steps; seeds {family.seeds} + {family.confirm_seeds}",
        "metric": ", ".join(dict.fromkeys(c.metric for c in family.claims)),
        "test": "; ".join(f"{c.name}: {c.kind}" for c in family.claims),
        "expected": "; ".join(c.statement for c in family.claims),
        "claims": {c.name: {"sesoi": c.sesoi, "sesoi_justification": c.justification} for c in family.claims},
        "justification": "; ".join(f"{c.name}: {c.justification}" for c in family.claims),
        "figures": [f"ablate/{family.name}.png"],
        "precondition": "every compared variant past the plateau"
        + "".join(f"; {c.name}: {c.gate.metric} gate" for c in family.claims if c.gate),
    }
