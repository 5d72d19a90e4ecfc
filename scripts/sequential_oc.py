"""The operating characteristics of a group-sequential design against fixed designs, by simulation
(tasks/report/sequential.py: simulate): for true effects from 0 to well past the SESOI, the rate of
each outcome and the mean seeds used. docs/report-statistics.md quotes its output:

    python scripts/sequential_oc.py --rounds 4 8 12 --fixed 8 12
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.private import run_private
from tasks.report.sequential import OBRIEN_FLEMING, SPENDINGS, SequentialDesign, simulate  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, nargs="+", default=[4, 8, 12])
    p.add_argument("--spending", choices=SPENDINGS, default=OBRIEN_FLEMING)
    p.add_argument("--fixed", type=int, nargs="*", default=[8, 12], help="fixed designs to compare, in seeds")
    p.add_argument("--sesoi", type=float, default=0.5, help="the SESOI in SDs of the per-seed values")
    p.add_argument("--effects", type=float, nargs="+", default=[0.0, 0.5, 1.0, 1.5, 3.0], help="true effects, in SDs")
    p.add_argument("--sims", type=int, default=100_000)
    args = p.parse_args()
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
