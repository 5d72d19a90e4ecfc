"""Online spike detection on the device, with no host sync per step.

Three rules, each evaluated every step on the step's loss and pre-clip gradient norm:

  zscore     value > mean + z·σ of the previous ``window`` finite values (one-sided: only a
             rise is a spike), once ``warmup`` values are in the window (OLMo-core: 6σ over 128,
             after 64)
  ratio      grad norm > ``ratio`` × its running mean over the window (seed 000: "> 10x average")
  nonfinite  a non-finite loss or gradient norm

It decides in ``on_before_optimizer``, before the update, so a policy that runs after it in the
same event (``order`` > 30) can veto the very step it flags through :attr:`SpikeDetector.now`.
A flagged value does not enter the window, so a spike does not raise its own baseline; a caller
that judges the new values a level, not a spike (skip_step at its veto cap), restarts the window
from them with :meth:`SpikeDetector.rebaseline`. The detector keeps its window, the step of its
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
        name: str = "spike_detector",
    ):
        if not 2 <= warmup <= window:
            raise ValueError(f"spike detector: need 2 <= warmup ({warmup}) <= window ({window})")
        self.window, self.warmup, self.z, self.ratio, self.name = window, warmup, zscore, ratio, name
        self.history: torch.Tensor | None = None  # (2, window): loss, grad norm; NaN = empty slot
        self.now: torch.Tensor | None = None  # bool scalar: this step is flagged
        self.flags: list[tuple[int, torch.Tensor]] = []  # (step, flag) of this run, read after it
        self.latest: torch.Tensor | None = None  # this step's (loss, grad norm)

    def _init_state(self, device: torch.device) -> None:
        self.history = torch.full((2, self.window), float("nan"), device=device)
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
        slot = self.cursor % self.window
        current = self.history.index_select(1, slot.view(1)).squeeze(1)
        self.history.index_copy_(1, slot.view(1), torch.where(keep, values, current).view(2, 1))
        self.cursor = self.cursor + keep.long()

    @torch.no_grad()
    def rebaseline(self, where: torch.Tensor) -> None:
        """Where ``where`` holds (a bool scalar tensor), empty the window and restart it from this
        step's values, flagged or not: the old level is no baseline any more. The z-score and
        ratio rules then wait for ``warmup`` values again. On the device, no sync."""
        # Called by a policy on a step this detector has judged: the window and the values exist.
        assert self.history is not None and self.latest is not None
        self.history = torch.where(where, torch.full_like(self.history, float("nan")), self.history)
        self.cursor = torch.where(where, 0, self.cursor)
        self._append(self.latest, where)

    def rules(self, values: torch.Tensor) -> torch.Tensor:
        """(zscore, ratio, nonfinite) hits for this step's (loss, grad norm), against the window."""
        assert self.history is not None  # made by on_before_optimizer before it asks
        filled = torch.isfinite(self.history)
        n = filled.sum(dim=1)  # (2,)
        mean = torch.where(filled, self.history, 0.0).sum(dim=1) / n.clamp(min=1)
        var = torch.where(filled, (self.history - mean[:, None]) ** 2, 0.0).sum(dim=1) / (n - 1).clamp(min=1)
        ready = n >= self.warmup
        zscore = (ready & (values > mean + self.z * var.sqrt())).any()
        ratio = ready[1] & (values[1] > self.ratio * mean[1])
        nonfinite = ~torch.isfinite(values).all()
        return torch.stack([zscore, ratio, nonfinite])

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


def make_detector(cfg: DetectorSettings) -> SpikeDetector:
    """A fresh detector with the study's settings (every branch and arm starts one of its own)."""
    return SpikeDetector(
        window=cfg.detect_window, warmup=cfg.detect_warmup, zscore=cfg.detect_zscore, ratio=cfg.detect_ratio
    )
