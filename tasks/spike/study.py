"""The spike study: per seed, an origin run trained cleanly at the ablation arm scale
(:func:`origin_config`), then from its scheduled checkpoint a clean control and, per cause
(injection kind), one branch per recovery policy, each scored against its seed's control
(tasks/spike/scores.py: the spike classified, the branch's outcome and scores); the PaLM replay
test; the collapse check. Plain functions over model/spike/ (the flow fans the seeds out and adds
tracking); the summary over seeds (the plateau gate, the detector's rate):
tasks/spike/summary.py; post-mortems and figures: tasks/spike/postmortem.py.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

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
from tasks.runtime.files import read_json
from tasks.runtime.outputs import MANIFEST
from tasks.spike.config import RecoveryConfig, SpikeConfig
from tasks.spike.scores import Costs, score

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


def poison_draws(spike: SpikeConfig) -> str:
    """Every origin's drawn stretch, as the registered poison rule prints it ("16: 226, 17: 147"):
    computed from the seeds the stage runs (``spike.all_seeds``), so a registration on fresh seeds
    prints their draws, not a list copied from an earlier version (tests/test_spike_study.py)."""
    return ", ".join(f"{seed}: {poison_length(spike, seed)}" for seed in spike.all_seeds)


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
