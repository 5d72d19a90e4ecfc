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
``may_fail`` aside) or when its mechanism gate is not met: the mechanism did not occur. Each claim
is gated on its own (a sibling's failed gate leaves it tested), and every gate reads the arms at the
claim's own conditions (:func:`gate_value`). A loss claim whose compared variant diverged in more
than half of its seeds is read as a difference in divergence rate (:func:`divergence`). In rounds,
the claims of a finding are walked by Holm's procedure (:func:`holm_walks`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
from scipy import stats as scipy_stats

from tasks.ablate.rounds import reachable_rounds
from tasks.config import Config
from tasks.design.families import DeclaredClaim, DeclaredFamily, matches, shown, variant_name
from tasks.design.preregistration import design
from tasks.design.stats import derived, divergence_rates, seed_means, tost_paired
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
    rate_line,
    smaller_than,
    subtract,
)
from tasks.report.sequential import (
    CONTINUE,
    INCONCLUSIVE,
    Outcome,
    SequentialDesign,
    boundaries,
    run_sequential,
    shared,
)
from tasks.report.verdict import CONTRADICTED, DIRECTION, EQUIVALENCE, NEGLIGIBLE, RATE, REPRODUCED, Claim


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
    measured = {c.name: gate_value(arms, family, c, unigram) for c in family.claims if c.gate}
    rates = {c.name: divergence(arms, family, c) for c in family.claims}
    claims = [
        rate_claim(c, rate) if (rate := rates[c.name]) else to_claim(c, tested[c.statement], halves, arms, family)
        for c in family.claims
    ]
    for claim, declared in zip(claims, family.claims):  # each claim judged on its own gates
        diverged = mostly_diverged(declared, rates[declared.name])
        claim.not_tested = gates(arms, family, declared, unigram, measured.get(declared.name), diverged)
    if (rounds := looks(cfg, family)) is not None:
        holm_walks(claims, [walker(arms, family, c, rounds, rates[c.name]) for c in family.claims])
    text, details = notes
    failed = details.pop("failed", None)
    compared = {c.statement: sides(arms, family, c) for c in family.claims}
    lines = [
        claims_numbers({c.statement: tested[c.statement]}, c.unit) + side_text(compared[c.statement])
        for c in family.claims
    ]
    lines += [rate_text(c, rates[c.name]) for c in family.claims if rates[c.name]]
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


def walk(
    values: dict[tuple, float],
    family: DeclaredFamily,
    claim: DeclaredClaim,
    rounds: SequentialDesign,
    share: float = 1.0,
) -> Outcome:
    """The claim's sequential outcome over its per-seed values in the family's seed order, up to the
    first seed with none (a failed arm ends the walk there: the next look is never full), at
    ``share`` of α (Holm's: :func:`holm_walks`). An equivalence claim is walked as expecting +1:
    negligible is what it predicts, beyond ±SESOI on either side contradicts it, so all of its
    boundaries take the share; a direction claim's negligible boundaries keep the whole α (a
    finding is NEGLIGIBLE only when every claim is, an intersection-union test: Berger 1982)."""
    seeds = family.all_seeds[: rounds.max_seeds]  # seeds past the looks the budget reaches are no part of the test
    ordered = list(itertools.takewhile(lambda v: v is not None, (values.get((s,)) for s in seeds)))
    equivalence = claim.kind == "equivalence"
    x = [float(v) for v in ordered if v is not None]
    return run_sequential(
        x, rounds, claim.sesoi, 1 if equivalence else claim.expected, share, share if equivalence else 1.0
    )


Walker = Callable[[float], Outcome]
"""A claim's sequential walk at a share of α."""

DECISIONS = {DIRECTION: (REPRODUCED, CONTRADICTED), EQUIVALENCE: (REPRODUCED, CONTRADICTED, NEGLIGIBLE)}
"""The walk outcomes that reject a claim's hypothesis at its share of α, by the claim's kind (a
divergence-rate claim is walked as a direction claim)."""


def holm_walks(claims: list[Claim], walkers: list[Walker]) -> None:
    """Holm's procedure over a finding's sequential claims (the graphical group-sequential Holm of
    Maurer & Bretz 2013, equal weights): each of the r claims not yet decided is walked over every
    look made at α / r; every claim that crosses a boundary keeps that outcome and hands its share
    to the rest, which are walked again at α / (r − k), until no further claim crosses. With one
    claim it is the unadjusted walk. A claim whose own gate failed takes no share."""
    open_ = [i for i, c in enumerate(claims) if c.not_tested is None]
    outcomes: dict[int, Outcome] = {}
    while open_:
        outcomes |= {i: walkers[i](1 / len(open_)) for i in open_}
        crossed = [i for i in open_ if outcomes[i].outcome in DECISIONS.get(claims[i].kind, DECISIONS[DIRECTION])]
        if not crossed:
            break
        open_ = [i for i in open_ if i not in crossed]
    for i, outcome in outcomes.items():
        claims[i].sequential = dataclasses.asdict(outcome)


def walker(
    arms: Arms,
    family: DeclaredFamily,
    claim: DeclaredClaim,
    rounds: SequentialDesign,
    rate: tuple[dict[tuple, bool], dict[tuple, bool]] | None,
) -> Walker:
    """The claim's walk at a share of α: over its divergence per seed when it is read as a rate, else
    over its per-seed values."""
    if rate:
        return functools.partial(walk_rate, *rate, family, rounds, claim.expected)
    return functools.partial(walk, per_seed(arms, family, claim), family, claim, rounds)


def walk_rate(
    a: dict[tuple, bool],
    b: dict[tuple, bool],
    family: DeclaredFamily,
    rounds: SequentialDesign,
    expected: int,
    share: float,
) -> Outcome:
    """A divergence-rate claim in rounds: at each look the exact McNemar test over the seeds of the
    rounds so far, against twice the direction boundary's one-sided level at ``share`` of α (the
    looks' levels add up to α under Bonferroni combination, whatever the test). An equivalence
    claim (expected 0) is walked as expecting +1: either crossing contradicts it."""
    ordered = list(itertools.takewhile(lambda s: (s,) in a and (s,) in b, family.all_seeds))
    levels = boundaries(shared(rounds, share))
    look: int | None = None
    for k, n in enumerate(rounds.rounds):
        if n > len(ordered):
            return Outcome(CONTINUE, look, 0 if look is None else rounds.rounds[look], None, share)
        look, seeds = k, [(s,) for s in ordered[:n]]
        d = divergence_rates({u: a[u] for u in seeds}, {u: b[u] for u in seeds})
        if d["p"] is not None and d["p"] < 2 * levels[k]:
            toward = (d["risk_difference"] > 0) == ((expected or 1) > 0)
            return Outcome(REPRODUCED if toward else CONTRADICTED, k, n, 2 * levels[k], share)
    return Outcome(INCONCLUSIVE, look, rounds.max_seeds, None, share)


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
    """The gate's measured value beside its threshold, and whether it is met, read by one rule for
    every gate: at the claim's own conditions. The gate's variant takes the factor values every
    variant the claim compares shares (a claim at one LR gates at that LR); with ``at_some``, the
    mean is taken at each level of that factor the claim reads at which every variant it compares
    (``may_fail`` aside) ended past the plateau (a mechanism measured in arms that did not train is
    the plateau's), and ``measured`` is the first such level's that meets the gate, else the one
    nearest to it."""
    gate = claim.gate
    assert gate is not None
    margin = design()["plateau_margin"]
    compared = compared_variants(family, claim)
    variant = {**shared_factors(compared), **gate.variant}
    levels = list(dict.fromkeys(v[gate.at_some] for v in compared)) if gate.at_some else [None]
    if gate.at_some:
        levels = [lv for lv in levels if trained_at(arms, family, claim, gate.at_some, lv, unigram, margin)]
    means = {level: _mean_at(arms, family, gate.metric, variant, gate.at_some, level) for level in levels}
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
        "variant": variant_name(variant),
        "measured": chosen[0][1] if chosen else None,
        "at": {gate.at_some: chosen[0][0]} if gate.at_some and chosen else None,
        "levels": {str(lv): m for lv, m in means.items()} if gate.at_some else None,
        "needs": needs,
        "met": bool(met),
    }


def shared_factors(variants: list[dict[str, Any]]) -> dict[str, Any]:
    """The factor values every one of ``variants`` has: the conditions a claim is stated at."""
    if not variants:
        return {}
    return {k: v for k, v in variants[0].items() if all(other.get(k) == v for other in variants[1:])}


def trained_at(
    arms: Arms,
    family: DeclaredFamily,
    claim: DeclaredClaim,
    factor: str,
    level: Any,
    unigram: float | None,
    margin: float,
) -> bool:
    """At ``level`` of ``factor``, every variant the claim compares there ended past the plateau, as
    a mean over its seeds; those predicted to fail aside (``may_fail``, and the variant a gate on
    the plateau reads: its failure to train is the mechanism)."""
    at_level = [v for v in compared_variants(family, claim) if v.get(factor) == level]
    failing = [*claim.may_fail, *([claim.gate.variant] if claim.gate and claim.gate.on_plateau else [])]
    kept = [v for v in at_level if not any(matches(v, exempt) for exempt in failing)]
    for v in kept:
        loss = arms.mean(family.name, "capped_loss", **v)
        if loss is None or unigram is None or loss > unigram - margin:
            return False
    return True


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
    arms: Arms,
    family: DeclaredFamily,
    claim: DeclaredClaim,
    unigram: float | None,
    g: dict[str, Any] | None,
    diverged: list[dict[str, Any]] | None = None,
) -> str | None:
    """Why the claim cannot be tested: a compared variant (each grid point it reads, mean over its
    seeds) on the plateau, ``may_fail`` aside, as for the built-in findings (and the sides of a
    claim read as a divergence rate: their failure to train is what it compares); or its mechanism
    gate not met (``g``: the gate's measured value, :func:`gate_value`). None when it can."""
    compared = compared_variants(family, claim)
    if claim.kind == "sensitivity":  # it reads the whole grid, whose worst points are its effect
        compared = best_per_slice(arms, family, claim, compared)
    exempt = [*claim.may_fail, *(diverged or [])]
    kept = [v for v in compared if not any(matches(v, e) for e in exempt)]
    alone = compared and not kept  # every variant it compares may fail: the family's base arm is its control
    if alone and (failed := plateau_gate(base_loss(arms, family), unigram, "the family's base arm")):
        return failed
    for variant in kept:
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


LOSSES = ("capped_loss", "val_loss", "final_loss")
"""The metrics a diverged arm's cap stands in for: a claim on one of them whose variant diverged
in most seeds is read as a divergence rate (higher loss, more divergence: the same sign)."""


def rate_sides(claim: DeclaredClaim) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The two variants whose divergence a loss claim compares when read as a rate: a and b (a
    contrast or equivalence), a at each ``across`` value (an interaction); None for a claim over a
    grid (a sensitivity or slope: capping the LRs that diverge is Wortsman et al.'s measure)."""
    if claim.metric not in LOSSES:
        return None
    if claim.kind in ("contrast", "equivalence"):
        return claim.a, claim.b
    if claim.kind == "interaction":
        ((factor, (first, second)),) = claim.across.items()
        return {**claim.a, factor: first}, {**claim.a, factor: second}
    return None


def diverged_seeds(arms: Arms, family: DeclaredFamily, variant: dict[str, Any]) -> dict[tuple, bool]:
    """Per seed, whether any arm of ``variant`` at that seed diverged (its raw final loss above
    ln V or non-finite, or the trainer's rule: tasks/design/stats.py: failed_to_train)."""
    out: dict[tuple, bool] = {}
    for unit, value in arms.values(family.name, "diverged", **variant).items():
        out[(unit[0],)] = out.get((unit[0],), False) or bool(value)
    return out


def divergence(
    arms: Arms, family: DeclaredFamily, claim: DeclaredClaim
) -> tuple[dict[tuple, bool], dict[tuple, bool]] | None:
    """The two sides' divergence per seed when a side diverged in more than half of its seeds (then
    the claim is a difference in divergence rate, never a difference of the cap); None otherwise."""
    sides = rate_sides(claim)
    if sides is None:
        return None
    a, b = (diverged_seeds(arms, family, side) for side in sides)
    return (a, b) if mostly_diverged(claim, (a, b)) else None


def mostly_diverged(
    claim: DeclaredClaim, rate: tuple[dict[tuple, bool], dict[tuple, bool]] | None
) -> list[dict[str, Any]]:
    """The sides of a claim read as a rate that diverged in more than half of their seeds: their
    failure to train is what the claim compares, so the plateau gate does not read them."""
    if rate is None:
        return []
    return [side for side, d in zip(rate_sides(claim) or (), rate, strict=True) if sum(d.values()) > len(d) / 2]


def rate_claim(claim: DeclaredClaim, rate: tuple[dict[tuple, bool], dict[tuple, bool]]) -> Claim:
    """The claim as a difference in divergence rate, a − b, by the exact McNemar test paired by seed."""
    d = divergence_rates(*rate)
    return Claim(
        claim.statement,  # the claim's name everywhere (metrics/sensitivity.json too); kind and unit say it is a rate
        d["risk_difference"],
        d["p"],
        0 if claim.kind == "equivalence" else claim.expected,
        kind=RATE,
        unit="diverged share",
    )


def rate_text(claim: DeclaredClaim, rate: tuple[dict[tuple, bool], dict[tuple, bool]] | None) -> str:
    assert rate is not None
    a, b = (variant_name(side) for side in rate_sides(claim) or ({}, {}))
    return f"{claim.name} diverged, {a} vs {b}, per seed: {rate_line(divergence_rates(*rate))}"


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
