"""The GPT and its optimizer wiring: every switch computes what its name says.

Block variants are checked against hand-written references in float64 built from the block's own
weights; z-loss against closed-form values; the parameter groups and the LR schedule against their
documented formulas. All models are tiny (d_model 32, 2 heads, seq 8) so the file runs in seconds.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from model.config import ModelConfig, MupConfig, OptimConfig, ScheduleConfig
from model.gpt import GPT, cross_entropy_and_z_loss
from model.optim import build_adamw, lr_at, param_groups, set_lr

REPO = Path(__file__).resolve().parents[1]
VOCAB = 32
BLOCKS, NORMS, MLPS, PARAMS = ("pre_ln", "post_ln"), ("layernorm", "rmsnorm"), ("gelu", "swiglu"), ("sp", "mup")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models run fastest single-threaded on a shared CPU; restore the setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny(**overrides) -> ModelConfig:
    return ModelConfig(**{"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 8, **overrides})


def tokens(batch: int = 4, seq: int = 8, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (batch, seq + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


# --------------------------------------------------------------------------------------------
# Hand-written references (plain tensor ops, no nn.functional shortcuts)
# --------------------------------------------------------------------------------------------


def ref_linear(lin: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    y = x @ lin.weight.T
    return y if lin.bias is None else y + lin.bias


def ref_norm(module: torch.nn.Module, kind: str, x: torch.Tensor) -> torch.Tensor:
    if kind == "layernorm":
        assert isinstance(module, torch.nn.LayerNorm)
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)  # biased variance
        y = (x - mean) / torch.sqrt(var + module.eps) * module.weight
        return y if module.bias is None else y + module.bias
    assert isinstance(module, torch.nn.RMSNorm)
    eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * module.weight


def ref_attention(attn, kind: str, qk_norm: bool, x: torch.Tensor) -> torch.Tensor:
    B, T, C = x.shape
    H = attn.n_head
    Dh = C // H
    q = ref_linear(attn.q, x)
    kv = ref_linear(attn.kv, x)
    k, v = kv[..., :C], kv[..., C:]
    q, k, v = (t.reshape(B, T, H, Dh).permute(0, 2, 1, 3) for t in (q, k, v))  # (B, H, T, Dh)
    if qk_norm:
        q, k = ref_norm(attn.q_norm, kind, q), ref_norm(attn.k_norm, kind, k)
    scores = (q @ k.transpose(-1, -2)) * attn.scale  # (B, H, T, T)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    e = torch.exp(scores - scores.max(-1, keepdim=True).values)
    p = e / e.sum(-1, keepdim=True)
    y = (p @ v).permute(0, 2, 1, 3).reshape(B, T, C)
    return ref_linear(attn.proj, y)


def ref_mlp(mlp, kind: str, x: torch.Tensor) -> torch.Tensor:
    h = ref_linear(mlp.up, x)
    if kind == "gelu":  # exact (erf) GELU
        h = 0.5 * h * (1.0 + torch.erf(h / math.sqrt(2.0)))
    else:  # SwiGLU: silu(gate) * value, gate first
        half = h.shape[-1] // 2
        gate, value = h[..., :half], h[..., half:]
        h = gate / (1.0 + torch.exp(-gate)) * value
    return ref_linear(mlp.proj, h)


def ref_block(block, kind: str, norm: str, mlp: str, qk_norm: bool, x: torch.Tensor) -> torch.Tensor:
    attn = lambda z: ref_attention(block.attn, norm, qk_norm, z)  # noqa: E731
    ffn = lambda z: ref_mlp(block.mlp, mlp, z)  # noqa: E731
    n1 = lambda z: ref_norm(block.norm1, norm, z)  # noqa: E731
    n2 = lambda z: ref_norm(block.norm2, norm, z)  # noqa: E731
    if kind == "pre_ln":
        x = x + attn(n1(x))
        return x + ffn(n2(x))
    x = n1(x + attn(x))
    return n2(x + ffn(x))


@torch.no_grad()
def randomise(module: torch.nn.Module, seed: int = 0) -> None:
    """Weights big enough that attention is far from uniform and every gain/bias matters."""
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
        if p.ndim == 2:
            p.copy_(noise / math.sqrt(p.shape[1]))
        elif name.endswith("bias"):
            p.copy_(0.2 * noise)
        else:  # norm gains
            p.copy_(1.0 + 0.3 * noise)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["noqk", "qknorm"])
@pytest.mark.parametrize("mlp", MLPS)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("block", BLOCKS)
def test_block_forward_matches_hand_written_reference(block, norm, mlp, qk_norm, bias):
    torch.manual_seed(0)
    model = (
        GPT(tiny(n_layer=1, block=block, norm=norm, mlp=mlp, qk_norm=qk_norm, bias=bias), MupConfig(), VOCAB)
        .double()
        .eval()
    )
    blk = model.blocks[0]
    randomise(blk)
    x = torch.randn(2, 8, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * 1.5 + 0.5
    with torch.no_grad():
        got = blk(x)
        want = ref_block(blk, block, norm, mlp, qk_norm, x)
    assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_reference_distinguishes_the_variants():
    """Guard for the reference test: swapping any one switch changes the block's output."""
    x = torch.randn(2, 8, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) + 0.5
    outputs = {}
    for combo in itertools.product(BLOCKS, NORMS, MLPS, (False, True)):
        torch.manual_seed(0)
        blk = (
            GPT(tiny(n_layer=1, block=combo[0], norm=combo[1], mlp=combo[2], qk_norm=combo[3]), MupConfig(), VOCAB)
            .double()
            .blocks[0]
        )
        randomise(blk)
        with torch.no_grad():
            outputs[combo] = blk(x)
    for a, b in itertools.combinations(outputs, 2):
        assert not torch.allclose(outputs[a], outputs[b], atol=1e-6), (a, b)


def test_post_ln_block_output_is_normalised_and_pre_ln_is_not():
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(3)) * 3 + 2
    for block, normalised in (("post_ln", True), ("pre_ln", False)):
        torch.manual_seed(0)
        blk = GPT(tiny(n_layer=1, block=block, norm="layernorm"), MupConfig(), VOCAB).blocks[0]
        with torch.no_grad():
            y = blk(x)
        zero_mean = torch.allclose(y.mean(-1), torch.zeros(2, 8), atol=1e-5)
        unit_var = torch.allclose(y.var(-1, unbiased=False), torch.ones(2, 8), atol=1e-3)
        assert (zero_mean and unit_var) is normalised, block


def test_swiglu_hidden_width_keeps_the_gelu_parameter_count():
    for d in (32, 64, 128, 384):
        gelu = GPT(tiny(n_layer=1, d_model=d, mlp="gelu"), MupConfig(), VOCAB).blocks[0].mlp
        swiglu = GPT(tiny(n_layer=1, d_model=d, mlp="swiglu"), MupConfig(), VOCAB).blocks[0].mlp
        assert gelu.up.out_features == gelu.proj.in_features == 4 * d
        assert swiglu.up.out_features == 2 * swiglu.proj.in_features  # gate and value halves
        n_gelu = sum(p.numel() for p in gelu.parameters())
        n_swiglu = sum(p.numel() for p in swiglu.parameters())
        assert abs(n_swiglu / n_gelu - 1) < 0.05, d


@pytest.mark.parametrize("d_model", [32, 64, 128])
def test_attention_scale_is_inverse_sqrt_head_dim_under_sp_and_inverse_head_dim_under_mup(d_model):
    base = 32
    n_head = 2
    d_head = d_model // n_head
    sp = GPT(tiny(d_model=d_model), MupConfig(parametrization="sp", base_width=base), VOCAB)
    mup = GPT(tiny(d_model=d_model), MupConfig(parametrization="mup", base_width=base), VOCAB)
    assert sp.blocks[0].attn.scale == pytest.approx(1 / math.sqrt(d_head))
    assert mup.blocks[0].attn.scale == pytest.approx(math.sqrt(base / n_head) / d_head)
    if d_model == base:  # the two coincide at the base width
        assert mup.blocks[0].attn.scale == pytest.approx(sp.blocks[0].attn.scale)


@pytest.mark.parametrize("block", BLOCKS)
def test_gpt_forward_is_embed_blocks_final_norm_readout_with_mup_multipliers(block):
    torch.manual_seed(0)
    mup = MupConfig(
        parametrization="mup",
        base_width=16,
        input_alpha=2.0,
        output_alpha=3.0,
        zero_init_readout=False,
        zero_init_query=False,
    )
    model = GPT(tiny(block=block, norm="layernorm"), mup, VOCAB).double().eval()
    x, _ = tokens()
    with torch.no_grad():
        got, _, _ = model(x)
        h = (model.wte.weight[x] + model.wpe.weight[: x.shape[1]]) * 2.0
        for blk in model.blocks:
            h = blk(h)
        if block == "pre_ln":  # post-LN blocks already end on a norm: no final norm
            h = ref_norm(model.norm_f, "layernorm", h)
        else:
            assert isinstance(model.norm_f, torch.nn.Identity)
        want = (h @ model.readout.weight.T) * (3.0 / (32 / 16))
    assert_close(got, want, rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------------------------
# z-loss
# --------------------------------------------------------------------------------------------


def z_loss(logits: torch.Tensor, coef: float) -> torch.Tensor:
    """The z-loss term of ``logits`` (its cross-entropy against class 0 aside)."""
    return cross_entropy_and_z_loss(logits, torch.zeros(len(logits), dtype=torch.long), coef)[1]


def test_z_loss_of_all_zero_logits_is_coef_times_log_vocab_squared():
    coef = 1e-2
    logits = torch.zeros(5, VOCAB, dtype=torch.float64)
    assert z_loss(logits, coef).item() == pytest.approx(coef * math.log(VOCAB) ** 2, rel=1e-12)


def test_z_loss_is_coef_times_mean_squared_logsumexp():
    # Row 0: Z = 4 (four zeros). Row 1: Z = 1 + 2 + 3 + 10 = 16 = 4², so log Z = 2·log 4.
    logits = torch.log(torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 2.0, 3.0, 10.0]], dtype=torch.float64))
    expected = 0.5 * (math.log(4) ** 2 + (2 * math.log(4)) ** 2)  # = 2.5 · log²4
    assert z_loss(logits, 1.0).item() == pytest.approx(expected, rel=1e-12)
    assert z_loss(logits, 1e-4).item() == pytest.approx(1e-4 * expected, rel=1e-12)


def test_z_loss_is_exactly_zero_when_coef_is_zero():
    logits = torch.randn(6, VOCAB) * 10
    out = z_loss(logits, 0.0)
    assert out.shape == () and out.item() == 0.0


@pytest.mark.parametrize("coef", [0.0, 1e-2])
def test_cross_entropy_and_z_loss_match_their_textbook_forms_and_gradients(coef):
    # One log-softmax and a hand-written backward (model/gpt.py): the values and gradients of
    # F.cross_entropy and coef · mean(logsumexp²), whatever weights the two losses get upstream.
    torch.manual_seed(0)
    logits = (torch.randn(32, VOCAB, dtype=torch.float64) * 3).requires_grad_()
    targets = torch.randint(0, VOCAB, (32,))
    ce, z = cross_entropy_and_z_loss(logits, targets, coef)
    want_ce = F.cross_entropy(logits, targets)
    want_z = coef * torch.logsumexp(logits, dim=-1).pow(2).mean()
    assert_close(ce, want_ce, rtol=1e-12, atol=1e-12)
    assert_close(z, want_z, rtol=1e-12, atol=1e-12)
    (got,) = torch.autograd.grad(2 * ce + 3 * z, logits)
    (want,) = torch.autograd.grad(2 * want_ce + 3 * want_z, logits)
    assert_close(got, want, rtol=1e-10, atol=1e-14)
    assert torch.autograd.gradcheck(lambda x: sum(cross_entropy_and_z_loss(x, targets, coef)), (logits,))


def test_gpt_forward_returns_cross_entropy_and_z_loss_of_its_logits():
    torch.manual_seed(0)
    coef = 1e-2
    model = GPT(tiny(z_loss=coef), MupConfig(), VOCAB)
    x, y = tokens()
    logits, ce, z = model(x, y)
    flat = logits.detach().double().reshape(-1, VOCAB)
    log_z = torch.log(torch.exp(flat).sum(-1))
    want_ce = (log_z - flat.gather(1, y.reshape(-1, 1)).squeeze(1)).mean()
    assert_close(ce.double(), want_ce, rtol=1e-5, atol=1e-6)
    assert_close(z.double(), coef * (log_z**2).mean(), rtol=1e-5, atol=1e-9)
    assert z.item() > 0
    z.backward()  # the z-loss is differentiable and reaches the readout
    assert model.readout.weight.grad is not None and model.readout.weight.grad.abs().sum() > 0


def test_gpt_forward_z_loss_is_zero_without_coef_and_absent_without_targets():
    torch.manual_seed(0)
    model = GPT(tiny(z_loss=0.0), MupConfig(), VOCAB)
    x, y = tokens()
    _, ce, z = model(x, y)
    assert z.item() == 0.0 and ce.item() > 0
    logits, ce, z = model(x)
    assert logits.shape == (4, 8, VOCAB) and ce is None and z is None


# --------------------------------------------------------------------------------------------
# Tied embeddings
# --------------------------------------------------------------------------------------------


def test_tied_embeddings_share_one_storage():
    torch.manual_seed(0)
    model = GPT(tiny(tie_embeddings=True), MupConfig(), VOCAB)
    untied = GPT(tiny(tie_embeddings=False), MupConfig(), VOCAB)
    assert model.readout.weight is model.wte.weight
    assert model.readout.weight.data_ptr() == model.wte.weight.data_ptr()
    with torch.no_grad():
        model.wte.weight[3, 5] = 123.0
    assert model.readout.weight[3, 5].item() == 123.0
    # Counted once: exactly one V×d matrix fewer than the untied model.
    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert n(untied) - n(model) == VOCAB * 32


def test_untied_embeddings_have_separate_storage():
    torch.manual_seed(0)
    model = GPT(tiny(tie_embeddings=False), MupConfig(), VOCAB)
    assert model.readout.weight is not model.wte.weight
    assert model.readout.weight.data_ptr() != model.wte.weight.data_ptr()
    before = model.readout.weight.detach().clone()
    with torch.no_grad():
        model.wte.weight.add_(1.0)
    assert torch.equal(model.readout.weight, before)


# --------------------------------------------------------------------------------------------
# Every variant trains: overfit one small batch
# --------------------------------------------------------------------------------------------

OVERFIT_LR, OVERFIT_MAX_STEPS, OVERFIT_TARGET = 1e-2, 80, 0.5


@pytest.mark.parametrize("extras", [{}, {"qk_norm": True, "z_loss": 1e-3}], ids=["plain", "qknorm+zloss"])
@pytest.mark.parametrize("parametrization", PARAMS)
@pytest.mark.parametrize("mlp", MLPS)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("block", BLOCKS)
def test_every_variant_overfits_one_batch(block, norm, mlp, parametrization, extras):
    torch.manual_seed(0)
    cfg = tiny(block=block, norm=norm, mlp=mlp, **extras)
    model = GPT(cfg, MupConfig(parametrization=parametrization, base_width=16), VOCAB)
    opt = build_adamw(model, OptimConfig(lr=OVERFIT_LR, weight_decay=0.0))
    set_lr(opt, OVERFIT_LR)
    x, y = tokens()
    losses = []
    for _ in range(OVERFIT_MAX_STEPS):
        _, ce, z = model(x, y)
        losses.append(ce.item())
        if losses[-1] < OVERFIT_TARGET:
            break
        opt.zero_grad(set_to_none=True)
        (ce + z).backward()
        opt.step()
    assert losses[0] > 0.9 * math.log(VOCAB)  # starts near chance
    assert losses[-1] < OVERFIT_TARGET, f"{len(losses)} steps: {losses[0]:.3f} -> {losses[-1]:.3f}"


# --------------------------------------------------------------------------------------------
# Parameter groups
# --------------------------------------------------------------------------------------------


def mup_model(width: int = 64, base: int = 16, **overrides) -> GPT:
    torch.manual_seed(0)
    cfg = tiny(d_model=width, bias=True, qk_norm=True, norm="layernorm", **overrides)
    return GPT(cfg, MupConfig(parametrization="mup", base_width=base), VOCAB)


def by_name(groups: list[dict]) -> dict[str, dict]:
    return {g["name"]: g for g in groups}


def ids(params) -> set[int]:
    return {id(p) for p in params}


def test_mup_hidden_matrices_get_lr_over_m_and_weight_decay_times_m():
    model = mup_model(width=64, base=16)  # m = 4
    wd = 0.1
    groups = by_name(param_groups(model, OptimConfig(weight_decay=wd)))
    hidden = groups["hidden"]
    assert hidden["lr_mult"] == pytest.approx(1 / 4)
    assert hidden["weight_decay"] == pytest.approx(wd * 4)
    expected = {
        id(lin.weight)
        for blk in model.blocks
        for lin in (blk.attn.q, blk.attn.kv, blk.attn.proj, blk.mlp.up, blk.mlp.proj)
    }
    assert ids(hidden["params"]) == expected


def test_mup_embeddings_and_readout_keep_the_base_lr():
    model = mup_model(width=64, base=16)
    wd = 0.1
    groups = by_name(param_groups(model, OptimConfig(weight_decay=wd)))
    assert ids(groups["embedding"]["params"]) == {id(model.wte.weight), id(model.wpe.weight)}
    assert groups["embedding"]["lr_mult"] == 1.0 and groups["embedding"]["weight_decay"] == 0.0
    assert ids(groups["readout"]["params"]) == {id(model.readout.weight)}
    assert groups["readout"]["lr_mult"] == 1.0 and groups["readout"]["weight_decay"] == wd
    decayed = by_name(param_groups(model, OptimConfig(weight_decay=wd, decay_embeddings=True)))
    assert decayed["embedding"]["weight_decay"] == wd


def test_norms_and_biases_are_not_decayed_unless_asked():
    model = mup_model()
    vectors = {id(p) for n, p in model.named_parameters() if p.ndim == 1}
    assert len(vectors) > 0
    plain = by_name(param_groups(model, OptimConfig(weight_decay=0.1)))["vector"]
    assert ids(plain["params"]) == vectors
    assert plain["weight_decay"] == 0.0 and plain["lr_mult"] == 1.0
    decayed = by_name(param_groups(model, OptimConfig(weight_decay=0.1, decay_norms_and_biases=True)))["vector"]
    assert decayed["weight_decay"] == 0.1


@pytest.mark.parametrize(
    ("parametrization", "tie"), [("sp", False), ("sp", True), ("mup", False)], ids=["sp-untied", "sp-tied", "mup"]
)  # the config forbids μP with tied embeddings
def test_every_parameter_is_in_exactly_one_group(parametrization, tie):
    torch.manual_seed(0)
    model = GPT(
        tiny(bias=True, qk_norm=True, tie_embeddings=tie),
        MupConfig(parametrization=parametrization, base_width=16),
        VOCAB,
    )
    groups = param_groups(model, OptimConfig())
    seen = [id(p) for g in groups for p in g["params"]]
    assert len(seen) == len(set(seen))
    assert set(seen) == {id(p) for p in model.parameters()}
    assert all(g["params"] for g in groups)  # no empty groups
    if tie:  # the shared matrix is an embedding, and there is no separate readout group
        assert "readout" not in by_name(groups)
        assert id(model.wte.weight) in ids(by_name(groups)["embedding"]["params"])


def test_sp_groups_all_use_the_base_lr_and_weight_decay():
    torch.manual_seed(0)
    model = GPT(tiny(d_model=64), MupConfig(parametrization="sp", base_width=16), VOCAB)
    groups = by_name(param_groups(model, OptimConfig(weight_decay=0.1)))
    assert all(g["lr_mult"] == 1.0 for g in groups.values())
    assert groups["hidden"]["weight_decay"] == 0.1


def test_build_adamw_carries_the_group_weight_decay_and_set_lr_applies_lr_mult():
    model = mup_model(width=64, base=16)  # m = 4
    opt = build_adamw(model, OptimConfig(lr=1e-3, weight_decay=0.1))
    assert isinstance(opt, torch.optim.AdamW)
    groups = by_name(opt.param_groups)
    assert groups["hidden"]["weight_decay"] == pytest.approx(0.4)
    set_lr(opt, 0.02)
    assert groups["hidden"]["lr"] == pytest.approx(0.02 / 4)
    for name in ("embedding", "readout", "vector"):
        assert groups[name]["lr"] == pytest.approx(0.02)
    set_lr(opt, 0.0)
    assert all(g["lr"] == 0.0 for g in opt.param_groups)


# --------------------------------------------------------------------------------------------
# LR schedule
# --------------------------------------------------------------------------------------------

PEAK, TOTAL = 1e-3, 100


def schedule(kind: str, warmup: int = 10, min_ratio: float = 0.1) -> list[float]:
    cfg = ScheduleConfig(kind=kind, warmup_steps=warmup, min_lr_ratio=min_ratio)
    return [lr_at(s, PEAK, TOTAL, cfg) for s in range(TOTAL)]


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_warmup_is_linear_and_reaches_peak_at_its_last_step(kind):
    lrs = schedule(kind, warmup=10)
    for s in range(10):
        assert lrs[s] == pytest.approx(PEAK * (s + 1) / 10)
    assert 0 < lrs[0] < lrs[1]
    assert lrs[9] == pytest.approx(PEAK)
    assert lrs[10] == pytest.approx(PEAK)  # decay starts from the peak
    assert max(lrs) == pytest.approx(PEAK)


def test_cosine_decays_monotonically_to_min_lr_at_the_last_step():
    lrs = schedule("cosine", warmup=10, min_ratio=0.1)
    after = lrs[10:]
    assert all(a >= b for a, b in zip(after, after[1:]))
    assert lrs[-1] == pytest.approx(0.1 * PEAK, rel=1e-9)
    assert min(lrs[10:]) == pytest.approx(0.1 * PEAK, rel=1e-9)
    # Cosine shape: halfway through the decay the LR is halfway between peak and floor.
    mid_cfg = ScheduleConfig(kind="cosine", warmup_steps=0, min_lr_ratio=0.1)
    assert lr_at(50, PEAK, 101, mid_cfg) == pytest.approx(0.55 * PEAK)
    # and a quarter of the way it is above the linear interpolation (cosine is concave there)
    assert lr_at(25, PEAK, 101, mid_cfg) > PEAK - 0.25 * 0.9 * PEAK


def test_linear_decays_in_equal_steps_to_min_lr_at_the_last_step():
    lrs = schedule("linear", warmup=10, min_ratio=0.2)
    diffs = [a - b for a, b in zip(lrs[10:], lrs[11:])]
    assert all(d == pytest.approx(diffs[0]) for d in diffs) and diffs[0] > 0
    assert lrs[-1] == pytest.approx(0.2 * PEAK, rel=1e-9)


def test_constant_holds_the_peak_after_warmup():
    lrs = schedule("constant", warmup=10, min_ratio=0.1)
    assert all(lr == PEAK for lr in lrs[10:])


def test_no_warmup_starts_at_the_peak():
    for kind in ("cosine", "linear", "constant"):
        assert schedule(kind, warmup=0)[0] == pytest.approx(PEAK)


def test_min_lr_ratio_one_keeps_cosine_flat():
    assert all(lr == pytest.approx(PEAK) for lr in schedule("cosine", warmup=5, min_ratio=1.0)[5:])
