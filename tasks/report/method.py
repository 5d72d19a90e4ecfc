"""The study's one method, shared by every finding (tasks/report/findings.py) and every declared
family (tasks/report/declared.py): per-seed values tested against 0 pooled and within each
registered half, claims with their registered SESOI, the plateau gate, the finding and its numbers.

The seed is the unit: arms of one seed share initialisation, data order and validation batches,
so a finding takes per-seed differences (a family crossing an LR grid averages its per-(seed, LR)
differences within each seed first, tasks/design/stats.py: seed_means) and tests them with the
paired t-test, pooled over every seed and, beside it, within each registered half (discovery,
confirmation). A diverged arm is a result: its loss is the loss at initialisation
(tasks/design/stats.py: capped_loss), and divergence is reported apart as a rate. Every variant a
claim compares must end ``plateau_margin`` nats below the unigram baseline (those the finding
predicts to fail aside, ``may_fail``): an arm that learned no more than unigram statistics tests nothing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tasks.config import Config
from tasks.design.preregistration import design
from tasks.design.stats import derived, paired, seed_means, seeds_for_tost_power, tost_paired, tost_power
from tasks.report.verdict import EQUIVALENCE, Claim, adjust, tested, verdict

Halves = dict[str, list[int]]
"""The registered halves of a stage's seeds: {"discovery": [...], "confirmation": [...]}."""


@dataclasses.dataclass
class Finding:
    """A finding's verdict with what decided it: its claims (each pooled over every seed, with each
    half's estimate), the precondition that failed (if one did), the numbers a reader checks, and
    the arms it read; ``halves`` holds each claim's comparison within each half of the seeds."""

    key: str
    verdict: str
    claims: list[Claim]
    precondition_failed: str | None
    numbers: str
    arms: list[str]
    base_val_loss: float | None = None
    details: dict[str, Any] = dataclasses.field(default_factory=dict)
    halves: dict[str, dict[str, dict[str, Any]]] = dataclasses.field(default_factory=dict)
    declared: dict[str, Any] | None = None
    """A declared family's registration (studies.yaml: tasks/report/declared.py), else None."""

    @property
    def check(self) -> str | None:
        """Why this is a check of the machinery and not a finding (registered ``check``), else None:
        true by construction or measured without training, so never counted among the findings."""
        return self.registered.get("check")

    @property
    def registered(self) -> dict[str, Any]:
        """The finding's pre-registered design: preregistration.yaml's entry, or its declaration."""
        if self.declared is not None:
            return self.declared
        registered: dict[str, Any] = design()["findings"][self.key]
        return registered

    def to_json(self) -> dict[str, Any]:
        r = self.registered
        return {
            "verdict": self.verdict,
            "claim": r["claim"],
            "source": r["source"],
            "test": r["test"],
            "expected": r["expected"],
            "precondition_failed": self.precondition_failed,
            "check": self.check,
            "sesoi": {c.what: c.sesoi for c in self.claims},
            "mde": {c.what: c.mde for c in self.claims},
            "powered": {c.what: c.powered for c in self.claims},
            "claims": [
                {**dataclasses.asdict(c), "holds": c.holds, "contradicted": c.contradicted, "negligible": c.negligible}
                for c in self.claims
            ],
            "halves": self.halves,
            "numbers": self.numbers,
            "base_val_loss": self.base_val_loss,
            "arms": self.arms,
            "details": self.details,
        }


def decide(
    key: str,
    claims: list[Claim],
    numbers: str,
    arms: list[str],
    precondition_failed: str | None = None,
    base_val_loss: float | None = None,
    details: dict[str, Any] | None = None,
    halves: dict[str, dict[str, dict[str, Any]]] | None = None,
) -> Finding:
    """The finding, its claims Holm-adjusted among themselves (tasks/report/verdict.py: adjust); when
    every claim's own gate failed, their reasons are the finding's."""
    adjust(claims)
    if claims and not precondition_failed and not tested(claims):
        precondition_failed = "; ".join(dict.fromkeys(c.not_tested or "" for c in claims))
    return Finding(
        key,
        verdict(claims, precondition_failed),
        claims,
        precondition_failed,
        numbers,
        arms,
        base_val_loss,
        details or {},
        halves or {},
    )


# ----------------------------------------------------------------------------------------------
# Seeds as units, halves, claims
# ----------------------------------------------------------------------------------------------


def ablation_halves(cfg: Config) -> Halves:
    return halves_for(cfg.ablation.seeds, cfg.ablation.confirm_seeds)


def halves_for(discovery: Sequence[int], confirmation: Sequence[int]) -> Halves:
    """The registered halves, the confirmation half only where it has seeds (a profile may have none)."""
    out = {"discovery": list(discovery)}
    if confirmation:
        out["confirmation"] = list(confirmation)
    return out


def within(values: Mapping[tuple, float], seeds: Sequence[int]) -> dict[tuple, float]:
    """The per-seed values of the units whose seed is in ``seeds``."""
    return {u: v for u, v in values.items() if u[0] in seeds}


def pooled_and_halves(values: dict[tuple, float], halves: Halves) -> dict[str, Any]:
    """The paired t-test of per-seed values (differences) against 0, pooled over every seed, with the
    same test within each half under ``halves``."""
    return {
        **_against_zero(values),
        "halves": {name: _against_zero(within(values, seeds)) for name, seeds in halves.items()},
    }


def _against_zero(values: dict[tuple, float]) -> dict[str, Any]:
    return paired(values, {u: 0.0 for u in values})


def per_seed_difference(a: dict[tuple, float], b: dict[tuple, float]) -> dict[tuple, float]:
    """a − b per unit, averaged within each seed (the seed is the unit)."""
    return seed_means(subtract(a, b))


def sesoi(key: str, claim: str) -> float:
    """The registered smallest effect of interest of ``claim`` of finding ``key``."""
    value: float = design()["findings"][key]["claims"][claim]["sesoi"]
    return value


def direction(key: str, claim: str, what: str, tested: dict[str, Any], expected: int, unit: str = "nats") -> Claim:
    """A directional claim from :func:`pooled_and_halves`, with its registered SESOI and each half's estimate."""
    return Claim(
        what,
        tested.get("estimate"),
        tested.get("p"),
        expected,
        sesoi=sesoi(key, claim),
        ci95=tested.get("ci95"),
        halves={h: c.get("estimate") for h, c in tested.get("halves", {}).items()},
        mde=tested.get("mde"),
        unit=unit,
        tost_p=smaller_than(tested, sesoi(key, claim)),
    )


def smaller_than(tested: Mapping[str, Any], margin: float) -> float | None:
    """The TOST p of per-seed differences against ±``margin`` (a direction claim's negligibility);
    None with no margin or no test."""
    diffs = tested.get("diffs") or []
    if margin <= 0 or tested.get("p") is None:
        return None
    p: float | None = tost_paired(diffs, margin).get("p")
    return p


def equivalence_power(tested: Mapping[str, Any], margin: float) -> dict[str, Any]:
    """An equivalence claim's TOST power (no true difference) at its seeds and measured SD, and the
    seeds 80 % power needs at that SD."""
    n, sd = tested.get("n") or 0, tested.get("sd_diff")
    if sd is None or n < 2:
        return {"power": None, "seeds_needed": None}
    return {"power": tost_power(n, sd, margin), "seeds_needed": seeds_for_tost_power(sd, margin)}


def equivalence(key: str, claim: str, what: str, values: dict[tuple, float], halves: Halves, unit: str) -> Claim:
    """An equivalence claim on per-seed values: TOST against its registered ±SESOI pooled; each half's estimate."""
    return equivalence_within(what, values, halves, sesoi(key, claim), unit)


def equivalence_within(what: str, values: dict[tuple, float], halves: Halves, margin: float, unit: str) -> Claim:
    """An equivalence claim on per-seed values: TOST against ±``margin`` pooled; each half's estimate."""
    tested = pooled_and_halves(values, halves)
    tost = tost_paired(list(values.values()), margin)
    return Claim(
        what,
        tested.get("estimate"),
        tost.get("p"),
        0,
        kind=EQUIVALENCE,
        sesoi=margin,
        ci95=tested.get("ci95"),
        halves={h: c.get("estimate") for h, c in tested["halves"].items()},
        mde=tested.get("mde"),
        unit=unit,
        **equivalence_power(tested, margin),
    )


def halves_of(claims: Mapping[str, dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per claim, its comparison within each half (for the report)."""
    return {what: tested.get("halves", {}) for what, tested in claims.items()}


# ----------------------------------------------------------------------------------------------
# The arms, as metrics/ablate.json lists them
# ----------------------------------------------------------------------------------------------


class Arms:
    """The ablate stage's arms, looked up by family and factors; values keyed by their pairing
    unit: the seed, and any factor not fixed by the lookup (e.g. the LR of a family that crosses an
    LR grid), so two lookups that differ in one factor pair arm by arm."""

    def __init__(self, ablate: dict[str, Any]):
        self.arms = ablate["arms"]

    def select(self, family: str, **factors: Any) -> list[dict[str, Any]]:
        return [
            a for a in self.arms if a["family"] == family and all(a["factors"].get(k) == v for k, v in factors.items())
        ]

    def values(self, family: str, figure: str, **factors: Any) -> dict[tuple, Any]:
        """``figure`` of every arm that ran, keyed by (seed, free factors...); failed arms are left out."""
        out = {}
        for a in self.select(family, **factors):
            if a.get("metrics"):
                free = tuple(v for k, v in sorted(a["factors"].items()) if k not in factors)
                out[(a["seed"], *free)] = derived(a["metrics"])[figure]
        return out

    def mean(self, family: str, figure: str, **factors: Any) -> float | None:
        values = [v for v in self.values(family, figure, **factors).values() if v is not None]
        return float(np.mean(values)) if values else None


def subtract(a: dict[tuple, float], b: dict[tuple, float]) -> dict[tuple, float]:
    """Per pairing unit, a − b, over the units both have."""
    return {u: a[u] - b[u] for u in sorted(a.keys() & b.keys())}


def plateau_gate(base_loss: float | None, unigram: float | None, what: str) -> str | None:
    """The precondition every trained family shares: its base arm ended past the unigram plateau."""
    margin = design()["plateau_margin"]
    if unigram is None:
        return "no unigram baseline (data/tokens missing)"
    if base_loss is None:
        return f"{what} has no finite loss"
    if base_loss > unigram - margin:
        return (
            f"{what} ended at {base_loss:.3f} nats, not {margin:g} below the unigram baseline "
            f"{unigram:.3f} (it has not learned past unigram statistics)"
        )
    return None


def compare_line(c: dict[str, Any], unit: str = "nats") -> str:
    """A paired comparison in a line: estimate [95 % CI], p, MDE, n."""
    if c.get("estimate") is None:
        test: str = c.get("test", "untested")
        return test
    ci = f" [{c['ci95'][0]:+.3g}, {c['ci95'][1]:+.3g}]" if c.get("ci95") else ""
    p = f", p={c['p']:.3g}" if c.get("p") is not None else f", {c['test']}"
    mde = f", MDE {c['mde']:.3g}" if c.get("mde") is not None else ""
    return f"Δ={c['estimate']:+.3g} {unit}{ci}{p}{mde}, n={c['n']}"


def rate_line(d: dict[str, Any]) -> str:
    (ea, eb), n = d["events"], d["n"]
    p = f", McNemar p={d['p']:.3g}" if d.get("p") is not None else ""
    return f"{ea}/{n} vs {eb}/{n}{p}"


def claims_numbers(tested: Mapping[str, dict[str, Any]], unit: str = "nats") -> str:
    """Each claim's pooled test, then each half's, in a line."""
    return "; ".join(
        f"{what}: {compare_line(t, unit)}"
        + "".join(f" | {half} {compare_line(h, unit)}" for half, h in t.get("halves", {}).items())
        for what, t in tested.items()
    )


def mean_text(values: Mapping[Any, float | None]) -> str:
    finite = [v for v in values.values() if v is not None and math.isfinite(v)]
    return f"{np.mean(finite):.3g}" if finite else "-"


def number(value: float | None, fmt: str = "{:.4f}") -> str:
    """``value`` formatted, or "-" where there is none (the report's tables use it too)."""
    return "-" if value is None else fmt.format(value)
