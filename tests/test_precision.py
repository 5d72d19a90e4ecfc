"""Precision modes: each trains; CPU emulation matches real autocast; fp16 range vs bf16 range."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from trainer_kit import Recorder, markov_tokens, tiny_config

from model.config import PrecisionConfig
from model.gpt import GPT
from model.precision import resolve_precision
from model.train import train

TOKENS = markov_tokens(20_000, vocab=64)  # a 64-token language in a 257-token vocabulary


@pytest.mark.parametrize(
    "mode, emulate, loss_scaling",
    [
        ("fp32", "auto", True),
        ("bf16", "always", True),
        ("fp16", "always", True),
        ("fp16", "always", False),
        ("bf16", "never", True),  # real CPU autocast (slow, tiny model)
        ("fp16", "never", True),
    ],
)
def test_each_precision_mode_trains_and_the_loss_falls(mode, emulate, loss_scaling):
    cfg = tiny_config(
        **{
            "train.steps": 25,
            "precision.mode": mode,
            "precision.emulate": emulate,
            "precision.loss_scaling": loss_scaling,
            "precision.init_scale": 1024.0,
        }
    )
    rec = Recorder()
    summary = train(cfg, TOKENS, TOKENS[:4000], callbacks=[rec])
    losses = [v for _, v in rec.series("train/loss")]
    assert summary["precision"].startswith(mode)
    assert ("emulated" in summary["precision"]) == (mode != "fp32" and emulate == "always")
    assert losses[-1] < losses[0] - 1.0, losses
    assert summary["skipped"] == 0


def _loss_logits_grads(model, x, y, mode, emulate):
    precision = resolve_precision(PrecisionConfig(mode=mode, emulate=emulate), "cpu")
    model.zero_grad()
    with precision.autocast():
        logits, ce, _ = model(x, y)
    ce.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return ce.item(), logits.detach().float(), grads


@pytest.mark.parametrize("mode, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_emulation_matches_real_autocast_within_tolerance(mode, dtype):
    """Stated tolerance, eps = machine epsilon of the low-precision type:
    loss within 0.1·eps·|loss|, logits within 2 ulps (2·eps·max|logit|), gradients within
    eps/2 relative L2, and closer to real autocast than fp32 is."""
    cfg = tiny_config()
    torch.manual_seed(0)
    model = GPT(cfg.model, cfg.mup, cfg.tokenizer.vocab_size)
    x, y = torch.randint(0, 257, (4, 16)), torch.randint(0, 257, (4, 16))
    eps = torch.finfo(dtype).eps
    loss_emu, logits_emu, grads_emu = _loss_logits_grads(model, x, y, mode, "always")
    loss_real, logits_real, grads_real = _loss_logits_grads(model, x, y, mode, "never")
    _, _, grads_fp32 = _loss_logits_grads(model, x, y, "fp32", "never")

    assert abs(loss_emu - loss_real) <= 0.1 * eps * abs(loss_real)
    assert (logits_emu - logits_real).abs().max() <= 2 * eps * logits_real.abs().max()
    rel_emu = ((grads_emu - grads_real).norm() / grads_real.norm()).item()
    rel_fp32 = ((grads_fp32 - grads_real).norm() / grads_real.norm()).item()
    assert rel_emu <= eps / 2
    assert rel_emu < rel_fp32


def _loss_with_large_activation(mode: str, emulate: str) -> torch.Tensor:
    """Block 0's MLP input weights × 1e4: the SwiGLU product reaching the MLP's output projection
    is ~1e6, beyond fp16's largest finite value (65504) and well inside bf16's range."""
    cfg = tiny_config()
    torch.manual_seed(0)
    model = GPT(cfg.model, cfg.mup, cfg.tokenizer.vocab_size)
    with torch.no_grad():
        model.blocks[0].mlp.up.weight.mul_(1e4)
    x = torch.randint(0, 257, (2, 16))
    with resolve_precision(PrecisionConfig(mode=mode, emulate=emulate), "cpu").autocast():
        _, ce, _ = model(x, x)
    return ce


@pytest.mark.parametrize("emulate", ["always", "never"])
def test_fp16_overflows_to_inf_where_bf16_does_not(emulate):
    assert not torch.isfinite(_loss_with_large_activation("fp16", emulate))
    assert torch.isfinite(_loss_with_large_activation("bf16", emulate))
    assert torch.isfinite(_loss_with_large_activation("fp32", emulate))


def test_emulated_fp16_rounds_matmul_outputs_like_the_real_type():
    precision = resolve_precision(PrecisionConfig(mode="fp16", emulate="always"), "cpu")
    x = torch.tensor([[65504.0], [65519.0], [65520.0], [1e-8]])  # (4, 1): one product per row
    with precision.autocast():
        y = F.linear(x, torch.ones(1, 1))
    assert y.dtype == torch.float32
    assert y.flatten().tolist() == [65504.0, 65504.0, float("inf"), 0.0]  # 1e-8 underflows
