"""The spike study: per seed, an origin run trained cleanly at the ablation arm scale
(:func:`origin_config`), then from its scheduled checkpoint a clean control and, per cause
(injection kind), one branch per recovery policy; each spike classified, each branch given its
outcome (recovered, gap, gave up) and scored against its seed's control (a branch that gave up
too: :func:`unreached_loss`); the PaLM replay test; the collapse check. The study's summary keeps
only the origins past the plateau (:func:`plateau_gate`) and says how often the detector caught
each cause (:func:`detection`). Plain functions over model/spike/ (the flow fans the seeds out and
adds tracking); post-mortems and figures: tasks/spike/postmortem.py.

Every branch of a seed starts bitwise from one state: the origin checkpoint continued cleanly for
``spike.warm_steps`` (the detector's warm-up), with the origin run's data order. Scores compare
per-step training losses, smoothed over ``recovery.smooth_steps`` because a branch that skipped
batches sees other batches than the control at the same step. One seed (:func:`run_seed`) is one
unit of work on one thread: its numbers do not depend on the process or on what ran there before.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from model.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint
from model.collapse import collapse_stats, sample
from model.data import TokenLoader, open_split
from model.detect import make_detector
from model.identity import run_identity
from model.spike.branch import Branch, Warm, replay, rollback_target, run_branch, warm_up
from model.spike.injections import Injection, TiedTo, injection_callback
from model.spike.records import Trace, cpu_copy
from model.telemetry import record_forward_stats, to_floats
from model.train import Load, Trainer
from model.typed_config import InputError
from tasks.config import Config
from tasks.design.curves import trailing_mean
from tasks.design.preregistration import design
from tasks.runtime.files import read_json
from tasks.runtime.outputs import MANIFEST
from tasks.spike.config import RecoveryConfig, SpikeConfig

CAUSES = {
    "data": "rare-token gradient (a batch of spike-causing poison: {reasons})",
    "lr": "LR too high (x{magnitude:g} for {duration} steps)",
    "grad": "gradient blow-up (pre-clip gradients x{magnitude:g} for {duration} steps)",
    "param": "parameter corruption (block {param_block}'s weight matrices x{magnitude:g})",
}
"""Root cause of each injection kind, for the post-mortem."""


def origin_config(cfg: Config, seed: int) -> Config:
    """The config of ``seed``'s origin run and of every branch from it: the ablation arm scale (μP
    at ``mup.base_width``, peak LR ``ablation.lr``, the study's precision), a cosine schedule over
    ``spike.run_steps`` with the arms' warmup fraction, one thread (a seed is one worker's unit);
    checkpoints every ``recovery.checkpoint_every`` steps, enough of them kept for the farthest
    rollback, the origin step pinned; no evaluation but the branches' own at the end."""
    a, s, r = cfg.ablation, cfg.spike, cfg.recovery
    keep = (s.warm_steps + r.eval_steps) // r.checkpoint_every + 2
    return cfg.replace(
        **{
            "model.d_model": a.d_model,
            "model.n_layer": a.n_layer,
            "model.n_head": a.n_head,
            "model.seq_len": a.seq_len,
            "train.batch_size": a.batch_size,
            "train.grad_accum": 1,
            "train.steps": s.run_steps,
            "train.seed": seed,
            "train.cpu_threads": 1,
            "train.eval_every": 0,
            "train.layer_stats_every": s.run_steps,
            "optim.lr": a.lr,
            "schedule.kind": "cosine",
            "schedule.warmup_steps": round(a.warmup_fraction * s.run_steps),
            "checkpoint.every_steps": r.checkpoint_every,
            "checkpoint.keep_last": keep,
            "checkpoint.every_minutes": 0.0,
            "checkpoint.milestones": [s.origin_step],
        }
    )


TIED_TO: dict[str, TiedTo] = {"data": "stream", "param": "once", "adam": "once"}
"""What each injection kind follows (model/spike/injections.py: Injection). Poisoned data stays
with its batches: skipping them is a fair recovery. A corrupted weight or optimizer state is a
transient fault (``once``): restoring a clean state clears it. The rest (lr, grad) are tied to the
step count (``step``): they strike the same absolute steps on every pass, so a restart that
replays those steps (skip_batch, rollback) meets them again, as the playbook's recurring spikes
do, and only a policy that changes the LR or the update itself can change what they do."""

POISON_LENGTH_STREAM = 1
"""Beside the origin's seed, the key of the poisoned stretch's length draw: a stream of its own
(the poison windows and the origin's data order draw from the seed alone)."""


def branch_recovery(policy: str, r: RecoveryConfig) -> tuple[str, RecoveryConfig]:
    """The branch driver's policy and settings for a study policy (model/spike/branch.py:
    run_branch). ``rollback`` is PaLM's (§5.1: restart ~100 steps before the spike, skip 200-500
    batches, the LR as it was): the driver's rollback at LR factor 1. ``rollback_lower_lr`` is the
    same restart at LR x ``recovery.lr_factor`` per attempt, compounding (playbook D's "drop the LR
    and restart"). Every other policy runs as configured."""
    if policy == "rollback":
        return "rollback", dataclasses.replace(r, lr_factor=1.0)
    if policy == "rollback_lower_lr":
        return "rollback", r
    return policy, r


def poison_length(spike: SpikeConfig, seed: int) -> int:
    """The origin's poisoned stretch in batches: drawn uniformly from ``spike.poison_batches_range``
    (both ends included), seeded by the origin's seed alone, so a rerun draws it again and no
    policy, worker or outcome can move it."""
    shortest, longest = spike.poison_batches_range
    return int(np.random.default_rng([seed, POISON_LENGTH_STREAM]).integers(shortest, longest + 1))


def make_injection(kind: str, cfg: Config, fork_step: int, position: int) -> Injection:
    """The injection of ``kind`` right after the fork, tied as TIED_TO says; a data injection as long
    as the origin's drawn stretch (:func:`poison_length`), any other as ``spike`` configures it."""
    injection = Injection.from_config(kind, cfg.spike, fork_step, position, TIED_TO.get(kind, "step"))
    if kind != "data":
        return injection
    return dataclasses.replace(injection, duration=poison_length(cfg.spike, cfg.train.seed))


def window(cfg: Config) -> tuple[int, int]:
    """(fork, end): the step every branch starts from (the origin checkpoint plus the warm-up; the
    injection is the next step) and the step it runs to."""
    fork = cfg.spike.origin_step + cfg.spike.warm_steps
    return fork, fork + cfg.recovery.eval_steps


# ----------------------------------------------------------------------------------------------
# Poison
# ----------------------------------------------------------------------------------------------


def poison_batches(project: Path, cfg: Config, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches of ``model.seq_len + 1``-token windows drawn (seeded by ``train.seed``) from the
    poison-pool ranges of ``spike.data_reasons`` (never the harmless reasons)."""
    manifest = read_json(project / MANIFEST)
    ranges = manifest["splits"]["poison"].get("reasons", {})
    tokens = open_split(project / MANIFEST, "poison")
    span, batch = cfg.model.seq_len + 1, cfg.train.batch_size
    windows = [
        tokens[r["offset"] + i : r["offset"] + i + span].astype(np.int64)
        for reason in cfg.spike.data_reasons
        if (r := ranges.get(reason))
        for i in range(0, r["tokens"] - span + 1, span)
    ]
    if not windows:
        raise InputError(
            f"{project / MANIFEST}: the poison pool holds no window of {span} tokens for "
            f"spike.data_reasons={cfg.spike.data_reasons}"
        )
    rng = np.random.default_rng(cfg.train.seed)
    out = []
    for _ in range(n):
        chunk = torch.from_numpy(np.stack([windows[i] for i in rng.integers(0, len(windows), batch)]))
        out.append((chunk[:, :-1], chunk[:, 1:]))
    return out


# ----------------------------------------------------------------------------------------------
# Classification and scores
# ----------------------------------------------------------------------------------------------


class Classification(NamedTuple):
    type: int  # 1 recoverable, 2 lingering, 3 divergent
    steps_to_recover: int | None  # steps after the injection until back within ε for good
    final_gap: float  # smoothed relative gap to the control at the end
    why: str


def classify(
    branch: Sequence[float], control: Sequence[float], epsilon: float, within: int, smooth: int
) -> Classification:
    """The spike type of a branch's per-step losses against the control's over the same steps
    (index 0: the first injected step); seed 004's three trajectories, with ε and W from
    ``recovery.recover_epsilon`` and ``recovery.recover_steps``:

      3 divergent    a non-finite loss, or the gap above ε at the end and still widening (the
                     last ``smooth`` steps' gap above the ``smooth`` before by more than ε)
      1 recoverable  back within ε of the control (smoothed, relative) at most W steps after
                     the injection, and within it from then on
      2 lingering    otherwise: back later than W, or settled more than ε above the control

    A branch with no step in the window (a policy that gave up before it) counts as divergent.
    """
    b, c = np.asarray(branch, dtype=float), np.asarray(control, dtype=float)[: len(branch)]
    if not len(b):
        return Classification(3, None, float("nan"), "no step in the window: the run gave up before it")
    if not np.isfinite(b).all():
        return Classification(3, None, float("nan"), "non-finite loss")
    gap = trailing_mean(b, smooth) / trailing_mean(c, smooth) - 1.0
    final = float(gap[-1])
    above = np.flatnonzero(gap > epsilon)
    back = 0 if not len(above) else int(above[-1]) + 1
    back_at = back if back < len(gap) else None
    late, before = gap[-smooth:].mean(), gap[-2 * smooth : -smooth].mean() if len(gap) >= 2 * smooth else gap[0]
    if final > epsilon and late > before + epsilon:
        return Classification(3, None, final, f"gap {final:+.1%} at the end and still widening")
    if back_at is not None and back_at <= within:
        return Classification(1, back_at, final, f"back within {epsilon:.0%} of the control after {back_at} steps")
    if back_at is not None:
        return Classification(2, back_at, final, f"back within {epsilon:.0%} only after {back_at} steps (> {within})")
    return Classification(2, None, final, f"settled {final:+.1%} from the control (> {epsilon:.0%})")


def capped(loss: float | None, cap: float) -> float:
    """A loss as the scores read it: at most ``cap`` (ln V), and the cap where it is not finite."""
    return min(loss, cap) if loss is not None and math.isfinite(loss) else cap


def unreached_loss(branch: Branch, cap: float) -> float:
    """What a step the branch never ran counts at. A branch that gave up (the retry cap) is left
    where its policy left it: the model that had just spiked again, trained no further, so every
    step after it counts at the loss of the step it gave up at (capped). That is the branch's own
    number, borrowed from no other branch or seed, so each seed's pair stays a pair; it scores the
    give-up in the same comparison as every other branch, where dropping it would favour the
    policies that give up. Any other stop (diverged) counts at the cap, as a diverged arm's loss
    is its loss at init (tasks/design/stats.py: capped_loss)."""
    if branch.status == "stopped" and branch.rows:
        return capped(branch.rows[-1]["loss"], cap)
    return cap


def window_curves(branch: Branch, control: Branch, smooth: int, cap: float) -> tuple[np.ndarray, np.ndarray]:
    """The branch's and the control's smoothed losses over the control's steps (the injection to
    the window's end). Every loss is capped at ``cap`` (ln V, the loss of a uniform guess), a loss
    that is not finite counts at the cap, and a step the branch never reached at
    :func:`unreached_loss`."""
    mine = {r["step"]: r["loss"] for r in branch.rows}
    missing = unreached_loss(branch, cap)
    steps = [r["step"] for r in control.rows]
    b = np.array([capped(mine[s], cap) if s in mine else missing for s in steps])
    c = np.array([capped(r["loss"], cap) for r in control.rows])
    return trailing_mean(b, smooth), trailing_mean(c, smooth)


def detected(branch: Branch, injection: Injection, within: int) -> bool:
    """Whether the detector caught the injected spike: a flag from the injection's first step to
    ``within`` steps after its last (``spike.detect_within``)."""
    last = injection.start + injection.duration - 1 + within
    return any(injection.start <= step <= last for step in branch.detections)


def outcome(status: str, spike_type: int) -> str:
    """``gave_up``: the branch did not run its window out (the policy's retry cap, or any stop
    other than divergence); ``recovered``: it completed and came back in time (type 1); ``gap``:
    otherwise (back late, settled above, or diverged: a diverged run is a result, as in the arms)."""
    if status not in ("completed", "diverged"):
        return "gave_up"
    return "recovered" if status == "completed" and spike_type == 1 else "gap"


def excess_area(branch: np.ndarray, control: np.ndarray) -> float:
    """Area of excess loss, nat·steps: the sum over steps of max(0, branch − control), both smoothed;
    what the spike cost on top of the clean run, whether it lingered or came back."""
    return float(np.clip(branch - control, 0.0, None).sum())


def aligned_losses(branch: Branch, control: Branch) -> tuple[list[float], list[float]]:
    """Losses of the steps both ran, in step order (a branch that gave up ends early)."""
    mine = {r["step"]: r["loss"] for r in branch.rows}
    steps = [r["step"] for r in control.rows if r["step"] in mine]
    theirs = {r["step"]: r["loss"] for r in control.rows}
    return [mine[s] for s in steps], [theirs[s] for s in steps]


@dataclasses.dataclass(frozen=True)
class Costs:
    """What one step costs, measured on the control: for tokens, FLOPs and dollars wasted."""

    seconds_per_step: float
    tokens_per_step: int
    flops_per_token: float
    gpu_hour_usd: float


def score(
    branch: Branch,
    control: Branch,
    injection: Injection,
    r: RecoveryConfig,
    costs: Costs,
    cap: float,
    detect_within: int,
) -> dict[str, Any]:
    """A policy's scores against the control (seed 004's incident cost included). ``scored_gap``
    (relative, at the window's end) reads the capped curves of :func:`window_curves`, a branch that
    gave up included (:func:`unreached_loss`): what the paired comparison reads, so no seed drops
    out. ``final_gap`` and ``excess_area`` are the same reading for a branch that ran its window
    out, None for one that gave up (its ``outcome`` says so); the type describes the raw losses of
    the steps it ran. ``detected``: whether the detector caught the injected spike
    (:func:`detected`); a missed spike's branch is scored all the same (its policy never acted)."""
    losses, control_losses = aligned_losses(branch, control)
    kind = classify(losses, control_losses, r.recover_epsilon, r.recover_steps, r.smooth_steps)
    result = outcome(branch.status, kind.type)
    smooth_branch, smooth_clean = window_curves(branch, control, r.smooth_steps, cap)
    gap = float(smooth_branch[-1] / smooth_clean[-1] - 1.0)
    scored = result != "gave_up"
    smooth_control = trailing_mean(np.asarray(control_losses), r.smooth_steps)
    peak = max(losses[i] / smooth_control[i] for i in range(len(losses))) if losses else float("nan")
    rerun = branch.steps_run - control.steps_run
    vetoed = sum(1 for row in branch.rows if row["skipped"])
    # Steps off the control's track (a recoverable branch, type 1, always came back at a step).
    spent = kind.steps_to_recover if kind.type == 1 and kind.steps_to_recover is not None else r.eval_steps
    wasted = max(0, rerun) + vetoed + spent
    flagged = [d for d in branch.detections if d >= injection.start]
    return {
        "outcome": result,
        "type": kind.type,
        "why": kind.why,
        "steps_to_recover": kind.steps_to_recover,
        "peak_ratio": peak,
        "peak_loss": max(losses) if losses else float("nan"),
        "grad_norm_peak": max((row["grad_norm"] for row in branch.rows), default=float("nan")),
        "final_loss": float(np.mean(losses[-r.smooth_steps :])) if losses else float("nan"),
        "scored_gap": gap,
        "final_gap": gap if scored else None,
        "excess_area": excess_area(smooth_branch, smooth_clean) if scored else None,
        "val_loss": branch.val_loss,
        "val_gap": (
            branch.val_loss - control.val_loss if branch.val_loss is not None and control.val_loss is not None else None
        ),
        "detected": detected(branch, injection, detect_within),
        "detected_at": flagged[0] if flagged else None,
        "latency": flagged[0] - injection.start if flagged else None,
        "status": branch.status,
        "stop_reason": branch.stop_reason,
        "steps_run": branch.steps_run,
        "restarts": branch.segments - 1,
        "rerun_steps": rerun,
        "vetoed_steps": vetoed,
        "wasted_steps": wasted,
        "wasted_tokens": wasted * costs.tokens_per_step,
        "wasted_flops": wasted * costs.tokens_per_step * costs.flops_per_token,
        "cost_usd": wasted * costs.seconds_per_step * costs.gpu_hour_usd / 3600,
        "actions": branch.actions,
        "segments": branch.segments,
    }


# ----------------------------------------------------------------------------------------------
# The study
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Study:
    """Everything the stage computed from one seed; the flow tracks it and writes the reports from it."""

    cfg: Config
    seed: int
    origin_run: dict[str, Any]  # the clean origin run up to its checkpoint (origin_metrics)
    fork_step: int
    end_step: int
    warm: Warm
    control: Branch
    branches: dict[str, dict[str, Branch]]  # kind -> policy -> branch
    injections: dict[str, Injection]
    scores: dict[str, dict[str, dict[str, Any]]]  # kind -> policy -> scores
    replays: dict[str, dict[str, Any]]
    spike_stats: dict[str, dict[str, dict[str, float]]]  # kind -> {pre_spike, at_spike} layer stats
    collapse_before: dict[str, float]
    false_positives: list[int]
    costs: Costs
    identities: dict[str, str]  # branch name -> run identity
    cpu_seconds: float = 0.0

    def branch_name(self, kind: str | None, policy: str) -> str:
        return branch_name(self.seed, kind, policy)


def branch_name(seed: int, kind: str | None, policy: str) -> str:
    """A branch's name across the study (MLflow child run, run identity key): seed, kind, policy."""
    return f"s{seed}/control" if kind is None else f"s{seed}/{kind}/{policy}"


class StudyRun:
    """The inputs of one seed's study and a factory of trainers for its runs."""

    def __init__(self, cfg: Config, project: Path, seed: int, run_dir: Path):
        self.seed, self.cfg, self.project, self.run_dir = seed, origin_config(cfg, seed), project, run_dir
        manifest = read_json(project / MANIFEST)
        self.data = {s: manifest["splits"][s]["sha256"] for s in ("train", "val", "poison")}
        self.eot = manifest["eot_id"]
        self.train, self.val = (open_split(project / MANIFEST, s) for s in ("train", "val"))
        self.parent = run_identity(self.cfg, self.data, None, {"study": "spike", "branch": "origin"}).digest

    def identity(self, extra: dict[str, Any]) -> str:
        return run_identity(self.cfg, self.data, self.parent, {"study": "spike", **extra}).digest

    def maker(self, identity: str):
        return lambda callbacks, directory: Trainer(self.cfg, self.train, self.val, callbacks, directory, identity)

    def origin_run(self) -> tuple[Path, dict[str, Any]]:
        """Train the seed's origin run cleanly from scratch to ``spike.origin_step``; its checkpoint
        there (the path) and what the run was (its loss and validation loss at the checkpoint)."""
        s, trace, directory = self.cfg.spike, Trace(), self.run_dir / "origin"
        trainer = self.maker(self.parent)([trace], directory)
        summary = trainer.run(until=s.origin_step)
        if summary["status"] != "completed":
            raise RuntimeError(f"spike: seed {self.seed}'s origin run {summary['status']} before step {s.origin_step}")
        path = checkpoint_path(directory, s.origin_step)
        if not path.exists():
            save_checkpoint(path, trainer.snapshot())
        losses = [row["loss"] for row in trace.read()][-self.cfg.recovery.smooth_steps :]
        return path, {
            "seed": self.seed,
            "role": "discovery" if self.seed in s.seeds else "confirmation",
            "identity": self.parent,
            "origin_step": s.origin_step,
            "run_steps": s.run_steps,
            "lr_at_origin": trainer.last_metrics.get("train/lr"),
            "train_loss": float(np.mean(losses)),
            "val_loss": trainer.evaluate(),
        }

    def prompts(self) -> torch.Tensor:
        n = self.cfg.spike.sample_prompts
        span = self.cfg.model.seq_len + 1
        return torch.from_numpy(np.stack([self.val[i * span : i * span + 8].astype(np.int64) for i in range(n)]))

    def collapse(self, model) -> dict[str, float]:
        if self.cfg.spike.sample_prompts == 0:
            return {}
        return collapse_stats(sample(model, self.prompts(), self.cfg.spike.sample_tokens), self.eot)


def layer_stats(model, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
    """Activation L2 and attention entropy per block (and the logit stats) on one batch."""
    with torch.no_grad(), record_forward_stats(model) as stats:
        model(*batch)
    return to_floats(stats)


def run_seed(cfg: Config, project: Path, seed: int, run_dir: Path) -> Study:
    """One seed's whole study: its origin run, then the warm-up, control, every cause x policy
    branch and the replays from its checkpoint. ``run_dir`` holds the checkpoints (scratch)."""
    cpu0 = time.process_time()
    study = StudyRun(cfg, project, seed, run_dir)
    checkpoint, origin_run = study.origin_run()
    result = run_branches(study, checkpoint, origin_run)
    result.cpu_seconds = time.process_time() - cpu0
    return result


def run_branches(study: StudyRun, checkpoint: Path, origin_run: dict[str, Any]) -> Study:
    """Warm-up, control, every injection x policy branch and the replays, from the origin checkpoint."""
    cfg, r, run_dir = study.cfg, study.cfg.recovery, study.run_dir
    fork_step, end = window(cfg)
    warm = warm_up(study.maker(study.identity({"branch": "warm"})), checkpoint, fork_step, cfg.spike, run_dir / "warm")
    origin = warm.origin
    position = int(origin[1]["loader"]["batches_served"])
    control_name = branch_name(study.seed, None, "continue")
    identities = {control_name: study.identity({"branch": "control"})}
    started = time.perf_counter()

    def collapse_probe(trainer: Trainer) -> dict[str, Any]:
        return {"collapse": study.collapse(trainer.model)}

    control = run_branch(
        study.maker(identities[control_name]), origin, end, "continue", r, cfg.spike, probe=collapse_probe
    )
    probe_trainer = study.maker(identities[control_name])([], None)
    probe_trainer.load(cpu_copy(origin[1]), origin[0], Load())
    collapse_before = study.collapse(probe_trainer.model)
    costs = Costs(
        (time.perf_counter() - started) / max(1, control.steps_run),
        probe_trainer.tokens_per_step,
        float(probe_trainer.flops_per_token),
        cfg.spike.gpu_hour_usd,
    )
    cap = math.log(cfg.tokenizer.vocab_size)
    injections: dict[str, Injection] = {k: make_injection(k, cfg, fork_step, position) for k in cfg.spike.kinds}
    poison = poison_batches(study.project, cfg, injections["data"].duration) if "data" in injections else []
    branches: dict[str, dict[str, Branch]] = {}
    scores: dict[str, dict[str, dict[str, Any]]] = {}
    replays: dict[str, dict[str, Any]] = {}
    stats: dict[str, dict[str, dict[str, float]]] = {}
    for kind, injection in injections.items():
        branches[kind], scores[kind] = {}, {}
        for policy in r.policies:
            driver, settings = branch_recovery(policy, r)
            name = branch_name(study.seed, kind, policy)
            identities[name] = study.identity(
                {"injection": injection.spec(), "policy": policy, "recovery": dataclasses.asdict(settings)}
            )
            branch = run_branch(
                study.maker(identities[name]),
                origin,
                end,
                driver,
                settings,
                cfg.spike,
                injection,
                poison,
                warm.timeline,
                run_dir / kind / policy,
                probe=collapse_probe,
            )
            branches[kind][policy] = branch
            scores[kind][policy] = {
                **score(branch, control, injection, r, costs, cap, cfg.spike.detect_within),
                "collapse": branch.probe.get("collapse", {}),
            }
        observed = branches[kind].get("continue") or next(iter(branches[kind].values()))
        replays[kind], stats[kind] = examine(study, warm, origin, injection, poison, observed)
        keep_offending_batches(branches[kind].values(), replays[kind]["steps"])
    return Study(
        cfg,
        study.seed,
        origin_run,
        fork_step,
        end,
        warm,
        control,
        branches,
        injections,
        scores,
        replays,
        stats,
        collapse_before,
        warm.alarms + control.detections,
        costs,
        identities,
    )


def keep_offending_batches(branches: Iterable[Branch], steps: Sequence[int]) -> None:
    """Drop every batch a branch kept but those of the offending ``steps`` (the post-mortem's token
    histogram): a seed's study travels back from its worker process, the window's batches need not."""
    for branch in branches:
        branch.batches = {s: b for s, b in branch.batches.items() if s in steps}


def offending_steps(branch: Branch, injection: Injection) -> list[int]:
    """The steps whose batches led to the spike: from the injection to the first detection."""
    detected = [d for d in branch.detections if d >= injection.start]
    last = detected[0] if detected else injection.start + injection.duration - 1
    return list(range(injection.start, last + 1))


def examine(study: StudyRun, warm: Warm, origin, injection: Injection, poison, observed: Branch):
    """The replay test and the layer statistics at the spike, for one injection."""
    cfg = study.cfg
    steps = offending_steps(observed, injection)
    batches = [observed.batches[s] for s in steps if s in observed.batches]
    target, path = rollback_target(warm.timeline, injection.start, cfg.recovery.rollback_steps)
    start = (path, load_checkpoint(path))
    baseline = origin[1]["callbacks"][make_detector(cfg.spike).name]
    result = replay(
        study.maker(study.identity({"branch": "replay", "injection": injection.spec()})),
        start,
        baseline,
        batches,
        cfg.spike,
    )
    result["steps"] = steps
    result["positions"] = [injection.position + (s - injection.start) * cfg.train.grad_accum for s in steps]
    # The model that met the spiking batch (origin run up to the step before it, injected), on
    # that batch, against the origin model on the clean batch the control trained on there.
    trainer = study.maker("probe")([injection_callback(injection, poison)], None)
    trainer.load(cpu_copy(origin[1]), origin[0], Load())
    if steps[-1] - 1 > trainer.step:
        trainer.run(until=steps[-1] - 1)
    clean = TokenLoader(study.train, cfg.model.seq_len, cfg.train.batch_size, cfg.train.seed)
    clean.load_state_dict({"batches_served": result["positions"][-1], "seed": cfg.train.seed})
    pre = study.maker("probe")([], None)
    pre.load(cpu_copy(origin[1]), origin[0], Load())
    stats = (
        {"pre_spike": layer_stats(pre.model, clean.next_batch()), "at_spike": layer_stats(trainer.model, batches[-1])}
        if batches
        else {}
    )
    return result, stats


def observed_policy(policies: Iterable[str]) -> str:
    """The branch that shows a spike with nobody intervening: ``continue``, else the first. Every
    branch of a cause runs the same steps up to the detector's first flag (the policies act on
    flags alone), so its detection is every branch's."""
    names = list(policies)
    return "continue" if "continue" in names else names[0]


def symptoms(study: Study, kind: str) -> dict[str, Any]:
    """What the spike looked like with nobody intervening (:func:`observed_policy`)."""
    r, injection = study.cfg.recovery, study.injections[kind]
    policy = observed_policy(study.branches[kind])
    rows = study.branches[kind][policy].rows
    after = [row for row in rows if row["step"] >= injection.start]
    before = [row["loss"] for row in study.warm.rows][-r.smooth_steps :]
    peak = max(after, key=lambda row: row["loss"])
    grad_peak = max(after, key=lambda row: row["grad_norm"])
    smoothed = trailing_mean(np.array([row["loss"] for row in after]), r.smooth_steps)
    later = min(r.recover_steps, len(after) - 1)
    return {
        "observed_policy": policy,
        "pre_spike_loss": float(np.mean(before)),
        "peak_loss": peak["loss"],
        "peak_step": peak["step"],
        "recovery_loss": float(smoothed[later]),
        "recovery_step": after[later]["step"],
        "grad_norm_peak": grad_peak["grad_norm"],
        "grad_norm_peak_step": grad_peak["step"],
    }


def origin_metrics(study: Study) -> dict[str, Any]:
    """One seed's entry of ``metrics/spike.json``: its origin run, and per injection and policy the
    scores without the action log, and the injection as run (``tied_to`` included: the finding
    checks it)."""
    control_losses = [r["loss"] for r in study.control.rows]
    out: dict[str, Any] = {
        "origin_run": study.origin_run,
        "fork_step": study.fork_step,
        "end_step": study.end_step,
        "false_positives": len(study.false_positives),
        "false_positive_steps": study.false_positives,
        "seconds_per_step": study.costs.seconds_per_step,
        "cpu_seconds": study.cpu_seconds,
        "control": {
            "final_loss": float(np.mean(control_losses[-study.cfg.recovery.smooth_steps :])),
            "val_loss": study.control.val_loss,
        },
        "collapse_before": study.collapse_before,
    }
    for kind, by_policy in study.scores.items():
        out[kind] = {
            "injection": study.injections[kind].spec(),
            "replay_spiked": study.replays[kind]["spiked"],
            "symptoms": symptoms(study, kind),
            **{p: {k: v for k, v in s.items() if k not in ("actions", "why")} for p, s in by_policy.items()},
        }
    return out


MATRIX_FIELDS = (
    "outcome",
    "scored_gap",
    "final_gap",
    "excess_area",
    "detected",
    "type",
    "status",
    "restarts",
    "steps_run",
)
"""What the matrix keeps of a branch's scores: what the finding and the report's table read."""

Matrix = dict[str, dict[str, dict[str, dict[str, Any]]]]
"""cause -> policy -> seed -> a branch's MATRIX_FIELDS."""


def matrix(studies: Sequence[Study], cfg: Config) -> Matrix:
    """cause -> policy -> seed -> the branch's outcome and scores (MATRIX_FIELDS), over ``studies``;
    every cause of ``spike.kinds`` and every policy has its cell, if empty, so a reader finds the
    grid whatever origins it holds."""
    out: Matrix = {kind: {p: {} for p in cfg.recovery.policies} for kind in cfg.spike.kinds}
    for study in studies:
        for kind, by_policy in study.scores.items():
            for policy, scores in by_policy.items():
                cell = out.setdefault(kind, {}).setdefault(policy, {})
                cell[str(study.seed)] = {k: scores[k] for k in MATRIX_FIELDS}
    return out


def plateau_gate(studies: Sequence[Study], unigram: float, margin: float) -> dict[str, Any]:
    """The plateau gate, one origin at a time (method: plateau): an origin whose validation loss at
    its checkpoint is not ``margin`` nats below the unigram baseline has learned no more than
    unigram statistics, a spike on it tests nothing, and it leaves the study, its seed named in
    ``excluded`` (a mean over origins would let one past the bound carry one that is not). ``why``:
    the half of the seeds (discovery, confirmation; one with no seeds aside) that keeps fewer than
    ``spike.min_origins_per_half`` origins, with which the finding is not tested; None if none."""
    spike = studies[0].cfg.spike
    bound = unigram - margin

    def passed(loss: float | None) -> bool:
        return loss is not None and math.isfinite(loss) and loss <= bound

    origins = {str(s.seed): {"role": s.origin_run["role"], "val_loss": s.origin_run["val_loss"]} for s in studies}
    for entry in origins.values():
        entry["passed"] = passed(entry["val_loss"])
    halves = {"discovery": spike.seeds, "confirmation": spike.confirm_seeds}
    short = [
        f"{half}: {kept} of {len(seeds)} origins past the plateau (needs >= {spike.min_origins_per_half})"
        for half, seeds in halves.items()
        if seeds and (kept := sum(origins[str(seed)]["passed"] for seed in seeds)) < spike.min_origins_per_half
    ]
    return {
        "unigram_val_loss": unigram,
        "margin": margin,
        "bound": bound,
        "origins": origins,
        "excluded": [int(seed) for seed, entry in origins.items() if not entry["passed"]],
        "min_origins_per_half": spike.min_origins_per_half,
        "why": "; ".join(short) or None,
    }


def detection(cells: Matrix) -> dict[str, dict[str, Any]]:
    """Per cause, how often the detector caught the injected spike over the matrix's origins (each
    cause's observed branch, :func:`observed_policy`), and the seeds it missed; a missed spike's
    branches stay in the matrix, scored (their policies never acted)."""
    out = {}
    for cause, by_policy in cells.items():
        by_seed = by_policy[observed_policy(by_policy)] if by_policy else {}
        missed = [int(seed) for seed, cell in by_seed.items() if not cell["detected"]]
        injected = len(by_seed)
        out[cause] = {
            "injected": injected,
            "detected": injected - len(missed),
            "rate": (injected - len(missed)) / injected if injected else None,
            "missed_seeds": missed,
        }
    return out


def give_ups(cells: Matrix) -> dict[str, dict[str, int]]:
    """Per cause and policy, the branches that gave up (the retry cap) over the matrix's origins:
    scored like every branch (:func:`unreached_loss`), and counted apart."""
    return {
        cause: {p: sum(c["outcome"] == "gave_up" for c in by_seed.values()) for p, by_seed in by_policy.items()}
        for cause, by_policy in cells.items()
    }


def summary_metrics(studies: Sequence[Study], unigram: float) -> dict[str, Any]:
    """``metrics/spike.json``: the cause x policy x seed matrix over the origins past the plateau
    (``plateau``: every origin's gate, the excluded seeds, and why the finding is not tested if a
    half keeps too few), its causes and policies in the config's order (the file's keys are sorted),
    the detection rate and the give-ups per cause, every seed's entry (its origin run, drawn poison
    length and details, excluded origins too), which seeds discover and which confirm, and the
    totals."""
    cfg = studies[0].cfg
    gate = plateau_gate(studies, unigram, design()["plateau_margin"])
    cells = matrix([s for s in studies if s.seed not in gate["excluded"]], cfg)
    out = {
        "matrix": cells,
        "causes": cfg.spike.kinds,
        "policies": cfg.recovery.policies,
        "plateau": gate,
        "detection": detection(cells),
        "give_ups": give_ups(cells),
        "poison_batches": {str(s.seed): s.injections["data"].duration for s in studies if "data" in s.injections},
        "seeds": {str(s.seed): origin_metrics(s) for s in studies},
        "discovery_seeds": cfg.spike.seeds,
        "confirm_seeds": cfg.spike.confirm_seeds,
        "postmortem_seed": studies[0].seed,
        "false_positives": sum(len(s.false_positives) for s in studies),
        "cpu_seconds": sum(s.cpu_seconds for s in studies),
    }
    plain: dict[str, Any] = json.loads(json.dumps(out, default=str))
    return plain
