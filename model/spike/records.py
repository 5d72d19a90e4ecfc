"""What a branch keeps of its steps: the per-step trace, the recent states skip_batch goes back
to, and the batches a replay feeds again."""

from __future__ import annotations

from typing import Any

import torch

from model.callbacks import Callback, RunInfo, TrainerView
from model.step import Batch, StepResult


class Trace(Callback):
    """Loss, pre-clip grad norm and whether the update was skipped, every step, as device tensors;
    :meth:`read` syncs once."""

    name, order = "trace", 60

    def __init__(self) -> None:
        self.rows: list[tuple[int, torch.Tensor]] = []

    def on_after_step(self, trainer: TrainerView, result: StepResult) -> None:
        skipped = (result.vetoed | result.skipped).float()
        self.rows.append((trainer.step, torch.stack([result.loss.float(), result.grad_norm.float(), skipped])))

    def read(self) -> list[dict[str, float]]:
        if not self.rows:
            return []
        values = torch.stack([v for _, v in self.rows]).tolist()
        return [
            {"step": s, "loss": v[0], "grad_norm": v[1], "skipped": bool(v[2])} for (s, _), v in zip(self.rows, values)
        ]


def cpu_copy(value: Any) -> Any:
    """A CPU copy of a (nested) state. Load states through it: Adam's ``load_state_dict`` keeps
    the given tensors, which training then updates in place."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: cpu_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(cpu_copy(v) for v in value)
    return value


class RecentStates(Callback):
    """The trainer's snapshot after each of the last ``depth`` steps (CPU copies), so skip_batch
    can go back to the state just before a flagged step without a checkpoint every step."""

    name, order = "recent_states", 90

    def __init__(self, depth: int = 2):
        self.depth = depth
        self.states: dict[int, dict[str, Any]] = {}

    def on_train_start(self, config: dict[str, Any], run: RunInfo) -> None:
        self.states = {}

    def on_step_end(self, trainer: TrainerView) -> None:
        self.states[trainer.step] = cpu_copy(trainer.snapshot())
        for step in sorted(self.states)[: -self.depth]:
            del self.states[step]

    def at(self, step: int) -> dict[str, Any] | None:
        return self.states.get(step)


class BatchTap(Callback):
    """Keeps the batches (after injection) of the steps in ``steps``: the offending batches a
    replay feeds again and the token histogram shows."""

    name, order = "batch_tap", 45

    def __init__(self, steps: range):
        self.steps = steps
        self.batches: dict[int, Batch] = {}

    def on_batch(self, trainer: TrainerView, batches: list[Batch]) -> list[Batch] | None:
        if trainer.step + 1 in self.steps and batches:
            x, y = batches[0]
            self.batches[trainer.step + 1] = (x.cpu(), y.cpu())
        return None
