"""Training telemetry without a host sync per step.

Per-step scalars (loss, z-loss, pre-clip grad norm, skipped/overflow flags) are added to running
sums that stay on the device; :meth:`Telemetry.drain` turns them into floats with ONE host sync per
log interval (OLMo-core and torchtitan reduce metrics the same way). The sums are part of every
checkpoint, so a run resumed in the middle of a log interval logs the same numbers.

Metric names are ``<namespace>/<name>``: ``train/*`` every ``train.log_every`` steps, ``stats/*``
(per-layer statistics, costlier) every ``train.layer_stats_every`` steps, ``val/*`` at evaluations.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch
from torch.nn.utils import get_total_norm

from model.gpt import GPT

_PER_STEP = ("loss", "z_loss", "grad_norm")


def to_floats(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    """Device scalars to Python floats in one host sync."""
    if not tensors:
        return {}
    values = torch.stack([t.detach().float().reshape(()) for t in tensors.values()]).tolist()
    return dict(zip(tensors, values))


class Telemetry:
    """Running sums of per-step scalars on the device, reduced once per log interval."""

    def __init__(self, device: torch.device):
        self.device = device
        self.totals = torch.zeros(3, device=device)  # skipped, overflow, vetoed steps since step 0
        self._reset_interval()

    def _reset_interval(self) -> None:
        n = len(_PER_STEP)
        self.sums = torch.zeros(n, device=self.device)
        self.counts = torch.zeros(n, device=self.device)  # finite values only
        self.maxes = torch.full((n,), float("-inf"), device=self.device)
        self.timer_start, self.timed_tokens = time.perf_counter(), 0

    @torch.no_grad()
    def add(
        self,
        loss: torch.Tensor,
        z_loss: torch.Tensor,
        grad_norm: torch.Tensor,
        skipped: torch.Tensor,
        overflow: torch.Tensor,
        vetoed: torch.Tensor,
        tokens: int,
    ) -> None:
        values = torch.stack([loss, z_loss, grad_norm]).float()  # (3,)
        finite = torch.isfinite(values)  # a non-finite step must not poison the interval mean
        self.sums += torch.where(finite, values, 0.0)
        self.counts += finite
        self.maxes = torch.maximum(self.maxes, torch.where(finite, values, float("-inf")))
        self.totals += torch.stack([skipped, overflow, vetoed]).float()
        self.timed_tokens += tokens

    def drain(self, extra: dict[str, torch.Tensor]) -> dict[str, float]:
        """The interval's means and maxima, cumulative skip/overflow counts, throughput and
        ``extra`` (device scalars), in one host sync; starts the next interval."""
        means = self.sums / self.counts  # nan when every step of the interval was non-finite
        tensors = {
            **{f"train/{name}": means[i] for i, name in enumerate(_PER_STEP)},
            "train/loss_max": self.maxes[0],
            "train/grad_norm_max": self.maxes[2],
            "train/skipped": self.totals[0],
            "train/overflows": self.totals[1],
            "train/vetoed": self.totals[2],
            **extra,
        }
        metrics = to_floats(tensors)
        metrics["train/tokens_per_s"] = self.timed_tokens / (time.perf_counter() - self.timer_start)
        self._reset_interval()
        return metrics

    def state_dict(self) -> dict[str, torch.Tensor]:
        # The throughput timer is not state: after a resume it measures this process only.
        return {"sums": self.sums, "counts": self.counts, "maxes": self.maxes, "totals": self.totals}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, value in state.items():
            setattr(self, name, value.to(self.device))


@torch.no_grad()
def optimizer_norms(model: GPT, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Global parameter norm and Adam second-moment (v) norm (v collapsing toward ε precedes the
    Adam instability of Molybog et al. 2023)."""
    params = list(model.parameters())
    v = [optimizer.state[p]["exp_avg_sq"] for p in params if p in optimizer.state]
    v_norm = get_total_norm(v) if v else torch.zeros((), device=params[0].device)
    return {"train/param_norm": get_total_norm(params), "train/adam_v_norm": v_norm}


@torch.no_grad()
def adam_update_rms(optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """RMS over every parameter element of g / √v̂ after an AdamW step, a device scalar (no sync):
    g the (clipped) gradient the step used, v̂ the bias-corrected second moment it divided by, ε
    left out. Near 1 when v̂ tracks g²; well above 1 when the second moment lags a growing gradient,
    the state that precedes loss spikes (Wortsman et al. 2023b, arXiv 2304.13013). Computed with
    one foreach kernel per operation and param group: an arm's trace takes it every step, and a
    loop over the parameters dispatched ~100 small ops a step."""
    sums: list[torch.Tensor] = []
    count = 0
    for group in optimizer.param_groups:
        stepped = [p for p in group["params"] if p.grad is not None and "exp_avg_sq" in optimizer.state.get(p, {})]
        if not stepped:
            continue
        states = [optimizer.state[p] for p in stepped]
        corrections = torch._foreach_pow(group["betas"][1], [s["step"] for s in states])  # β₂^t
        torch._foreach_neg_(corrections)
        torch._foreach_add_(corrections, 1.0)  # 1 - β₂^t
        v_hat = torch._foreach_div([s["exp_avg_sq"] for s in states], corrections)
        torch._foreach_clamp_min_(v_hat, 1e-30)
        grads = [p.grad.float() for p in stepped]
        ratios = torch._foreach_mul(grads, grads)
        torch._foreach_div_(ratios, v_hat)
        sums += torch._foreach_norm(ratios, 1)  # the sums: every ratio is >= 0
        count += sum(p.numel() for p in stepped)
    return (torch.stack(sums).sum() / count).sqrt() if sums else torch.full((), float("nan"))


def _layers(model: GPT) -> dict[str, torch.nn.Module]:
    return {
        "wte": model.wte,
        "wpe": model.wpe,
        **{f"block{i}": block for i, block in enumerate(model.layers)},
        "norm_f": model.norm_f,
        "readout": model.readout,
    }


@torch.no_grad()
def layer_grad_norms(model: GPT) -> dict[str, torch.Tensor]:
    """Gradient norm of each layer (a tied readout shares the embedding's gradient)."""
    out = {}
    for name, module in _layers(model).items():
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        if grads:
            out[f"stats/grad_norm/{name}"] = get_total_norm(grads)
    return out


def sampled_blocks(n_layer: int) -> list[int]:
    """First, middle and last block: where activation growth shows first."""
    return sorted({0, n_layer // 2, n_layer - 1})


@contextlib.contextmanager
def record_forward_stats(model: GPT) -> Iterator[dict[str, torch.Tensor]]:
    """Collect activation and logit statistics of the forward passes inside the block; the dict
    is filled when the block exits (values of the last micro-batch).

    stats/act_l2/blockI     mean over tokens of the L2 norm of the residual stream after block I
    stats/attn_logit_max/blockI  largest pre-softmax attention logit (Wortsman et al. 2023)
    stats/attn_entropy/blockI    mean attention entropy in nats, every block (seed 002: collapse)
    stats/logits/{mean,std,max,log_z}  output logits; log_z = mean log Σ exp(logits) (PaLM z-loss)
    """
    stats: dict[str, torch.Tensor] = {}

    def activation_hook(name: str) -> Callable[[torch.nn.Module, tuple[torch.Tensor, ...], torch.Tensor], None]:
        def hook(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            stats[f"stats/act_l2/{name}"] = output.detach().float().norm(dim=-1).mean()

        return hook

    def logits_hook(
        module: torch.nn.Module,
        inputs: tuple[torch.Tensor, ...],
        output: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None],
    ) -> None:
        logits = output[0].detach().float()  # (B, T, V)
        stats.update(
            {
                "stats/logits/mean": logits.mean(),
                "stats/logits/std": logits.std(),
                "stats/logits/max": logits.max(),
                "stats/logits/log_z": torch.logsumexp(logits, dim=-1).mean(),
            }
        )

    handles = [
        model.layers[i].register_forward_hook(activation_hook(f"block{i}")) for i in sampled_blocks(len(model.blocks))
    ]
    handles.append(model.register_forward_hook(logits_hook))
    for block in model.layers:
        block.attn.record_logit_max = True
    try:
        yield stats
    finally:
        for handle in handles:
            handle.remove()
        for i, block in enumerate(model.layers):
            block.attn.record_logit_max = False
            if block.attn.logit_max is not None:
                assert block.attn.entropy is not None  # Attention.forward sets both together
                stats[f"stats/attn_logit_max/block{i}"] = block.attn.logit_max
                stats[f"stats/attn_entropy/block{i}"] = block.attn.entropy
                block.attn.logit_max = block.attn.entropy = None
