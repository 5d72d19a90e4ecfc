"""The measurement probes (model/probes.py): fp16 range shares, the RangeProbe callback, and the
depth probe of gradient norms at init."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from trainer_kit import markov_tokens, tiny_config

from model.callbacks import Callback
from model.config import ModelConfig, PrecisionConfig
from model.gpt import GPT
from model.optim import build_adamw
from model.precision import FP16_MAX, FP16_SMALLEST_NORMAL, FP16_SMALLEST_SUBNORMAL, resolve_precision
from model.probes import (
    QUANTITIES,
    RangeProbe,
    RangeRecorder,
    finite_forward,
    fp16_range_shares,
    gradient_norms_at_init,
    overflow_multiplier,
    summarize_depth,
    underflow_by_shift,
)
from model.step import TrainModule
from model.train import Trainer, train

TOKENS, VAL = np.split(markov_tokens(24_000, vocab=64), [20_000])
SMALL = ModelConfig(d_model=32, n_head=2, seq_len=16)


def test_fp16_limits_are_where_a_cast_to_half_overflows_and_flushes():
    half_info = torch.finfo(torch.float16)
    assert (half_info.max, half_info.tiny) == (FP16_MAX, FP16_SMALLEST_NORMAL)
    half = torch.tensor([FP16_MAX, 65520.0, FP16_SMALLEST_SUBNORMAL, 2.0**-26]).half().float()
    assert half.tolist() == [FP16_MAX, math.inf, FP16_SMALLEST_SUBNORMAL, 0.0]


def test_range_shares_are_shares_of_the_nonzero_elements():
    t = torch.tensor([0.0, 1e-9, 2.0**-25, 2.0**-23, 1.0, 7e4, -7e4])
    # Nonzero: 6. Below 2^-24: 1e-9, 2^-25. Below 2^-14: those and 2^-23. Above 65504: ±7e4.
    assert fp16_range_shares(t) == {"count": 6, "below_subnormal": 2 / 6, "below_normal": 3 / 6, "above_max": 2 / 6}
    assert math.isnan(fp16_range_shares(torch.zeros(3))["below_subnormal"])


def _step_under_loss_scale(scale: float) -> dict[tuple[str, str], float]:
    """Range shares of one fp32 forward/backward of the project's step with a GradScaler at ``scale``."""
    cfg = tiny_config()
    torch.manual_seed(0)
    model = GPT(cfg.model, cfg.mup, cfg.tokenizer.vocab_size)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    module = TrainModule(model, build_adamw(model, cfg.optim), scaler, resolve_precision(PrecisionConfig(), "cpu"), 1.0)
    batch = torch.from_numpy(TOKENS[: 4 * 17].astype(np.int64)).view(4, 17)
    with RangeRecorder(model) as recorder:
        module.forward_backward(1, [(batch[:, :-1], batch[:, 1:])])
    return recorder.shares()


def test_a_loss_scale_of_2_pow_minus_30_pushes_the_gradients_below_fp16s_subnormal():
    unscaled, tiny = _step_under_loss_scale(1.0), _step_under_loss_scale(2.0**-30)
    for layer in ("block0", "block1"):
        for quantity in ("act_grad_below_subnormal", "param_grad_below_subnormal"):
            assert unscaled[(layer, quantity)] < 0.01
            assert tiny[(layer, quantity)] > 0.99


def test_activations_beyond_fp16s_max_count_as_overflow():
    cfg = tiny_config()
    model = GPT(cfg.model, cfg.mup, cfg.tokenizer.vocab_size)
    with torch.no_grad():
        model.wte.weight.fill_(1e5)  # Pre-LN carries the embedding along the residual stream
    with RangeRecorder(model) as recorder:
        model(torch.zeros(2, 8, dtype=torch.long))
    shares = recorder.shares()
    assert shares[("block0", "act_above_max")] == shares[("block1", "act_above_max")] == 1.0
    assert shares[("block0", "mlp_pre_above_max")] == 0.0  # the MLP reads the normalised stream


def scaled_block(model: GPT, block: int, factor: float) -> GPT:
    scaled = copy.deepcopy(model)
    with torch.no_grad():
        for p in scaled.blocks[block].parameters():
            if p.dim() == 2:
                p.mul_(factor)
    return scaled


@pytest.mark.parametrize("block", [0, 1])
def test_the_overflow_multiplier_is_the_first_power_of_two_that_overflows_fp16_and_not_bf16(block):
    cfg = tiny_config()
    torch.manual_seed(0)
    model = GPT(cfg.model, cfg.mup, cfg.tokenizer.vocab_size)
    weights = copy.deepcopy(model.state_dict())
    batch = torch.from_numpy(TOKENS[: 4 * 17].astype(np.int64)).view(4, 17)
    x, y = batch[:, :-1], batch[:, 1:]
    m = overflow_multiplier(model, x, y, block)
    assert m >= 2.0 and math.log2(m).is_integer()
    assert finite_forward(scaled_block(model, block, m / 2), x, y, "fp16")  # the last multiplier that does not
    assert not finite_forward(scaled_block(model, block, m), x, y, "fp16")
    assert finite_forward(scaled_block(model, block, m), x, y, "bf16")
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())  # measured on a copy


def test_the_overflow_multiplier_refuses_when_no_power_of_two_up_to_the_bound_overflows():
    cfg = tiny_config()
    model = GPT(cfg.model, cfg.mup, cfg.tokenizer.vocab_size)
    x = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="block 0: no multiplier up to 2\\^1 overflows fp16"):
        overflow_multiplier(model, x, x, 0, max_doublings=1)


@pytest.mark.parametrize("shift", [0, 9, 16])
def test_one_pass_gives_the_underflow_share_a_run_at_each_loss_shift_measures(shift):
    # The probe reads every k off one unshifted backward; a run with precision.loss_shift = k, its
    # RangeProbe at step 1 (same init, same first batch), must find exactly that share.
    cfg = tiny_config(**{"train.steps": 1, "schedule.warmup_steps": 0, "precision.mode": "fp32"})
    probe_trainer = Trainer(cfg, TOKENS, VAL)
    x, y = probe_trainer.loader.next_batch()
    shares = underflow_by_shift(probe_trainer.model, x, y, [0, 9, 16])
    ranges = RangeProbe(every=100)
    Trainer(cfg.replace(**{"precision.loss_shift": shift}), TOKENS, VAL, [ranges]).run()
    measured = max(r.share for r in ranges.rows if r.quantity == "act_grad_below_subnormal" and r.step == 1)
    assert shares[shift] == measured


def test_the_underflow_share_grows_with_the_shift_until_every_gradient_is_below_the_subnormal():
    cfg = tiny_config()
    trainer = Trainer(cfg, TOKENS, VAL)
    x, y = trainer.loader.next_batch()
    shares = underflow_by_shift(trainer.model, x, y, range(41))
    values = [shares[k] for k in range(41)]
    assert values == sorted(values) and values[0] < 0.01 and values[40] == 1.0
    assert not any(block._backward_hooks or block._forward_hooks for block in trainer.model.layers)


def test_range_probe_reports_every_block_and_quantity_at_step_one_and_every_n_steps():
    probe = RangeProbe(every=3)
    trainer = Trainer(tiny_config(**{"train.steps": 7}), TOKENS, VAL, [probe])
    trainer.run()
    assert sorted({row.step for row in probe.rows}) == [1, 3, 6]
    at_step_3 = {(row.layer, row.quantity) for row in probe.rows if row.step == 3}
    assert at_step_3 == {(layer, q) for layer in ("block0", "block1") for q in QUANTITIES}
    assert len(probe.rows) == 3 * len(at_step_3)
    assert all(0.0 <= row.share <= 1.0 for row in probe.rows)
    assert probe.recorder is None and not any(block._forward_hooks for block in trainer.model.blocks)


class StopAfter(Callback):
    def __init__(self, step: int):
        self.step = step

    def on_step_start(self, trainer) -> None:
        if trainer.step + 1 == self.step:
            trainer.request_stop("test")


def test_range_probe_rows_survive_a_checkpoint_resume(tmp_path):
    cfg = tiny_config(**{"train.steps": 6, "checkpoint.every_steps": 2})
    straight, first, second = RangeProbe(every=2), RangeProbe(every=2), RangeProbe(every=2)
    train(cfg, TOKENS, VAL, tmp_path / "straight", [straight])
    assert train(cfg, TOKENS, VAL, tmp_path / "resumed", [first, StopAfter(3)])["status"] == "stopped"
    assert train(cfg, TOKENS, VAL, tmp_path / "resumed", [second])["start_step"] == 3
    assert second.rows == straight.rows and len({row.step for row in straight.rows}) == 4


def test_range_probe_refuses_a_cadence_below_one():
    with pytest.raises(ValueError, match="every"):
        RangeProbe(every=0)


def test_depth_probe_gives_a_positive_finite_norm_per_block_and_the_readout():
    norms = gradient_norms_at_init(SMALL, depth=3, block="post_ln", batch=2)
    assert list(norms) == ["block0", "block1", "block2", "readout"]
    assert all(math.isfinite(v) and v > 0 for v in norms.values())


def test_depth_probe_is_bitwise_deterministic_for_a_seed_and_leaves_the_global_rng_alone():
    torch.manual_seed(7)
    before = torch.random.get_rng_state()
    a = gradient_norms_at_init(SMALL, depth=2, block="pre_ln", seeds=(3,), batch=2)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert gradient_norms_at_init(SMALL, depth=2, block="pre_ln", seeds=(3,), batch=2) == a
    assert gradient_norms_at_init(SMALL, depth=2, block="pre_ln", seeds=(4,), batch=2) != a


def test_depth_summary_fits_the_log_log_slope_of_the_last_block():
    # Pre-LN as Xiong et al. predict (last block ∝ 1/√L), Post-LN flat; first block 1.0.
    sweep = {
        (block, L): {**{f"block{i}": 1.0 for i in range(L - 1)}, f"block{L - 1}": last, "readout": 1.0}
        for L in (2, 4, 8)
        for block, last in (("pre_ln", 3.0 / math.sqrt(L)), ("post_ln", 2.0))
    }
    summary = summarize_depth(sweep)
    assert summary.slopes["pre_ln"] == pytest.approx(-0.5) and summary.slopes["post_ln"] == pytest.approx(0.0)
    row = next(r for r in summary.rows if r["block"] == "pre_ln" and r["depth"] == 4)
    assert row["last"] == 1.5 and row["last_over_first"] == 1.5
