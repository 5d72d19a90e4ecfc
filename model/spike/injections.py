"""Spike injections: trainer callbacks that put a deterministic spike into a run.

Each is tied to a window of ``duration``:

  stream  the batches at positions [position, position + duration): the steps that consume them
          get it, so a policy that skips those batches (skip_batch, rollback) avoids it and a
          replay of them meets it again, as PaLM found its spikes tied to data windows
  step    optimizer steps [start, start + duration), whatever batches they consume: skipping
          batches cannot remove it, and a rollback that replays those steps meets it again (a
          spike of the dynamics, not of the data, e.g. a fault in the LR schedule)
  once    the same steps on the first pass only: a branch that goes back to an earlier state
          (skip_batch, rollback) does not meet it again (a transient fault of the weights or
          optimizer state, which restoring a clean state clears). The branch driver drops it
          after a restart once it has fired.
  (``data`` is the batches: always ``stream``.)

  data   those batches replaced by poison-pool sequences (excluding the source, swap_data, ends
         it): whole, or over a ramp of ``ramp`` batches each row's last tokens, a share rising
         from the first batch (:func:`poisoned_tokens`), so the spike's onset is gradual and the
         detector's latency is what the poison does, not a given
  lr     LR × magnitude for the steps that consume them
  grad   gradients × magnitude before clipping, for the same steps
  param  every weight matrix of block ``param_block`` × magnitude at the window's first step:
         its attention logits and its write into the residual stream blow up (a parameter-space
         corruption, as a bad update would leave)
  adam   Adam's second moment of every weight matrix of block ``param_block`` ÷ magnitude at the
         window's first step: the next updates grow by √magnitude (the second moment
         under-estimating g², Wortsman et al. 2023b's route to a spike; an optimizer-state fault)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Literal, Protocol, get_args

import torch

from model.callbacks import Callback, TrainerView
from model.step import Batch


class InjectionSettings(Protocol):
    """What an injection reads; the study's ``spike`` section (tasks/spike/config.py) has these."""

    # Read-only members: a frozen config section is one.
    @property
    def duration(self) -> int: ...
    @property
    def data_batches(self) -> int: ...
    @property
    def magnitude(self) -> float: ...
    @property
    def param_block(self) -> int: ...
    @property
    def poison_ramp_batches(self) -> int: ...


TiedTo = Literal["stream", "step", "once"]


@dataclasses.dataclass(frozen=True)
class Injection:
    """One injected spike: its stream window starts at ``position`` (the batches served at the
    origin) and meets step ``start`` (the origin step + 1) on a run that skips nothing;
    ``tied_to`` says which of the two it follows (module doc)."""

    kind: str
    start: int
    position: int
    duration: int
    magnitude: float
    param_block: int = 0
    tied_to: TiedTo = "stream"
    ramp: int = 0  # data: batches over which the poisoned share of each row rises (poisoned_tokens)

    def __post_init__(self) -> None:
        if self.tied_to not in get_args(TiedTo) or (self.kind == "data" and self.tied_to != "stream"):
            raise ValueError(
                f"{self.kind} injection: tied_to={self.tied_to!r}; one of {get_args(TiedTo)} ('stream' for data)"
            )

    @classmethod
    def from_config(
        cls, kind: str, cfg: InjectionSettings, origin_step: int, origin_position: int, tied_to: TiedTo = "stream"
    ) -> Injection:
        return cls(
            kind,
            origin_step + 1,
            origin_position,
            cfg.data_batches if kind == "data" else cfg.duration,
            1.0 if kind == "data" else cfg.magnitude,
            cfg.param_block,
            tied_to,
            cfg.poison_ramp_batches if kind == "data" else 0,
        )

    def spec(self) -> dict[str, Any]:
        """What identifies it (run identity ``extra``, MLflow tags)."""
        return dataclasses.asdict(self)

    def in_window(self, position: int) -> bool:
        return self.position <= position < self.position + self.duration

    def window_index(self, trainer: TrainerView) -> int | None:
        """Where the step about to run falls in the window (0 .. duration-1; None outside it):
        counted in optimizer steps if tied to steps (or once), else by the stream position of its
        first batch."""
        if self.tied_to in ("step", "once"):
            index = trainer.step + 1 - self.start
        else:
            index = trainer.loader.batches_served - self.position
        return index if 0 <= index < self.duration else None


class StepSpike(Callback):
    """Base of the injections that act at the start of the steps in their window; ``fired`` says
    whether any did in this run (the driver drops a ``once`` injection that fired)."""

    order = 40

    def __init__(self, injection: Injection):
        self.injection, self.fired = injection, False

    def on_step_start(self, trainer: TrainerView) -> None:
        index = self.injection.window_index(trainer)
        if index is not None:
            self.fired = True
            self.apply(trainer, index)

    def apply(self, trainer: TrainerView, index: int) -> None:
        raise NotImplementedError


class LRSpike(StepSpike):
    name = "inject_lr"

    def apply(self, trainer: TrainerView, index: int) -> None:
        trainer.scale_lr(self.injection.magnitude)


class GradSpike(StepSpike):
    name = "inject_grad"

    def apply(self, trainer: TrainerView, index: int) -> None:
        trainer.scale_grad(self.injection.magnitude)


class ParamSpike(StepSpike):
    name = "inject_param"

    @torch.no_grad()
    def apply(self, trainer: TrainerView, index: int) -> None:
        if index == 0:
            for p in trainer.model.block_matrices(self.injection.param_block):
                p.mul_(self.injection.magnitude)


class AdamSpike(StepSpike):
    name = "inject_adam"

    @torch.no_grad()
    def apply(self, trainer: TrainerView, index: int) -> None:
        if index == 0:
            for p in trainer.model.block_matrices(self.injection.param_block):
                state = trainer.optimizer.state.get(p, {})
                if "exp_avg_sq" in state:  # none before the first update
                    state["exp_avg_sq"].div_(self.injection.magnitude)


def poisoned_tokens(index: int, tokens: int, ramp: int) -> int:
    """How many of a row's ``tokens`` the ``index``-th batch of a poisoned stretch (0 first) serves
    poisoned, at the row's end: all of them past a ramp of ``ramp`` batches, on it a share rising
    linearly to the whole row (ramp = tokens: one token more per batch); ``ramp`` 0: all from the
    first."""
    if ramp <= 0:
        return tokens
    return min(tokens, math.ceil(tokens * (index + 1) / ramp))


class DataSpike(Callback):
    """Serves ``poison[i]`` (the last :func:`poisoned_tokens` tokens of each row, the batch's own
    before them) in place of the batch at stream position ``position + i``; after :meth:`exclude`
    (swap_data) the poison source is out and the clean batches flow again."""

    name, order = "inject_data", 40

    def __init__(self, injection: Injection, poison: Sequence[Batch]):
        if len(poison) != injection.duration:
            raise ValueError(f"data injection: {len(poison)} poison batches for duration {injection.duration}")
        self.injection, self.poison, self.excluded = injection, list(poison), False

    def exclude(self) -> None:
        self.excluded = True

    def on_batch(self, trainer: TrainerView, batches: list[Batch]) -> list[Batch] | None:
        if self.excluded:
            return None
        first = trainer.loader.batches_served - len(batches)  # stream position of batches[0]
        out = []
        for i, batch in enumerate(batches):
            k = first + i - self.injection.position
            if self.injection.in_window(first + i):
                batch = self.mix(k, batch, trainer.device)
            out.append(batch)
        return out

    def mix(self, index: int, batch: Batch, device: torch.device) -> Batch:
        """The ``index``-th poisoned batch: each row's last tokens poison (inputs and targets), as
        many as the ramp has reached, its own tokens before them."""
        x, y = (t.to(device) for t in self.poison[index])
        keep = x.shape[1] - poisoned_tokens(index, x.shape[1], self.injection.ramp)
        return torch.cat([batch[0][:, :keep], x[:, keep:]], 1), torch.cat([batch[1][:, :keep], y[:, keep:]], 1)


def injection_callback(injection: Injection, poison: Sequence[Batch] = ()) -> Callback:
    """The callback that injects ``injection`` (``poison``: the batches a data injection serves)."""
    if injection.kind == "data":
        return DataSpike(injection, poison)
    return {"lr": LRSpike, "grad": GradSpike, "param": ParamSpike, "adam": AdamSpike}[injection.kind](injection)
