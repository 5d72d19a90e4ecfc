"""Spike injections and recovery policies, as trainer callbacks, and the branch driver that runs a
policy to the end of its window in run segments.

Injections, deterministic from the config. Each is tied to a window of ``duration``:

  stream  the batches at positions [position, position + duration): the steps that consume them
          get it, so a policy that skips those batches (skip_batch, rollback) avoids it and a
          replay of them meets it again, as PaLM found its spikes tied to data windows
  step    optimizer steps [start, start + duration), whatever batches they consume: skipping
          batches cannot remove it, and a rollback that replays those steps meets it again (a
          spike of the dynamics, not of the data). Not for ``data``, which is the batches.

  data   those batches replaced by poison-pool sequences (excluding the source, swap_data, ends it)
  lr     LR × magnitude for the steps that consume them
  grad   gradients × magnitude before clipping, for the same steps
  param  every weight matrix of block ``param_block`` × magnitude when the first of them is
         served: its attention logits and its write into the residual stream blow up (a
         parameter-space corruption, as a bad update would leave)

Policies act only on what :class:`~model.detect.SpikeDetector` flags, never on the injection step.
``continue`` and ``skip_step`` (which vetoes on the device in the step it flags) run without a
per-step sync; the others are host decisions, read from the detector once per step at step end
(one sync per step). Those that need an earlier state (``skip_batch``, ``rollback``) stop the segment with a request; the
driver (:func:`run_branch`) starts the next segment from that state with explicit loading.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, get_args

import torch

from model.callbacks import Callback
from model.checkpoint import checkpoint_path, list_checkpoints, load_checkpoint, save_checkpoint
from model.detect import SpikeDetector
from model.identity import LOADABLE
from model.train import Load

# ----------------------------------------------------------------------------------------------
# Injections
# ----------------------------------------------------------------------------------------------


class InjectionSettings(Protocol):
    """What an injection reads; the study's ``spike`` section (tasks/spike/config.py) has these."""

    duration: int
    magnitude: float
    param_block: int


class DetectorSettings(Protocol):
    """What the spike detector reads; the study's ``spike`` section has these."""

    detect_window: int
    detect_warmup: int
    detect_zscore: float
    detect_ratio: float


class RecoverySettings(Protocol):
    """What the recovery policies read; the study's ``recovery`` section has these."""

    skip_batches: int
    rollback_steps: int
    lr_factor: float
    max_retries: int
    max_consecutive_vetoes: int


TiedTo = Literal["stream", "step"]


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

    def __post_init__(self) -> None:
        if self.tied_to not in get_args(TiedTo) or (self.kind == "data" and self.tied_to != "stream"):
            raise ValueError(f"{self.kind} injection: tied_to={self.tied_to!r}; 'stream' or 'step' ('stream' for data)")

    @classmethod
    def from_config(
        cls, kind: str, cfg: InjectionSettings, origin_step: int, origin_position: int, tied_to: TiedTo = "stream"
    ) -> Injection:
        return cls(
            kind,
            origin_step + 1,
            origin_position,
            cfg.duration,
            1.0 if kind == "data" else cfg.magnitude,
            cfg.param_block,
            tied_to,
        )

    def spec(self) -> dict[str, Any]:
        """What identifies it (run identity ``extra``, MLflow tags)."""
        return dataclasses.asdict(self)

    def in_window(self, position: int) -> bool:
        return self.position <= position < self.position + self.duration

    def window_index(self, trainer) -> int | None:
        """Where the step about to run falls in the window (0 .. duration-1; None outside it):
        counted in optimizer steps if step-tied, else by the stream position of its first batch."""
        if self.tied_to == "step":
            index = trainer.step + 1 - self.start
        else:
            index = trainer.loader.batches_served - self.position
        return index if 0 <= index < self.duration else None


class LRSpike(Callback):
    name, order = "inject_lr", 40

    def __init__(self, injection: Injection):
        self.injection = injection

    def on_step_start(self, trainer) -> None:
        if self.injection.window_index(trainer) is not None:
            trainer.scale_lr(self.injection.magnitude)


class GradSpike(LRSpike):
    name = "inject_grad"

    def on_step_start(self, trainer) -> None:
        if self.injection.window_index(trainer) is not None:
            trainer.scale_grad(self.injection.magnitude)


class ParamSpike(LRSpike):
    name = "inject_param"

    @torch.no_grad()
    def on_step_start(self, trainer) -> None:
        if self.injection.window_index(trainer) == 0:
            for p in trainer.model.blocks[self.injection.param_block].parameters():
                if p.dim() == 2:  # matrices; norm gains stay
                    p.mul_(self.injection.magnitude)


class DataSpike(Callback):
    """Serves ``poison[i]`` in place of the batch at stream position ``position + i``; after
    :meth:`exclude` (swap_data) the poison source is out and the clean batches flow again."""

    name, order = "inject_data", 40

    def __init__(self, injection: Injection, poison: Sequence[tuple[torch.Tensor, torch.Tensor]]):
        if len(poison) != injection.duration:
            raise ValueError(f"data injection: {len(poison)} poison batches for duration {injection.duration}")
        self.injection, self.poison, self.excluded = injection, list(poison), False

    def exclude(self) -> None:
        self.excluded = True

    def on_batch(self, trainer, batches):
        if self.excluded:
            return None
        first = trainer.loader.batches_served - len(batches)  # stream position of batches[0]
        out = []
        for i, batch in enumerate(batches):
            k = first + i - self.injection.position
            if self.injection.in_window(first + i):
                batch = tuple(t.to(trainer.device) for t in self.poison[k])
            out.append(batch)
        return out


def injection_callback(injection: Injection, poison: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> Callback:
    """The callback that injects ``injection`` (``poison``: the batches a data injection serves)."""
    if injection.kind == "data":
        return DataSpike(injection, poison)
    return {"lr": LRSpike, "grad": GradSpike, "param": ParamSpike}[injection.kind](injection)


# ----------------------------------------------------------------------------------------------
# Observation: per-step trace and recent states
# ----------------------------------------------------------------------------------------------


class Trace(Callback):
    """Loss, pre-clip grad norm and whether the update was skipped, every step, as device tensors;
    :meth:`read` syncs once."""

    name, order = "trace", 60

    def __init__(self) -> None:
        self.rows: list[tuple[int, torch.Tensor]] = []

    def on_after_step(self, trainer, result) -> None:
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
        self.depth, self.states = depth, {}

    def on_train_start(self, config, run) -> None:
        self.states = {}

    def on_step_end(self, trainer) -> None:
        self.states[trainer.step] = cpu_copy(trainer.snapshot())
        for step in sorted(self.states)[: -self.depth]:
            del self.states[step]

    def at(self, step: int) -> dict[str, Any] | None:
        return self.states.get(step)


# ----------------------------------------------------------------------------------------------
# Policies
# ----------------------------------------------------------------------------------------------


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

    def on_step_end(self, trainer) -> None:
        if not self.acts_on_host or self.detector.now is None or not bool(self.detector.now):  # host read
            return
        self.react(trainer, trainer.step)

    def on_train_end(self, summary) -> None:
        if not self.acts_on_host:
            for step in self.detector.flagged_steps():
                self.react(None, step)

    def record(self, step: int, action: str) -> None:
        self.actions.append({"step": step, "policy": self.kind, "action": action})

    def react(self, trainer, step: int) -> None:
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

    def on_before_optimizer(self, trainer, pending) -> None:
        flagged = self.detector.now
        if flagged is None:
            return
        at_cap = flagged & (self.streak >= self.cfg.max_consecutive_vetoes)
        veto = flagged & ~at_cap
        pending.veto(veto)
        self.detector.rebaseline(at_cap)
        self.streak = torch.where(veto, self.streak + 1, 0)
        self.at_cap.append((pending.step, at_cap))

    def on_train_end(self, summary) -> None:
        if self.at_cap:
            hits = torch.stack([hit for _, hit in self.at_cap]).tolist()  # one sync, after the run
            self.passed = {step for (step, _), hit in zip(self.at_cap, hits) if hit}
        super().on_train_end(summary)

    def react(self, trainer, step: int) -> None:
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

    def on_step_start(self, trainer) -> None:
        trainer.scale_lr(self.factor)

    def react(self, trainer, step: int) -> None:
        if self.factor == 1.0:
            self.factor = self.cfg.lr_factor
            self.record(step, f"LR x{self.cfg.lr_factor:g} from step {step + 1} on")


class SwapData(Policy):
    """Exclude the offending data source and continue (playbook E); only a data injection has one."""

    kind, acts_on_host = "swap_data", True

    def __init__(self, detector: SpikeDetector, cfg: RecoverySettings, data: DataSpike | None):
        super().__init__(detector, cfg)
        self.data = data

    def react(self, trainer, step: int) -> None:
        if self.data is not None and not self.data.excluded:
            self.data.exclude()
            self.record(step, "poison source excluded from the stream; continue")
        elif self.data is None and not self.actions:
            self.record(step, "no data source to exclude (not a data spike); continue")


class StopAndRestart(Policy):
    """skip_batch and rollback: stop the segment at the first detection and ask the driver for a
    new one (an earlier state needs explicit loading, never a live mutation)."""

    acts_on_host = True

    def react(self, trainer, step: int) -> None:
        if self.restart is None:
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

    def on_step_start(self, trainer) -> None:
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


# ----------------------------------------------------------------------------------------------
# The branch driver
# ----------------------------------------------------------------------------------------------


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
    batches: dict[int, tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=dict)
    probe: dict[str, Any] = dataclasses.field(default_factory=dict)


class BatchTap(Callback):
    """Keeps the batches (after injection) of the steps in ``steps``: the offending batches a
    replay feeds again and the token histogram shows."""

    name, order = "batch_tap", 45

    def __init__(self, steps: range):
        self.steps, self.batches = steps, {}

    def on_batch(self, trainer, batches):
        if trainer.step + 1 in self.steps and batches:
            x, y = batches[0]
            self.batches[trainer.step + 1] = (x.cpu(), y.cpu())
        return None


MakeTrainer = Callable[[list[Any], Path | None], Any]
"""(callbacks, checkpoint_dir or None) -> a fresh Trainer of the branch's config and identity."""


def run_branch(
    make_trainer: MakeTrainer,
    origin: tuple[Path, dict[str, Any]],
    until: int,
    policy: str,
    cfg: RecoverySettings,
    spike: DetectorSettings,
    injection: Injection | None = None,
    poison=(),
    timeline: Sequence[tuple[int, Path]] = (),
    checkpoint_dir: Path | None = None,
    probe: Callable[[Any], dict] | None = None,
) -> Branch:
    """Run one branch from ``origin`` (path, checkpoint state) to step ``until``: segments until
    the policy asks for nothing more or the retry cap is reached. ``timeline``: checkpoints
    (step, path) before the origin on this branch's history (a rollback's targets); ``probe``:
    what to measure on the final trainer (kept in ``Branch.probe``)."""
    branch = Branch(policy)
    history = sorted(timeline)
    start_path, start_state, skip, lr_factor = origin[0], origin[1], 0, 1.0
    rows: dict[int, dict[str, float]] = {}
    while True:
        branch.segments += 1
        detector = make_detector(spike)
        data = injection_callback(injection, poison) if injection else None
        pol = make_policy(policy, detector, cfg, data if isinstance(data, DataSpike) else None)
        tap = BatchTap(range(injection.start, until + 1)) if injection else None
        callbacks = [detector, Trace(), pol, *[c for c in (data, tap) if c is not None]]
        if lr_factor != 1.0:
            callbacks.append(ScaleLR(lr_factor))
        if policy == "skip_batch":
            callbacks.append(RecentStates())
        segment_dir = checkpoint_dir / f"segment_{branch.segments}" if checkpoint_dir and policy == "rollback" else None
        trainer = make_trainer(callbacks, segment_dir)
        trainer.load(cpu_copy(start_state), start_path, Load(), LOADABLE)
        if skip:
            trainer.loader.skip(skip)
        summary = trainer.run(until=until)
        trace = callbacks[1].read()
        branch.steps_run += len(trace)
        for row in trace:  # a replayed step replaces the abandoned one
            rows[row["step"]] = row
        branch.detections += detector.flagged_steps()
        branch.actions += pol.actions
        if tap is not None:
            branch.batches.update(tap.batches)
        branch.status, branch.stop_reason = summary["status"], summary["stop_reason"]
        restart = pol.restart
        if restart is None or summary["status"] == "diverged":
            break
        attempt = sum(1 for a in branch.actions if a["action"].startswith(("rolled back", "skipped")))
        if attempt > cfg.max_retries:
            branch.status = "stopped"
            branch.stop_reason = (
                f"{policy}: spiked again at step {restart.detected} after {attempt} "
                f"restarts (recovery.max_retries={cfg.max_retries}); gave up"
            )
            pol.record(restart.detected, "gave up: retry cap reached")
            branch.actions.append(pol.actions[-1])
            break
        if segment_dir is not None:
            history += [(s, p) for s, p in list_checkpoints(segment_dir) if s < restart.detected]
        if policy == "skip_batch":
            # back to the state just before the flagged step; its batch and the next k-1 skipped
            # flagged at the segment's first step: the state it started from is the one before
            start_state = callbacks[-1].at(restart.detected - 1) or start_state
            before = int(start_state["step"])
            start_path, skip = Path(f"<memory: step {before}>"), cfg.skip_batches
            rows = {s: r for s, r in rows.items() if s <= before}
            branch.actions.append(
                {
                    "step": restart.detected,
                    "policy": policy,
                    "action": f"skipped batches of steps {before + 1}-{before + skip} "
                    f"from the state after step {before}",
                }
            )
        else:
            target, path = rollback_target(history, restart.detected, cfg.rollback_steps * (attempt + 1))
            start_path, start_state = path, load_checkpoint(path)
            skip = restart.detected - target  # the window of batches that led to the spike
            lr_factor *= cfg.lr_factor
            history = [(s, p) for s, p in history if s <= target]
            rows = {s: r for s, r in rows.items() if s <= target}
            branch.actions.append(
                {
                    "step": restart.detected,
                    "policy": policy,
                    "action": f"rolled back to step {target}, skipped batches of steps "
                    f"{target + 1}-{restart.detected}, LR x{lr_factor:g}",
                }
            )
    branch.rows = [rows[s] for s in sorted(rows)]
    branch.val_loss = trainer.evaluate() if branch.status != "diverged" else None
    branch.probe = probe(trainer) if probe else {}
    branch.detections = sorted(set(branch.detections))
    return branch


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
    Its checkpoints, the last at ``until``, are every branch's shared past: the origin and the
    rollback targets."""
    detector, trace = make_detector(spike), Trace()
    trainer = make_trainer([detector, trace], checkpoint_dir)
    trainer.start_from(milestone)
    trainer.run(until=until)
    if not checkpoint_path(checkpoint_dir, until).exists():
        save_checkpoint(checkpoint_path(checkpoint_dir, until), trainer.snapshot())
    return Warm(
        [(s, p) for s, p in list_checkpoints(checkpoint_dir) if s <= until], detector.flagged_steps(), trace.read()
    )


class ServeBatches(Callback):
    """Replaces the batches of steps ``first``, ``first + 1``, ... with ``batches`` in order."""

    name, order = "serve_batches", 40

    def __init__(self, first: int, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]):
        self.first, self.batches = first, list(batches)

    def on_batch(self, trainer, batches):
        k = trainer.step + 1 - self.first
        if 0 <= k < len(self.batches):
            return [tuple(t.to(trainer.device) for t in self.batches[k])]
        return None


def replay(
    make_trainer: MakeTrainer,
    start: tuple[Path, dict[str, Any]],
    baseline: dict[str, Any],
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
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


def make_detector(cfg: DetectorSettings) -> SpikeDetector:
    return SpikeDetector(
        window=cfg.detect_window, warmup=cfg.detect_warmup, zscore=cfg.detect_zscore, ratio=cfg.detect_ratio
    )


# ----------------------------------------------------------------------------------------------
# Collapse check (seed 000: repetitive or empty generations)
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def sample(model, prompts: torch.Tensor, n_tokens: int, seed: int = 0) -> list[list[int]]:
    """Sampled continuations (temperature 1, a fixed generator) of each prompt row."""
    generator = torch.Generator(device=prompts.device).manual_seed(seed)
    was_training = model.training
    model.eval()
    seq = prompts
    for _ in range(n_tokens):
        logits, _, _ = model(seq[:, -model.cfg.seq_len :])
        probs = torch.softmax(logits[:, -1].float(), dim=-1)
        seq = torch.cat([seq, torch.multinomial(probs, 1, generator=generator)], dim=1)
    model.train(was_training)
    return seq[:, prompts.shape[1] :].tolist()


def collapse_stats(generations: list[list[int]], eot: int, n: int = 2) -> dict[str, float]:
    """distinct-n (unique n-grams / n-grams, over all generations), the share of generations that
    end at once (first token end-of-text: empty output), and the share of repeated tokens."""
    grams = [tuple(g[i : i + n]) for g in generations for i in range(len(g) - n + 1)]
    tokens = [t for g in generations for t in g]
    return {
        "distinct_2": len(set(grams)) / len(grams) if grams else 0.0,
        "empty_rate": sum(1 for g in generations if not g or g[0] == eot) / max(1, len(generations)),
        "repeat_rate": 1 - len(set(tokens)) / len(tokens) if tokens else 0.0,
    }
