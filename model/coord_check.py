"""μP coordinate check (Yang et al. 2022, "Tensor Programs V", §D.1): the mean |activation| of
every layer after a few AdamW steps at one learning rate, at several widths.

Under μP these stay put as the width grows; under the standard parametrization the same LR makes
them blow up with width. tests/test_mup.py pins that; the search stage draws it
(reports/search/coord_check.png).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from model.config import ModelConfig, MupConfig, OptimConfig, Parametrization
from model.gpt import GPT
from model.optim import build_adamw, set_lr


def activations(model: GPT, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Output of every layer on input ``x``, captured with forward hooks."""
    out: dict[str, torch.Tensor] = {}

    def keep(name: str) -> Callable[[torch.nn.Module, tuple[torch.Tensor, ...], torch.Tensor], None]:
        return lambda _module, _inputs, output: out.__setitem__(name, output.detach())

    hooks = [
        model.layers[0].register_forward_pre_hook(lambda _module, inputs: out.__setitem__("embed", inputs[0].detach()))
    ]
    for i, block in enumerate(model.layers):
        hooks += [
            block.attn.register_forward_hook(keep(f"block{i}.attn")),
            block.mlp.register_forward_hook(keep(f"block{i}.mlp")),
            block.register_forward_hook(keep(f"block{i}")),
        ]
    try:
        with torch.no_grad():
            out["logits"], _, _ = model(x)
    finally:
        for h in hooks:
            h.remove()
    return out


def coord_check(
    parametrization: Parametrization,
    widths: Sequence[int],
    steps: int,
    lr: float,
    *,
    base_width: int,
    n_layer: int = 2,
    n_head: int = 4,
    seq_len: int = 16,
    batch: int = 8,
    vocab: int = 128,
    seed: int = 0,
) -> dict[str, list[float]]:
    """Mean |activation| per layer after ``steps`` AdamW steps at constant ``lr``, one value per width.

    Returns ``{layer: [value per width]}`` with layers ``embed``, ``block{i}.attn``,
    ``block{i}.mlp``, ``block{i}`` and ``logits``, plus ``<layer>:update``: mean |a_t - a_0|, how
    far that output moved from init. Init and data are seeded, and the batch is the same at every
    width, so the width is the only thing that changes along a list.
    """
    g = torch.Generator().manual_seed(seed + 1)
    idx = torch.randint(0, vocab, (batch, seq_len + 1), generator=g)
    x, y = idx[:, :-1], idx[:, 1:]
    out: dict[str, list[float]] = {}
    for width in widths:
        torch.manual_seed(seed)
        cfg = ModelConfig(n_layer=n_layer, n_head=n_head, d_model=width, seq_len=seq_len)
        model = GPT(cfg, MupConfig(parametrization=parametrization, base_width=base_width), vocab)
        at_init = activations(model, x)
        opt = build_adamw(model, OptimConfig(lr=lr, weight_decay=0.0, grad_clip=0.0))
        set_lr(opt, lr)  # applies each group's μP lr_mult
        for _ in range(steps):
            _, ce, z = model(x, y)
            opt.zero_grad(set_to_none=True)
            (ce + z).backward()
            opt.step()
        trained = activations(model, x)
        for name, a in trained.items():
            out.setdefault(name, []).append(a.abs().mean().item())
            out.setdefault(f"{name}:update", []).append((a - at_init[name]).abs().mean().item())
    return out
