"""Online spike detection on the device, with no host sync per step.

Three rules, each evaluated every step on the step's loss and pre-clip gradient norm:

  zscore     value > mean + z·σ of the baseline: the ``window`` finite values before the newest
             ``lag`` (one-sided: only a rise is a spike), once ``warmup`` values are in it
             (OLMo-core: 6σ over the previous 128, after 64, no lag)
  ratio      grad norm > ``ratio`` × its mean over the baseline (seed 000: "> 10x average")
  nonfinite  a non-finite loss or gradient norm

Why the lag: a value the detector does not flag joins its baseline. A rise that grows over several
steps (poison coming on batch by batch) enters a trailing window below the threshold and lifts its
mean and, more, its σ, so the threshold climbs ahead of it and a slow enough rise is never flagged.
With a lag, the newest ``lag`` values wait before they count, so a rise is judged against the level
from before it for its first ``lag`` steps: one that reaches a flagged size within them is caught,
at the step where it crosses (the latency is what the rise does, not the window).

It decides in ``on_before_optimizer``, before the update, so a policy that runs after it in the
same event (``order`` > 30) can veto the very step it flags through :attr:`SpikeDetector.now`.
A flagged value does not enter the window, so a spike does not raise its own baseline; a caller
that judges the new values a level, not a spike (skip_step at its veto cap), restarts the window
from them with :meth:`SpikeDetector.rebaseline`. The detector keeps its window (the baseline and the
``lag`` values waiting to join it, one ring), the step of its
first and newest detection and a per-rule count as device tensors (part of checkpoints);
:meth:`detections` reads them on the host, at a log point or after the run, and
:meth:`flagged_steps` every step this run flagged (one sync, after the run).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from model.callbacks import Callback, TrainerView

if TYPE_CHECKING:
    from model.step import PendingStep

RULES = ("zscore", "ratio", "nonfinite")


class SpikeDetector(Callback):
    """Flags spikes of the training loss and pre-clip grad norm; see the module doc."""

    order = 30

    def __init__(
        self,
        window: int = 128,
        warmup: int = 64,
        zscore: float = 6.0,
        ratio: float = 10.0,
        lag: int = 0,
        name: str = "spike_detector",
    ):
        if not 2 <= warmup <= window:
            raise ValueError(f"spike detector: need 2 <= warmup ({warmup}) <= window ({window})")
        if lag < 0:
            raise ValueError(f"spike detector: need lag ({lag}) >= 0")
        self.window, self.warmup, self.z, self.ratio, self.name = window, warmup, zscore, ratio, name
        self.lag, self.slots = lag, window + lag
        # (2, slots): loss, grad norm, the newest ``lag`` accepted values and the baseline before
        # them, in a ring; NaN = empty slot
        self.history: torch.Tensor | None = None
        self.now: torch.Tensor | None = None  # bool scalar: this step is flagged
        self.flags: list[tuple[int, torch.Tensor]] = []  # (step, flag) of this run, read after it
        self.latest: torch.Tensor | None = None  # this step's (loss, grad norm)

    def _init_state(self, device: torch.device) -> None:
        self.history = torch.full((2, self.slots), float("nan"), device=device)
        self.cursor = torch.zeros((), dtype=torch.long, device=device)
        self.first = torch.full((), -1, dtype=torch.long, device=device)  # step of the first detection
        self.last = torch.full((), -1, dtype=torch.long, device=device)  # step of the newest one
        self.counts = torch.zeros(len(RULES), dtype=torch.long, device=device)

    @torch.no_grad()
    def on_before_optimizer(self, trainer: TrainerView, pending: PendingStep) -> None:
        values = torch.stack([pending.loss, pending.grad_norm]).float()  # (2,)
        if self.history is None:
            self._init_state(values.device)
        elif self.history.device != values.device:  # restored from a checkpoint, which loads on the CPU
            for key, value in self.state_dict().items():
                setattr(self, key, value.to(values.device))
        hits = self.rules(values)  # (3,) bool
        spike = hits.any()
        self.now = spike
        self.flags.append((pending.step, spike))
        self.counts += hits.long()
        self.first = torch.where((self.first < 0) & spike, pending.step, self.first)
        self.last = torch.where(spike, pending.step, self.last)
        self.latest = values
        self._append(values, ~spike)  # only unflagged values extend the baseline

    def _append(self, values: torch.Tensor, where: torch.Tensor) -> None:
        """Put finite ``values`` in the window's next slot where ``where`` holds (sync-free)."""
        assert self.history is not None  # the window is made before the first value arrives
        keep = where & torch.isfinite(values).all()
        slot = self.cursor % self.slots
        current = self.history.index_select(1, slot.view(1)).squeeze(1)
        self.history.index_copy_(1, slot.view(1), torch.where(keep, values, current).view(2, 1))
        self.cursor = self.cursor + keep.long()

    @torch.no_grad()
    def rebaseline(self, where: torch.Tensor) -> None:
        """Where ``where`` holds (a bool scalar tensor), empty the window and restart it from this
        step's values, flagged or not: the old level is no baseline any more. The z-score and
        ratio rules then wait for ``lag + warmup`` values again (the new level passes the lag like
        any value). On the device, no sync."""
        # Called by a policy on a step this detector has judged: the window and the values exist.
        assert self.history is not None and self.latest is not None
        self.history = torch.where(where, torch.full_like(self.history, float("nan")), self.history)
        self.cursor = torch.where(where, 0, self.cursor)
        self._append(self.latest, where)

    def rules(self, values: torch.Tensor) -> torch.Tensor:
        """(zscore, ratio, nonfinite) hits for this step's (loss, grad norm), against the baseline."""
        assert self.history is not None  # made by on_before_optimizer before it asks
        filled = torch.isfinite(self.history) & self.in_baseline()
        n = filled.sum(dim=1)  # (2,)
        mean = torch.where(filled, self.history, 0.0).sum(dim=1) / n.clamp(min=1)
        var = torch.where(filled, (self.history - mean[:, None]) ** 2, 0.0).sum(dim=1) / (n - 1).clamp(min=1)
        ready = n >= self.warmup
        zscore = (ready & (values > mean + self.z * var.sqrt())).any()
        ratio = ready[1] & (values[1] > self.ratio * mean[1])
        nonfinite = ~torch.isfinite(values).all()
        return torch.stack([zscore, ratio, nonfinite])

    def in_baseline(self) -> torch.Tensor:
        """(slots,) bool: the slots at least ``lag`` accepted values old (slot ``cursor - 1`` is the
        newest, age 0), computed from the cursor on the device."""
        assert self.history is not None
        slots = torch.arange(self.slots, device=self.history.device)
        age = (self.cursor - 1 - slots) % self.slots
        return age >= self.lag

    def detections(self) -> dict[str, Any]:
        """First and newest detection step (None if none) and hits per rule, read on the host."""
        if self.history is None:
            return {"first": None, "last": None, **{r: 0 for r in RULES}}
        first, last = int(self.first), int(self.last)
        return {
            "first": first if first >= 0 else None,
            "last": last if last >= 0 else None,
            **dict(zip(RULES, self.counts.tolist())),
        }

    def flagged_steps(self) -> list[int]:
        """Every step this run flagged (not those of the checkpoint it started from)."""
        if not self.flags:
            return []
        hits = torch.stack([flag for _, flag in self.flags]).tolist()
        return [step for (step, _), hit in zip(self.flags, hits) if hit]

    def state_dict(self) -> dict[str, Any]:
        if self.history is None:
            return {}
        return {
            "history": self.history,
            "cursor": self.cursor,
            "first": self.first,
            "last": self.last,
            "counts": self.counts,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "history" in state and state["history"].shape[1] != self.slots:  # the ring's order depends on it
            raise ValueError(
                f"spike detector: the saved window has {state['history'].shape[1]} slots, this detector "
                f"window + lag = {self.window} + {self.lag}; restore it with the settings it ran with"
            )
        for key, value in state.items():
            setattr(self, key, value.clone())


class DetectorSettings(Protocol):
    """What the spike detector reads; the study's ``spike`` section has these."""

    # Read-only members: a frozen config section (tasks/spike/config.py: SpikeConfig) is one.
    @property
    def detect_window(self) -> int: ...
    @property
    def detect_warmup(self) -> int: ...
    @property
    def detect_zscore(self) -> float: ...
    @property
    def detect_ratio(self) -> float: ...
    @property
    def detect_lag(self) -> int: ...


def make_detector(cfg: DetectorSettings) -> SpikeDetector:
    """A fresh detector with the spike study's settings (every branch starts one of its own)."""
    return SpikeDetector(
        window=cfg.detect_window,
        warmup=cfg.detect_warmup,
        zscore=cfg.detect_zscore,
        ratio=cfg.detect_ratio,
        lag=cfg.detect_lag,
    )
