"""Side effects of and interventions in a training run, hung on the loop as callbacks.

Per step the loop fires, in this order, each callback in ascending ``order``:

  on_step_start(trainer)          controls for this step: trainer.scale_lr(f), scale_grad(f)
                                  (factors multiply), request_eager(), request_stop(reason),
                                  trainer.loader.skip(n)
  on_batch(trainer, batches)      the step's micro-batches [(x, y)]: return a new list to replace
                                  them (data injection) or an empty one to drop them (the step is
                                  then skipped); None keeps them. The stream position advances
                                  by the batches drawn, whatever is returned.
  ... forward/backward (gradients unscaled, multiplied, pre-clip norm taken) ...
  on_before_optimizer(trainer, pending)
                                  pending.loss / .grad_norm / .layer_grad_norms are DEVICE tensors;
                                  pending.veto(cond) skips the update where the bool tensor holds
                                  (weights, Adam state untouched) without a host sync
  ... clipping and the optimizer update (or the skip) ...
  on_after_step(trainer, result)  the StepResult (device tensors: loss, grad_norm, skipped,
                                  overflow, vetoed, ...); trainer.step is the completed step
  on_log(step, metrics)           every metric due at this step (train/*, stats/*, val/*), floats
  on_eval(step, val_loss)         after a validation pass (its loss is also in on_log)
  on_step_end(trainer)            the Checkpointer (order 100, last) saves here
  on_checkpoint(step, path)       after a checkpoint was written

around them on_train_start(config, run) once, on_train_end(summary) once for every typed end
(summary["status"]: completed, stopped, diverged, preempted), on_error(trainer, exc) when an
exception escapes the loop, and on_close(trainer) always, last.

Nothing here may sync the host per step: reading a device tensor (``.item()``, ``float()``,
``if tensor:``) in on_before_optimizer or on_after_step stalls every step; decide on the device
and read the outcome in on_log, where the loop syncs anyway.

``step`` is the number of optimizer steps completed. Callbacks are named (``name``, default the
class name; two with one name are refused). A stateful callback returns its state from
``state_dict`` (tensors, dicts, lists, numbers, strings: checkpoints load with weights_only=True),
stored under its name, and gets it back through ``load_state_dict`` when a run resumes.
Subclassing :class:`Callback` is optional: the loop calls only the hooks an object has
(``order`` defaults to 50).
"""

from __future__ import annotations

import csv
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from tqdm import tqdm

from model.checkpoint import checkpoint_path, list_checkpoints, remove_checkpoint, save_checkpoint
from model.config import CheckpointConfig
from model.private import create_exclusive, private_run_dir

if TYPE_CHECKING:
    import torch

    from model.config import TrainingConfig
    from model.data import TokenLoader
    from model.gpt import GPT
    from model.step import Batch, PendingStep, StepResult


class TrainerView(Protocol):
    """What a hook may read of the trainer and ask of it; model/train.py's Trainer is one. Hooks
    name this, not the Trainer, so this module stays below the loop that fires them."""

    @property
    def cfg(self) -> TrainingConfig: ...
    @property
    def step(self) -> int: ...  # optimizer steps completed
    @property
    def stopping(self) -> bool: ...  # a stop as of the end of this step
    @property
    def device(self) -> torch.device: ...
    @property
    def model(self) -> GPT: ...
    @property
    def optimizer(self) -> torch.optim.Optimizer: ...
    @property
    def loader(self) -> TokenLoader: ...  # the training stream (``skip(n)``, ``batches_served``)

    def scale_lr(self, factor: float) -> None: ...
    def scale_grad(self, factor: float) -> None: ...
    def request_eager(self) -> None: ...
    def request_stop(self, reason: str) -> None: ...
    def snapshot(self) -> dict[str, Any]: ...
    def fire(self, hook: str, *args: Any) -> None: ...


@dataclass(frozen=True)
class RunInfo:
    """What a callback may want to know about the run when it starts."""

    device: str  # "cpu", "cuda:0"
    precision: str  # e.g. "bf16 (emulated)", "fp16 (autocast, loss scaling)"
    start_step: int  # 0, or the step of the checkpoint the run resumed from
    total_steps: int
    tokens_per_step: int
    n_params: int
    identity: str  # run identity digest (model/identity.py)
    checkpoint_dir: str | None  # None: the run writes no checkpoints
    resumed_from: str | None  # checkpoint path, when resumed


def callback_name(cb: Any) -> str:
    """The key of a callback's checkpointed state."""
    return getattr(cb, "name", None) or type(cb).__name__


class Callback:
    """Base class: every hook is a no-op; override the ones you need."""

    order: int = 50
    name: str | None = None  # None: the class name

    def on_train_start(self, config: dict[str, Any], run: RunInfo) -> None: ...
    def on_step_start(self, trainer: TrainerView) -> None: ...
    def on_batch(self, trainer: TrainerView, batches: list[Batch]) -> list[Batch] | None: ...
    def on_before_optimizer(self, trainer: TrainerView, pending: PendingStep) -> None: ...
    def on_after_step(self, trainer: TrainerView, result: StepResult) -> None: ...
    def on_log(self, step: int, metrics: dict[str, float]) -> None: ...
    def on_eval(self, step: int, val_loss: float) -> None: ...
    def on_step_end(self, trainer: TrainerView) -> None: ...
    def on_checkpoint(self, step: int, path: Path) -> None: ...
    def on_train_end(self, summary: dict[str, Any]) -> None: ...
    def on_error(self, trainer: TrainerView, error: BaseException) -> None: ...
    def on_close(self, trainer: TrainerView) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class CSVLogger(Callback):
    """One CSV per metric namespace under ``directory`` ("train/loss" goes to train.csv, column
    "loss"), ``step`` first. The directory belongs to this logger: at the start of a run every CSV
    in it loses its rows after the start step, so a resumed run appends without duplicates (those
    rows came from steps it repeats) and a fresh run starts empty."""

    order = 20

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.headers: dict[Path, list[str]] = {}

    def on_train_start(self, config: dict[str, Any], run: RunInfo) -> None:
        private_run_dir(self.directory, "plot folder")
        for path in sorted(self.directory.glob("*.csv")):
            header, rows = _read_csv(path)
            _rewrite_csv(path, header, [r for r in rows if int(r["step"]) <= run.start_step])

    def on_log(self, step: int, metrics: dict[str, float]) -> None:
        by_file: dict[str, dict[str, Any]] = defaultdict(lambda: {"step": step})
        for key, value in metrics.items():
            namespace, _, name = key.partition("/")
            by_file[namespace][name or namespace] = value
        for namespace, row in by_file.items():
            self._append(self.directory / f"{namespace}.csv", row)

    def _append(self, path: Path, row: dict[str, Any]) -> None:
        if path not in self.headers:
            self.headers[path] = _read_csv(path)[0] if path.exists() else []
        header = self.headers[path]
        if not set(row) <= set(header):  # new columns (first row, or a changed metric set)
            old_header, rows = _read_csv(path) if path.exists() else ([], [])
            header = old_header + [k for k in row if k not in old_header]
            _rewrite_csv(path, header, rows)
            self.headers[path] = header
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=header, restval="").writerow(row)


def _read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        return list(reader.fieldnames or []), rows


def _rewrite_csv(path: Path, header: list[str], rows: list[dict[str, Any]]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with os.fdopen(create_exclusive(tmp), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header, restval="")
        if header:
            writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


class ProgressBar(Callback):
    """A tqdm bar (loss, tokens/s, ETA) on a terminal; one plain line per log interval otherwise
    (CI logs, ``dvc repro`` output, Prefect workers)."""

    order = 10

    def __init__(self) -> None:
        self.bar: tqdm | None = None

    def on_train_start(self, config: dict[str, Any], run: RunInfo) -> None:
        self.total, self.start_step, self.t0 = run.total_steps, run.start_step, time.perf_counter()
        if sys.stdout.isatty():
            self.bar = tqdm(total=run.total_steps, initial=run.start_step, unit="step", dynamic_ncols=True)

    def on_step_end(self, trainer: TrainerView) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def on_log(self, step: int, metrics: dict[str, float]) -> None:
        if "train/loss" not in metrics:
            return
        loss, tok_s = metrics["train/loss"], metrics["train/tokens_per_s"]
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tok_s:,.0f}", refresh=False)
            return
        rate = (step - self.start_step) / (time.perf_counter() - self.t0)
        eta = (self.total - step) / rate if rate > 0 else float("nan")
        val = f" | val {metrics['val/loss']:.4f}" if "val/loss" in metrics else ""
        print(
            f"step {step}/{self.total} | loss {loss:.4f}{val} | grad_norm {metrics['train/grad_norm']:.3g}"
            f" | lr {metrics['train/lr']:.3g} | {tok_s:,.0f} tok/s | eta {_hms(eta)}",
            flush=True,
        )

    def on_train_end(self, summary: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.close()


def _hms(seconds: float) -> str:
    if seconds != seconds:
        return "?"
    minutes, s = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{s:02d}"


# ----------------------------------------------------------------------------------------------
# The checkpointing callback
# ----------------------------------------------------------------------------------------------


class Checkpointer(Callback):
    """Saves at the end of a step when due: every ``every_steps`` steps, after ``every_minutes``
    of wall clock since the last save, at a milestone, at the last step, or when the run is asked
    to stop (preemption). Keeps the newest ``keep_last`` rolling checkpoints; milestones are never
    deleted. Runs last so the checkpoint holds every other callback's state after the step."""

    order = 100

    def __init__(self, directory: str | Path, cfg: CheckpointConfig, total_steps: int):
        self.directory, self.cfg, self.total_steps = Path(directory), cfg, total_steps
        self.last_save = time.monotonic()
        self.seconds = 0.0  # time spent saving, for the checkpoint share of wall time

    def due(self, step: int, stopping: bool) -> bool:
        c = self.cfg
        return (
            stopping
            or step == self.total_steps
            or step in c.milestones
            or (c.every_steps > 0 and step % c.every_steps == 0)
            or (c.every_minutes > 0 and time.monotonic() - self.last_save >= 60 * c.every_minutes)
        )

    def on_step_end(self, trainer: TrainerView) -> None:
        if not self.due(trainer.step, trainer.stopping):
            return
        start = time.perf_counter()
        path = checkpoint_path(self.directory, trainer.step)
        save_checkpoint(path, trainer.snapshot())
        self._prune()
        self.last_save = time.monotonic()
        self.seconds += time.perf_counter() - start
        trainer.fire("on_checkpoint", trainer.step, path)

    def _prune(self) -> None:
        rolling = [p for step, p in list_checkpoints(self.directory) if step not in self.cfg.milestones]
        for path in rolling[: -self.cfg.keep_last]:
            remove_checkpoint(path)
