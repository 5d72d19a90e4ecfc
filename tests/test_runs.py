"""Runs you can trust and intervene in: the step hooks (batch replacement and dropping, veto,
composed scales), named callback state, explicit and selective loading, identity-checked resume,
the run lock, typed stops, error/close hooks and the precision path."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from trainer_kit import Recorder, markov_tokens, tiny_config

from model import precision as precision_mod
from model.callbacks import Callback
from model.checkpoint import RunLock, RunLocked, list_checkpoints, load_checkpoint
from model.config import PrecisionConfig
from model.stops import EXIT_CODES
from model.train import Load, Trainer, main, train
from model.typed_config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
REPO = Path(__file__).resolve().parents[1]
TOKENS, VAL = np.split(markov_tokens(24_000, vocab=64), [20_000])


def weights_and_adam(trainer: Trainer):
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    return weights, copy.deepcopy(trainer.optimizer.state_dict()["state"])


def assert_same_state(a, b) -> None:
    (w0, adam0), (w1, adam1) = a, b
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    assert adam0.keys() == adam1.keys()
    for p in adam0:
        for k in adam0[p]:
            assert torch.equal(adam0[p][k], adam1[p][k]), (p, k)


# -- hooks ---------------------------------------------------------------------------------------


class ReplaceBatchAt(Callback):
    """Replaces step ``at``'s batches with a constant-token batch; checks the loss the step saw."""

    def __init__(self, at: int):
        self.at = at

    def on_batch(self, trainer, batches):
        if trainer.step + 1 != self.at:
            return None
        x = torch.full_like(batches[0][0], 7)
        self.injected = [(x, x.clone())]
        with torch.no_grad():
            self.expected = trainer.model(x, x)[1]
        return self.injected

    def on_before_optimizer(self, trainer, pending):
        if pending.step == self.at:
            self.seen = pending.loss.clone()


def test_a_batch_hook_replaces_the_step_batches():
    hook = ReplaceBatchAt(3)
    train(tiny_config(**{"train.steps": 4}), TOKENS, VAL, callbacks=[hook])
    assert torch.equal(hook.seen, hook.expected)


class DropBatchesAt(Callback):
    def __init__(self, at: int):
        self.at = at

    def on_batch(self, trainer, batches):
        if trainer.step + 1 == self.at:
            self.position = trainer.loader.state_dict()["batches_served"]
            self.before = weights_and_adam(trainer)
            return []
        return None

    def on_step_end(self, trainer):
        if trainer.step == self.at:
            self.after = weights_and_adam(trainer)
            self.position_after = trainer.loader.state_dict()["batches_served"]


def test_dropping_every_batch_skips_the_step_and_the_stream_moves_on():
    hook = DropBatchesAt(3)
    summary = train(tiny_config(**{"train.steps": 5, "train.grad_accum": 2}), TOKENS, VAL, callbacks=[hook])
    assert_same_state(hook.before, hook.after)
    assert hook.position_after == hook.position  # the two batches were drawn before the hook
    assert summary["vetoed"] == 1 and summary["skipped"] == 0 and summary["steps"] == 5


class VetoWhen(Callback):
    """Vetoes step ``at`` through a device-side condition; records state around it and the
    loader position (which advances: the vetoed batches are consumed, not replayed)."""

    def __init__(self, at: int):
        self.at = at

    def on_before_optimizer(self, trainer, pending):
        if pending.step == self.at:
            self.before = weights_and_adam(trainer)
            self.position = trainer.loader.state_dict()["batches_served"]
            pending.veto(pending.grad_norm > 0)  # a tensor: no host sync

    def on_step_end(self, trainer):
        if trainer.step == self.at:
            self.after = weights_and_adam(trainer)
        if trainer.step == self.at + 1:
            self.position_next = trainer.loader.state_dict()["batches_served"]


@pytest.mark.parametrize("implementation", ["auto", "foreach"])
def test_a_veto_leaves_weights_and_adam_state_bitwise_untouched(implementation):
    hook = VetoWhen(4)
    cfg = tiny_config(**{"train.steps": 6, "optim.implementation": implementation})
    summary = train(cfg, TOKENS, VAL, callbacks=[hook])
    assert_same_state(hook.before, hook.after)
    assert hook.position_next == hook.position + 1  # step 5 reads the batch after the vetoed one
    assert summary["vetoed"] == 1 and summary["skipped"] == 0


class Scale(Callback):
    def __init__(self, name: str, lr: float = 1.0, grad: float = 1.0):
        self.name, self.lr, self.grad = name, lr, grad

    def on_step_start(self, trainer):
        trainer.scale_lr(self.lr)
        trainer.scale_grad(self.grad)


class FirstGradNorm(Callback):
    def on_before_optimizer(self, trainer, pending):
        if pending.step == 1:
            self.value = pending.grad_norm.item()


def test_lr_and_gradient_scales_of_several_callbacks_multiply():
    cfg = tiny_config(**{"train.steps": 3, "optim.grad_clip": 0.0})
    plain, scaled = Recorder(), Recorder()
    g_plain, g_scaled = FirstGradNorm(), FirstGradNorm()
    train(cfg, TOKENS, VAL, callbacks=[plain, g_plain])
    train(
        cfg,
        TOKENS,
        VAL,
        callbacks=[scaled, g_scaled, Scale("spike", lr=3.0, grad=2.0), Scale("policy", lr=0.5, grad=3.0)],
    )
    assert [v for _, v in scaled.series("train/lr")] == pytest.approx(
        [1.5 * v for _, v in plain.series("train/lr")], rel=1e-12
    )
    assert g_scaled.value == pytest.approx(6.0 * g_plain.value, rel=1e-5)


class Counter(Callback):
    order = 60

    def __init__(self, name: str):
        self.name, self.count = name, 0

    def on_after_step(self, trainer, result):
        self.count += 1

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def test_callback_state_is_saved_and_restored_by_name(tmp_path):
    cfg = tiny_config(**{"train.steps": 4, "checkpoint.every_steps": 2})
    train(cfg, TOKENS, VAL, tmp_path, [Counter("a"), Counter("b")])
    state = load_checkpoint(tmp_path / "checkpoints/step_00000004.pt")["callbacks"]
    assert state["a"] == {"count": 4} and state["b"] == {"count": 4}
    # Resumed in another order, each gets its own state back.
    b, a = Counter("b"), Counter("a")
    trainer = Trainer(cfg.replace(**{"train.steps": 4}), TOKENS, VAL, [b, a], tmp_path / "checkpoints")
    trainer.resume()
    assert (a.count, b.count) == (4, 4)
    with pytest.raises(ValueError, match="distinct names.*a"):
        Trainer(cfg, TOKENS, VAL, [Counter("a"), Counter("a")])


# -- loading -------------------------------------------------------------------------------------


def test_selective_loading_applies_the_current_beta2_after_the_optimizer_state(tmp_path):
    cfg = tiny_config(**{"train.steps": 4, "checkpoint.every_steps": 4})
    train(cfg, TOKENS, VAL, tmp_path)
    source = tmp_path / "checkpoints/step_00000004.pt"
    saved = load_checkpoint(source)

    changed = cfg.replace(**{"optim.beta2": 0.999, "optim.weight_decay": 0.0, "optim.eps": 1e-6, "train.steps": 8})
    trainer = Trainer(changed, TOKENS, VAL)
    trainer.start_from(source)
    for group in trainer.optimizer.param_groups:
        assert group["betas"] == (0.9, 0.999) and group["eps"] == 1e-6 and group["weight_decay"] == 0.0
    state = trainer.optimizer.state_dict()["state"]
    assert all(torch.equal(state[i]["exp_avg_sq"], saved["optimizer"]["state"][i]["exp_avg_sq"]) for i in state)
    assert trainer.step == 4 and trainer.loader.state_dict() == saved["loader"]

    weights_only = Trainer(changed, TOKENS, VAL)
    weights_only.start_from(source, Load.weights_only())
    assert weights_only.step == 0 and not weights_only.optimizer.state
    assert all(torch.equal(v, saved["model"][k]) for k, v in weights_only.model.state_dict().items())


def test_starting_from_a_checkpoint_of_another_architecture_is_refused_naming_the_keys(tmp_path):
    cfg = tiny_config(**{"train.steps": 2, "checkpoint.every_steps": 2})
    train(cfg, TOKENS, VAL, tmp_path)
    wider = Trainer(cfg.replace(**{"model.d_model": 64}), TOKENS, VAL)
    with pytest.raises(ConfigError, match=r"model.d_model \(32 -> 64\)"):
        wider.start_from(tmp_path / "checkpoints/step_00000002.pt")


@pytest.mark.parametrize("foreign", ["same_shapes", "other_shapes"])
def test_a_foreign_checkpoint_is_passed_over_and_the_previous_valid_one_resumed(tmp_path, capsys, foreign):
    cfg = tiny_config(**{"train.steps": 6, "checkpoint.every_steps": 2, "checkpoint.keep_last": 5})
    train(cfg, TOKENS, VAL, tmp_path / "mine", callbacks=[])
    other = cfg.replace(
        **({"train.seed": 1} if foreign == "same_shapes" else {"model.d_model": 64}), **{"train.steps": 8}
    )
    train(other, TOKENS, VAL, tmp_path / "theirs")
    mine = tmp_path / "mine/checkpoints"
    for f in ("step_00000006.pt", "step_00000006.pt.sha256"):  # as if killed before step 6 was saved
        (mine / f).unlink()
    for f in ("step_00000008.pt", "step_00000008.pt.sha256"):
        shutil.copy(tmp_path / "theirs/checkpoints" / f, mine)
    capsys.readouterr()

    summary = train(cfg, TOKENS, VAL, tmp_path / "mine")
    assert summary["status"] == "completed" and summary["start_step"] == 4 and summary["steps"] == 6
    err = capsys.readouterr().err
    assert "step_00000008.pt is unusable: belongs to run" in err


# -- the lock ------------------------------------------------------------------------------------

HOLDER = """
import sys, time
from model.checkpoint import RunLock
with RunLock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(60)
"""


def test_one_writer_per_run_directory_and_a_killed_holder_releases_it(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunLocked, match=f"pid {holder.pid}"), RunLock(tmp_path):
            pass
        cfg = tiny_config(**{"train.steps": 2})
        with pytest.raises(RunLocked):
            train(cfg, TOKENS, VAL, tmp_path)
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        with RunLock(tmp_path):  # taken over at once, no manual cleanup
            pass
    finally:
        holder.kill()


def test_orphaned_temporary_files_of_interrupted_writes_are_removed(tmp_path):
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    orphan = ckpt / ".step_00000002.pt.tmp99999"
    orphan.write_bytes(b"half")
    train(tiny_config(**{"train.steps": 2}), TOKENS, VAL, tmp_path)
    assert not orphan.exists()


# -- typed stops ---------------------------------------------------------------------------------


class NaNGradients(Callback):
    def on_step_start(self, trainer):
        trainer.scale_grad(float("nan"))


def test_a_run_whose_every_step_is_non_finite_ends_diverged_without_corrupting_weights(tmp_path):
    cfg = tiny_config(**{"train.steps": 12, "train.diverge_after": 3, "train.log_every": 1})
    trainer = Trainer(cfg, TOKENS, VAL, [NaNGradients()], tmp_path / "checkpoints")
    summary = trainer.run()
    assert summary["status"] == "diverged" and summary["diverged_at"] == 3 and summary["steps"] == 3
    assert "diverged at step 3" in summary["stop_reason"]
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoints")] == [3]


def test_an_fp16_run_whose_loss_scale_collapses_ends_diverged_not_completed(tmp_path):
    # Every step overflows, so the scaler skips it and halves its scale: the weights are frozen.
    cfg = tiny_config(
        **{
            "train.steps": 12,
            "train.diverge_after": 3,
            "train.log_every": 1,
            "precision.mode": "fp16",
            "precision.emulate": "always",
        }
    )
    summary = Trainer(cfg, TOKENS, VAL, [NaNGradients()], tmp_path / "checkpoints").run()
    assert summary["overflows"] == 3 and summary["skipped"] == 0
    assert summary["status"] == "diverged" and summary["diverged_at"] == 3


def test_the_torch_only_cli_exits_with_the_diverged_code(tmp_path):
    cfg = tiny_config(**{"train.steps": 4})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(dataclasses.asdict(cfg)))
    TOKENS.tofile(tmp_path / "train.bin")
    VAL.tofile(tmp_path / "val.bin")
    code = main(
        [
            "--params",
            str(tmp_path / "params.yaml"),
            "--train-tokens",
            str(tmp_path / "train.bin"),
            "--val-tokens",
            str(tmp_path / "val.bin"),
            "--out",
            str(tmp_path / "run"),
            "--set",
            "train.diverge_loss=1.0",
        ]
    )
    assert code == EXIT_CODES["diverged"] == 3


class StopAfter(Callback):
    def __init__(self, step: int):
        self.step = step

    def on_after_step(self, trainer, result):
        if trainer.step == self.step:
            trainer.request_stop("policy gave up: retry cap reached")


def test_a_callback_stop_is_a_typed_stop_with_its_reason_not_a_preemption(tmp_path):
    cfg = tiny_config(**{"train.steps": 8})
    summary = train(cfg, TOKENS, VAL, tmp_path, [StopAfter(3)])
    assert summary["status"] == "stopped" and summary["steps"] == 3
    assert summary["stop_reason"] == "policy gave up: retry cap reached"
    assert EXIT_CODES["stopped"] not in (0, EXIT_CODES["preempted"])
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoints")] == [3]


class Explodes(Callback):
    def __init__(self):
        self.events = []

    def on_after_step(self, trainer, result):
        if trainer.step == 2:
            raise RuntimeError("boom")

    def on_train_end(self, summary):
        self.events.append("train_end")

    def on_error(self, trainer, error):
        self.events.append(f"error:{error}")

    def on_close(self, trainer):
        self.events.append("close")


def test_an_exception_fires_on_error_then_on_close():
    cb = Explodes()
    with pytest.raises(RuntimeError, match="boom"):
        train(tiny_config(**{"train.steps": 4}), TOKENS, VAL, callbacks=[cb])
    assert cb.events == ["error:boom", "close"]


def test_an_unavailable_device_is_a_config_error_naming_the_key():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="train.device: 'cuda' is not available here"):
        Trainer(tiny_config(**{"train.device": "cuda"}), TOKENS, VAL)


# -- precision -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, mode, expect",
    [
        ({"avx512_bf16"}, "bf16", "bf16 (autocast, AVX512-BF16)"),
        ({"avx2"}, "bf16", "bf16 (emulated)"),
        ({"avx512_bf16"}, "fp16", "fp16 (emulated, loss scaling)"),
        ({"amx_fp16"}, "fp16", "fp16 (autocast, AMX-FP16, loss scaling)"),
    ],
)
def test_emulate_auto_uses_real_autocast_where_the_cpu_has_the_type(monkeypatch, flags, mode, expect):
    monkeypatch.setattr(precision_mod, "cpu_flags", lambda: frozenset(flags))
    chosen = precision_mod.resolve_precision(PrecisionConfig(mode=mode, numerics="native"), "cpu")
    assert chosen.describe() == expect


# -- detection -----------------------------------------------------------------------------------


class GradSpikeAt(Callback):
    def __init__(self, at: int, factor: float):
        self.at, self.factor = at, factor

    def on_step_start(self, trainer):
        if trainer.step + 1 == self.at:
            trainer.scale_grad(self.factor)


def test_the_detector_catches_an_injected_gradient_spike_and_stays_silent_without_one(tmp_path):
    from model.detect import SpikeDetector

    cfg = tiny_config(**{"train.steps": 40, "optim.grad_clip": 1.0, "checkpoint.every_steps": 20})
    quiet, spiked = SpikeDetector(window=16, warmup=8), SpikeDetector(window=16, warmup=8)
    train(cfg, TOKENS, VAL, tmp_path / "quiet", [quiet])
    assert quiet.detections()["first"] is None
    train(cfg, TOKENS, VAL, tmp_path / "spiked", [spiked, GradSpikeAt(30, 1000.0)])
    found = spiked.detections()
    assert found["first"] == 30 and found["ratio"] >= 1 and found["zscore"] >= 1
    # Its window and counts are checkpoint state: a resume carries them on.
    resumed = SpikeDetector(window=16, warmup=8)
    trainer = Trainer(cfg, TOKENS, VAL, [resumed, GradSpikeAt(30, 1000.0)], tmp_path / "spiked/checkpoints")
    trainer.resume()
    assert resumed.detections() == found


def test_the_bare_trainer_on_the_studys_params_needs_no_study_key(tmp_path):
    """params.yaml pins milestones and a spike step past 20 steps; those are the study's rules
    (tasks/config.py), not the trainer's, so a short bare run needs only the key it changes."""
    rng = np.random.default_rng(0)
    for split in ("train", "val"):  # ids below 257: any vocabulary holds the bytes
        rng.integers(0, 257, 60_000, dtype=np.uint16).tofile(tmp_path / f"{split}.bin")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "model.train",
            "--train-tokens",
            str(tmp_path / "train.bin"),
            "--val-tokens",
            str(tmp_path / "val.bin"),
            "--out",
            str(tmp_path / "run"),
            "--set",
            "train.steps=20",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout[done.stdout.index("{\n") :])  # after the progress lines
    assert summary["status"] == "completed" and summary["steps"] == 20
    assert [s for s, _ in list_checkpoints(tmp_path / "run" / "checkpoints")] == [20]


@pytest.mark.parametrize("bad", ["train.steps", "=20"])
def test_the_bare_trainer_refuses_a_set_without_key_and_value(tmp_path, capsys, bad):
    code = main(["--train-tokens", "x", "--val-tokens", "y", "--out", str(tmp_path), "--set", bad])
    assert code == 2 and "expected key=value" in capsys.readouterr().err
