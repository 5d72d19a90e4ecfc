"""make demo's one decided claim (scripts/demo-studies.yaml, the demo copy's studies.yaml): the fp16
finding's registered claim ``unscaled`` as registered, at the smoke profile's arm scale, whose base
arm is the one the registered loss-shift probe measures, on 6 seeds in two halves."""

from __future__ import annotations

import shutil
from pathlib import Path

from tasks.ablate.grid import expand
from tasks.config import load_config
from tasks.design.preregistration import design
from tasks.design.stats import ALPHA
from tasks.design.studies import STUDIES, builtin_families, read_studies

REPO = Path(__file__).resolve().parents[1]


def demo_family(tmp_path: Path):
    shutil.copy(REPO / "scripts/demo-studies.yaml", tmp_path / STUDIES)
    cfg = load_config(REPO / "params.yaml", "smoke")
    (family,) = read_studies(tmp_path, cfg)
    return cfg, family


def test_the_demos_claim_is_the_registered_fp16_unscaled_claim_with_its_sesoi_and_gate(tmp_path):
    cfg, family = demo_family(tmp_path)
    (claim,) = family.claims
    registered = design()["findings"]["fp16"]["claims"]["unscaled"]
    assert (claim.kind, claim.metric, claim.expected, claim.sesoi) == (
        registered["kind"],
        registered["metric"],
        registered["expected"],
        registered["sesoi"],
    )
    assert (claim.a, claim.b) == (registered["a"], registered["b"])
    gate = registered["gate"]
    assert claim.gate is not None and claim.gate.metric == gate["metric"] and claim.gate.variant == gate["variant"]
    assert dict(claim.gate.bounds) == {"at_least": gate["at_least"], "at_most": gate["at_most"]}
    assert family.seeds and family.confirm_seeds
    seeds = len(family.seeds) + len(family.confirm_seeds)  # the fewest whose exact McNemar can reach α
    assert 2 ** (1 - seeds) < ALPHA <= 2 ** (2 - seeds), "a diverged share on these seeds could never be decided"


def test_the_demos_base_arm_is_the_one_the_registered_loss_shift_probe_measures(tmp_path):
    """The probe (tasks/ablate/conditions.py) runs one step at init of the precision family's fp32
    arm at its first seed: the demo family's fp32 arm at that seed must build the same model, data
    order and loss, so the shift it sets is this family's own."""
    cfg, family = demo_family(tmp_path)
    precision = next(f for f in builtin_families(cfg) if f.name == "precision")
    seed = cfg.ablation.seeds[0]
    assert family.seeds[0] == seed
    probed = precision.overrides(cfg.ablation, {"precision": "fp32"}, seed, loss_shift=5)
    demo = family.overrides(cfg.ablation, {"precision": "fp32"}, seed, loss_shift=5)
    at_init = [
        k for k in probed if k.startswith(("model.", "mup.", "precision.")) or k in ("train.seed", "train.batch_size")
    ]
    assert {k: demo[k] for k in at_init} == {k: probed[k] for k in at_init}
    assert len([a for a in expand(cfg, [family]) if a.family == family.name]) == 3 * 6  # 3 precisions x 6 seeds
