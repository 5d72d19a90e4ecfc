"""The xiong family's sizing probe, run on ``ablation.sizing_seeds`` (never a discovery or
confirmation seed) and blind to the claim: it trains only the variants the finding's plateau gate
reads, never Post-LN without warmup (the variant the finding predicts to fail, ``may_fail``).

One registered rule (tasks/design/preregistration.yaml, the xiong finding's ``condition``):

  steps   ``ablation.xiong_steps`` is the smallest of ``ablation.sizing_xiong_steps`` at which every
          gated variant (block x warmup x LR of the family, less ``may_fail``) ends at least the
          method's ``plateau_margin`` below the unigram baseline at every sizing seed, its capped
          validation loss read as the gate reads it (tasks/design/stats.py: capped_loss). Version 2
          trained 400 steps, and Post-LN with warmup ended on the plateau at both LRs: the family
          was never tested.

A probe is one arm trained exactly as the ablate stage trains it (tasks/ablate/arm.py: run_arm) at
one candidate length. ``python -m tasks.ablate.sizing --out FILE`` (``--steps``, ``--seeds`` to
split the probes over processes; ``--from FILE ...`` to apply the rule to probes already run;
``--profile``, ``--set KEY=VALUE``) prints each probe and what the rule picks; the value goes into
params.yaml by hand, with what was seen, in the design's change history.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from model.private import run_private
from model.typed_config import add_config_arguments, parse_sets
from tasks.ablate.arm import run_arm
from tasks.ablate.grid import Arm, arm_config, arm_metrics, families, family_arm
from tasks.config import Config, load_config
from tasks.data.unigram import unigram_baseline
from tasks.design.families import matches
from tasks.design.preregistration import design
from tasks.design.stats import capped_loss
from tasks.runtime.files import write_json
from tasks.runtime.outputs import MANIFEST
from tasks.runtime.workers import clean_state


def gated_arms(cfg: Config, seeds: Iterable[int]) -> list[Arm]:
    """The xiong arms the plateau gate reads, at ``seeds``: every variant but those predicted to fail."""
    family = families(cfg)["xiong"]
    exempt = [e for c in family.claims for e in c.may_fail]
    variants = [v for v in family.variants() if not any(matches(v, e) for e in exempt)]
    return [family_arm(family, seed, **v) for v in variants for seed in seeds]


def plateau_bound(unigram: float) -> float:
    """The loss a gated variant must end at or below: the method's margin under the unigram baseline."""
    margin: float = design()["plateau_margin"]
    return unigram - margin


def probe(cfg: Config, project: Path, arm: Arm, steps: int, run_dir: Path) -> dict[str, Any]:
    """One arm of the family trained for ``steps`` as the stage trains it, and its capped loss."""
    started = time.perf_counter()
    clean_state()  # one thread, as a stage's worker trains an arm
    sized = cfg.replace(**{"ablation.xiong_steps": steps})
    arm_cfg = arm_config(sized, arm, families(sized)["xiong"])
    result = run_arm(arm_cfg, project, run_dir / f"{steps}" / f"{arm.variant}-s{arm.seed}")
    metrics = arm_metrics(result, arm_cfg)
    return {
        "steps": steps,
        "variant": arm.variant,
        "seed": arm.seed,
        "capped_loss": capped_loss(metrics),
        "val_loss": metrics["val_loss"],
        "status": metrics["status"],
        "seconds": time.perf_counter() - started,
    }


def choose_steps(probes: Sequence[dict[str, Any]], expected: int, bound: float) -> int | None:
    """The rule: the smallest candidate length with all ``expected`` probes (gated variants x sizing
    seeds) run and every capped loss at or below ``bound``; None if no length has."""
    by_steps: dict[int, list[float]] = {}
    for p in probes:
        by_steps.setdefault(int(p["steps"]), []).append(float(p["capped_loss"]))
    return next(
        (n for n in sorted(by_steps) if len(by_steps[n]) == expected and max(by_steps[n]) <= bound),
        None,
    )


def summary(cfg: Config, probes: Sequence[dict[str, Any]], unigram: float) -> dict[str, Any]:
    """What the rule picks from the probes, and the numbers it read: per length, the worst gated
    variant's loss at each sizing seed."""
    bound = plateau_bound(unigram)
    expected = len(gated_arms(cfg, cfg.ablation.sizing_seeds))
    worst: dict[str, dict[str, float]] = {}
    for p in probes:
        by_seed = worst.setdefault(str(p["steps"]), {})
        by_seed[str(p["seed"])] = max(by_seed.get(str(p["seed"]), float("-inf")), float(p["capped_loss"]))
    return {
        "sizing_seeds": cfg.ablation.sizing_seeds,
        "unigram_val_loss": unigram,
        "bound": bound,
        "probes_per_length": expected,
        "worst_gated_loss": worst,
        "xiong_steps": choose_steps(probes, expected, bound),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--project", type=Path, default=Path.cwd(), help="the project (its params.yaml and data)")
    add_config_arguments(parser, params=False)
    parser.add_argument("--out", type=Path, required=True, help="JSON file for the probes and what the rule picks")
    parser.add_argument("--steps", type=int, nargs="+", help="candidate lengths to run (default: all of them)")
    parser.add_argument("--seeds", type=int, nargs="+", help="sizing seeds to run (default: all of them)")
    parser.add_argument("--from", dest="sources", type=Path, nargs="+", help="apply the rule to these probe files")
    args = parser.parse_args(argv)
    cfg = load_config(args.project / "params.yaml", args.profile, parse_sets(args.sets))
    a = cfg.ablation
    unigram = float(unigram_baseline(args.project / MANIFEST, a.seq_len)["unigram_val_loss"])
    probes: list[dict[str, Any]] = []
    if args.sources:
        probes = [p for source in args.sources for p in json.loads(source.read_text())["probes"]]
    else:
        for steps in args.steps or a.sizing_xiong_steps:
            for arm in gated_arms(cfg, args.seeds or a.sizing_seeds):
                probes.append(probe(cfg, args.project, arm, steps, args.out.parent / "xiong_sizing"))
                print(json.dumps(probes[-1]), flush=True)
    result = {"summary": summary(cfg, probes, unigram), "probes": probes}
    write_json(args.out, result)
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    sys.exit(run_private(main))
