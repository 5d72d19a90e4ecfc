"""Ablation arms of one shape trained as one fused group (model/fused.py), each arm's result written
as ``python -m tasks.ablate.arm`` writes it: the same probes, the same record (tasks/ablate/arm.py:
ArmProbes), the same cache key; the provenance names the fused trainer, and its ``numeric_path``
differs from the single arm's (other kernels: the same arm within rounding, not bitwise). Arms with
an injected spike or the fp16 range probe steer single steps and train alone (run_arm).

    python -m tasks.ablate.fused group.json     # a JSON list: each arm's python -m tasks.ablate.arm arguments

The gpu study's window trains its fused groups with this command (tasks/gpu_study/window.py); the
plan marks which arms may fuse (:func:`fusion_key`).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from model.data import open_split
from model.fused import PER_ARM, FusedArms, shared_settings, why_alone
from model.private import private_run_dir, run_private
from model.provenance import with_trainer
from model.typed_config import UserError, parse_sets
from tasks.ablate.arm import MANIFEST, ArmProbes, parser, write_result
from tasks.ablate.grid import arm_key, code_digest, data_hashes
from tasks.config import Config, load_config


def run_fused(
    cfgs: list[Config], project: Path, outs: list[Path], data: Path = MANIFEST.parent
) -> list[dict[str, Any]]:
    """Train the arms ``cfgs`` describe as one group into ``outs`` (one folder each) on the
    tokenize output in ``data`` (relative to ``project``); returns (and writes) their results."""
    manifest = project / data / MANIFEST.name
    hashes, code = data_hashes(manifest), code_digest()
    keys = [arm_key(cfg, hashes, code, "none", 0) for cfg in cfgs]
    train_tokens, val_tokens = open_split(manifest, "train"), open_split(manifest, "val")
    probes = [ArmProbes(cfg, manifest, val_tokens) for cfg in cfgs]
    group = FusedArms(cfgs, train_tokens, val_tokens, [p.callbacks for p in probes], keys)
    results = [p.record(key, summary) for p, key, summary in zip(probes, keys, group.run(), strict=True)]
    for result in results:  # the same arm, other bits than python -m tasks.ablate.arm's: said where they are compared
        result["provenance"] = with_trainer(result["provenance"], f"model/fused.py, {len(cfgs)} arms")
    for out, result in zip(outs, results, strict=True):
        write_result(private_run_dir(out, "arm folder") / "result.json", result)
    return results


def fusion_key(arguments: list[str], project: Path) -> str | None:
    """A digest equal for exactly the arms that may train in one fused group (their shared
    settings, data and params file); None for an arm that trains alone (an injected spike, the
    range probe, or what model/fused.py: why_alone names). Arms whose arguments differ only in
    ``--out`` and :data:`PER_ARM` keys have one key, computed once (a plan's hundreds of arms)."""
    return _fusion_key(tuple(_shape_arguments(arguments)), project)


def _shape_arguments(arguments: list[str]) -> list[str]:
    """``arguments`` without ``--out`` and the ``--set`` of a key arms of one group may differ in."""
    kept: list[str] = []
    rest = iter(arguments)
    for argument in rest:
        if argument == "--out":
            next(rest, None)  # its value
        elif not argument.startswith("--out=") and not _per_arm_set(argument):
            kept.append(argument)
    return kept


def _per_arm_set(argument: str) -> bool:
    return argument.startswith("--set=") and argument.removeprefix("--set=").split("=")[0] in PER_ARM


@functools.cache
def _fusion_key(arguments: tuple[str, ...], project: Path) -> str | None:
    args, cfg = _parsed([*arguments, "--out", "unused"], project)
    if args.spike != "none" or args.range_probe_every or why_alone(cfg):
        return None
    shared = {**shared_settings(cfg), "--data": args.data, "--params": args.params}
    return hashlib.sha256(json.dumps(shared, sort_keys=True, default=str).encode()).hexdigest()[:16]


def run_group(group: list[list[str]], project: Path) -> list[dict[str, Any]]:
    """Train the arms whose ``python -m tasks.ablate.arm`` arguments ``group`` lists as one fused
    group, each into its own ``--out``; a :class:`UserError` names an arm that cannot join."""
    if not group:
        raise UserError("a fused group needs at least one arm")
    parsed = [_parsed(arguments, project) for arguments in group]
    for i, (args, _) in enumerate(parsed):
        if args.spike != "none" or args.range_probe_every:
            raise UserError(f"arm {i}: --spike/--range-probe-every steer single steps; that arm trains alone")
        if (args.data, args.params) != (parsed[0][0].data, parsed[0][0].params):
            raise UserError(f"arm {i}: --data/--params differ from arm 0's; a group trains on one data set")
    params = (project / parsed[0][0].params).resolve()
    outs = [project / args.out for args, _ in parsed]
    return run_fused([cfg for _, cfg in parsed], params.parent, outs, Path(parsed[0][0].data))


def _parsed(arguments: list[str], project: Path) -> tuple[argparse.Namespace, Config]:
    args = parser().parse_args(arguments)
    return args, load_config(project / args.params, args.profile, parse_sets(args.sets))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tasks.ablate.fused", description=__doc__.split("\n\n")[0])
    p.add_argument("group", type=Path, help="a JSON list of each arm's python -m tasks.ablate.arm arguments")
    args = p.parse_args(argv)
    try:
        group = json.loads(args.group.read_text())
        if not isinstance(group, list) or not all(
            isinstance(a, list) and all(isinstance(x, str) for x in a) for a in group
        ):
            raise UserError("not a JSON list of argument lists (each arm's python -m tasks.ablate.arm arguments)")
        results = run_group(group, Path.cwd())
    except (OSError, ValueError) as e:  # UserError is a ValueError, and so is bad JSON
        print(f"spikelab: error: {args.group}: {e}", file=sys.stderr)
        return 2
    for result in results:  # a diverged arm is a result, as the single arm's exit 3 is
        summary = result["summary"]
        print(json.dumps({"key": result["key"], **{k: summary[k] for k in ("status", "diverged_at", "final_loss")}}))
    return 0


if __name__ == "__main__":
    sys.exit(run_private(main))
