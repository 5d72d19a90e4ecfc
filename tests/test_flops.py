"""FLOPs per token (PaLM App. B) and MFU from the one table of device peaks."""

from __future__ import annotations

import pytest
import torch
from trainer_kit import tiny_config

from model import flops
from model.gpt import GPT


@pytest.mark.parametrize("tied", [False, True])
def test_flops_per_token_is_6n_plus_attention_with_n_the_matmul_weights(tied):
    cfg = tiny_config(**{"model.tie_embeddings": tied})
    model = GPT(cfg.model, cfg.mup, cfg.tokenizer.vocab_size)
    m = cfg.model
    per_block = sum(p.numel() for p in model.blocks[0].parameters())
    n = m.n_layer * per_block + sum(p.numel() for p in model.norm_f.parameters()) + model.readout.weight.numel()
    attention = 12 * m.n_layer * m.n_head * (m.d_model // m.n_head) * m.seq_len
    assert flops.model_flops_per_token(model) == 6 * n + attention


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_peak_flops_by_device_name_and_mfu(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert flops.peak_flops(torch.device("cuda")) == peak
    expected = None if peak is None else 1e5 * 1e9 / peak
    assert flops.mfu(1e5, 1e9, flops.peak_flops(torch.device("cuda"))) == expected


def test_no_peak_and_no_mfu_on_the_cpu():
    assert flops.peak_flops(torch.device("cpu")) is None
    assert flops.mfu(1e5, 1e9, None) is None
