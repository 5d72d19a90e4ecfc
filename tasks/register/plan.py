"""The design as it will run (issue #58, item 4), computed before any run: each family's looks
(the rounds its reserved budget reaches: tasks/ablate/rounds.py), the one-sided level each look
spends, and each claim's power there, beside the fixed design of the same maximum seeds.

Power needs an effect in units of the per-seed SD, which no claim registers: the plan states it
at one assumption, the SESOI = :data:`SESOI_SD` SD of the per-seed differences (the convention of
scripts/sequential_oc.py and docs/report-statistics.md), for a true effect of twice the SESOI
(direction claims: P(reproduced)) or of zero (equivalence claims: P(negligible)).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tasks.ablate.config import MIN_FIRST_ROUND
from tasks.ablate.rounds import reachable_rounds
from tasks.config import Config
from tasks.design.families import DeclaredClaim, DeclaredFamily
from tasks.report.declared import looks
from tasks.report.sequential import SequentialDesign, boundaries, simulate

SESOI_SD = 0.5
"""The SESOI in SDs of the per-seed values at which power is stated."""
SIMS = 20_000
"""Simulated claims per power figure: its Monte Carlo SE is at most 0.0035."""


def claim_power(design: SequentialDesign, claim: DeclaredClaim) -> float:
    """P(reproduced) at a true effect of 2 x SESOI for a direction claim, P(negligible) at 0 for an
    equivalence claim, under ``design``."""
    equivalence = claim.kind == "equivalence"
    effect = 0.0 if equivalence else 2 * SESOI_SD
    rates = simulate(design, effect, SESOI_SD, 1, SIMS, np.random.default_rng(0))
    return rates["negligible" if equivalence else "reproduced"]


def family_plan(cfg: Config, family: DeclaredFamily) -> dict[str, Any]:
    """A family's looks as it will run, the level each spends, and each claim's power, sequential
    and fixed at the same maximum."""
    seeds = len(family.all_seeds)
    registered = list(cfg.ablation.rounds) or [seeds]
    if not cfg.ablation.rounds and seeds < MIN_FIRST_ROUND:  # the smoke profile's 2 seeds: no power to state
        return {
            "registered_rounds": registered,
            "looks": registered,
            "one_sided_levels": [],
            "spent": 0.0,
            "claims": {},
        }
    design = looks(cfg, family) or SequentialDesign((seeds,))
    fixed = SequentialDesign((design.max_seeds,))
    levels = boundaries(design)
    return {
        "registered_rounds": registered,
        "looks": list(design.rounds),
        "one_sided_levels": [round(x, 6) for x in levels],
        "spent": round(sum(levels), 6),
        "claims": {
            c.name: {"power": round(claim_power(design, c), 3), "fixed_power": round(claim_power(fixed, c), 3)}
            for c in family.claims
        },
    }


def plan(cfg: Config, families: list[DeclaredFamily]) -> dict[str, Any]:
    """Every family's plan (a family its grid cannot state has no claims, and no plan)."""
    return {
        "reach": list(reachable_rounds(cfg.ablation.rounds, cfg.ablation.budget_seeds)),
        "sesoi_sd": SESOI_SD,
        "families": {f.name: family_plan(cfg, f) for f in families if f.claims},
    }


def plan_lines(planned: dict[str, Any]) -> list[str]:
    """The plan as the command prints it: per family its looks and spending, per claim its power."""
    lines = [
        f"power at SESOI = {planned['sesoi_sd']:g} SD of the per-seed values: direction claims P(reproduced) at "
        "2 x SESOI, equivalence claims P(negligible) at 0; fixed: one look at the same maximum seeds"
    ]
    for name, f in planned["families"].items():
        cut = (
            ""
            if f["looks"] == f["registered_rounds"]
            else f" (registered {f['registered_rounds']}: the budget reaches these)"
        )
        levels = ", ".join(f"{x:.4g}" for x in f["one_sided_levels"])
        if not f["claims"]:
            lines.append(f"  {name}: {f['looks'][0]} seeds, fewer than a t-test's {MIN_FIRST_ROUND}: no power stated")
            continue
        lines.append(f"  {name}: looks at {f['looks']} seeds{cut}; one-sided levels {levels} (sum {f['spent']:.4g})")
        for claim, p in f["claims"].items():
            lines.append(f"    {claim}: power {p['power']:.3f} (fixed {p['fixed_power']:.3f})")
    return lines
