"""The branch driver: one recovery policy run from a spike's origin to the end of its window, in
segments. A policy that needs an earlier state (skip_batch, rollback) ends its segment with a
request; the next segment starts from that state with explicit loading, never a live mutation.
Also the shared warm-up before the origin and the PaLM-style replay of the offending batches."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from model.callbacks import Callback, TrainerView
from model.checkpoint import checkpoint_path, list_checkpoints, load_checkpoint, save_checkpoint
from model.detect import DetectorSettings, SpikeDetector, make_detector
from model.identity import LOADABLE
from model.spike.injections import DataSpike, Injection, StepSpike, injection_callback
from model.spike.policies import Policy, RecoverySettings, Restart, ScaleLR, make_policy
from model.spike.records import BatchTap, RecentStates, Trace, cpu_copy
from model.step import Batch
from model.train import Load, Trainer

MakeTrainer = Callable[[list[Any], Path | None], Trainer]
"""(callbacks, checkpoint_dir or None) -> a fresh Trainer of the branch's config and identity."""


@dataclasses.dataclass
class Branch:
    """What a branch did: its final timeline, every segment's rows, actions, and its end."""

    policy: str
    status: str = "completed"  # completed | stopped (gave up) | diverged
    stop_reason: str | None = None
    rows: list[dict[str, float]] = dataclasses.field(default_factory=list)  # final timeline, by step
    steps_run: int = 0  # optimizer steps executed, replays included
    detections: list[int] = dataclasses.field(default_factory=list)
    actions: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    segments: int = 0
    val_loss: float | None = None
    batches: dict[int, Batch] = dataclasses.field(default_factory=dict)
    probe: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Start:
    """Where a segment starts: a state (and where it came from), the stream batches it skips
    first, and the LR factor it trains at (a rollback lowers it)."""

    path: Path
    state: dict[str, Any]
    skip: int = 0
    lr_factor: float = 1.0


@dataclasses.dataclass
class Segment:
    """One segment's trainer, policy and records, after it ran."""

    trainer: Trainer
    policy: Policy
    detector: SpikeDetector
    rows: list[dict[str, float]]
    batches: dict[int, Batch]
    recent: RecentStates | None
    summary: dict[str, Any]
    fired: bool  # a step injection acted in this segment


def run_segment(
    make_trainer: MakeTrainer,
    start: Start,
    until: int,
    policy: str,
    cfg: RecoverySettings,
    spike: DetectorSettings,
    injection: Injection | None,
    poison: Sequence[Batch],
    segment_dir: Path | None,
) -> Segment:
    """Train from ``start`` to ``until`` (or the policy's stop) with a fresh detector, policy and
    injection."""
    detector, trace = make_detector(spike), Trace()
    data = injection_callback(injection, poison) if injection else None
    pol = make_policy(policy, detector, cfg, data if isinstance(data, DataSpike) else None)
    tap = BatchTap(range(injection.start, until + 1)) if injection else None
    scale = ScaleLR(start.lr_factor) if start.lr_factor != 1.0 else None
    recent = RecentStates() if policy == "skip_batch" else None
    callbacks = [c for c in (detector, trace, pol, data, tap, scale, recent) if c is not None]
    trainer = make_trainer(callbacks, segment_dir)
    trainer.load(cpu_copy(start.state), start.path, Load(), LOADABLE)
    if start.skip:
        trainer.loader.skip(start.skip)
    summary = trainer.run(until=until)
    fired = isinstance(data, StepSpike) and data.fired
    return Segment(trainer, pol, detector, trace.read(), tap.batches if tap else {}, recent, summary, fired)


def run_branch(
    make_trainer: MakeTrainer,
    origin: tuple[Path, dict[str, Any]],
    until: int,
    policy: str,
    cfg: RecoverySettings,
    spike: DetectorSettings,
    injection: Injection | None = None,
    poison: Sequence[Batch] = (),
    timeline: Sequence[tuple[int, Path]] = (),
    checkpoint_dir: Path | None = None,
    probe: Callable[[Trainer], dict[str, Any]] | None = None,
) -> Branch:
    """Run one branch from ``origin`` (path, checkpoint state) to step ``until``: segments until
    the policy asks for nothing more or the retry cap is reached. ``timeline``: checkpoints
    (step, path) before the origin on this branch's history (a rollback's targets); ``probe``:
    what to measure on the final trainer (kept in ``Branch.probe``)."""
    branch = Branch(policy)
    history = sorted(timeline)
    start = Start(*origin)
    rows: dict[int, dict[str, float]] = {}
    while True:
        branch.segments += 1
        segment_dir = checkpoint_dir / f"segment_{branch.segments}" if checkpoint_dir and policy == "rollback" else None
        seg = run_segment(make_trainer, start, until, policy, cfg, spike, injection, poison, segment_dir)
        for row in seg.rows:  # a replayed step replaces the abandoned one
            rows[int(row["step"])] = row
        record_segment(branch, seg)
        restart = seg.policy.restart
        if restart is None or seg.summary["status"] == "diverged":
            break
        attempt = sum(1 for a in branch.actions if a["action"].startswith(("rolled back", "skipped")))
        if attempt > cfg.max_retries:
            give_up(branch, seg.policy, restart, attempt, cfg)
            break
        if segment_dir is not None:
            history += [(s, p) for s, p in list_checkpoints(segment_dir) if s < restart.detected]
        if injection is not None and injection.tied_to == "once" and seg.fired:
            injection = None  # a transient fault: the replay from a clean state does not meet it
        if policy == "skip_batch":
            start, kept = skip_restart(branch, seg, restart, start, cfg)
        else:
            start, kept = rollback_restart(branch, seg, history, restart, attempt, start, cfg)
            history = [(s, p) for s, p in history if s <= kept]
        rows = {s: r for s, r in rows.items() if s <= kept}
    branch.rows = [rows[s] for s in sorted(rows)]
    branch.val_loss = seg.trainer.evaluate() if branch.status != "diverged" else None
    branch.probe = probe(seg.trainer) if probe else {}
    branch.detections = sorted(set(branch.detections))
    return branch


def record_segment(branch: Branch, seg: Segment) -> None:
    """Add what a segment did to the branch; its end is the branch's until another segment runs."""
    branch.steps_run += len(seg.rows)
    branch.detections += seg.detector.flagged_steps()
    branch.actions += seg.policy.actions
    branch.batches.update(seg.batches)
    branch.status, branch.stop_reason = seg.summary["status"], seg.summary["stop_reason"]


def give_up(branch: Branch, pol: Policy, restart: Restart, attempt: int, cfg: RecoverySettings) -> None:
    """The retry cap is reached: the branch ends ``stopped`` where it spiked again."""
    branch.status = "stopped"
    branch.stop_reason = (
        f"{branch.policy}: spiked again at step {restart.detected} after {attempt} "
        f"restarts (recovery.max_retries={cfg.max_retries}); gave up"
    )
    pol.record(restart.detected, "gave up: retry cap reached")
    branch.actions.append(pol.actions[-1])


def skip_restart(
    branch: Branch, seg: Segment, restart: Restart, start: Start, cfg: RecoverySettings
) -> tuple[Start, int]:
    """skip_batch: back to the state just before the flagged step, skipping its batch and the
    next k-1. Returns the next start and the last step of the timeline it keeps."""
    # flagged at the segment's first step: the state it started from is the one before
    assert seg.recent is not None, "skip_batch segments keep their recent states"
    state = seg.recent.at(restart.detected - 1) or start.state
    before = int(state["step"])
    branch.actions.append(
        {
            "step": restart.detected,
            "policy": branch.policy,
            "action": f"skipped batches of steps {before + 1}-{before + cfg.skip_batches} "
            f"from the state after step {before}",
        }
    )
    return Start(Path(f"<memory: step {before}>"), state, cfg.skip_batches, start.lr_factor), before


def rollback_restart(
    branch: Branch,
    seg: Segment,
    history: Sequence[tuple[int, Path]],
    restart: Restart,
    attempt: int,
    start: Start,
    cfg: RecoverySettings,
) -> tuple[Start, int]:
    """rollback: to the newest checkpoint ``rollback_steps`` × attempts before the flagged step,
    at a lowered LR, skipping the batches that led to the spike and the skip window from the
    flagged one on (the ``skip_batches`` that skip_batch skips): PaLM §5.1 restarted ~100 steps
    before a spike and skipped 200-500 batches, past the spike, not only up to it. Counted in
    stream positions (the segment stopped right after the flagged step's batch), so a second
    rollback past an earlier one's skip lands after what it skipped. Returns the next start and
    the step it goes back to."""
    target, path = rollback_target(history, restart.detected, cfg.rollback_steps * (attempt + 1))
    state = load_checkpoint(path)
    lr_factor = start.lr_factor * cfg.lr_factor
    flagged = int(seg.trainer.loader.batches_served) - 1  # stream position of the flagged step's batch
    skip = flagged + cfg.skip_batches - int(state["loader"]["batches_served"])
    branch.actions.append(
        {
            "step": restart.detected,
            "policy": branch.policy,
            "action": f"rolled back to step {target}, skipped {skip} batches (stream positions up to "
            f"{flagged + cfg.skip_batches - 1}: the flagged step's and {cfg.skip_batches - 1} after it), LR x{lr_factor:g}",
        }
    )
    return Start(path, state, skip, lr_factor), target


@dataclasses.dataclass
class Warm:
    """The stretch every branch shares: checkpoints (step, path) up to the origin (the last),
    the detector's flags on it (false alarms) and the per-step trace."""

    timeline: list[tuple[int, Path]]
    alarms: list[int]
    rows: list[dict[str, float]]

    @property
    def origin(self) -> tuple[Path, dict[str, Any]]:
        path = self.timeline[-1][1]
        return path, load_checkpoint(path)


def warm_up(
    make_trainer: MakeTrainer, milestone: Path, until: int, spike: DetectorSettings, checkpoint_dir: Path
) -> Warm:
    """Clean training from a pretrain milestone (everything loaded: the continuation is bitwise
    pretrain's) to step ``until`` with the detector on, so its window is warm at the injection.
    The milestone and the checkpoints after it, the last at ``until``, are every branch's shared
    past: the origin and the rollback targets (the milestone is the farthest one: a rollback
    ``spike.warm_steps`` back finds it, where the first checkpoint after it is a cadence short)."""
    detector, trace = make_detector(spike), Trace()
    trainer = make_trainer([detector, trace], checkpoint_dir)
    trainer.start_from(milestone)
    first = trainer.step
    trainer.run(until=until)
    if not checkpoint_path(checkpoint_dir, until).exists():
        save_checkpoint(checkpoint_path(checkpoint_dir, until), trainer.snapshot())
    after = [(s, p) for s, p in list_checkpoints(checkpoint_dir) if first < s <= until]
    return Warm([(first, milestone), *after], detector.flagged_steps(), trace.read())


class ServeBatches(Callback):
    """Replaces the batches of steps ``first``, ``first + 1``, ... with ``batches`` in order."""

    name, order = "serve_batches", 40

    def __init__(self, first: int, batches: Sequence[Batch]):
        self.first, self.batches = first, list(batches)

    def on_batch(self, trainer: TrainerView, batches: list[Batch]) -> list[Batch] | None:
        k = trainer.step + 1 - self.first
        if 0 <= k < len(self.batches):
            x, y = self.batches[k]
            return [(x.to(trainer.device), y.to(trainer.device))]
        return None


def replay(
    make_trainer: MakeTrainer,
    start: tuple[Path, dict[str, Any]],
    baseline: dict[str, Any],
    batches: Sequence[Batch],
    spike: DetectorSettings,
) -> dict[str, Any]:
    """PaLM §5.1, automated: feed the offending ``batches`` again from an earlier state ``start``,
    nothing else injected, and see whether the detector (its window taken from ``baseline``, the
    detector state just before the spike) flags them. Flags: the data alone causes the spike."""
    detector = make_detector(spike)
    trace = Trace()
    trainer = make_trainer([detector, trace, ServeBatches(int(start[1]["step"]) + 1, batches)], None)
    trainer.load(cpu_copy(start[1]), start[0], Load(), LOADABLE)
    detector.load_state_dict(baseline)
    trainer.run(until=trainer.step + len(batches))
    return {
        "from_step": int(start[1]["step"]),
        "batches": len(batches),
        "flagged": detector.flagged_steps(),
        "losses": [r["loss"] for r in trace.read()],
        "spiked": bool(detector.flagged_steps()),
    }


def rollback_target(history: Sequence[tuple[int, Path]], detected: int, back: int) -> tuple[int, Path]:
    """The newest checkpoint at least ``back`` steps before ``detected``; the oldest one when none
    is that far back (the study's origin milestone bounds how far a rollback can go)."""
    eligible = [(s, p) for s, p in history if s <= detected - back]
    return max(eligible) if eligible else min(history)
