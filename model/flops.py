"""Model FLOPs per token and MFU: the one place these numbers are defined.

flops/token = 6·N + 12·L·H·Q·T   (PaLM, Chowdhery et al. 2022, App. B; nanoGPT ``estimate_mfu``)
  6·N           forward (2) + backward (4) FLOPs of every weight matrix applied to each token
  12·L·H·Q·T    the attention scores and the weighted sum of values (causal masking not discounted)
MFU = tokens/s · flops/token / peak FLOP/s of the device.
"""

from __future__ import annotations

import torch

from model.config import TrainingConfig
from model.gpt import GPT

# Dense bf16 tensor-core peaks (vendor datasheets, no sparsity). Matched as substrings of
# torch.cuda.get_device_name(), first match wins, so the PCIe H100 comes before the SXM one.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM
    ("H200", 989e12),
    ("A100", 312e12),
)


def flops_per_token(n_params: int, n_layer: int, n_head: int, head_dim: int, seq_len: int) -> float:
    """Training FLOPs per token; ``n_params`` counts the weights applied by a matmul per token."""
    return 6.0 * n_params + 12.0 * n_layer * n_head * head_dim * seq_len


def training_flops(cfg: TrainingConfig) -> float:
    """A run's training FLOPs from its config alone, before any model is built: ``flops_per_token``
    with N the blocks' matrices (12·L·d² for attention and a 4x MLP) and the readout (d·V), times
    the tokens it trains on. Progress lines weigh their ETA by it (units differ by width, depth
    and steps: a trial at 4x the width costs about 16x, not 1x)."""
    m, t = cfg.model, cfg.train
    n = 12 * m.n_layer * m.d_model**2 + m.d_model * cfg.tokenizer.vocab_size
    tokens = t.steps * t.batch_size * t.grad_accum * m.seq_len
    return tokens * flops_per_token(n, m.n_layer, m.n_head, m.d_model // m.n_head, m.seq_len)


def model_flops_per_token(model: GPT) -> float:
    """N excludes the embedding lookups (no matmul) but keeps an untied readout (a real matmul);
    with tied embeddings the shared matrix is counted once, as the readout (nanoGPT)."""
    cfg = model.cfg
    n = model.num_params(non_embedding=True)  # all but the position embedding
    if not cfg.tie_embeddings:
        n -= model.wte.weight.numel()
    return flops_per_token(n, cfg.n_layer, cfg.n_head, cfg.d_model // cfg.n_head, cfg.seq_len)


def peak_flops(device: torch.device) -> float | None:
    """Peak dense bf16 FLOP/s of a known accelerator; None when unknown (e.g. any CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in name), None)


def mfu(tokens_per_s: float, flops_per_tok: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation in [0, 1]; None when the peak is unknown."""
    return None if peak is None else tokens_per_s * flops_per_tok / peak
