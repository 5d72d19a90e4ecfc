"""Recovery policies: trainer callbacks that react to what :class:`~model.detect.SpikeDetector`
flags, never to the injection itself.

``continue`` and ``skip_step`` (which vetoes on the device in the step it flags) run without a
per-step sync; the others are host decisions, read from the detector once per step at step end
(one sync per step). Those that need an earlier state (``skip_batch``, ``rollback``) stop the
segment with a :class:`Restart` request; the branch driver (model/spike/branch.py) starts the
next segment from that state with explicit loading.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch

from model.callbacks import Callback, TrainerView
from model.detect import SpikeDetector
from model.spike.injections import DataSpike
from model.step import PendingStep


class RecoverySettings(Protocol):
    """What the recovery policies read; the study's ``recovery`` section has these."""

    # Read-only members: a frozen config section is one.
    @property
    def skip_batches(self) -> int: ...
    @property
    def rollback_steps(self) -> int: ...
    @property
    def lr_factor(self) -> float: ...
    @property
    def max_retries(self) -> int: ...
    @property
    def max_consecutive_vetoes(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class Restart:
    """A policy's request for a new segment: the detected step and what to do."""

    policy: str
    detected: int


class Policy(Callback):
    """Base: reacts to each flagged step and records every action. A policy that acts on the host
    reads the detector's flag at step end (one sync per step); one that does not (``continue``,
    ``skip_step``) records its reactions after the segment, from the detector's flags, so its
    run has no per-step sync. ``continue`` is this base: it lets the run ride."""

    name, order = "policy", 35
    kind = "continue"
    acts_on_host = False

    def __init__(self, detector: SpikeDetector, cfg: RecoverySettings):
        self.detector, self.cfg = detector, cfg
        self.actions: list[dict[str, Any]] = []
        self.restart: Restart | None = None

    def on_step_end(self, trainer: TrainerView) -> None:
        if not self.acts_on_host or self.detector.now is None or not bool(self.detector.now):  # host read
            return
        self.react(trainer, trainer.step)

    def on_train_end(self, summary: dict[str, Any]) -> None:
        if not self.acts_on_host:
            for step in self.detector.flagged_steps():
                self.react(None, step)

    def record(self, step: int, action: str) -> None:
        self.actions.append({"step": step, "policy": self.kind, "action": action})

    def react(self, trainer: TrainerView | None, step: int) -> None:
        self.record(step, "spike detected; continue (no intervention)")


class SkipStep(Policy):
    """Veto the update of a flagged step on the device (OLMo-core's skip-step optimizer), at most
    ``max_consecutive_vetoes`` in a row: the next flagged step goes through and the detector
    restarts its window from it. Flagged values never enter the window, so after a genuine level
    shift (the loss settles higher) every later step would be flagged and vetoed and the run
    would stop learning; the cap treats a run of flags that long as the new level."""

    kind = "skip_step"

    def __init__(self, detector: SpikeDetector, cfg: RecoverySettings):
        super().__init__(detector, cfg)
        self.streak: torch.Tensor | int = 0  # consecutive vetoes (a device tensor after a step)
        self.at_cap: list[tuple[int, torch.Tensor]] = []  # (step, let through at the cap), read after the run
        self.passed: set[int] = set()

    def on_before_optimizer(self, trainer: TrainerView, pending: PendingStep) -> None:
        flagged = self.detector.now
        if flagged is None:
            return
        at_cap = flagged & (self.streak >= self.cfg.max_consecutive_vetoes)
        veto = flagged & ~at_cap
        pending.veto(veto)
        self.detector.rebaseline(at_cap)
        self.streak = torch.where(veto, self.streak + 1, 0)
        self.at_cap.append((pending.step, at_cap))

    def on_train_end(self, summary: dict[str, Any]) -> None:
        if self.at_cap:
            hits = torch.stack([hit for _, hit in self.at_cap]).tolist()  # one sync, after the run
            self.passed = {step for (step, _), hit in zip(self.at_cap, hits) if hit}
        super().on_train_end(summary)

    def react(self, trainer: TrainerView | None, step: int) -> None:
        if step in self.passed:
            cap = self.cfg.max_consecutive_vetoes
            self.record(step, f"let through after {cap} vetoes in a row (a level shift); detector re-baselined")
        else:
            self.record(step, "update vetoed (weights and Adam state untouched)")


class LowerLR(Policy):
    """LR × ``lr_factor`` from the first detection on (playbook D)."""

    kind, acts_on_host = "lower_lr", True

    def __init__(self, detector: SpikeDetector, cfg: RecoverySettings):
        super().__init__(detector, cfg)
        self.factor = 1.0

    def on_step_start(self, trainer: TrainerView) -> None:
        trainer.scale_lr(self.factor)

    def react(self, trainer: TrainerView | None, step: int) -> None:
        if self.factor == 1.0:
            self.factor = self.cfg.lr_factor
            self.record(step, f"LR x{self.cfg.lr_factor:g} from step {step + 1} on")


class SwapData(Policy):
    """Exclude the offending data source and continue (playbook E); only a data injection has one."""

    kind, acts_on_host = "swap_data", True

    def __init__(self, detector: SpikeDetector, cfg: RecoverySettings, data: DataSpike | None):
        super().__init__(detector, cfg)
        self.data = data

    def react(self, trainer: TrainerView | None, step: int) -> None:
        if self.data is not None and not self.data.excluded:
            self.data.exclude()
            self.record(step, "poison source excluded from the stream; continue")
        elif self.data is None and not self.actions:
            self.record(step, "no data source to exclude (not a data spike); continue")


class StopAndRestart(Policy):
    """skip_batch and rollback: stop the segment at the first detection and ask the driver for a
    new one (an earlier state needs explicit loading, never a live mutation)."""

    acts_on_host = True

    def react(self, trainer: TrainerView | None, step: int) -> None:
        if self.restart is None:
            assert trainer is not None, "a host policy reacts during the run"
            self.restart = Restart(self.kind, step)
            trainer.request_stop(f"{self.kind}: spike detected at step {step}")


class SkipBatch(StopAndRestart):
    kind = "skip_batch"


class Rollback(StopAndRestart):
    kind = "rollback"


class ScaleLR(Callback):
    """A constant LR factor for a whole segment (a rollback's lowered LR)."""

    name, order = "scale_lr", 36

    def __init__(self, factor: float):
        self.factor = factor

    def on_step_start(self, trainer: TrainerView) -> None:
        trainer.scale_lr(self.factor)


def make_policy(kind: str, detector: SpikeDetector, cfg: RecoverySettings, data: DataSpike | None) -> Policy:
    if kind == "swap_data":
        return SwapData(detector, cfg, data)
    return {
        "continue": Policy,
        "skip_step": SkipStep,
        "lower_lr": LowerLR,
        "skip_batch": SkipBatch,
        "rollback": Rollback,
    }[kind](detector, cfg)
