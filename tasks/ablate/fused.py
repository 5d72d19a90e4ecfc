"""Ablation arms of one shape trained as one fused group (model/fused.py), each arm's result written
as ``python -m tasks.ablate.arm`` writes it: the same probes, the same record (tasks/ablate/arm.py:
ArmProbes), the same cache key; the provenance names the fused trainer, and its ``numeric_path``
differs from the single arm's (other kernels: the same arm within rounding, not bitwise). Arms with
an injected spike or the fp16 range probe steer single steps and train alone (run_arm)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from model.data import open_split
from model.fused import FusedArms
from model.private import private_run_dir
from model.provenance import with_trainer
from tasks.ablate.arm import MANIFEST, ArmProbes, write_result
from tasks.ablate.grid import arm_key, code_digest, data_hashes
from tasks.config import Config


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
