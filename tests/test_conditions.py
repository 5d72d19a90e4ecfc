"""The conditions two findings need (tasks/ablate/conditions.py): the loss shift chosen by the
one-step probe (the smallest k reaching the registered underflow share, exactly at it included,
none when no k up to 16 does), and the overflow injection sized by its probe at the injection step."""

from __future__ import annotations

import math

import torch
from trainer_kit import markov_tokens, tiny_config

from model.probes import finite_forward
from model.spike.injections import Injection
from model.train import Trainer
from tasks.ablate.conditions import MAX_PROBE_SHIFT, OverflowProbeSpike, loss_shift_probe, probe_batch
from tests.test_search import tiny_project

ARM_SCALE = {
    "ablation.d_model": 32,
    "ablation.n_layer": 1,
    "ablation.n_head": 2,
    "ablation.seq_len": 16,
    "ablation.batch_size": 4,
}


def probe(tmp_path, target: float) -> dict:
    project = tmp_path / "project"
    if not project.exists():
        tiny_project(project)
    return loss_shift_probe(tiny_config(**{**ARM_SCALE, "ablation.underflow_target": target}), project)


def test_the_loss_shift_is_the_smallest_k_whose_share_reaches_the_target_exactly_at_it_included(tmp_path):
    first = probe(tmp_path, 0.1)
    shares = {int(k): v for k, v in first["shares"].items()}
    assert sorted(shares) == list(range(MAX_PROBE_SHIFT + 1))
    k = first["k"]
    assert k is not None and shares[k] >= 0.1 and (k == 0 or shares[k - 1] < 0.1)
    assert probe(tmp_path, shares[k])["k"] == k, "a share exactly at the target reaches it"
    above = math.nextafter(shares[k], 1.0)
    assert probe(tmp_path, above)["k"] == next((j for j in range(k + 1, 17) if shares[j] >= above), None)


def test_no_loss_shift_up_to_16_reaching_the_target_leaves_the_condition_unreached(tmp_path):
    shares = probe(tmp_path, 0.1)["shares"]
    beyond = math.nextafter(shares[str(MAX_PROBE_SHIFT)], 1.0)
    assert beyond < 1.0, "this tiny model keeps some gradients above 2^-24 even at k = 16"
    assert probe(tmp_path, beyond)["k"] is None


def test_the_overflow_injection_takes_fp16s_forward_just_past_its_range_and_not_bf16s():
    cfg = tiny_config(**{"precision.mode": "fp32"})
    tokens = markov_tokens(20_000)
    trainer = Trainer(cfg, tokens, markov_tokens(4_000, seed=1))
    x, y = probe_batch(markov_tokens(4_000, seed=1), cfg.model.seq_len, cfg.train.batch_size)
    spike = OverflowProbeSpike(Injection("param", 1, 0, 1, 0.0, 0, "once"), (x, y))
    before = [p.clone() for p in trainer.model.block_matrices(0)]
    spike.on_step_start(trainer)  # the step about to run is step 1: the injection's
    m = spike.multiplier
    assert m is not None and m >= 2.0 and math.log2(m).is_integer()
    assert all(torch.equal(p, b * m) for p, b in zip(trainer.model.block_matrices(0), before))
    assert not finite_forward(trainer.model, x, y, "fp16") and finite_forward(trainer.model, x, y, "bf16")
    with torch.no_grad():
        for p in trainer.model.block_matrices(0):
            p.div_(2.0)
    assert finite_forward(trainer.model, x, y, "fp16"), "half the multiplier leaves fp16 in range"
    assert spike.state_dict() == {"multiplier": m}
