"""The training step, the loop around it, and ``train()``, the one entry point stages call.

    train_step   one optimizer step: forward/backward over the micro-batches (precision context,
                 loss scaling), unscale, optional gradient multiplier, pre-clip global norm,
                 clipping, a non-finite guard decided on the device, AdamW.
    Trainer      the loop: schedule, data, telemetry, evaluation, callbacks, checkpoint state,
                 resume, preemption.
    train()      build a Trainer, resume if a checkpoint exists, run, return a summary dict.

With the fused AdamW that ``optim.implementation: auto`` selects, nothing in a step waits on the
host except at log, stats and eval points (one sync each); foreach/loop AdamW adds one per step
(the non-finite guard's decision).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import yaml
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from model.callbacks import Callback, CSVLogger, ProgressBar, RunInfo
from model.checkpoint import Checkpointer, capture_rng, load_checkpoint, load_latest, restore_rng
from model.config import Config, OptimConfig, load_config
from model.data import TokenLoader, open_tokens
from model.flops import mfu, model_flops_per_token, peak_flops
from model.gpt import GPT
from model.optim import build_adamw, lr_at, set_lr
from model.precision import Precision, resolve_precision
from model.telemetry import (Telemetry, layer_grad_norms, optimizer_norms, record_forward_stats,
                             to_floats)

PREEMPTED_EXIT_CODE = 75
"""Exit status after a preemption checkpoint: EX_TEMPFAIL (sysexits.h), "try again"; rerunning
the same command resumes."""

CHECKPOINT_FORMAT = 1


class Preempted(SystemExit):
    """Raised by the loop after SIGTERM/SIGINT once the checkpoint of the current step is written.
    Left uncaught, the process exits with PREEMPTED_EXIT_CODE."""

    def __init__(self, step: int):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step = step


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


# ----------------------------------------------------------------------------------------------
# The step
# ----------------------------------------------------------------------------------------------


class StepResult(NamedTuple):
    """Device tensors (no host sync); flags are bool scalars."""

    loss: torch.Tensor        # mean cross-entropy over the micro-batches
    z_loss: torch.Tensor      # mean z-loss term (0 when model.z_loss is 0)
    grad_norm: torch.Tensor   # global gradient norm before clipping (unscaled, after grad_scale)
    skipped: torch.Tensor     # non-finite loss or gradient: weights and Adam state untouched
    overflow: torch.Tensor    # fp16 loss-scale overflow (also untouched; counted apart from skipped)
    update_ratio: torch.Tensor | None          # ‖Δθ‖/‖θ‖ of this step, when asked for
    layer_grad_norms: dict[str, torch.Tensor]  # per-layer pre-clip norms, when asked for


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
               precision: Precision, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
               clip: float, grad_scale: float = 1.0, watch_update: bool = False,
               watch_layers: bool = False) -> StepResult:
    """One optimizer step over ``micro_batches`` [(x, y), each (B, T)] with gradient accumulation.
    The learning rate is whatever the param groups hold (the loop sets it)."""
    optimizer.zero_grad(set_to_none=True)
    n = len(micro_batches)
    ce_sum = z_sum = torch.zeros((), device=micro_batches[0][0].device)
    for x, y in micro_batches:
        with precision.autocast():
            _, ce, z = model(x, y)
        scaler.scale((ce + z) / n).backward()
        ce_sum, z_sum = ce_sum + ce.detach(), z_sum + z.detach()
    loss, z_loss = ce_sum / n, z_sum / n

    scaler.unscale_(optimizer)  # no-op unless fp16 loss scaling
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    if grad_scale != 1.0:  # spike-injection hook; applied before the norm so the norm shows it
        for g in grads:
            g.mul_(grad_scale)
    grad_norm = get_total_norm(grads)
    layer_norms = layer_grad_norms(model) if watch_layers else {}
    if clip > 0:
        clip_grads_with_norm_(params, clip, grad_norm)

    grads_finite = torch.isfinite(grad_norm)
    overflow = ~grads_finite if scaler.is_enabled() else torch.zeros_like(grads_finite)
    bad = ~(grads_finite & torch.isfinite(loss + z_loss))
    before = [p.detach().clone() for p in params] if watch_update else None
    _guarded_step(optimizer, bad)
    scaler.update()  # backs the loss scale off after an overflow, grows it after a clean stretch
    ratio = None
    if before is not None:
        with torch.no_grad():
            ratio = get_total_norm([p - b for p, b in zip(params, before)]) / get_total_norm(before)
    return StepResult(loss, z_loss, grad_norm, bad & ~overflow, overflow, ratio, layer_norms)


def _guarded_step(optimizer: torch.optim.Optimizer, bad: torch.Tensor) -> None:
    """Step unless ``bad``. Fused AdamW takes ``found_inf`` (the GradScaler protocol) and skips on
    the device: no update, no moment change, step count restored. Other kernels need one host sync."""
    if optimizer.defaults.get("fused"):
        optimizer.found_inf = bad.float()
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    elif not bad.item():
        optimizer.step()


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    """Owns the model, optimizer, loss scaler, loaders, telemetry and callbacks of one run.

    Callbacks see the trainer in on_step_start/on_step_end. Per-step hooks for spike injection
    and recovery, both reset to 1.0 before every on_step_start:
      lr_scale     multiplies this step's scheduled learning rate
      grad_scale   multiplies this step's gradients (before the norm and clipping)
    and ``loader.skip(n)`` skips batches. ``stop_requested`` (set by SIGTERM/SIGINT or a callback)
    ends the run after the current step with a checkpoint and :class:`Preempted`.
    """

    def __init__(self, cfg: Config, train_tokens: np.ndarray, val_tokens: np.ndarray,
                 callbacks: Sequence[Callback] = (), checkpoint_dir: str | Path | None = None):
        self.cfg = cfg
        t = cfg.train
        self.device = resolve_device(t.device)
        if t.cpu_threads:
            torch.set_num_threads(t.cpu_threads)
        seed_everything(t.seed)
        self.model = GPT(cfg.model, cfg.mup, cfg.tokenizer.vocab_size).to(self.device)
        self.forward_model = torch.compile(self.model) if t.compile else self.model
        self.optimizer = build_adamw(self.model, cfg.optim)
        self.precision = resolve_precision(cfg.precision, self.device.type)
        self.scaler = self.precision.grad_scaler(cfg.precision)
        self.loader = TokenLoader(train_tokens, cfg.model.seq_len, t.batch_size, t.seed,
                                  t.num_workers, t.pin_memory)
        self.val_loader = TokenLoader(val_tokens, cfg.model.seq_len, t.batch_size, t.seed)
        self.telemetry = Telemetry(self.device)
        self.checkpointer = (Checkpointer(checkpoint_dir, cfg.checkpoint, t.steps)
                             if checkpoint_dir is not None else None)
        self.callbacks = sorted([*callbacks, *([self.checkpointer] if self.checkpointer else [])],
                                key=lambda cb: getattr(cb, "order", Callback.order))  # stable sort
        self.tokens_per_step = t.batch_size * t.grad_accum * cfg.model.seq_len
        self.flops_per_token = model_flops_per_token(self.model)
        self.peak_flops = peak_flops(self.device)
        self.step = 0
        self.lr_scale = self.grad_scale = 1.0
        self.stop_requested = False  # set by a signal or a callback, at any time
        self.stopping = False  # stop_requested as of the end of the current step; Checkpointer reads it
        self.resumed_from: Path | None = None
        self.last_metrics: dict[str, float] = {}  # newest value of every metric, for the summary

    def fire(self, hook: str, *args: Any) -> None:
        """Call ``hook`` on every callback that has it (duck typing: subclassing Callback is optional)."""
        for cb in self.callbacks:
            method = getattr(cb, hook, None)
            if method is not None:
                method(*args)

    # -- state ---------------------------------------------------------------------------------

    def _stateful_callbacks(self) -> list[tuple[str, Callback]]:
        """Callbacks with state, named by class (#k for the k-th repeat of a class)."""
        seen: dict[str, int] = {}
        keyed = []
        for cb in self.callbacks:
            if not hasattr(cb, "state_dict"):
                continue
            name = type(cb).__name__
            seen[name] = seen.get(name, -1) + 1
            keyed.append((name if seen[name] == 0 else f"{name}#{seen[name]}", cb))
        return keyed

    def snapshot(self) -> dict[str, Any]:
        """Everything a bitwise-identical continuation needs, as weights_only-loadable values."""
        return {
            "format": CHECKPOINT_FORMAT,
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": capture_rng(),
            "loader": self.loader.state_dict(),
            "telemetry": self.telemetry.state_dict(),
            "last_metrics": self.last_metrics,
            "callbacks": {key: cb.state_dict() for key, cb in self._stateful_callbacks()},
            "config": dataclasses.asdict(self.cfg),
        }

    def restore(self, state: dict[str, Any], source: Path) -> None:
        if state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{source}: checkpoint format {state.get('format')!r}, expected {CHECKPOINT_FORMAT}")
        _warn_config_changes(state["config"], dataclasses.asdict(self.cfg), source)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if state["scaler"]:  # empty when the saving run had no loss scaling
            self.scaler.load_state_dict(state["scaler"])
        self.loader.load_state_dict(state["loader"])
        self.telemetry.load_state_dict(state["telemetry"])
        self.last_metrics = dict(state["last_metrics"])
        for key, cb in self._stateful_callbacks():
            if key in state["callbacks"]:
                cb.load_state_dict(state["callbacks"][key])
        restore_rng(state["rng"])
        self.step, self.resumed_from = state["step"], source
        print(f"spikelab: resumed from {source} at step {self.step}", file=sys.stderr, flush=True)

    def resume(self, init_from: str | Path | None = None) -> None:
        """Continue from the newest valid checkpoint of this run; without one, start from
        ``init_from`` (e.g. a pretraining milestone) if given."""
        latest = load_latest(self.checkpointer.directory) if self.checkpointer else None
        if latest is not None:
            self.restore(latest[1], latest[0])
        elif init_from is not None:
            self.restore(load_checkpoint(Path(init_from)), Path(init_from))

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Train from ``self.step`` to ``train.steps``; returns the summary (see :func:`train`)."""
        self.fire("on_train_start", self.cfg.to_flat_dict(), self._run_info())
        start_step, self.eval_seconds = self.step, 0.0
        self.start_time = time.perf_counter()
        with _stop_on_signals(self):
            while self.step < self.cfg.train.steps:
                self._advance()
                if self.stopping:
                    summary = self._summary(start_step, preempted=True)
                    self.fire("on_train_end", summary)
                    raise Preempted(self.step)
        summary = self._summary(start_step, preempted=False)
        self.fire("on_train_end", summary)
        return summary

    def _advance(self) -> None:
        """One step and everything due after it: logs, stats, evaluation, callbacks."""
        t, total = self.cfg.train, self.cfg.train.steps
        self.lr_scale = self.grad_scale = 1.0
        self.fire("on_step_start", self)
        lr = lr_at(self.step, self.cfg.optim.lr, total, self.cfg.schedule) * self.lr_scale
        set_lr(self.optimizer, lr)
        step = self.step + 1
        log_now = step % t.log_every == 0 or step == total
        stats_now = step % t.layer_stats_every == 0
        eval_now = (t.eval_every > 0 and step % t.eval_every == 0) or step == total

        batches = [self._next_batch(self.loader) for _ in range(t.grad_accum)]
        # Stats steps run eagerly: forward hooks and the logit-max probe would break a compiled graph.
        model = self.model if stats_now else self.forward_model
        with record_forward_stats(self.model) if stats_now else contextlib.nullcontext({}) as forward_stats:
            result = train_step(model, self.optimizer, self.scaler, self.precision, batches,
                                self.cfg.optim.grad_clip, self.grad_scale,
                                watch_update=log_now, watch_layers=stats_now)
        self.step = step
        self.telemetry.add(result.loss, result.z_loss, result.grad_norm, result.skipped,
                           result.overflow, self.tokens_per_step)
        metrics = self._metrics_due(result, forward_stats, lr, log_now, stats_now)
        if eval_now:
            metrics["val/loss"] = self.evaluate()
        if metrics:
            self.last_metrics.update(metrics)
            self.fire("on_log", step, metrics)
        if eval_now:
            self.fire("on_eval", step, metrics["val/loss"])
        self.stopping = self.stop_requested  # latched: a signal from here on stops after the next step
        self.fire("on_step_end", self)

    def _metrics_due(self, result: StepResult, forward_stats: dict[str, torch.Tensor], lr: float,
                     log_now: bool, stats_now: bool) -> dict[str, float]:
        """Log-interval and layer metrics due at this step, in one host sync."""
        layer_stats = {**forward_stats, **result.layer_grad_norms} if stats_now else {}
        if not log_now:
            return to_floats(layer_stats)
        extra = {**optimizer_norms(self.model, self.optimizer),
                 "train/update_ratio": result.update_ratio, **layer_stats}
        metrics = self.telemetry.drain(extra)
        return {**metrics, **self._host_metrics(lr, metrics["train/tokens_per_s"])}

    def _host_metrics(self, lr: float, tokens_per_s: float) -> dict[str, float]:
        out = {"train/lr": lr, "train/tokens": float(self.step * self.tokens_per_step)}
        if self.scaler.is_enabled():
            out["train/loss_scale"] = self.scaler.get_scale()
        utilisation = mfu(tokens_per_s, self.flops_per_token, self.peak_flops)
        if utilisation is not None:
            out["train/mfu"] = utilisation
        return out

    def _next_batch(self, loader: TokenLoader) -> tuple[torch.Tensor, torch.Tensor]:
        # A DataLoader draws its base seed from the global RNG whenever an iterator is created (at
        # the first batch of a process, so after every resume); keep that draw out of the stream
        # dropout uses, or a resumed run would not be bitwise identical.
        with torch.random.fork_rng(devices=[]):
            x, y = loader.next_batch()
        non_blocking = self.cfg.train.pin_memory
        return x.to(self.device, non_blocking=non_blocking), y.to(self.device, non_blocking=non_blocking)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation cross-entropy over the same ``train.eval_batches`` batches every time."""
        start = time.perf_counter()
        self.model.eval()
        self.val_loader.load_state_dict({"batches_served": 0, "seed": self.val_loader.seed})
        total = torch.zeros((), device=self.device)
        for _ in range(self.cfg.train.eval_batches):
            x, y = self._next_batch(self.val_loader)
            with self.precision.autocast():
                _, ce, _ = self.forward_model(x, y)
            total += ce
        self.model.train()
        loss = (total / self.cfg.train.eval_batches).item()
        self.eval_seconds += time.perf_counter() - start
        return loss

    def _run_info(self) -> RunInfo:
        return RunInfo(
            device=str(self.device), precision=self.precision.describe(), start_step=self.step,
            total_steps=self.cfg.train.steps, tokens_per_step=self.tokens_per_step,
            n_params=self.model.num_params(non_embedding=False),
            checkpoint_dir=str(self.checkpointer.directory) if self.checkpointer else None,
            resumed_from=str(self.resumed_from) if self.resumed_from else None)

    def _summary(self, start_step: int, preempted: bool) -> dict[str, Any]:
        wall = time.perf_counter() - self.start_time
        checkpoint_s = self.checkpointer.seconds if self.checkpointer else 0.0
        tokens = (self.step - start_step) * self.tokens_per_step
        train_s = wall - self.eval_seconds
        tokens_per_s = tokens / train_s if train_s > 0 else 0.0
        m = self.last_metrics
        return {
            "steps": self.step, "start_step": start_step, "preempted": preempted,
            "final_loss": m.get("train/loss"), "val_loss": m.get("val/loss"),
            "skipped": int(m.get("train/skipped", 0)), "overflows": int(m.get("train/overflows", 0)),
            "tokens_per_s": tokens_per_s,  # training loop incl. telemetry and checkpoints, excl. eval
            "mfu": mfu(tokens_per_s, self.flops_per_token, self.peak_flops),
            "wall_s": wall, "eval_s": self.eval_seconds, "checkpoint_s": checkpoint_s,
            "checkpoint_time_share": checkpoint_s / wall if wall > 0 else 0.0,
            "precision": self.precision.describe(), "device": str(self.device),
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
        }


@contextlib.contextmanager
def _stop_on_signals(trainer: Trainer) -> Iterator[None]:
    """SIGTERM/SIGINT set ``trainer.stop_requested`` and restore the previous handlers, so a
    second signal acts as usual. Signals reach only the main thread; elsewhere (a worker thread
    of an orchestrator) nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def request_stop(signum, frame):
        trainer.stop_requested = True
        for s, handler in previous.items():
            signal.signal(s, handler)

    for s in previous:
        signal.signal(s, request_stop)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _warn_config_changes(saved: dict[str, Any], current: dict[str, Any], source: Path) -> None:
    changed = _changed_keys(saved, current)
    if changed:
        print(f"spikelab: config differs from {source} in: {', '.join(changed)}", file=sys.stderr)


def _changed_keys(saved: dict[str, Any], current: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key, value in current.items():
        if isinstance(value, dict):
            out += _changed_keys(saved.get(key) or {}, value, f"{prefix}{key}.")
        elif saved.get(key) != value:
            out.append(prefix + key)
    return out


# ----------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------


def train(cfg: Config, train_tokens: np.ndarray, val_tokens: np.ndarray,
          out_dir: str | Path | None = None, callbacks: Sequence[Callback] = (),
          init_from: str | Path | None = None) -> dict[str, Any]:
    """Train one model; returns a summary dict.

    ``out_dir``: checkpoints go to ``<out_dir>/checkpoints`` and the run resumes from the newest
    valid one; None (an LR-search trial, a benchmark) writes nothing. ``init_from``: a checkpoint
    to start from when ``out_dir`` has none. After SIGTERM/SIGINT the current step finishes, a
    checkpoint is written and :class:`Preempted` (exit code 75) is raised.

    Summary: steps, start_step, preempted, final_loss (last logged train loss), val_loss,
    skipped, overflows, tokens_per_s (excluding evaluation), mfu (None off known GPUs), wall_s,
    eval_s, checkpoint_s, checkpoint_time_share, precision, device, resumed_from.
    """
    checkpoint_dir = Path(out_dir) / "checkpoints" if out_dir is not None else None
    trainer = Trainer(cfg, train_tokens, val_tokens, callbacks, checkpoint_dir)
    trainer.resume(init_from)
    return trainer.run()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m model.train``: one run on a bare box (no orchestration, no tracking)."""
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--params", default="params.yaml", help="params.yaml (default: %(default)s)")
    p.add_argument("--profile", help="overlay in profiles/ (default: the file's `profile` key)")
    p.add_argument("--train-tokens", required=True, help="token shard of the training split")
    p.add_argument("--val-tokens", required=True, help="token shard of the validation split")
    p.add_argument("--dtype", default="uint16", help="token id dtype of the shards (default: %(default)s)")
    p.add_argument("--out", required=True, help="run directory: checkpoints/, plots/*.csv")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a dotted config key, value parsed as YAML (repeatable)")
    args = p.parse_args(argv)
    cfg = load_config(args.params, args.profile)
    if args.set:
        cfg = cfg.replace(**{k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.set)})
    out = Path(args.out)
    summary = train(cfg, open_tokens(args.train_tokens, args.dtype), open_tokens(args.val_tokens, args.dtype),
                    out, [ProgressBar(), CSVLogger(out / "plots")])
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
