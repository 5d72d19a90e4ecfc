"""μP coordinate check (Yang et al. 2022, "Tensor Programs V", §D.1; model/coord_check.py).

Train a few AdamW steps at one fixed learning rate at several widths, then record the mean absolute
coordinate of every layer's output (embedding, each attention and MLP branch, each block, the
logits) and of how far it moved from its value at init. Under μP these stay put as the width
grows; under the standard parametrization the same LR makes them blow up with width. If the μP
wiring in ``model/gpt.py`` (multipliers, init) or ``model/optim.py`` (per-group LR) breaks, the μP
curves stop being flat and :func:`test_mup_activations_do_not_grow_with_width` fails.

Checked by mutation (scratch copies of model/, not committed): the μP test fails with the logit
multiplier not divided by m, with hidden LR not divided by m, with hidden or residual-output init
not scaled by 1/√m, with the readout LR divided by m, and with the embedding LR divided by m. It
does not see an SP-style 1/√d_head attention scale: with the query zero-initialised, five steps
are too few for q·k to develop (that scale is pinned in test_model.py instead).
"""

from __future__ import annotations

import pytest
import torch

from model.config import ModelConfig, MupConfig, OptimConfig
from model.coord_check import coord_check as _coord_check
from model.gpt import GPT
from model.optim import build_adamw, set_lr

WIDTHS = (64, 128, 256, 512)
BASE_WIDTH = 64
STEPS = 5
LR = 3e-3  # the same LR for both parametrizations; μP transfers it, SP does not
VOCAB = 128
FLAT = 1.6  # μP: largest/smallest value across widths (seen: <= 1.3; broken wiring: >= 2.9)
GROWS = 3.0  # SP: widest/narrowest width (seen: >= 5)


def coord_check(parametrization: str) -> dict[str, list[float]]:
    return _coord_check(parametrization, WIDTHS, STEPS, LR, base_width=BASE_WIDTH, vocab=VOCAB)


def spread(values: list[float]) -> float:
    """Largest over smallest value across widths."""
    return max(values) / min(values)


def growth(values: list[float]) -> float:
    """Widest over narrowest width."""
    return values[-1] / values[0]


def show(values: list[float]) -> str:
    return f"{[f'{v:.3g}' for v in values]} at widths {list(WIDTHS)}"


@pytest.fixture(scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def mup_coords(_one_thread) -> dict[str, list[float]]:
    return coord_check("mup")


@pytest.fixture(scope="module")
def sp_coords(_one_thread) -> dict[str, list[float]]:
    return coord_check("sp")


def test_coord_check_records_every_layer_at_every_width(mup_coords):
    layers = {"embed", "block0.attn", "block0.mlp", "block0", "block1.attn", "block1.mlp", "block1", "logits"}
    assert set(mup_coords) == layers | {f"{name}:update" for name in layers}
    for name, values in mup_coords.items():
        assert len(values) == len(WIDTHS), name
        assert all(v > 0 for v in values), name  # trained: even the zero-init readout moved


def test_mup_activations_do_not_grow_with_width(mup_coords):
    bad = {name: show(values) for name, values in mup_coords.items() if not spread(values) < FLAT}
    assert not bad, f"μP coordinates vary more than {FLAT}x across widths: {bad}"


def test_sp_activations_blow_up_with_width_at_the_same_lr(sp_coords):
    assert growth(sp_coords["logits"]) > GROWS, show(sp_coords["logits"])
    for name in ("block0", "block1", "block0:update", "block1:update"):
        values = sp_coords[name]
        assert growth(values) > GROWS, (name, show(values))
        # and monotonically: every doubling of width makes it worse
        assert all(a < b for a, b in zip(values, values[1:])), (name, show(values))


def test_mup_and_sp_coincide_at_the_base_width():
    """m = 1: same init, multipliers, attention scale and LRs, once μP's zero-inits are off."""
    torch.manual_seed(0)
    idx = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    x, y = idx[:, :-1], idx[:, 1:]
    cfg = ModelConfig(n_layer=2, n_head=4, d_model=BASE_WIDTH, seq_len=8)
    losses = {}
    for p in ("sp", "mup"):
        torch.manual_seed(0)
        model = GPT(
            cfg,
            MupConfig(parametrization=p, base_width=BASE_WIDTH, zero_init_readout=False, zero_init_query=False),
            VOCAB,
        )
        opt = build_adamw(model, OptimConfig(lr=LR))
        set_lr(opt, LR)
        trace = []
        for _ in range(3):
            _, ce, _ = model(x, y)
            trace.append(ce.item())
            opt.zero_grad()
            ce.backward()
            opt.step()
        losses[p] = trace
    assert losses["mup"] == pytest.approx(losses["sp"], rel=1e-6)
