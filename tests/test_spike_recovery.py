"""Injections, the detector and the recovery policies on a tiny model (model/spike/)."""

from __future__ import annotations

import dataclasses
import random
import tempfile
from pathlib import Path

import pytest
import torch

from model.callbacks import Callback
from model.detect import SpikeDetector, make_detector
from model.identity import LOADABLE
from model.spike.branch import run_branch, warm_up
from model.spike.injections import AdamSpike, DataSpike, Injection, poisoned_tokens
from model.spike.policies import SkipStep
from model.spike.records import cpu_copy
from model.step import PendingStep
from model.train import Load, Trainer
from tasks.spike.config import RecoveryConfig, SpikeConfig
from tasks.spike.study import branch_recovery
from tests.trainer_kit import markov_tokens, tiny_config

TOKENS, VAL = markov_tokens(30_000), markov_tokens(4_000, seed=1)
SPIKE = SpikeConfig(
    warm_steps=16, detect_window=16, detect_warmup=8, duration=2, poison_batches_range=[2, 2], magnitude=100.0
)
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
ONE_BATCH = dataclasses.replace(RECOVERY, skip_batches=1)
"""A rollback that skips no batch past the flagged one: its replay serves the batches the branch
would have met next, which at this tiny scale raise no false alarm at the detector's 6σ (further
on in the stream some do: tests of the rollback's steps and LR use it)."""
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


class AppliedLR(Callback):
    """The LR every step's update used (SP: every group's)."""

    name = "applied_lr"

    def __init__(self) -> None:
        self.log: list[tuple[int, float]] = []

    def on_before_optimizer(self, trainer, pending):
        self.log.append((pending.step, trainer.optimizer.param_groups[0]["lr"]))


class Served(Callback):
    """The inputs every step trains on, after any injection."""

    name, order = "served", 45

    def __init__(self) -> None:
        self.x: dict[int, torch.Tensor] = {}

    def on_batch(self, trainer, batches):
        self.x[trainer.step + 1] = batches[0][0].cpu()


def segments(log: list[tuple[int, float]]) -> list[list[tuple[int, float]]]:
    """A branch's per-step log cut where a restart goes back in steps."""
    cuts = [0, *(i for i in range(1, len(log)) if log[i][0] <= log[i - 1][0]), len(log)]
    return [log[a:b] for a, b in zip(cuts, cuts[1:])]


def rollback_targets(result) -> list[int]:
    return [
        int(a["action"].split("step ")[1].split(",")[0])
        for a in result.actions
        if a["action"].startswith("rolled back")
    ]


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


def branch(
    study,
    kind,
    policy,
    log=None,
    keep=None,
    steps=(),
    recovery=RECOVERY,
    until=ORIGIN + 12,
    tied_to="stream",
    extra=(),
    spike=SPIKE,
    poisoned=None,
):
    """One branch from the shared warm-up; ``poisoned``: the poison batches it holds (default
    ``spike.duration``)."""
    watch = [Positions(log if log is not None else [], keep if keep is not None else {}, steps), *extra]
    make = lambda cbs, d: Trainer(CFG, TOKENS, VAL, [*cbs, *watch], d)  # noqa: E731
    injection = None
    if kind is not None:
        injection = dataclasses.replace(Injection.from_config(kind, spike, ORIGIN, ORIGIN), tied_to=tied_to)
    return run_branch(
        make,
        study["origin"],
        until,
        policy,
        recovery,
        spike,
        injection,
        poison(spike.duration if poisoned is None else poisoned),
        study["timeline"],
        Path(tempfile.mkdtemp(prefix=f"{kind}-{policy}-", dir=study["root"])),
    )


def test_the_milestone_is_the_farthest_rollback_target_of_the_warm_up(study):
    steps = [s for s, _ in study["timeline"]]
    assert steps[0] == 1 and study["timeline"][0][1].name == "step_00000001.pt"  # the pretrain milestone
    assert steps == sorted(steps) and steps[-1] == ORIGIN


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


def test_skip_batch_stops_at_a_step_it_flags_mid_segment_and_restarts_from_the_state_before_it(study):
    log = []
    detected = branch(study, "lr", "skip_batch", log=log).detections[0]  # the LR spike shows a step late
    assert detected > ORIGIN + 1  # not the segment's first step: the state before it is a recent one
    first, restart = segments(log)[:2]
    assert first[-1][0] == detected and restart[0][0] == detected


def test_rollback_restores_an_earlier_checkpoint_skips_the_window_and_gives_up_at_the_retry_cap(study):
    log = []
    # An LR spike that lasts: every restart meets it again, so the branch must give up.
    lasting = SpikeConfig(**{**SPIKE.__dict__, "duration": 40, "magnitude": 300.0})
    result = branch(study, "lr", "rollback", log=log, spike=lasting, poisoned=0)
    rollbacks = [a for a in result.actions if a["action"].startswith("rolled back")]
    assert len(rollbacks) == RECOVERY.max_retries + 1
    assert result.status == "stopped" and "gave up" in result.stop_reason
    first, target = rollbacks[0], rollback_targets(result)[0]
    assert target <= first["step"] - RECOVERY.rollback_steps
    # The next segment starts at the target's step with the batches up to the detection skipped,
    # and the skip window after it (the batches skip_batch skips: PaLM skipped past the spike).
    starts = [i for i in range(1, len(log)) if log[i][0] <= log[i - 1][0]]
    step, position = log[starts[0]]
    assert step == target + 1
    assert position == dict(log[: starts[0]])[first["step"]] + RECOVERY.skip_batches


def test_rollback_skips_a_poisoned_stretch_as_long_as_the_skip_window_and_never_serves_it_again(study):
    # Poison on every batch of the skip window: a rollback that skipped only up to the flagged
    # batch would meet the rest of it and give up at the retry cap.
    n = RECOVERY.skip_batches
    stretch = SpikeConfig(**{**SPIKE.__dict__, "poison_batches_range": [n, n]})
    log: list = []
    result = branch(study, "data", "rollback", log=log, spike=stretch, poisoned=n)
    assert result.actions[0]["step"] == ORIGIN + 1  # the first poisoned batch is flagged
    first = result.actions[0]["action"]
    assert first.startswith("rolled back") and f"stream positions up to {ORIGIN + n - 1}:" in first
    poisoned = range(ORIGIN, ORIGIN + n)  # stream positions of the stretch
    replayed = [entry for segment in segments(log)[1:] for entry in segment]
    assert replayed and not any(position in poisoned for _, position in replayed)


@pytest.mark.parametrize("tied_to", ["stream", "step"])
def test_skip_batch_skips_a_stream_tied_lr_injection_but_a_step_tied_one_hits_the_replayed_steps(study, tied_to):
    log, lrs = [], AppliedLR()
    result = branch(study, "lr", "skip_batch", log=log, tied_to=tied_to, extra=[lrs])
    assert result.segments >= 2
    position, lr = dict(log), dict(lrs.log)  # a replayed step's values replace the abandoned ones
    injected_steps = range(ORIGIN + 1, ORIGIN + 1 + SPIKE.duration)
    replayed = [s for s in injected_steps if position[s] >= ORIGIN + SPIKE.duration]  # on batches past the window
    assert replayed
    factor = SPIKE.magnitude if tied_to == "step" else 1.0
    assert [lr[s] for s in replayed] == pytest.approx([CFG.optim.lr * factor] * len(replayed))


@pytest.mark.parametrize("policy", ["rollback", "skip_batch"])
def test_a_state_fault_is_cleared_by_going_back_to_a_clean_state_where_a_step_tied_one_is_met_again(study, policy):
    recovery = ONE_BATCH if policy == "rollback" else RECOVERY
    once = branch(study, "param", policy, tied_to="once", recovery=recovery)
    assert once.detections[0] == ORIGIN + 1
    assert once.segments == 2 and once.status == "completed"  # one restart, and the replay is clean
    again = branch(study, "param", policy, tied_to="step", recovery=recovery)
    assert again.status == "stopped" and "gave up" in again.stop_reason  # every replay meets it


class SecondMoments(Callback):
    """Adam's second moment of every weight matrix at the start of one step, after the injections
    (order 40) acted."""

    name, order = "second_moments", 41

    def __init__(self, step: int):
        self.step, self.v = step, {}

    def on_step_start(self, trainer):
        if trainer.step + 1 == self.step:
            self.v = {
                name: trainer.optimizer.state[p]["exp_avg_sq"].clone()
                for name, p in trainer.model.named_parameters()
                if p.dim() == 2
            }


def test_the_adam_injection_divides_only_its_blocks_second_moments_by_the_magnitude(study):
    injection = Injection.from_config("adam", SPIKE, ORIGIN, ORIGIN, tied_to="once")
    seen = SecondMoments(ORIGIN + 1)
    trainer = Trainer(CFG, TOKENS, VAL, [AdamSpike(injection), seen])
    path, state = study["origin"]
    trainer.load(cpu_copy(state), path, Load(), LOADABLE)
    before = {
        name: trainer.optimizer.state[p]["exp_avg_sq"].clone()
        for name, p in trainer.model.named_parameters()
        if p.dim() == 2
    }
    trainer.run(until=ORIGIN + 1)
    block = f"blocks.{SPIKE.param_block}."
    assert any(name.startswith(block) for name in before)
    for name, v in before.items():
        expected = v / SPIKE.magnitude if name.startswith(block) else v
        assert torch.equal(seen.v[name], expected), name


@pytest.mark.parametrize(("kind", "tied_to"), [("data", "step"), ("data", "once"), ("param", "sometimes")])
def test_an_injection_tie_outside_its_kinds_choices_is_refused_naming_both(kind, tied_to):
    with pytest.raises(ValueError, match=f"{kind} injection: tied_to='{tied_to}'"):
        Injection(kind, 1, 1, 2, 100.0, 0, tied_to)


def test_lower_lr_cuts_the_applied_lr_by_lr_factor_from_the_step_after_the_detection(study):
    lrs = AppliedLR()
    detected = branch(study, "data", "lower_lr", extra=[lrs]).detections[0]
    expected = [CFG.optim.lr * (1.0 if s <= detected else RECOVERY.lr_factor) for s in range(ORIGIN + 1, ORIGIN + 13)]
    assert [lr for _, lr in lrs.log] == pytest.approx(expected)


def test_each_rollback_goes_further_back_and_lowers_the_applied_lr_again(study):
    # A step-tied LR spike: every replay of its steps meets it again, so the branch rolls back twice.
    lrs = AppliedLR()
    result = branch(study, "lr", "rollback", tied_to="step", extra=[lrs], recovery=ONE_BATCH)
    first, second = rollback_targets(result)
    assert second < first  # the pass after the second meets the step-tied spike again (LR x lr_factor²): it may give up
    injected = range(ORIGIN + 1, ORIGIN + 1 + SPIKE.duration)
    for attempt, segment in enumerate(segments(lrs.log)):  # LR x lr_factor per rollback, compounding
        base = CFG.optim.lr * RECOVERY.lr_factor**attempt
        assert [lr for _, lr in segment] == pytest.approx(
            [base * (SPIKE.magnitude if s in injected else 1) for s, _ in segment]
        )
    assert [segment[0][0] for segment in segments(lrs.log)[1:]] == [first + 1, second + 1]


def test_palms_rollback_keeps_the_lr_so_it_meets_a_step_tied_pulse_on_every_replay_and_gives_up(study):
    # The study's ``rollback`` (PaLM §5.1): no LR cut, so the replayed steps meet the same pulse at
    # the same LR and the retry cap ends the branch; it cannot clear the pulse by lowering the LR.
    driver, settings = branch_recovery("rollback", ONE_BATCH)
    lrs = AppliedLR()
    result = branch(study, "lr", driver, tied_to="step", extra=[lrs], recovery=settings)
    assert result.status == "stopped" and "gave up" in result.stop_reason
    passes = segments(lrs.log)
    assert len(passes) == ONE_BATCH.max_retries + 2  # the first pass, every rollback, then the give-up
    injected = range(ORIGIN + 1, ORIGIN + 1 + SPIKE.duration)
    for segment in passes:
        met = [lr for s, lr in segment if s in injected]
        assert met and met == pytest.approx([CFG.optim.lr * SPIKE.magnitude] * len(met))  # the LR as it was


@pytest.mark.parametrize(
    ("policy", "driver", "lr_factor"),
    [
        ("rollback", "rollback", 1.0),
        ("rollback_lower_lr", "rollback", RECOVERY.lr_factor),
        ("lower_lr", "lower_lr", 0.5),
    ],
)
def test_each_study_policy_runs_the_drivers_policy_with_its_lr_factor(policy, driver, lr_factor):
    assert branch_recovery(policy, RECOVERY) == (driver, dataclasses.replace(RECOVERY, lr_factor=lr_factor))


def test_swap_data_serves_the_clean_batches_from_the_step_after_the_detection(study):
    swapped, clean = Served(), Served()
    detected = branch(study, "data", "swap_data", extra=[swapped]).detections[0]
    branch(study, None, "continue", extra=[clean])
    assert detected < ORIGIN + SPIKE.duration  # the poison window outlasts the detection
    assert torch.equal(swapped.x[detected], poison(1)[0][0])
    assert all(torch.equal(swapped.x[s], clean.x[s]) for s in range(detected + 1, ORIGIN + 13))


# ----------------------------------------------------------------------------------------------
# The detector and skip_step on given values (window 16, warmup 8, 6σ)
# ----------------------------------------------------------------------------------------------


def level(value: float, n: int, seed: int = 0) -> list[float]:
    """``n`` values around ``value`` (1 % noise)."""
    rng = random.Random(seed)
    return [value + 0.01 * value * rng.gauss(0, 1) for _ in range(n)]


def feed(losses: list[float], policy_cfg: RecoveryConfig | None = None):
    """Steps 1, 2, ... with these losses (a steady grad norm) through a detector and, with a
    config, skip_step after it; returns the detector, the policy and the vetoed steps."""
    detector = make_detector(SPIKE)
    policy = SkipStep(detector, policy_cfg) if policy_cfg else None
    vetoed = []
    for step, (loss, grad_norm) in enumerate(zip(losses, level(1.0, len(losses), seed=1)), start=1):
        pending = PendingStep(step, torch.tensor(loss), torch.tensor(0.0), torch.tensor(grad_norm), {})
        detector.on_before_optimizer(None, pending)
        if policy:
            policy.on_before_optimizer(None, pending)
        vetoed.append((step, pending.vetoed))
    return detector, policy, [step for step, v in vetoed if v]


@pytest.mark.parametrize(
    ("index", "ramp", "expected"),
    [(0, 8, 1), (6, 8, 7), (7, 8, 8), (8, 8, 8), (0, 3, 3), (2, 3, 8), (0, 0, 8), (5, 0, 8)],
)
def test_a_ramped_poison_takes_one_share_more_of_each_row_per_batch_up_to_the_whole_row(index, ramp, expected):
    assert poisoned_tokens(index, 8, ramp) == expected  # ramp 0: the whole row from the first batch


def test_a_ramped_poison_batch_keeps_each_rows_own_tokens_before_its_poisoned_end():
    clean = (torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long))
    poisoned = [(torch.full((2, 4), 7), torch.full((2, 4), 8))] * 3
    spike = DataSpike(Injection("data", 1, 0, 3, 1.0, ramp=2), poisoned)
    x, y = spike.mix(0, clean, torch.device("cpu"))
    assert x.tolist() == [[0, 0, 7, 7]] * 2 and y.tolist() == [[1, 1, 8, 8]] * 2  # inputs and targets alike
    assert spike.mix(1, clean, torch.device("cpu"))[0].tolist() == [[7] * 4] * 2  # the ramp's end: all poison
    assert spike.mix(2, clean, torch.device("cpu"))[0].tolist() == [[7] * 4] * 2


def test_the_detector_flags_every_step_of_a_multi_step_spike():
    detector, _, _ = feed(level(2.0, 20) + [4.0, 4.0, 4.0] + level(2.0, 5, seed=2))
    assert detector.flagged_steps() == [21, 22, 23]


def test_the_detector_catches_a_second_spike_as_its_baseline_kept_out_the_first():
    # Had 4.0 entered the 16-value window, mean + 6σ would be ~5 and the second spike missed.
    detector, _, _ = feed(level(2.0, 20) + [4.0] + level(2.0, 10, seed=2) + [4.0] + level(2.0, 3, seed=3))
    assert detector.flagged_steps() == [21, 32]


def test_the_detector_does_not_flag_a_sharp_loss_drop():
    detector, _, _ = feed(level(2.0, 20) + level(0.5, 20, seed=2))
    assert detector.flagged_steps() == []


def lagged(losses: list[float], lag: int, window: int = 16, warmup: int = 8) -> SpikeDetector:
    """A detector at 6σ with this lag fed steps 1, 2, ... with these losses and a grad norm of 1.0
    (constant: its σ is 0 and 1.0 is not above its mean, so only the loss can be flagged)."""
    detector = SpikeDetector(window=window, warmup=warmup, zscore=6.0, lag=lag)
    for step, loss in enumerate(losses, start=1):
        detector.on_before_optimizer(None, PendingStep(step, torch.tensor(loss), torch.tensor(0.0), ONE, {}))
    return detector


ONE = torch.tensor(1.0)
CLEAN = [1.9, 2.1] * 24  # 48 steps: any 16 of them have mean 2.0 and σ 0.103, so mean + 6σ = 2.62
FAST = [2.0 + 0.1 * k for k in range(1, 31)]  # crosses 2.62 at its 7th step (2.7): latency 6
SLOW = [2.0 + 0.025 * k for k in range(1, 121)]  # crosses 2.62 at its 25th step (2.625): latency 24


def first_flag(detector: SpikeDetector) -> int | None:
    """Steps after the clean stretch of the detector's first flag (1: the rise's first step)."""
    return next((step - len(CLEAN) for step in detector.flagged_steps()), None)


def test_a_rise_exactly_at_the_lagged_threshold_is_not_a_spike_and_one_just_above_it_is():
    # Window 3, warmup 3, lag 2: at step 6 the baseline is steps 1-3 (0, 2, 4: mean 2, σ 2, so
    # mean + 6σ = 14 exactly); steps 4 and 5 (8, 8: a rise in progress) wait in the lag.
    rise = [0.0, 2.0, 4.0, 8.0, 8.0]
    assert lagged([*rise, 14.0], lag=2, window=3, warmup=3).flagged_steps() == []
    assert lagged([*rise, 14.001], lag=2, window=3, warmup=3).flagged_steps() == [6]
    # Without the lag the baseline is 4, 8, 8 (mean + 6σ = 20.5): the rise has lifted it past 14.001.
    assert lagged([*rise, 14.001], lag=0, window=3, warmup=3).flagged_steps() == []


def test_a_rise_that_grows_through_the_threshold_lifts_a_trailing_baseline_and_is_never_flagged():
    assert first_flag(lagged(CLEAN + FAST, lag=0)) is None


def test_a_lagged_baseline_flags_a_rise_where_it_crosses_the_level_before_it():
    assert first_flag(lagged(CLEAN + FAST, lag=8)) == 7
    # Crossing at latency 24 with a lag of 24: its first step joins the baseline one step later.
    assert first_flag(lagged(CLEAN + SLOW, lag=24)) == 25


@pytest.mark.parametrize("lag", [8, 16])
def test_a_ramp_slower_than_the_lag_enters_the_baseline_and_is_never_flagged(lag):
    assert first_flag(lagged(CLEAN + SLOW, lag=lag)) is None


def test_a_detector_resumed_from_its_state_keeps_the_values_waiting_in_the_lag():
    whole = lagged(CLEAN + FAST, lag=8)
    first, rest = (CLEAN + FAST)[:52], (CLEAN + FAST)[52:]  # the rise's first 4 steps are in the lag
    resumed = SpikeDetector(window=16, warmup=8, zscore=6.0, lag=8)
    resumed.load_state_dict(lagged(first, lag=8).state_dict())
    for step, loss in enumerate(rest, start=len(first) + 1):
        resumed.on_before_optimizer(None, PendingStep(step, torch.tensor(loss), torch.tensor(0.0), ONE, {}))
    assert resumed.flagged_steps() == [s for s in whole.flagged_steps() if s > len(first)]
    assert resumed.detections() == whole.detections()


def test_a_detector_refuses_the_state_of_one_with_another_lag_naming_both_sizes():
    with pytest.raises(ValueError, match=r"saved window has 24 slots, this detector window \+ lag = 16 \+ 4"):
        SpikeDetector(window=16, warmup=8, lag=4).load_state_dict(lagged(CLEAN, lag=8).state_dict())


def test_after_a_rebaseline_a_lagged_detector_waits_for_lag_plus_warmup_values():
    detector = lagged(CLEAN, lag=8)
    detector.rebaseline(torch.tensor(True))  # step 48's value starts the window again
    # At step t the ring holds steps 48 ... t - 1, the newest 8 in the lag: t - 56 baseline values,
    # so the detector is armed (8) from step 64 on.
    for step in range(49, 65):
        pending = PendingStep(step, torch.tensor(9.0 if step == 63 else 2.0), torch.tensor(0.0), ONE, {})
        detector.on_before_optimizer(None, pending)
    assert detector.flagged_steps() == []  # step 63's jump came with 7 baseline values: not armed
    detector.on_before_optimizer(None, PendingStep(65, torch.tensor(9.0), torch.tensor(0.0), ONE, {}))
    assert detector.flagged_steps() == [65]


def test_skip_step_lets_a_level_shift_through_after_the_veto_cap_and_still_vetoes_a_later_spike():
    # The loss settles 50 % higher at step 21; a spike at step 51, after the re-based warm-up.
    cfg = RecoveryConfig(max_consecutive_vetoes=4)
    detector, policy, vetoed = feed(level(2.0, 20) + level(3.0, 30, seed=2) + [6.0] + level(3.0, 3, seed=3), cfg)
    assert vetoed == [21, 22, 23, 24, 51]
    assert detector.flagged_steps() == [21, 22, 23, 24, 25, 51]
    policy.on_train_end({})
    assert [a["action"].startswith("let through") for a in policy.actions] == [False] * 4 + [True, False]
