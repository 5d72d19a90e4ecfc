"""Injections, the detector and the recovery policies on a tiny model (model/spike.py)."""

from __future__ import annotations

import pytest
import torch

from model.callbacks import Callback
from model.spike import Injection, run_branch, warm_up
from model.train import Trainer
from tasks.spike.config import RecoveryConfig, SpikeConfig
from tests.trainer_kit import markov_tokens, tiny_config

TOKENS, VAL = markov_tokens(30_000), markov_tokens(4_000, seed=1)
SPIKE = SpikeConfig(at_step=1, warm_steps=16, detect_window=16, detect_warmup=8, duration=2, magnitude=100.0)
RECOVERY = RecoveryConfig(
    skip_batches=3, rollback_steps=4, checkpoint_every=2, eval_steps=12, recover_steps=8, smooth_steps=3, max_retries=1
)
CFG = tiny_config(
    **{
        "train.steps": 40,
        "checkpoint.every_steps": 2,
        "checkpoint.keep_last": 50,
        "checkpoint.milestones": [1],
        "optim.lr": 3e-3,
        "schedule.kind": "constant",
    }
)
ORIGIN = 17  # the milestone is step 1; warm-up to 17; injection from step 18
RARE = 256  # a token the Markov data never reaches through its permutation walk this early


def poison(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Long single-token runs: one rare token repeated, the seed-000 spike cause."""
    run = torch.full((4, 17), RARE, dtype=torch.long)
    return [(run[:, :-1], run[:, 1:])] * n


class Positions(Callback):
    """The stream position of every step's batch and the state after chosen steps."""

    name, order = "positions", 41

    def __init__(self, log: list, keep: dict, steps=()):
        self.log, self.keep, self.steps = log, keep, set(steps)

    def on_batch(self, trainer, batches):
        self.log.append((trainer.step + 1, trainer.loader.batches_served - 1))

    def on_step_end(self, trainer):
        if trainer.step in self.steps:
            state = {"model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict()["state"]}
            self.keep[trainer.step] = {part: {k: _clone(v) for k, v in d.items()} for part, d in state.items()}


def _clone(value):
    return {k: v.clone() for k, v in value.items()} if isinstance(value, dict) else value.clone()


def bitwise_equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(bitwise_equal(a[k], b[k]) for k in a)
    return torch.equal(a, b)


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """A milestone at step 1, the warm-up to ORIGIN with checkpoints: what every branch shares."""
    root = tmp_path_factory.mktemp("spike")
    Trainer(CFG, TOKENS, VAL, [], root / "pretrain").run(until=1)
    milestone = root / "pretrain" / "step_00000001.pt"
    warm = warm_up(lambda cbs, d: Trainer(CFG, TOKENS, VAL, cbs, d), milestone, ORIGIN, SPIKE, root / "warm")
    return {"root": root, "timeline": warm.timeline, "alarms": warm.alarms, "origin": warm.origin}


def branch(study, kind, policy, log=None, keep=None, steps=(), recovery=RECOVERY, until=ORIGIN + 12):
    extra = [Positions(log if log is not None else [], keep if keep is not None else {}, steps)]
    make = lambda cbs, d: Trainer(CFG, TOKENS, VAL, [*cbs, *extra], d)  # noqa: E731
    injection = None if kind is None else Injection.from_config(kind, SPIKE, ORIGIN, ORIGIN)
    return run_branch(
        make,
        study["origin"],
        until,
        policy,
        recovery,
        SPIKE,
        injection,
        poison(SPIKE.duration),
        study["timeline"],
        study["root"] / f"{kind}-{policy}",
    )


@pytest.mark.parametrize("kind", ["data", "lr", "grad", "param"])
def test_every_injection_kind_makes_a_spike_the_detector_catches_within_two_steps(study, kind):
    found = branch(study, kind, "continue").detections
    assert found and ORIGIN + 1 <= found[0] <= ORIGIN + 3


def test_the_detector_stays_silent_on_the_control(study):
    assert study["alarms"] == [] and branch(study, None, "continue").detections == []


def test_skip_step_leaves_weights_and_adam_state_bitwise_untouched_at_the_flagged_step(study):
    keep = {}
    result = branch(study, "data", "skip_step", keep=keep, steps=(ORIGIN + 1,))
    assert result.detections[0] == ORIGIN + 1  # the poison batch is flagged in its own step
    before, after = study["origin"][1], keep[ORIGIN + 1]
    assert bitwise_equal(before["model"], after["model"])
    assert bitwise_equal(before["optimizer"]["state"], after["optimizer"])  # moments and step counts


def test_skip_batch_serves_exactly_the_batches_after_the_skipped_ones(study):
    log = []
    result = branch(study, "data", "skip_batch", log=log)
    assert result.detections[0] == ORIGIN + 1
    served = dict(log)  # step -> stream position; the replayed steps overwrote the abandoned ones
    next_position = study["origin"][1]["loader"]["batches_served"]  # the spiking step's batch
    k = RECOVERY.skip_batches
    assert [served[s] for s in range(ORIGIN + 1, ORIGIN + 13)] == list(range(next_position + k, next_position + k + 12))
    assert result.segments == 2 and result.status == "completed"


def test_rollback_restores_an_earlier_checkpoint_skips_the_window_and_gives_up_at_the_retry_cap(study):
    log = []
    # An LR spike that lasts: every restart meets it again, so the branch must give up.
    lasting = SpikeConfig(**{**SPIKE.__dict__, "duration": 40, "magnitude": 300.0})
    make = lambda cbs, d: Trainer(CFG, TOKENS, VAL, [*cbs, Positions(log, {})], d)  # noqa: E731
    result = run_branch(
        make,
        study["origin"],
        ORIGIN + 12,
        "rollback",
        RECOVERY,
        lasting,
        Injection.from_config("lr", lasting, ORIGIN, ORIGIN),
        (),
        study["timeline"],
        study["root"] / "rollback-cap",
    )
    rollbacks = [a for a in result.actions if a["action"].startswith("rolled back")]
    assert len(rollbacks) == RECOVERY.max_retries + 1
    assert result.status == "stopped" and "gave up" in result.stop_reason
    first = rollbacks[0]
    target = int(first["action"].split("step ")[1].split(",")[0])
    assert target <= first["step"] - RECOVERY.rollback_steps
    # The next segment starts at the target's step with the batches up to the detection skipped.
    starts = [i for i in range(1, len(log)) if log[i][0] <= log[i - 1][0]]
    step, position = log[starts[0]]
    assert step == target + 1
    assert position == dict(log[: starts[0]])[first["step"]] + 1
