"""K training arms of one shape trained as one model K times wider (issue 60; HFTA, Wang et al. 2021).

    FusedArms  the K arms' weights stacked (K, ...) in one flat (K, N) buffer; one vmapped forward
               (torch.func: functional_call over the model of model/gpt.py), one backward, one
               AdamW over the flat buffer with every hyperparameter a (K,) tensor.

Each arm keeps what makes it an arm: its own init (``train.seed``, drawn as the Trainer draws it),
its own data order (row k of an ArmsLoader: what a TokenLoader of its seed serves, gathered for all
K arms by ``train.num_workers`` host processes), LR schedule and peak, β₁, β₂, ε, weight decay,
gradient clip and z-loss coefficient (:data:`PER_ARM`), its own Adam moments and step count, its own
telemetry (model/telemetry.py's Telemetry), divergence rule and callbacks. Everything else must be
equal across the group (:func:`check_group`): keys that change the graph or the shapes (qk-norm,
block, depth, ...) make separate groups.

An arm's non-finite loss or gradient never reaches another arm: every operation is per arm along
dim 0 (the K losses are summed only to backpropagate once, and d(sum)/d(loss_k) = 1), and an arm's
update is masked out where it is skipped, as the single-arm path skips it (weights, moments and step
count bitwise untouched). A diverged arm is frozen (its summary taken then, as the Trainer stops);
the others train on.

What a single arm (model/train.py) does that a fused group does not: checkpoints and resume (a
group reruns whole), compile (the vmapped step runs eagerly), dropout (vmap's randomness is not the
Trainer's), fp16 and its loss scaling, callbacks that steer a step (``on_step_start``,
``on_batch``, ``on_step_end``: spikes, range probes); :func:`check_group` refuses them in one line.
A group trains in fp32 or in bf16 autocast with fp32 master weights, gradients and Adam state
(model/precision.py: real autocast or its emulation, resolved as for the single arm).

Numbers: the same arms trained one by one agree to within rounding, not bitwise: the CPU's fused
AdamW kernel, scaled_dot_product_attention and the loss's own backward (model/gpt.py) round
differently from their batched counterparts here (tests/test_fused.py states the tolerance).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.func import functional_call, vmap

from model.callbacks import RunInfo
from model.config import TrainingConfig
from model.data import ArmsLoader, Tokens
from model.flops import model_flops_per_token, peak_flops
from model.gpt import GPT
from model.optim import lr_at, param_groups
from model.precision import Precision, resolve_precision
from model.step import PendingStep, StepResult
from model.stops import RunStatus
from model.telemetry import Telemetry, _layers, record_forward_stats, to_floats
from model.threads import idle_cores
from model.train import DivergenceRule, resolve_device, run_summary, seed_everything
from model.typed_config import ConfigError

PER_ARM = (
    "train.seed",
    "optim.lr",
    "optim.beta1",
    "optim.beta2",
    "optim.eps",
    "optim.weight_decay",
    "optim.grad_clip",
    "schedule.kind",
    "schedule.warmup_steps",
    "schedule.min_lr_ratio",
    "model.z_loss",
)
"""The keys arms of one fused group may differ in: none changes a shape or the graph."""

FUSED_PRECISIONS = ("fp32", "bf16")
"""What a fused group trains in: bf16 autocast keeps fp32 master weights, gradients and Adam state
(model/precision.py) and needs no loss scaler, so the flat fp32 AdamW serves both."""

IGNORED = ("train.compile", "checkpoint.")
"""Keys a fused group does not read: it runs eagerly and writes no checkpoints."""


def check_group(cfgs: Sequence[TrainingConfig]) -> None:
    """Refuse, in one line naming the key, a group whose arms differ outside :data:`PER_ARM` or
    that asks for what the fused step does not do (see the module doc)."""
    if not cfgs:
        raise ConfigError("a fused group needs at least one arm")
    first = shared_settings(cfgs[0])
    for i, cfg in enumerate(cfgs[1:], start=1):
        flat = shared_settings(cfg)
        for key in sorted(first.keys() | flat.keys()):
            if first.get(key) != flat.get(key):
                raise ConfigError(
                    f"{key}: arm {i} has {flat.get(key)!r}, arm 0 {first.get(key)!r}; "
                    "arms of one fused group differ only in " + ", ".join(PER_ARM)
                )
    if reason := why_alone(cfgs[0]):
        raise ConfigError(reason)


def shared_settings(cfg: TrainingConfig) -> dict[str, Any]:
    """What every arm of one fused group has equal: the flat config but :data:`PER_ARM` and
    :data:`IGNORED` (equal settings here and :func:`why_alone` None: the arms fuse)."""
    return {k: v for k, v in cfg.to_flat_dict().items() if k not in PER_ARM and not k.startswith(IGNORED)}


def why_alone(cfg: TrainingConfig) -> str | None:
    """Why an arm of this config cannot train in a fused group (one line naming the key), or None."""
    if cfg.model.dropout > 0:
        return "model.dropout: a fused group trains without dropout (vmap's randomness is not the Trainer's)"
    if cfg.precision.mode not in FUSED_PRECISIONS or cfg.precision.loss_shift:
        return (
            f"precision.mode: {cfg.precision.mode} (loss_shift {cfg.precision.loss_shift}); a fused group trains "
            "in fp32 or bf16 unshifted (fp16 needs the loss scaler and its skips, which the fused step has not)"
        )
    return None


class FusedArms:
    """K arms of one shape, one step for all; ``callbacks[k]`` are arm k's (each gets its own
    objects: a detector, a trace, ...). Fired per arm: on_train_start, on_before_optimizer (a veto
    skips that arm's update only), on_after_step, on_log, on_eval, on_train_end, on_close; the
    ``trainer`` they see is an :class:`ArmView`."""

    def __init__(
        self,
        cfgs: Sequence[TrainingConfig],
        train_tokens: Tokens,
        val_tokens: Tokens,
        callbacks: Sequence[Sequence[Any]],
        identities: Sequence[str],
    ):
        check_group(cfgs)
        self.cfgs, self.k = list(cfgs), len(cfgs)
        cfg = cfgs[0]
        self.device = resolve_device(cfg.train.device)
        if self.device.type == "cpu":
            torch.set_num_threads(cfg.train.cpu_threads or idle_cores())
        self.models = [self._arm_model(c) for c in cfgs]  # each arm's own init; the final weights go back here
        self.precision = resolve_precision(cfg.precision, self.device.type)
        self.skeleton = _skeleton(self.models[0], matmul_attention=self.device.type == "cpu")
        self.groups = _param_groups(self.models, self.cfgs, self.device)
        self.names = [name for group in self.groups for name in group.names]  # a tied weight once
        self.flat, self.params = _stacked(self.models, self.names, self.device)
        self.exp_avg, self.exp_avg_sq = torch.zeros_like(self.flat), torch.zeros_like(self.flat)
        self.adam_steps = torch.zeros(self.k, dtype=torch.float64, device=self.device)
        self._set_hyperparameters()
        self.layer_params = _layer_parameters(self.skeleton)
        t = cfg.train
        seeds = [c.train.seed for c in cfgs]
        # The group's data on host cores: train.num_workers processes gather every arm's next batch
        # while the device trains, into pinned memory on a GPU (the device copy then overlaps).
        self.pinned = t.pin_memory and self.device.type == "cuda"
        self.loader = ArmsLoader(train_tokens, cfg.model.seq_len, t.batch_size, seeds, t.num_workers, self.pinned)
        self.val_loader = ArmsLoader(val_tokens, cfg.model.seq_len, t.batch_size, seeds)  # in process, as the Trainer's
        self.callbacks = [sorted(cbs, key=lambda cb: getattr(cb, "order", 50)) for cbs in callbacks]
        self.identities = list(identities)
        self.telemetry = [Telemetry(self.device) for _ in cfgs]
        self.divergence = [DivergenceRule(t.diverge_after, t.diverge_loss, self.device) for _ in cfgs]
        self.views = [ArmView(self, k) for k in range(self.k)]
        self.active = torch.ones(self.k, dtype=torch.bool, device=self.device)
        self.summaries: list[dict[str, Any] | None] = [None] * self.k
        self.last_metrics: list[dict[str, float]] = [{} for _ in cfgs]
        self.tokens_per_step = t.batch_size * t.grad_accum * cfg.model.seq_len
        self.flops_per_token = model_flops_per_token(self.models[0])
        self.peak = peak_flops(self.device)
        self.step = 0
        self.update_rms = torch.full((self.k,), float("nan"), device=self.device)

    def _arm_model(self, cfg: TrainingConfig) -> GPT:
        seed_everything(cfg.train.seed)  # as the Trainer seeds before it builds the model
        return GPT(cfg.model, cfg.mup, cfg.tokenizer.vocab_size).to(self.device)

    def _set_hyperparameters(self) -> None:
        """Each arm's β₁, β₂, ε, clip and z-loss coefficient, (K,) float64 (the group's decays and
        μP multipliers: :class:`ParamGroup`)."""
        self.beta1, self.beta2, self.eps, self.clip, self.z_coef = (
            torch.tensor([getter(c) for c in self.cfgs], dtype=torch.float64, device=self.device)
            for getter in (
                lambda c: c.optim.beta1,
                lambda c: c.optim.beta2,
                lambda c: c.optim.eps,
                lambda c: c.optim.grad_clip,
                lambda c: c.model.z_loss,
            )
        )

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> list[dict[str, Any]]:
        """Train every arm to ``train.steps`` or its divergence; returns each arm's summary (as
        model/train.py's ``train`` returns one)."""
        total = self.cfgs[0].train.steps
        for k in range(self.k):
            self._fire(k, "on_train_start", self.cfgs[k].to_flat_dict(), self._run_info(k))
        self.start_time, self.eval_seconds = time.perf_counter(), 0.0
        try:
            while self.step < total and any(s is None for s in self.summaries):
                self._advance()
            for k in range(self.k):
                if self.summaries[k] is None:
                    self._finish(k, "completed", None)
        finally:
            self._write_back()
            for k in range(self.k):
                self._fire(k, "on_close", self.views[k])
        return [s for s in self.summaries if s is not None]

    def _advance(self) -> None:
        """One step of every arm and what is due after it, as the Trainer's _advance per arm."""
        t, total = self.cfgs[0].train, self.cfgs[0].train.steps
        lrs = [lr_at(self.step, c.optim.lr, total, c.schedule) for c in self.cfgs]
        step = self.step + 1
        log_now = step % t.log_every == 0 or step == total
        stats_now = step % t.layer_stats_every == 0
        running = [k for k in range(self.k) if self.summaries[k] is None]
        pending, forward_stats = self._pending(step, stats_now, running)
        before = self.flat.clone() if log_now else None
        results = self._update(pending, lrs, before)
        for k in running:
            r = results[k]
            self.telemetry[k].add(r.loss, r.z_loss, r.grad_norm, r.skipped, r.overflow, r.vetoed, self.tokens_per_step)
            self.divergence[k].update(step, r)
            self._fire(k, "on_after_step", self.views[k], r)
        val = self.evaluate() if (t.eval_every > 0 and step % t.eval_every == 0) or step == total else None
        for k in running:
            layer_stats = {**{n: v[k] for n, v in forward_stats.items()}, **results[k].layer_grad_norms}
            self._log(k, self._metrics(k, layer_stats, results[k].update_ratio, lrs[k], log_now), val)
            if log_now and (at := self.divergence[k].diverged_at()) is not None:
                self._finish(k, "diverged", f"diverged at step {at} (train.diverge_after/diverge_loss)")

    def _pending(
        self, step: int, stats_now: bool, running: list[int]
    ) -> tuple[list[PendingStep], dict[str, torch.Tensor]]:
        """Forward and backward; each arm's step as its on_before_optimizer callbacks see it (and
        may veto it), and the forward statistics at stats steps."""
        ce, z, forward_stats = self._forward_backward(stats_now)
        grad_norm = _arm_norms([_grad(self.params[name]) for name in self.names])
        layer_norms = self._layer_grad_norms() if stats_now else {}
        pending = [
            PendingStep(step, ce[k], z[k], grad_norm[k], {n: v[k] for n, v in layer_norms.items()})
            for k in range(self.k)
        ]
        for k in running:
            self._fire(k, "on_before_optimizer", self.views[k], pending[k])
        return pending, forward_stats

    def _update(self, pending: list[PendingStep], lrs: list[float], before: torch.Tensor | None) -> list[StepResult]:
        """Every arm's update, skipped where its step is non-finite, vetoed or the arm has ended;
        each arm's StepResult (with its update ratio when ``before`` holds the weights)."""
        ce, z = torch.stack([p.loss for p in pending]), torch.stack([p.z_loss for p in pending])
        grad_norm, vetoed = torch.stack([p.grad_norm for p in pending]), torch.stack([p.vetoed for p in pending])
        nonfinite = ~(torch.isfinite(grad_norm) & torch.isfinite(ce + z))
        grads = torch.cat([_grad(self.params[name]).flatten(1) for name in self.names], dim=1)
        self._adamw(grads, grad_norm, nonfinite | vetoed | ~self.active, lrs)
        self.step += 1
        ratio = _row_norms(self.flat - before) / _row_norms(before) if before is not None else None
        no_overflow = torch.zeros_like(nonfinite)  # fp32 and bf16: no loss scaler
        return [
            StepResult(
                ce[k],
                z[k],
                grad_norm[k],
                nonfinite[k],
                no_overflow[k],
                vetoed[k] & ~nonfinite[k],
                ratio[k] if ratio is not None else None,
                p.layer_grad_norms,
            )  # fmt: skip
            for k, p in enumerate(pending)
        ]

    def _log(self, k: int, metrics: dict[str, float], val: list[float] | None) -> None:
        if val is not None:
            metrics["val/loss"] = val[k]
        if metrics:
            self.last_metrics[k].update(metrics)
            self._fire(k, "on_log", self.step, metrics)
        if val is not None:
            self._fire(k, "on_eval", self.step, val[k])

    def _forward_backward(self, stats_now: bool) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Accumulate every arm's gradients over its micro-batches; each arm's mean cross-entropy
        and z-loss term, (K,) each, and the forward statistics of the last micro-batch, (K,) each."""
        accum = self.cfgs[0].train.grad_accum
        for p in self.params.values():
            p.grad = None
        ce_sum = z_sum = torch.zeros(self.k, device=self.device)
        forward = vmap(_arm_forward(self.skeleton, stats_now))
        stats: dict[str, torch.Tensor] = {}
        for _ in range(accum):
            x, y = self._next_batches(self.loader)
            with self.precision.autocast():  # as the Trainer's forward: the loss takes the logits in fp32
                logits, stats = forward(self.params, x)
            ce, z = arm_losses(logits, y, self.z_coef)
            ((ce + z) / accum).sum().backward()  # d(sum)/d(loss_k) = 1: each arm's gradient is its own
            ce_sum, z_sum = ce_sum + ce.detach(), z_sum + z.detach()
        return ce_sum / accum, z_sum / accum, stats

    @torch.no_grad()
    def _adamw(self, grads: torch.Tensor, grad_norm: torch.Tensor, skip: torch.Tensor, lrs: list[float]) -> None:
        """Clip each arm's gradient to its own norm, then AdamW (decay first, as torch's kernel)
        where the arm is not skipped; a skipped arm's weights, moments and step count stay bitwise
        as they were. Per-arm scalars are (K, 1) columns, taken in float64 as torch's fused kernel
        takes its scalars; each param group is one span of the flat buffer."""
        clip = torch.where(self.clip > 0, (self.clip / (grad_norm.double() + 1e-6)).clamp(max=1.0), 1.0)
        grads = grads * clip.float()[:, None]
        steps = self.adam_steps + (~skip).double()
        lr = torch.tensor(lrs, dtype=torch.float64, device=self.device)[:, None]
        b1, b2 = self.beta1[:, None], self.beta2[:, None]
        bc1, bc2 = 1 - b1 ** steps[:, None], 1 - b2 ** steps[:, None]
        squares = grads * grads
        exp_avg = self.exp_avg.lerp(grads, (1 - b1).float())
        exp_avg_sq = torch.addcmul(self.exp_avg_sq * b2.float(), squares, (1 - b2).float())
        update = exp_avg / (exp_avg_sq.sqrt() / bc2.sqrt().float() + self.eps[:, None].float())
        param = torch.empty_like(self.flat)
        for group in self.groups:
            rows, group_lr = self.flat[:, group.span], lr * group.lr_mult
            if group.decays_independently:  # model/step.py: _decay_independently, before the step
                rows = rows * (1 - group.independent).float()
            if group.decays_coupled:
                rows = rows * (1 - group_lr * group.coupled).float()
            torch.addcmul(rows, (group_lr / bc1).float(), update[:, group.span], value=-1, out=param[:, group.span])
        keep = ~skip[:, None]
        self.flat.copy_(torch.where(keep, param, self.flat))
        self.exp_avg.copy_(torch.where(keep, exp_avg, self.exp_avg))
        self.exp_avg_sq.copy_(torch.where(keep, exp_avg_sq, self.exp_avg_sq))
        self.adam_steps = steps
        # Adam's update RMS (model/telemetry.py: adam_update_rms), per arm: g / √v̂, ε left out.
        v_hat = (self.exp_avg_sq / (1 - b2 ** steps[:, None]).float()).clamp_min(1e-30)
        self.update_rms = ((squares / v_hat).sum(dim=1) / grads.shape[1]).sqrt()

    def _layer_grad_norms(self) -> dict[str, torch.Tensor]:
        """model/telemetry.py's layer_grad_norms, (K,) per layer."""
        return {
            f"stats/grad_norm/{layer}": _arm_norms([_grad(self.params[n]) for n in names])
            for layer, names in self.layer_params.items()
        }

    def _metrics(
        self, k: int, layer_stats: dict[str, torch.Tensor], ratio: torch.Tensor | None, lr: float, log_now: bool
    ) -> dict[str, float]:
        """Arm k's metrics due at this step, named and computed as the Trainer's _metrics_due
        (``ratio``: its update ratio, taken at log steps)."""
        if not log_now:
            return to_floats(layer_stats)
        assert ratio is not None  # a log step watches its update
        extra = {
            "train/param_norm": self.flat[k].norm(),
            "train/adam_v_norm": self.exp_avg_sq[k].norm(),
            "train/update_ratio": ratio,
            **layer_stats,
        }
        metrics = self.telemetry[k].drain(extra)
        return {**metrics, "train/lr": lr, "train/tokens": float(self.step * self.tokens_per_step)}

    @torch.no_grad()
    def evaluate(self) -> list[float]:
        """Each arm's mean validation cross-entropy over the same ``train.eval_batches`` batches of
        its own validation order every time (the Trainer's evaluate)."""
        start = time.perf_counter()
        self.val_loader.rewind()
        forward = vmap(_arm_forward(self.skeleton, False))
        total = torch.zeros(self.k, device=self.device)
        for _ in range(self.cfgs[0].train.eval_batches):
            x, y = self._next_batches(self.val_loader)
            with self.precision.autocast():
                logits, _ = forward(self.params, x)
            total += arm_losses(logits, y, torch.zeros_like(self.z_coef))[0]
        self.eval_seconds += time.perf_counter() - start
        return (total / self.cfgs[0].train.eval_batches).tolist()

    def _next_batches(self, loader: ArmsLoader) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch of each arm's stream, stacked (K, B, T), on the device; the DataLoader's seed
        draw kept out of the global RNG, as the Trainer keeps it."""
        with torch.random.fork_rng(devices=[]):
            x, y = loader.next_batch()
        return x.to(self.device, non_blocking=self.pinned), y.to(self.device, non_blocking=self.pinned)

    def _finish(self, k: int, status: RunStatus, reason: str | None) -> None:
        """Arm k's summary as of now; a diverged arm is frozen (its update masked from here on)."""
        self.active[k] = False
        summary = run_summary(
            status=status,
            stop_reason=reason,
            diverged_at=self.divergence[k].diverged_at(),
            steps=self.step,
            start_step=0,
            identity=self.identities[k],
            metrics=self.last_metrics[k],
            wall_s=time.perf_counter() - self.start_time,
            eval_s=self.eval_seconds,
            checkpoint_s=0.0,
            tokens_per_step=self.tokens_per_step,
            flops_per_token=self.flops_per_token,
            peak=self.peak,
            precision=self.precision.describe(),
            device=self.device,
            resumed_from=None,
        )
        self.summaries[k] = summary
        self._fire(k, "on_train_end", summary)

    @torch.no_grad()
    def _write_back(self) -> None:
        """Each arm's final weights into its own GPT (what on_close's probes read)."""
        for k, model in enumerate(self.models):
            params = dict(model.named_parameters())
            for name in self.names:
                params[name].copy_(self.params[name][k])

    def _fire(self, k: int, hook: str, *args: Any) -> None:
        for cb in self.callbacks[k]:
            method = getattr(cb, hook, None)
            if method is not None:
                method(*args)

    def _run_info(self, k: int) -> RunInfo:
        return RunInfo(
            device=str(self.device),
            precision=self.precision.describe(),
            start_step=0,
            total_steps=self.cfgs[k].train.steps,
            tokens_per_step=self.tokens_per_step,
            n_params=self.models[k].num_params(non_embedding=False),
            identity=self.identities[k],
            checkpoint_dir=None,
            resumed_from=None,
        )


@dataclasses.dataclass(frozen=True)
class ParamGroup:
    """One of model/optim.py's param groups, as one span of every arm's row of the flat buffer."""

    names: list[str]
    span: slice
    lr_mult: float  # μP's, the same for every arm of one shape
    coupled: torch.Tensor  # (K, 1) AdamW weight decay of each arm (× lr at each step)
    independent: torch.Tensor  # (K, 1) independent decay of each arm

    @property
    def decays_coupled(self) -> bool:
        return bool((self.coupled != 0).any())

    @property
    def decays_independently(self) -> bool:
        return bool((self.independent != 0).any())


def _param_groups(models: list[GPT], cfgs: list[TrainingConfig], device: torch.device) -> list[ParamGroup]:
    """model/optim.py's param groups of every arm (one structure: arms of a group share shape and
    decay flags), laid out one after another."""
    per_arm = [param_groups(model, cfg.optim) for model, cfg in zip(models, cfgs, strict=True)]
    names_of = {id(p): name for name, p in models[0].named_parameters()}
    out, start = [], 0
    for i, group in enumerate(per_arm[0]):
        size = sum(p.numel() for p in group["params"])
        out.append(
            ParamGroup(
                [names_of[id(p)] for p in group["params"]],
                slice(start, start + size),
                group["lr_mult"],
                *(
                    torch.tensor([[arm[i][key]] for arm in per_arm], dtype=torch.float64, device=device)
                    for key in ("weight_decay", "independent_decay")
                ),
            )
        )
        start += size
    return out


class ArmView:
    """What arm k's callbacks read of the trainer (model/callbacks.py: TrainerView's reading part)."""

    def __init__(self, group: FusedArms, k: int):
        self.group, self.k = group, k
        self.cfg = group.cfgs[k]
        self.device = group.device
        self.precision: Precision = group.precision

    @property
    def step(self) -> int:
        return self.group.step

    @property
    def model(self) -> GPT:
        """The arm's own model; its weights are the arm's after the run (read at on_close)."""
        return self.group.models[self.k]

    def update_rms(self) -> torch.Tensor:
        return self.group.update_rms[self.k]


def arm_losses(logits: torch.Tensor, targets: torch.Tensor, z_coef: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each arm's mean cross-entropy and z-loss term (coef · mean log²Z; exactly 0 where its coef
    is 0), (K,) each, from (K, B, T, V) logits: model/gpt.py's cross_entropy_and_z_loss per arm,
    log Z taken the same way (the row's largest logit minus its log-probability)."""
    logits = logits.float().flatten(1, 2)  # (K, N, V)
    log_p = torch.log_softmax(logits, dim=-1)
    ce = -log_p.gather(2, targets.flatten(1)[..., None]).squeeze(2).mean(dim=1)
    if not bool((z_coef != 0).any()):
        return ce, torch.zeros_like(ce)
    top, at = logits.max(dim=-1, keepdim=True)
    log_z = (top - log_p.gather(2, at)).squeeze(2)  # (K, N)
    z = torch.where(z_coef != 0, z_coef.float() * log_z.pow(2).mean(dim=1), 0.0)
    return ce, z


def _arm_forward(skeleton: GPT, stats_now: bool) -> Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """One arm's logits (and, at stats steps, model/telemetry.py's forward statistics): vmapped
    over the stacked weights and the stacked batches."""

    def forward(params: dict[str, torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if not stats_now:
            return functional_call(skeleton, params, (x,))[0], {}
        with record_forward_stats(skeleton) as stats:
            logits = functional_call(skeleton, params, (x,))[0]
        return logits, stats

    return forward


def _skeleton(model: GPT, matmul_attention: bool) -> GPT:
    """The model's structure without its weights, which each call supplies (functional_call)."""
    skeleton = copy.deepcopy(model).to("meta")
    for block in skeleton.layers:
        block.attn.matmul_attention = matmul_attention
    return skeleton


def _stacked(models: list[GPT], names: list[str], device: torch.device) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One (K, N) buffer of every arm's weights, and each parameter as a (K, ...) leaf view of it:
    the optimizer updates the buffer in one pass, the forward reads the views."""
    per_arm = [dict(m.named_parameters()) for m in models]
    flat = torch.stack([torch.cat([p[name].detach().flatten() for name in names]) for p in per_arm]).to(device)
    params, start = {}, 0
    for name in names:
        shape = per_arm[0][name].shape
        stop = start + per_arm[0][name].numel()
        params[name] = flat[:, start:stop].view(len(models), *shape).requires_grad_()
        start = stop
    return flat, params


def _layer_parameters(skeleton: GPT) -> dict[str, list[str]]:
    """The parameter names of each layer model/telemetry.py's layer_grad_norms reports (a tied
    readout under the embedding's name)."""
    canonical = {id(p): name for name, p in skeleton.named_parameters()}
    layers = {layer: [canonical[id(p)] for p in module.parameters()] for layer, module in _layers(skeleton).items()}
    return {layer: names for layer, names in layers.items() if names}  # Post-LN's norm_f is an Identity


def _arm_norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The total 2-norm of each arm's slice of ``tensors`` (each (K, ...)): (K,)."""
    norms: torch.Tensor = torch.stack([_row_norms(t.flatten(1)) for t in tensors]).norm(dim=0)
    return norms


def _row_norms(x: torch.Tensor) -> torch.Tensor:
    norms: torch.Tensor = torch.linalg.vector_norm(x, dim=1)
    return norms


def _grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None, "every parameter takes part in every arm's loss"
    return p.grad
