"""The training loop and ``train()``, the entry point a bare box calls (``python -m model.train``).

    Trainer      the loop around the step (model/step.py: TrainModule): schedule, data, callbacks and their events, telemetry, evaluation,
                 checkpoint state, explicit and selective loading, typed stops.
    train()      one run in a locked directory: resume or start, run, return the summary.

With the fused AdamW that ``optim.implementation: auto`` selects, nothing in a step waits on the
host except at log, stats and eval points (one sync each); foreach/loop AdamW adds one per step
(the skip decision). Callbacks see device tensors and must keep it so (see model/callbacks.py).

How a run ends is typed (model/stops.py): ``run()`` returns a summary whose ``status`` is
completed, stopped (a callback asked, with a reason) or diverged (``train.diverge_after`` /
``train.diverge_loss``), and raises :class:`Preempted` after SIGTERM/SIGINT once the step's
checkpoint is written.

Under ``torchrun`` (``torchrun --nproc-per-node N -m model.train ...``; model/distributed.py) the
ranks train as one process with the same config would: ``train.batch_size`` is the global batch,
each rank takes its slice. Rank 0 alone holds the run lock, writes checkpoints and (in ``main``)
logs; every rank resumes from the checkpoint rank 0 picks. Stops and preemption are agreed on at
the end of every step, so all ranks stop at the same one.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import random
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import torch

from model.callbacks import Callback, Checkpointer, CSVLogger, ProgressBar, RunInfo, callback_name
from model.checkpoint import (
    CheckpointError,
    RunLock,
    capture_rng,
    load_checkpoint,
    load_latest,
    remove_orphans,
    restore_rng,
)
from model.config import TrainingConfig, check_device, load_training_config
from model.data import TokenLoader, Tokens, open_tokens
from model.distributed import World, init_world, leave_world, wrap
from model.flops import mfu, model_flops_per_token, peak_flops
from model.gpt import GPT
from model.identity import LOADABLE, RESUMABLE, check_loadable, run_identity
from model.numerics import check_mode
from model.optim import build_adamw, lr_at, set_lr
from model.precision import resolve_precision
from model.private import private_run_dir, run_private
from model.step import Batch, StepResult, TrainModule
from model.stops import Preempted, RunStatus
from model.telemetry import Telemetry, adam_update_rms, optimizer_norms, record_forward_stats, to_floats
from model.threads import idle_cores
from model.typed_config import ConfigError, UserError, add_config_arguments, parse_sets

CHECKPOINT_FORMAT = 2
"""2: checkpoints carry the run identity; format-1 files (no identity) are never resumed."""


def resolve_device(name: str) -> torch.device:
    """``auto``: CUDA when available. An explicit device that is not there is a ConfigError
    (``check_device``; a stage calls it through ``tasks.config.check_runtime``), raised before a stage touches anything."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    check_device(name)
    return torch.device(name)


# ----------------------------------------------------------------------------------------------
# Divergence, decided on the device
# ----------------------------------------------------------------------------------------------


class DivergenceRule:
    """``train.diverge_after`` consecutive non-finite steps, or the loss above ``train.diverge_loss``.
    A loss-scale overflow counts toward the streak: one is the scaler probing its scale, but
    ``diverge_after`` in a row have cut the scale by 2^diverge_after, so the run no longer trains
    (e.g. a forward pass that overflows fp16 every step). Tracked with device tensors;
    :meth:`diverged_at` is read at log points only."""

    def __init__(self, after: int, max_loss: float, device: torch.device):
        self.after, self.max_loss = after, max_loss
        self.streak = torch.zeros((), dtype=torch.long, device=device)
        self.first = torch.full((), -1, dtype=torch.long, device=device)  # step it fired, or -1

    @torch.no_grad()
    def update(self, step: int, result: StepResult) -> None:
        self.streak = torch.where(result.skipped | result.overflow, self.streak + 1, 0)
        hit = (self.streak >= self.after) if self.after > 0 else torch.zeros_like(result.skipped)
        if self.max_loss > 0:
            hit = hit | (result.loss > self.max_loss)
        self.first = torch.where((self.first < 0) & hit, step, self.first)

    def diverged_at(self) -> int | None:
        first = int(self.first)  # the one host sync, at a log point
        return first if first >= 0 else None

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"streak": self.streak, "first": self.first}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.streak, self.first = (state[k].to(self.first.device) for k in ("streak", "first"))


# ----------------------------------------------------------------------------------------------
# Selective loading
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Load:
    """What to take from a checkpoint. Everything (the default) is a bitwise continuation; a run
    started from another run's checkpoint may take less, e.g. ``Load.weights_only()``."""

    weights: bool = True
    optimizer: bool = True  # Adam moments and step counts (then the current hyperparameters apply)
    scaler: bool = True  # fp16 loss scale and its growth tracker
    loader: bool = True  # data position
    rng: bool = True  # torch, CUDA, numpy and Python RNG states
    step: bool = True  # the step counter (so the LR schedule), telemetry sums, last metrics
    callbacks: bool = True  # each named callback's state

    @classmethod
    def weights_only(cls) -> Load:
        return cls(optimizer=False, scaler=False, loader=False, rng=False, step=False, callbacks=False)


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def tokens_digest(tokens: Tokens) -> str:
    """Content hash of a token array, for the identity of runs not given one (tests, benchmarks)."""
    return hashlib.sha256(np.ascontiguousarray(tokens).view(np.uint8).data).hexdigest()


class Trainer:
    """Owns the train module, loaders, telemetry and callbacks of one run.

    Per-step controls for callbacks (all reset before every ``on_step_start``):
      scale_lr(f), scale_grad(f)   multiply this step's scheduled LR / gradients; factors from
                                   several callbacks compose by multiplication
      request_eager()              run this step uncompiled (forward hooks need it)
      request_stop(reason)         end the run after this step: checkpoint, status ``stopped``
      loader.skip(n)               skip n batches of the training stream
    """

    def __init__(
        self,
        cfg: TrainingConfig,
        train_tokens: Tokens,
        val_tokens: Tokens,
        callbacks: Sequence[Any] = (),
        checkpoint_dir: str | Path | None = None,
        identity: str | None = None,
        world: World | None = None,
    ):
        self.cfg = cfg
        t = cfg.train
        self.world = world or World.current()
        if t.batch_size % self.world.size:
            raise ConfigError(f"train.batch_size: {t.batch_size} does not split evenly over {self.world.size} ranks")
        self.device = self.world.device(resolve_device(t.device))
        if self.device.type == "cpu":  # ranks on one node share its idle cores
            torch.set_num_threads(t.cpu_threads or max(1, idle_cores() // self.world.local_size))
        seed_everything(t.seed)
        self.identity = (
            identity
            or run_identity(cfg, {"train": tokens_digest(train_tokens), "val": tokens_digest(val_tokens)}).digest
        )
        model = GPT(cfg.model, cfg.mup, cfg.tokenizer.vocab_size).to(self.device)
        check_mode(cfg.precision.numerics, self.device.type)
        precision = resolve_precision(cfg.precision, self.device.type)
        if t.compile and precision.emulated:
            # Measured 2026-11-25 (torch 2.13, CPU): a compiled ablation arm in emulated bf16 ended at a
            # validation loss of 5e16 (eager: 5.07), one in emulated fp16 diverged at step 160 (eager
            # completes). Why is not established; the numbers are wrong either way.
            raise ConfigError(
                f"train.compile: true with {precision.describe()}: compiled, the emulated rounding "
                "gives wrong numbers (a bf16 arm's loss 5e16); compile with fp32 or real autocast "
                "(precision.emulate: never), or run this precision eagerly"
            )
        replica = wrap(model, self.world)
        self.module = TrainModule(
            model,
            build_adamw(model, cfg.optim, cfg.precision.loss_multiplier),
            precision.grad_scaler(cfg.precision),
            precision,
            cfg.optim.grad_clip,
            torch.compile(replica) if t.compile else None,  # type: ignore[arg-type]  # compile(Module) returns an OptimizedModule, a Module; torch types it as a callable
            replica,
            self.world,
            cfg.precision.loss_multiplier,
        )
        self.model, self.optimizer, self.scaler, self.precision = (
            model,
            self.module.optimizer,
            self.module.scaler,
            precision,
        )
        shard = (self.world.rank, self.world.size)
        self.loader = TokenLoader(
            train_tokens, cfg.model.seq_len, t.batch_size, t.seed, t.num_workers, t.pin_memory, shard
        )
        self.val_loader = TokenLoader(val_tokens, cfg.model.seq_len, t.batch_size, t.seed, shard=shard)
        self.telemetry = Telemetry(self.device)
        self.divergence = DivergenceRule(t.diverge_after, t.diverge_loss, self.device)
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.checkpointer = (  # rank 0 writes; the others read it back on resume
            Checkpointer(checkpoint_dir, cfg.checkpoint, t.steps)
            if checkpoint_dir is not None and self.world.is_main
            else None
        )
        self.callbacks = _ordered([*callbacks, *([self.checkpointer] if self.checkpointer else [])])
        self.tokens_per_step = t.batch_size * t.grad_accum * cfg.model.seq_len
        self.flops_per_token = model_flops_per_token(self.model)
        peak = peak_flops(self.device)  # of one device; tokens/s counts every rank's
        self.peak_flops = peak * self.world.size if peak is not None else None
        self.step = 0
        self.stop_reason: str | None = None  # set by a callback; ends the run after the step
        self.signalled = False  # set by SIGTERM/SIGINT, at any time
        self.stopping = False  # a stop as of the end of the current step; the Checkpointer reads it
        self.resumed_from: Path | None = None
        self.last_metrics: dict[str, float] = {}  # newest value of every metric, for the summary
        self._reset_step_controls()

    # -- controls for callbacks ----------------------------------------------------------------

    def _reset_step_controls(self) -> None:
        self.lr_factor = self.grad_factor = 1.0
        self.eager_requested = False

    def scale_lr(self, factor: float) -> None:
        self.lr_factor *= factor

    def scale_grad(self, factor: float) -> None:
        self.grad_factor *= factor

    def request_eager(self) -> None:
        self.eager_requested = True

    def request_stop(self, reason: str) -> None:
        self.stop_reason = self.stop_reason or reason
        self.stopping = True  # asked in on_step_end, the Checkpointer (last there) still saves this step

    def fire(self, hook: str, *args: Any) -> None:
        """Call ``hook`` on every callback that has it (duck typing: subclassing Callback is optional)."""
        for cb in self.callbacks:
            method = getattr(cb, hook, None)
            if method is not None:
                method(*args)

    # -- state ---------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Everything a bitwise-identical continuation needs, as weights_only-loadable values."""
        return {
            "format": CHECKPOINT_FORMAT,
            "identity": self.identity,
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": capture_rng(),
            "loader": self.loader.state_dict(),
            "telemetry": self.telemetry.state_dict(),
            "divergence": self.divergence.state_dict(),
            "last_metrics": self.last_metrics,
            "callbacks": {callback_name(cb): cb.state_dict() for cb in self.callbacks if hasattr(cb, "state_dict")},
            "config": dataclasses.asdict(self.cfg),
        }

    def load(
        self, state: dict[str, Any], source: Path, what: Load = Load(), allowed: Sequence[str] = RESUMABLE
    ) -> None:
        """Take ``what`` from a checkpoint's ``state``. Config keys outside ``allowed`` must match
        (else a ConfigError names them); after optimizer state is loaded, the current config's
        hyperparameters apply."""
        if state.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(source, f"format {state.get('format')!r}, expected {CHECKPOINT_FORMAT}")
        changed = check_loadable(state["config"], self.cfg, str(source), allowed)
        if what.weights:
            self.model.load_state_dict(state["model"])
        if what.optimizer:
            self.optimizer.load_state_dict(state["optimizer"])
            self.module.apply_hyperparameters(self.cfg)
        if what.scaler and state["scaler"]:  # empty when the saving run had no loss scaling
            self.scaler.load_state_dict(state["scaler"])
        if what.loader:
            self.loader.load_state_dict(state["loader"])
        if what.step:
            self.step = state["step"]
            self.telemetry.load_state_dict(state["telemetry"])
            self.divergence.load_state_dict(state["divergence"])
            self.last_metrics = dict(state["last_metrics"])
        if what.callbacks:
            for cb in self.callbacks:
                key = callback_name(cb)
                if hasattr(cb, "load_state_dict") and key in state["callbacks"]:
                    cb.load_state_dict(state["callbacks"][key])
        if what.rng:
            restore_rng(state["rng"])
        self.resumed_from = source
        note = f" (config differs in {', '.join(changed)})" if changed else ""
        if self.world.is_main:
            print(f"spikelab: loaded {source} at step {state['step']}{note}", file=sys.stderr, flush=True)

    def resume(self) -> bool:
        """Continue from the newest valid checkpoint of this run's identity, if any; under
        torchrun every rank loads the one rank 0 picked."""
        if self.checkpoint_dir is None:
            return False
        latest = load_latest(self.checkpoint_dir, self.identity) if self.world.is_main else None
        path = self.world.from_main(latest[0] if latest is not None else None)
        if path is not None:
            self.load(latest[1] if latest is not None else load_checkpoint(path), path)
        return path is not None

    def start_from(self, path: str | Path, what: Load = Load(), allowed: Sequence[str] | None = None) -> None:
        """Start this run from another run's checkpoint (a pretraining milestone, say), taking
        ``what``; the config may differ from the saved one in ``identity.LOADABLE`` keys."""
        path = Path(path)
        self.load(load_checkpoint(path), path, what, LOADABLE if allowed is None else allowed)

    # -- the loop ------------------------------------------------------------------------------

    def run(self, until: int | None = None) -> dict[str, Any]:
        """Train from ``self.step`` to ``until`` (default ``train.steps``); returns the summary
        (see :func:`train`). Raises :class:`Preempted` after SIGTERM/SIGINT. ``on_error`` fires
        for any other exception, ``on_close`` always."""
        end = until or self.cfg.train.steps
        self.fire("on_train_start", self.cfg.to_flat_dict(), self._run_info())
        start_step, self.eval_seconds = self.step, 0.0
        self.start_time = time.perf_counter()
        status: RunStatus = "completed"
        try:
            with _stop_on_signals(self):
                while self.step < end and status == "completed":
                    status = self._advance()
            summary = self._summary(start_step, status)
            self.fire("on_train_end", summary)
            if status == "preempted":
                raise Preempted(self.step, "SIGTERM/SIGINT")
            return summary
        except BaseException as e:
            if not isinstance(e, Preempted):
                self.fire("on_error", self, e)
            raise
        finally:
            self.fire("on_close", self)

    def _advance(self) -> RunStatus:
        """One step and everything due after it; returns the run's status after the step."""
        t, total = self.cfg.train, self.cfg.train.steps
        self._reset_step_controls()
        self.fire("on_step_start", self)
        lr = lr_at(self.step, self.cfg.optim.lr, total, self.cfg.schedule) * self.lr_factor
        set_lr(self.optimizer, lr)
        step = self.step + 1
        log_now = step % t.log_every == 0 or step == total
        stats_now = step % t.layer_stats_every == 0
        eval_now = (t.eval_every > 0 and step % t.eval_every == 0) or step == total

        batches = [self._next_batch(self.loader) for _ in range(t.grad_accum)]
        for cb in self.callbacks:  # each may see, replace or drop the step's batches
            hook = getattr(cb, "on_batch", None)
            if hook is not None:
                replaced = hook(self, batches)
                batches = batches if replaced is None else list(replaced)
        # Stats steps run eagerly: forward hooks and the logit-max probe would break a compiled graph.
        eager = stats_now or self.eager_requested
        stats: contextlib.AbstractContextManager[dict[str, torch.Tensor]] = (
            record_forward_stats(self.model) if stats_now else contextlib.nullcontext({})
        )
        with stats as forward_stats:
            pending = self.module.forward_backward(step, batches, self.grad_factor, eager, watch_layers=stats_now)
        if not batches:  # every batch dropped: nothing to learn from, the step is skipped
            pending.veto()
        self.fire("on_before_optimizer", self, pending)
        result = self.module.optimizer_step(pending, watch_update=log_now)
        self.step = step
        self.telemetry.add(
            result.loss,
            result.z_loss,
            result.grad_norm,
            result.skipped,
            result.overflow,
            result.vetoed,
            self.tokens_per_step,
        )
        self.divergence.update(step, result)
        self.fire("on_after_step", self, result)

        metrics = self._metrics_due(result, forward_stats, lr, log_now, stats_now)
        if eval_now:
            metrics["val/loss"] = self.evaluate()
        if metrics:
            self.last_metrics.update(metrics)
            self.fire("on_log", step, metrics)
        if eval_now:
            self.fire("on_eval", step, metrics["val/loss"])
        status = self._status_after(log_now)
        self.stopping = status != "completed"  # latched: a signal from here on stops after the next step
        self.fire("on_step_end", self)
        if status == "completed" and self.stop_reason and not self.world.distributed:
            return "stopped"  # asked at step end; under torchrun the next step's agreement takes it
        return status

    def _status_after(self, log_now: bool) -> RunStatus:
        """The run's status after this step, the same on every rank: divergence is decided on
        all-reduced values; a signal or a stop request on any rank stops them all."""
        if log_now and (at := self.divergence.diverged_at()) is not None:
            self.stop_reason = self.stop_reason or f"diverged at step {at} (train.diverge_after/diverge_loss)"
            return "diverged"
        signalled, asked = self.world.agree(self.signalled, bool(self.stop_reason))
        if asked and self.world.distributed:
            self.stop_reason = self.world.first_of(self.stop_reason)
        if signalled:
            return "preempted"
        return "stopped" if asked else "completed"

    def _metrics_due(
        self, result: StepResult, forward_stats: dict[str, torch.Tensor], lr: float, log_now: bool, stats_now: bool
    ) -> dict[str, float]:
        """Log-interval and layer metrics due at this step, in one host sync."""
        layer_stats = {**forward_stats, **result.layer_grad_norms} if stats_now else {}
        if not log_now:
            return to_floats(layer_stats)
        assert result.update_ratio is not None, "a log step watches its update (_advance: watch_update=log_now)"
        extra = {
            **optimizer_norms(self.model, self.optimizer),
            "train/update_ratio": result.update_ratio,
            **layer_stats,
        }
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

    def _next_batch(self, loader: TokenLoader) -> Batch:
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
        # Not `compiled or model`: a compiled module has no truth value (it raises TypeError).
        model = self.model if self.module.compiled is None else self.module.compiled
        total = torch.zeros((), device=self.device)
        for _ in range(self.cfg.train.eval_batches):
            x, y = self._next_batch(self.val_loader)
            with self.precision.autocast():
                _, ce, _ = model(x, y)
            total += ce
        self.model.train()
        loss = self.world.mean_(total / self.cfg.train.eval_batches).item()  # each rank scored its slices
        self.eval_seconds += time.perf_counter() - start
        return loss

    def _run_info(self) -> RunInfo:
        return RunInfo(
            device=str(self.device),
            precision=self.precision.describe(),
            start_step=self.step,
            total_steps=self.cfg.train.steps,
            tokens_per_step=self.tokens_per_step,
            n_params=self.model.num_params(non_embedding=False),
            identity=self.identity,
            checkpoint_dir=str(self.checkpoint_dir) if self.checkpoint_dir else None,
            resumed_from=str(self.resumed_from) if self.resumed_from else None,
        )

    def _summary(self, start_step: int, status: RunStatus) -> dict[str, Any]:
        return run_summary(
            status=status,
            stop_reason=self.stop_reason,
            diverged_at=self.divergence.diverged_at(),
            steps=self.step,
            start_step=start_step,
            identity=self.identity,
            metrics=self.last_metrics,
            wall_s=time.perf_counter() - self.start_time,
            eval_s=self.eval_seconds,
            checkpoint_s=self.checkpointer.seconds if self.checkpointer else 0.0,
            tokens_per_step=self.tokens_per_step,
            flops_per_token=self.flops_per_token,
            peak=self.peak_flops,
            precision=self.precision.describe(),
            device=self.device,
            resumed_from=self.resumed_from.name if self.resumed_from else None,
        )

    def update_rms(self) -> torch.Tensor:
        """Adam's update RMS of the step just taken (model/telemetry.py: adam_update_rms)."""
        return adam_update_rms(self.optimizer)


def run_summary(
    *,
    status: RunStatus,
    stop_reason: str | None,
    diverged_at: int | None,
    steps: int,
    start_step: int,
    identity: str,
    metrics: dict[str, float],
    wall_s: float,
    eval_s: float,
    checkpoint_s: float,
    tokens_per_step: int,
    flops_per_token: float,
    peak: float | None,
    precision: str,
    device: torch.device,
    resumed_from: str | None,
) -> dict[str, Any]:
    """A run's summary (see :func:`train`), from what its loop kept: the Trainer's and each arm of
    a fused group's (model/fused.py) alike."""
    tokens = (steps - start_step) * tokens_per_step
    train_s = wall_s - eval_s
    tokens_per_s = tokens / train_s if train_s > 0 and tokens else None
    return {
        "status": status,
        "stop_reason": stop_reason if status != "completed" else None,
        "diverged_at": diverged_at,
        "steps": steps,
        "start_step": start_step,
        "identity": identity,
        "final_loss": metrics.get("train/loss"),
        "val_loss": metrics.get("val/loss"),
        "skipped": int(metrics.get("train/skipped", 0)),
        "overflows": int(metrics.get("train/overflows", 0)),
        "vetoed": int(metrics.get("train/vetoed", 0)),
        "tokens_per_s": tokens_per_s,  # training loop incl. telemetry and checkpoints, excl. eval
        "mfu": mfu(tokens_per_s, flops_per_token, peak) if tokens_per_s else None,
        "wall_s": wall_s,
        "eval_s": eval_s,
        "checkpoint_s": checkpoint_s,
        "checkpoint_time_share": checkpoint_s / wall_s if wall_s > 0 else 0.0,
        "precision": precision,
        "device": str(device),
        "cpu_threads": torch.get_num_threads() if device.type == "cpu" else None,
        "resumed_from": resumed_from,
        "telemetry": final_telemetry(metrics),
    }


def final_telemetry(metrics: dict[str, float]) -> dict[str, float]:
    """The newest value of what people compare across runs: every ``train/*`` figure and the
    largest attention logit over the sampled blocks."""
    out = {k.removeprefix("train/"): v for k, v in metrics.items() if k.startswith("train/")}
    logit_max = [v for k, v in metrics.items() if k.startswith("stats/attn_logit_max/")]
    if logit_max:
        out["attn_logit_max"] = max(logit_max)
    return out


def _ordered(callbacks: Sequence[Any]) -> list[Any]:
    """Callbacks by ascending ``order`` (stable); two with one name would share checkpoint state."""
    names = [callback_name(cb) for cb in callbacks]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"callbacks need distinct names (give each a `name`): {', '.join(duplicates)}")
    return sorted(callbacks, key=lambda cb: getattr(cb, "order", Callback.order))


@contextlib.contextmanager
def _stop_on_signals(trainer: Trainer) -> Iterator[None]:
    """SIGTERM/SIGINT set ``trainer.signalled`` and restore the previous handlers, so a second
    signal acts as usual. Signals reach only the main thread; elsewhere (a worker thread of an
    orchestrator) nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def request_stop(signum: int, frame: FrameType | None) -> None:
        trainer.signalled = True
        for s, handler in previous.items():
            signal.signal(s, handler)

    for s in previous:
        signal.signal(s, request_stop)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


# ----------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------


def train(
    cfg: TrainingConfig,
    train_tokens: Tokens,
    val_tokens: Tokens,
    out_dir: str | Path | None = None,
    callbacks: Sequence[Any] = (),
    init_from: str | Path | None = None,
    load: Load = Load(),
    identity: str | None = None,
) -> dict[str, Any]:
    """Train one model; returns a summary dict.

    ``out_dir``: the run directory, locked for the run; checkpoints go to ``<out_dir>/checkpoints``
    and the run resumes from the newest valid one of its identity. None (an LR-search trial, a
    benchmark) writes nothing. ``init_from``: a checkpoint to start from (taking ``load``) when
    the run has none of its own. ``identity``: the run's identity when more than config and data
    make it (an ablation arm's injection); default computed from them. After SIGTERM/SIGINT the current step finishes, a checkpoint is
    written and :class:`Preempted` (exit code 75) is raised.

    Summary: status (completed | stopped | diverged), stop_reason, diverged_at, steps, start_step,
    identity, final_loss (last logged train loss), val_loss, skipped, overflows, vetoed,
    tokens_per_s (excluding evaluation; None when no step ran), mfu (None off known GPUs), wall_s,
    eval_s, checkpoint_s, checkpoint_time_share, precision, device, cpu_threads (the intra-op threads used), resumed_from (file name),
    telemetry (the final train/* figures and the max attention logit).

    Under torchrun, call it on every rank: rank 0 alone takes the lock and writes; ``callbacks``
    that log or write must be given on rank 0 only, those that decide (a detector, a policy) on all.
    """
    main_rank = World.current().is_main
    with RunLock(out_dir) if out_dir is not None and main_rank else contextlib.nullcontext():
        checkpoint_dir = Path(out_dir) / "checkpoints" if out_dir is not None else None
        if checkpoint_dir is not None and main_rank:
            private_run_dir(checkpoint_dir, "checkpoint folder")  # as the run directory: this user's alone
            remove_orphans(checkpoint_dir)
        trainer = Trainer(cfg, train_tokens, val_tokens, callbacks, checkpoint_dir, identity)
        if not trainer.resume() and init_from is not None:
            trainer.start_from(init_from, load)
        return trainer.run()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m model.train``: one run on a bare box (no orchestration, no tracking); under
    ``torchrun --nproc-per-node N -m model.train`` one run over N data-parallel ranks."""
    from model.stops import EXIT_CODES

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--train-tokens", required=True, help="the training split: a token file, or a folder of them")
    p.add_argument("--val-tokens", required=True, help="the validation split: a token file, or a folder of them")
    p.add_argument("--dtype", default="uint16", help="token id dtype of the shards (default: %(default)s)")
    p.add_argument("--out", required=True, help="run directory: checkpoints/, plots/*.csv")
    add_config_arguments(p)
    args = p.parse_args(argv)
    try:
        cfg = load_training_config(args.params, args.profile, parse_sets(args.sets))  # the training sections only
        world = init_world(resolve_device(cfg.train.device).type)
    except UserError as e:
        print(f"spikelab: error: {e}", file=sys.stderr)
        return 2
    try:
        out = Path(args.out)
        summary = train(
            cfg,
            open_tokens(args.train_tokens, args.dtype),
            open_tokens(args.val_tokens, args.dtype),
            out,
            [ProgressBar(), CSVLogger(out / "plots")] if world.is_main else [],
        )
    except UserError as e:
        print(f"spikelab: error: {e}", file=sys.stderr)
        return 2
    finally:
        leave_world()
    if world.is_main:
        print(json.dumps(summary, indent=2))
    return EXIT_CODES[summary["status"]]


if __name__ == "__main__":
    sys.exit(run_private(main))
