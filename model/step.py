"""The training step (OLMo-core's TrainModule), apart from the loop that drives it (model/train.py).

    TrainModule  forward/backward over the micro-batches (precision context, loss scaling),
                 unscale, gradient multiplier, pre-clip global norm; then, apart, the optimizer
                 step: clipping, a skip decided on the device (non-finite values or a callback's
                 veto), independent weight decay, AdamW, loss-scale update.
    PendingStep  a step between backward and the update, as ``on_before_optimizer`` sees it.
    StepResult   what a step did, as device tensors.

Nothing here reads a device value on the host, except the skip decision of a non-fused AdamW.
Under torchrun (model/distributed.py) the forward runs through DistributedDataParallel, which
averages gradients over ranks in the last micro-batch's backward; the step's losses are averaged
the same way and a veto on one rank holds on all, so every rank takes the same update or skip.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from model.config import TrainingConfig
from model.distributed import SINGLE, World
from model.gpt import GPT
from model.optim import param_groups
from model.precision import Precision
from model.telemetry import layer_grad_norms

Batch = tuple[torch.Tensor, torch.Tensor]  # (x, y), each (B, T) token ids


class PendingStep:
    """A step between backward and the optimizer update, as ``on_before_optimizer`` sees it.
    Every field is a device tensor: reading one on the host (``.item()``, ``bool()``) costs a sync
    per step, which the hot path must not have; decide on the device and call :meth:`veto`."""

    def __init__(
        self,
        step: int,
        loss: torch.Tensor,
        z_loss: torch.Tensor,
        grad_norm: torch.Tensor,
        layer_grad_norms: dict[str, torch.Tensor],
    ):
        self.step = step  # the optimizer step this update would complete (1-based)
        self.loss = loss  # mean cross-entropy over the micro-batches (and over ranks)
        self.z_loss = z_loss  # mean z-loss term (0 when model.z_loss is 0; over ranks too)
        self.grad_norm = grad_norm  # global pre-clip norm (unscaled, after the grad multiplier)
        self.layer_grad_norms = layer_grad_norms  # per layer, at layer-stats steps only
        self.vetoed = torch.zeros((), dtype=torch.bool, device=loss.device)

    def veto(self, condition: torch.Tensor | bool = True) -> None:
        """Skip the optimizer update where ``condition`` holds (a bool scalar tensor): weights and
        Adam state stay bitwise untouched. Vetoes of several callbacks combine with OR."""
        self.vetoed = self.vetoed | torch.as_tensor(condition, device=self.vetoed.device)


class StepResult(NamedTuple):
    """What a step did, as device tensors (no host sync); flags are bool scalars."""

    loss: torch.Tensor
    z_loss: torch.Tensor
    grad_norm: torch.Tensor
    skipped: torch.Tensor  # non-finite loss or gradient: weights and Adam state untouched
    overflow: torch.Tensor  # fp16 loss-scale overflow (also untouched; counted apart from skipped)
    vetoed: torch.Tensor  # a callback vetoed a finite update (untouched too)
    update_ratio: torch.Tensor | None  # ‖Δθ‖/‖θ‖ of this step, when asked for
    layer_grad_norms: dict[str, torch.Tensor]


class TrainModule:
    """The model, its optimizer and loss scaler, and the two halves of a step. The learning rate is
    whatever the param groups hold (the loop sets it)."""

    def __init__(
        self,
        model: GPT,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        precision: Precision,
        clip: float,
        compiled: torch.nn.Module | None = None,
        replica: torch.nn.Module | None = None,
        world: World = SINGLE,
        loss_multiplier: float = 1.0,
    ):
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        # The parameters, listed once: a small model's step should not walk the module tree twice.
        # Loading a checkpoint or injecting a spike changes their values, never the tensors themselves.
        self.params = list(model.parameters())
        self.loss_multiplier = loss_multiplier  # 2^-precision.loss_shift: the gradients are that much smaller
        self.precision, self.clip = precision, clip
        self.replica = replica or model  # what the forward runs through: DDP(model) under torchrun
        self.compiled = compiled  # torch.compile(replica), or None
        self.world = world

    def forward_backward(
        self,
        step: int,
        batches: Sequence[Batch],
        grad_scale: float = 1.0,
        eager: bool = False,
        watch_layers: bool = False,
    ) -> PendingStep:
        """Accumulate gradients over ``batches``; unscale, multiply by ``grad_scale`` (before the
        norm, so the norm shows it), and take the global pre-clip norm."""
        model = self.replica if eager or self.compiled is None else self.compiled
        self.optimizer.zero_grad(set_to_none=True)
        device = self._device()
        ce_sum = z_sum = torch.zeros((), device=device)
        for i, (x, y) in enumerate(batches):
            with self._grads_reduced(last=i == len(batches) - 1):
                with self.precision.autocast():
                    _, ce, z = model(x, y)
                loss = (ce + z) / len(batches)
                if self.loss_multiplier != 1.0:
                    loss = loss * self.loss_multiplier
                self.scaler.scale(loss).backward()
            ce_sum, z_sum = ce_sum + ce.detach(), z_sum + z.detach()
        n = max(1, len(batches))
        if self.world.distributed:  # the global mean: equal slices per rank
            ce_sum, z_sum = self.world.mean_(torch.stack([ce_sum, z_sum])).unbind()
        self.scaler.unscale_(self.optimizer)  # no-op unless fp16 loss scaling
        grads = [p.grad for p in self.params if p.grad is not None]
        if grad_scale != 1.0:
            torch._foreach_mul_(grads, grad_scale)
        grad_norm = get_total_norm(grads) if grads else torch.zeros((), device=device)
        layer_norms = layer_grad_norms(self.model) if watch_layers else {}
        if self.loss_multiplier != 1.0:  # the unshifted norms (exact: a power of two) decide the clip and are logged
            grad_norm = grad_norm / self.loss_multiplier
            layer_norms = {name: norm / self.loss_multiplier for name, norm in layer_norms.items()}
        return PendingStep(step, ce_sum / n, z_sum / n, grad_norm, layer_norms)

    def optimizer_step(self, pending: PendingStep, watch_update: bool = False) -> StepResult:
        """Clip and update, unless the step is non-finite or vetoed (decided on the device)."""
        params = [p for p in self.params if p.grad is not None]
        if self.clip > 0 and params:
            clip_grads_with_norm_(params, self.clip, pending.grad_norm)
        grads_finite = torch.isfinite(pending.grad_norm)
        if self.world.distributed:  # one rank's non-finite gradient (its own multiplier) or veto holds for all
            bad_grads, pending.vetoed = self.world.any(torch.stack([~grads_finite, pending.vetoed])).unbind()
            grads_finite = ~bad_grads
        overflow = ~grads_finite if self.scaler.is_enabled() else torch.zeros_like(grads_finite)
        nonfinite = ~(grads_finite & torch.isfinite(pending.loss + pending.z_loss))
        before = [p.detach().clone() for p in params] if watch_update else None
        skip = nonfinite | pending.vetoed
        _decay_independently(self.optimizer, skip)
        _guarded_step(self.optimizer, skip)
        self.scaler.update()  # backs the loss scale off after an overflow, grows it after a clean stretch
        ratio = None
        if before is not None:
            with torch.no_grad():
                ratio = get_total_norm([p - b for p, b in zip(params, before)]) / get_total_norm(before)
        return StepResult(
            pending.loss,
            pending.z_loss,
            pending.grad_norm,
            nonfinite & ~overflow,
            overflow,
            pending.vetoed & ~nonfinite,
            ratio,
            pending.layer_grad_norms,
        )

    def step(self, step: int, batches: Sequence[Batch], watch_update: bool = False) -> StepResult:
        """Both halves with no callback in between (benchmarks, simple loops)."""
        return self.optimizer_step(self.forward_backward(step, batches), watch_update)

    def _grads_reduced(self, last: bool) -> contextlib.AbstractContextManager:
        """DDP all-reduces gradients in the backward of the last micro-batch only (``no_sync``
        before it, which must hold over the forward too): one exchange per step."""
        if last or not isinstance(self.replica, torch.nn.parallel.DistributedDataParallel):
            return contextlib.nullcontext()
        return self.replica.no_sync()

    def _device(self) -> torch.device:
        return self.params[0].device

    def apply_hyperparameters(self, cfg: TrainingConfig) -> None:
        """Put the current config's AdamW settings (β₁, β₂, ε, weight decay, μP multipliers) into
        the param groups: ``optimizer.load_state_dict`` restores the saved run's values."""
        wanted = {g["name"]: g for g in param_groups(self.model, cfg.optim)}
        for group in self.optimizer.param_groups:
            spec = wanted[group["name"]]
            group.update(
                betas=(cfg.optim.beta1, cfg.optim.beta2),
                eps=cfg.optim.eps * cfg.precision.loss_multiplier,
                weight_decay=spec["weight_decay"],
                independent_decay=spec["independent_decay"],
                lr_mult=spec["lr_mult"],
            )


@torch.no_grad()
def _decay_independently(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """p ← p·(1 − d) for each group's ``independent_decay`` d (``optim.weight_decay_mode:
    independent``), first, as AdamW decays before its update; a skipped step multiplies by 1.0,
    which leaves p bitwise (decided on the device). Done here rather than as AdamW's weight_decay
    = d / lr: that is exact only up to rounding, divides by zero where the LR is 0, and would have
    to follow every LR change (schedule, μP multiplier, an injection, lower_lr)."""
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.grad is not None]  # those AdamW steps
        if group["independent_decay"] and params:
            torch._foreach_mul_(params, torch.where(skip, 1.0, 1.0 - group["independent_decay"]))


def _guarded_step(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """Step unless ``skip``. Fused AdamW takes ``found_inf`` (the GradScaler protocol) and skips on
    the device: no update, no moment change, step count restored. Other kernels need one host sync."""
    if optimizer.defaults.get("fused"):
        optimizer.found_inf = skip.float()  # type: ignore[attr-defined]  # GradScaler's protocol: fused AdamW reads it
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf  # type: ignore[attr-defined]  # set just above
    elif not skip.item():
        optimizer.step()
