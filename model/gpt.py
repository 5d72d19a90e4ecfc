"""A GPT with every switch a training-stability study needs, in plain PyTorch.

Switches (all from :class:`model.config.ModelConfig` / :class:`MupConfig`):
  block   pre_ln  x = x + f(norm(x))           GPT-2 style; trains without warmup
          post_ln x = norm(x + f(x))           original Transformer; large output-side grads at init
  norm    layernorm | rmsnorm
  mlp     gelu (4d hidden) | swiglu (gated, ~8d/3 hidden, same parameter count)
  qk_norm per-head norm of queries and keys (bounds attention logits at high LR)
  z_loss  coef · log²Z on the readout (PaLM), returned apart from the cross-entropy
  parametrization sp | mup: μP multipliers and init live here, the μP learning rates in optim.py

μP (Yang & Hu 2021) with width multiplier m = d_model / base_width:
  embedding output × input_alpha            (init std σ, LR constant)
  hidden matrices init std σ/√m             (LR ÷ m, see optim.py)
  residual output projections σ/√(2·L·m)
  attention scale √d_head_base / d_head     (= 1/√d_head at m = 1, ∝ 1/d_head beyond)
  logits × output_alpha / m                 (readout init zero by default, LR constant)
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import handle_torch_function, has_torch_function

from model.config import ModelConfig, MupConfig


def make_norm(kind: str, dim: int, bias: bool) -> nn.Module:
    if kind == "layernorm":
        return nn.LayerNorm(dim, bias=bias)
    return nn.RMSNorm(dim)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, attn_scale: float):
        super().__init__()
        self.n_head, self.d_head = cfg.n_head, cfg.d_model // cfg.n_head
        self.q = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.kv = nn.Linear(cfg.d_model, 2 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.q_norm = make_norm(cfg.norm, self.d_head, cfg.bias) if cfg.qk_norm else nn.Identity()
        self.k_norm = make_norm(cfg.norm, self.d_head, cfg.bias) if cfg.qk_norm else nn.Identity()
        self.scale = attn_scale
        self.dropout = cfg.dropout
        # Set by the trainer at stats steps: the max pre-softmax logit and the attention entropy
        # cost an explicit q·kᵀ.
        self.record_logit_max = False
        self.logit_max: torch.Tensor | None = None
        self.entropy: torch.Tensor | None = None  # mean over heads and queries, in nats
        # Set by the fused trainer (model/fused.py): softmax(q·kᵀ)·v as matrix products, which vmap
        # batches; scaled_dot_product_attention has no batching rule on the CPU (vmap loops over it).
        self.matmul_attention = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q = self.q(x).view(B, T, self.n_head, self.d_head).transpose(1, 2)  # (B, H, T, Dh)
        k, v = self.kv(x).split(C, dim=2)
        k = k.view(B, T, self.n_head, self.d_head).transpose(1, 2)  # (B, H, T, Dh)
        v = v.view(B, T, self.n_head, self.d_head).transpose(1, 2)  # (B, H, T, Dh)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.record_logit_max:
            with torch.no_grad():
                logits = (q @ k.transpose(-2, -1)) * self.scale  # (B, H, T, T)
                causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
                masked = logits.masked_fill(~causal, float("-inf")).float()
                self.logit_max = masked.amax()
                # Entropy collapse (Zhai et al. 2023, seed 002): attention onto one token is ~0 nats.
                p = masked.softmax(dim=-1)
                self.entropy = -(p * p.clamp_min(1e-30).log()).sum(dim=-1).mean()
        if self.matmul_attention:  # no dropout: the fused trainer refuses model.dropout > 0
            y = causal_attention(q, k, v, self.scale)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.scale, dropout_p=self.dropout if self.training else 0.0
            )  # (B, H, T, Dh)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(B, T, C))
        return out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q·kᵀ·scale, causal)·v for (B, H, T, Dh) q, k, v, computed in fp32 and returned in
    q's dtype, as the CPU's scaled_dot_product_attention computes bf16 inputs: under autocast, or
    under its emulation (which rounds this call's inputs and output only, as it does SDPA's), the
    scores and probabilities are not rounded to bf16 either."""
    if has_torch_function((q, k, v)):  # an emulation mode (model/precision.py) takes the call whole
        out: torch.Tensor = handle_torch_function(causal_attention, (q, k, v), q, k, v, scale)
        return out
    T = q.size(-2)
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    with torch.autocast(q.device.type, enabled=False):
        scores = ((q.float() @ k.float().transpose(-2, -1)) * scale).masked_fill(future, float("-inf"))
        return (scores.softmax(dim=-1) @ v.float()).to(q.dtype)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gated = cfg.mlp == "swiglu"
        # SwiGLU has three matrices; 2/3 of the 4d hidden width keeps the parameter count of GELU.
        hidden = _round_up(8 * cfg.d_model // 3, 8) if self.gated else 4 * cfg.d_model
        self.up = nn.Linear(cfg.d_model, (2 if self.gated else 1) * hidden, bias=cfg.bias)
        self.proj = nn.Linear(hidden, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self.gated:
            gate, value = h.chunk(2, dim=-1)
            h = F.silu(gate) * value
        else:
            h = F.gelu(h)
        out: torch.Tensor = self.proj(h)
        return out


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, attn_scale: float):
        super().__init__()
        self.post_ln = cfg.block == "post_ln"
        self.norm1 = make_norm(cfg.norm, cfg.d_model, cfg.bias)
        self.attn = Attention(cfg, attn_scale)
        self.norm2 = make_norm(cfg.norm, cfg.d_model, cfg.bias)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.post_ln:
            x = self.norm1(x + self.drop(self.attn(x)))
            out: torch.Tensor = self.norm2(x + self.drop(self.mlp(x)))
        else:
            x = x + self.drop(self.attn(self.norm1(x)))
            out = x + self.drop(self.mlp(self.norm2(x)))
        return out


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, mup: MupConfig, vocab_size: int):
        super().__init__()
        self.cfg, self.mup_cfg, self.vocab_size = cfg, mup, vocab_size
        self.is_mup = mup.parametrization == "mup"
        self.width_mult = cfg.d_model / mup.base_width if self.is_mup else 1.0
        d_head = cfg.d_model // cfg.n_head
        base_d_head = mup.base_width / cfg.n_head
        attn_scale = math.sqrt(base_d_head) / d_head if self.is_mup else 1.0 / math.sqrt(d_head)

        self.wte = nn.Embedding(vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, attn_scale) for _ in range(cfg.n_layer))
        # Post-LN already ends every block on a norm; the original Transformer has no final norm.
        self.norm_f = make_norm(cfg.norm, cfg.d_model, cfg.bias) if cfg.block == "pre_ln" else nn.Identity()
        self.readout = nn.Linear(cfg.d_model, vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.readout.weight = self.wte.weight
        self.input_mult = mup.input_alpha if self.is_mup else 1.0
        self.output_mult = mup.output_alpha / self.width_mult if self.is_mup else 1.0
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.cfg.init == "xavier":
            self._xavier_init()
        else:
            self._gpt2_init()
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                module.reset_parameters()

    def _xavier_init(self) -> None:
        """The original Transformer's init (Xiong et al. 2020's setting): unit-scale embeddings,
        Xavier-normal matrices, no depth scaling, so the residual stream grows with depth."""
        nn.init.normal_(self.wte.weight, std=1.0)
        nn.init.normal_(self.wpe.weight, std=1.0)
        for lin in self.modules():
            if isinstance(lin, nn.Linear) and lin.weight is not self.wte.weight:
                nn.init.xavier_normal_(lin.weight)

    def _gpt2_init(self) -> None:
        std, m, L = self.cfg.init_std, self.width_mult, self.cfg.n_layer
        nn.init.normal_(self.wte.weight, std=std)
        nn.init.normal_(self.wpe.weight, std=std)
        for block in self.layers:
            for lin in (block.attn.q, block.attn.kv, block.mlp.up):
                nn.init.normal_(lin.weight, std=std / math.sqrt(m))
            for lin in (block.attn.proj, block.mlp.proj):  # residual outputs: depth-scaled
                nn.init.normal_(lin.weight, std=std / math.sqrt(2 * L * m))
            if self.is_mup and self.mup_cfg.zero_init_query:
                nn.init.zeros_(block.attn.q.weight)
        if not self.cfg.tie_embeddings:
            if self.is_mup and self.mup_cfg.zero_init_readout:
                nn.init.zeros_(self.readout.weight)
            else:
                nn.init.normal_(self.readout.weight, std=std / math.sqrt(m))

    @property
    def layers(self) -> list[Block]:
        """``blocks`` typed as what they hold: nn.ModuleList yields plain Modules to a type checker."""
        return cast("list[Block]", list(self.blocks))

    def block_matrices(self, block: int) -> list[torch.Tensor]:
        """The weight matrices of one block (its norm gains and biases left out): what a ``param``
        injection scales and the overflow probe sizes."""
        return [p for p in self.blocks[block].parameters() if p.dim() == 2]

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """idx, targets: (B, T) token ids. Returns logits (B, T, V) and, with targets, the mean
        cross-entropy and the z-loss term (coef · mean log²Z; zero when the coef is 0)."""
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.drop(_scaled(self.wte(idx) + self.wpe(pos), self.input_mult))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = _scaled(self.readout(self.norm_f(x)), self.output_mult)  # (B, T, V)
        if targets is None:
            return logits, None, None
        ce, z = cross_entropy_and_z_loss(logits.float().view(B * T, -1), targets.reshape(-1), self.cfg.z_loss)
        return logits, ce, z

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n


def cross_entropy_and_z_loss(
    logits: torch.Tensor, targets: torch.Tensor, coef: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean cross-entropy of (N, V) ``logits`` against (N,) ``targets`` and PaLM's auxiliary
    z-loss coef · mean(log²Z), Z = Σ exp(logits), which keeps the softmax normaliser near 1 (an
    exact 0 when coef is 0)."""
    ce, z = _CrossEntropyZLoss.apply(logits, targets, coef)
    return ce, z


class _CrossEntropyZLoss(torch.autograd.Function):
    """Both losses from one log-softmax, and their gradient in one pass over the logits:
    softmax · (g_ce + 2·coef·g_z·log Z) / N − onehot(targets) · g_ce / N. F.cross_entropy
    zero-fills and scatters its NLL gradient before the log-softmax backward reads it, and a
    separate logsumexp (several passes, forward and backward) read the logits again for the
    z-loss: a z-loss ablation arm's step takes ~9 % less CPU time without them, a plain one's ~2 %."""

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, coef: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        log_p = torch.log_softmax(logits, dim=-1)  # (N, V)
        ce = -log_p.gather(1, targets[:, None]).mean()
        log_z = None
        if coef == 0:
            z = logits.new_zeros(())
        else:
            # log Z = x - log p(x) for any logit x; the row's largest, whose log p is the least
            # negative, loses the fewest digits.
            top, at = logits.max(dim=-1, keepdim=True)
            log_z = (top - log_p.gather(1, at)).squeeze(1)  # (N,)
            z = coef * log_z.pow(2).mean()
        ctx.save_for_backward(log_p, targets, log_z)
        ctx.coef = coef
        return ce, z

    @staticmethod
    def backward(ctx: Any, g_ce: torch.Tensor, g_z: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        log_p, targets, log_z = ctx.saved_tensors
        n = log_p.shape[0]
        target_weight = g_ce / n
        grad = log_p.exp()  # the softmax
        if log_z is None:
            grad.mul_(target_weight)
        else:
            grad.mul_((target_weight + g_z * (2 * ctx.coef / n) * log_z)[:, None])
        grad.scatter_add_(1, targets[:, None], (-target_weight).expand(n, 1))
        return grad, None, None


def _scaled(x: torch.Tensor, mult: float) -> torch.Tensor:
    """x · mult, skipped where mult is 1 (SP, μP at the base width): x · 1.0 is x bitwise, but
    multiplying the (B, T, V) logits costs a pass over them forward and another backward."""
    return x if mult == 1.0 else x * mult


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple
