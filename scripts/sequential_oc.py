"""The operating characteristics of a group-sequential design against fixed designs, by simulation
(tasks/report/sequential.py: simulate): for true effects from 0 to well past the SESOI, the rate of
each outcome and the mean seeds used. docs/report-statistics.md quotes its output:

    python scripts/sequential_oc.py --rounds 4 8 12 --fixed 8 12

With ``--study PROFILE`` it simulates the whole registered study instead (issue #58, item 3): every
ablation family of the profile with its claims, each family on the looks its budget reaches
(tasks/ablate/rounds.py: reachable_rounds), the claims of one family correlated through their shared
arms (``--rho``: the correlation of two claims' per-seed values; 0.5 is two differences against
one shared arm of equal variance), Holm within each family at each look's spent level
(tasks/design/stats.py: holm; the report's walk, tasks/report/declared.py: holm_walks, also lets a
claim decided at a later look hand its share back to the looks already made, so it rejects at least
as often as this simulation). It prints the family-wise rates under three nulls (every effect 0;
every effect at +SESOI, where a wrong reproduced is likeliest; at -SESOI, likewise contradicted):
some claim of the study, and of its worst family, reproduced or contradicted; then each family's
power per claim at 1, 1.5 and 2 x SESOI, the other claims null. docs/registration.md quotes it:

    python scripts/sequential_oc.py --study default --sims 4000
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.private import run_private  # noqa: E402
from tasks.ablate.config import MIN_FIRST_ROUND  # noqa: E402
from tasks.design.stats import holm  # noqa: E402
from tasks.report.sequential import (  # noqa: E402
    OBRIEN_FLEMING,
    SPENDINGS,
    SequentialDesign,
    boundaries,
    equivalence_boundaries,
    simulate,
)

REPRODUCED, CONTRADICTED, NEGLIGIBLE = 2, 1, 3


def family_outcomes(
    draws: np.ndarray, design: SequentialDesign, sesoi: float, holm: Callable[[Sequence[float]], list[float]]
) -> np.ndarray:
    """Each simulated family's claims' outcome codes (0 inconclusive), ``draws`` (sims, claims,
    seeds) walked over the looks: at each look the open claims' one-sided p-values against ±SESOI
    are Holm-adjusted over the family's claims and compared with the look's spent level; an
    equivalence (negligible) is each claim's own TOST at the look's level."""
    sims, m, _ = draws.shape
    codes = np.zeros((sims, m), dtype=int)
    for k, n in enumerate(design.rounds):
        x = draws[:, :, :n]
        mean, se = x.mean(axis=2), x.std(axis=2, ddof=1) / math.sqrt(n)
        p_up = stats.t.sf((mean - sesoi) / se, n - 1)  # H0: δ <= s (reproduced when rejected)
        p_down = stats.t.sf((-mean - sesoi) / se, n - 1)  # H0: δ >= -s (contradicted)
        level, margin = boundaries(design)[k], equivalence_boundaries(design)[k]
        half = float(stats.t.isf(margin, n - 1)) * se
        negligible = (mean - half > -sesoi) & (mean + half < sesoi)
        for s in np.flatnonzero((codes == 0).any(axis=1)):
            up, down = holm(list(p_up[s])), holm(list(p_down[s]))
            for c in np.flatnonzero(codes[s] == 0):
                if up[c] < level:
                    codes[s, c] = REPRODUCED
                elif down[c] < level:
                    codes[s, c] = CONTRADICTED
                elif negligible[s, c]:
                    codes[s, c] = NEGLIGIBLE
    return codes


def correlated(rng: np.random.Generator, sims: int, m: int, n: int, rho: float, effects: np.ndarray) -> np.ndarray:
    """Per-seed values of ``m`` claims with pairwise correlation ``rho`` and SD 1, shifted by ``effects``."""
    shared = rng.standard_normal((sims, 1, n))
    own = rng.standard_normal((sims, m, n))
    return math.sqrt(rho) * shared + math.sqrt(1 - rho) * own + effects[None, :, None]


def study(profile: str, rho: float, sesoi: float, sims: int) -> None:
    from tasks.ablate.grid import families
    from tasks.config import load_config
    from tasks.report.declared import looks

    cfg = load_config(Path(__file__).resolve().parents[1] / "params.yaml", profile)
    fams = {
        f.name: (len(f.claims), looks(cfg, f) or SequentialDesign((len(f.all_seeds),)))
        for f in families(cfg).values()
        if f.claims and (cfg.ablation.rounds or len(f.all_seeds) >= MIN_FIRST_ROUND)  # a t-test's fewest seeds
    }
    if not fams:
        raise SystemExit(f"study {profile}: no family with claims and >= {MIN_FIRST_ROUND} seeds to simulate")
    claims = sum(m for m, _ in fams.values())
    rng = np.random.default_rng(1)
    print(
        f"study {profile}: {len(fams)} families, {claims} claims; SESOI {sesoi:g} SD; claims of a family "
        f"correlated rho = {rho:g}; Holm within family at each look; {sims:,} simulated studies"
    )
    nulls = {"every effect 0": 0.0, "every effect at +SESOI": sesoi, "every effect at -SESOI": -sesoi}
    for what, effect in nulls.items():
        codes = {
            name: family_outcomes(correlated(rng, sims, m, d.max_seeds, rho, np.full(m, effect)), d, sesoi, holm)
            for name, (m, d) in fams.items()
        }
        rates = {code: [(c == code).any(axis=1) for c in codes.values()] for code in (REPRODUCED, CONTRADICTED)}
        worst = {code: max(r.mean() for r in rows) for code, rows in rates.items()}
        print(
            f"{what}: P(some claim of the study reproduced) {np.any(rates[REPRODUCED], axis=0).mean():.4f} "
            f"(worst family {worst[REPRODUCED]:.4f}), contradicted {np.any(rates[CONTRADICTED], axis=0).mean():.4f} "
            f"(worst family {worst[CONTRADICTED]:.4f})"
        )
    print("power per claim (its effect at k x SESOI, the family's other claims null): P(reproduced)")
    for name, (m, d) in fams.items():
        row = []
        for k in (1.0, 1.5, 2.0):
            effects = np.zeros(m)
            effects[0] = k * sesoi
            codes = family_outcomes(correlated(rng, sims, m, d.max_seeds, rho, effects), d, sesoi, holm)
            row.append(f"{k:g}x {(codes[:, 0] == REPRODUCED).mean():.3f}")
        print(f"  {name} ({m} claims, looks {list(d.rounds)}): {', '.join(row)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, nargs="+", default=[4, 8, 12])
    p.add_argument("--spending", choices=SPENDINGS, default=OBRIEN_FLEMING)
    p.add_argument("--fixed", type=int, nargs="*", default=[8, 12], help="fixed designs to compare, in seeds")
    p.add_argument("--sesoi", type=float, default=0.5, help="the SESOI in SDs of the per-seed values")
    p.add_argument("--effects", type=float, nargs="+", default=[0.0, 0.5, 1.0, 1.5, 3.0], help="true effects, in SDs")
    p.add_argument("--sims", type=int, default=100_000)
    p.add_argument("--study", metavar="PROFILE", help="simulate the profile's whole registered study instead")
    p.add_argument("--rho", type=float, default=0.5, help="--study: correlation of two claims of one family")
    args = p.parse_args()
    if args.study:
        study(args.study, args.rho, args.sesoi, args.sims)
        return
    designs = {f"sequential {args.spending} {tuple(args.rounds)}": SequentialDesign(tuple(args.rounds), args.spending)}
    designs |= {f"fixed {n}": SequentialDesign((n,)) for n in args.fixed}
    print(f"SESOI {args.sesoi:g} SD, {args.sims:,} simulated claims per row, expected sign +1")
    print(f"{'effect/SD':>9}  {'design':<36} {'reproduced':>10} {'negligible':>10} {'contradicted':>12} {'seeds':>6}")
    for effect in args.effects:
        for name, design in designs.items():
            r = simulate(design, effect, args.sesoi, 1, args.sims, np.random.default_rng(1))
            print(
                f"{effect:>9g}  {name:<36} {r['reproduced']:>10.4f} {r['negligible']:>10.4f} "
                f"{r['contradicted']:>12.4f} {r['mean_seeds']:>6.2f}"
            )


if __name__ == "__main__":
    sys.exit(run_private(main))
