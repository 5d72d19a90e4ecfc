"""Checkpoints: bitwise resume, fallback from corruption, atomic writes, weights_only, retention,
and SIGTERM save-and-resume in a real process."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from trainer_kit import Recorder, float_bits, markov_tokens, tiny_config

from model.callbacks import Callback, CSVLogger
from model.checkpoint import capture_rng, list_checkpoints, load_checkpoint, load_latest, restore_rng, save_checkpoint
from model.stops import EXIT_CODES, Preempted
from model.train import main, train

ROOT = Path(__file__).resolve().parents[1]
TOKENS, VAL = np.split(markov_tokens(24_000, vocab=64), [20_000])


class StopAt(Callback):
    """Asks the loop to stop after step ``step``, as SIGTERM during that step does."""

    def __init__(self, step: int):
        self.step = step

    def on_step_start(self, trainer) -> None:
        if trainer.step + 1 == self.step:
            trainer.signalled = True


def _identity_of(checkpoint_dir: Path) -> str:
    """The run identity recorded in the newest checkpoint file that loads."""
    for _, path in reversed(list_checkpoints(checkpoint_dir)):
        try:
            return load_checkpoint(path)["identity"]
        except Exception:
            continue
    raise AssertionError(f"no loadable checkpoint in {checkpoint_dir}")


def _logged(rec: Recorder) -> list[tuple[int, str, float]]:
    """Every logged value except throughput, which is wall-clock."""
    return [(step, k, v) for step, m in rec.logs for k, v in sorted(m.items()) if k != "train/tokens_per_s"]


@pytest.mark.parametrize("mode", ["fp32", "fp16"])
def test_stopped_and_resumed_run_is_bitwise_identical_to_uninterrupted_run(tmp_path, mode):
    # Dropout exercises the RNG; log_every=2 with a stop at step 5 resumes mid log interval.
    cfg = tiny_config(
        **{
            "train.steps": 8,
            "train.log_every": 2,
            "train.layer_stats_every": 3,
            "train.eval_every": 4,
            "model.dropout": 0.1,
            "precision.mode": mode,
            "precision.emulate": "always",
            "checkpoint.every_steps": 3,
        }
    )
    straight = Recorder()
    train(cfg, TOKENS, VAL, tmp_path / "straight", [straight, CSVLogger(tmp_path / "straight_csv")])

    first, second = Recorder(), Recorder()
    with pytest.raises(Preempted) as stopped:
        train(cfg, TOKENS, VAL, tmp_path / "resumed", [first, CSVLogger(tmp_path / "resumed_csv"), StopAt(5)])
    assert stopped.value.code == EXIT_CODES["preempted"] and stopped.value.step == 5
    summary = train(cfg, TOKENS, VAL, tmp_path / "resumed", [second, CSVLogger(tmp_path / "resumed_csv")])
    assert summary["start_step"] == 5 and summary["steps"] == 8

    a, b = _logged(straight), _logged(first) + _logged(second)
    assert [(s, k) for s, k, _ in a] == [(s, k) for s, k, _ in b]
    assert float_bits([v for *_, v in a]) == float_bits([v for *_, v in b])
    final_a = load_checkpoint(tmp_path / "straight/checkpoints/step_00000008.pt")["model"]
    final_b = load_checkpoint(tmp_path / "resumed/checkpoints/step_00000008.pt")["model"]
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)
    # The CSV of the resumed run has each step once, with the straight run's losses.
    rows = lambda d: [(r.split(",")[0], r.split(",")[1]) for r in (d / "train.csv").read_text().splitlines()]
    assert rows(tmp_path / "resumed_csv") == rows(tmp_path / "straight_csv")


def test_fp16_resume_after_the_loss_scale_moved_is_bitwise_the_straight_run(tmp_path):
    # From 2^20 the scale backs off twice, then grows after every 3 clean steps: stopped at step
    # 4 it has moved and is 2 clean steps into an interval, so the resume must restore both.
    cfg = tiny_config(
        **{
            "train.steps": 9,
            "precision.mode": "fp16",
            "precision.emulate": "always",
            "precision.init_scale": 2.0**20,
            "precision.growth_interval": 3,
        }
    )
    straight, first, second = Recorder(), Recorder(), Recorder()
    train(cfg, TOKENS, VAL, tmp_path / "straight", [straight])
    with pytest.raises(Preempted):
        train(cfg, TOKENS, VAL, tmp_path / "resumed", [first, StopAt(4)])
    saved = load_checkpoint(tmp_path / "resumed/checkpoints/step_00000004.pt")["scaler"]
    assert saved["scale"] < 2.0**20 and saved["_growth_tracker"] == 2
    train(cfg, TOKENS, VAL, tmp_path / "resumed", [second])

    scales = lambda rec: [v for _, v in rec.series("train/loss_scale")]  # noqa: E731
    assert scales(first) + scales(second) == scales(straight)
    assert max(scales(straight)[4:]) > saved["scale"]  # it grew after the resume point
    a, b = (load_checkpoint(tmp_path / f"{run}/checkpoints/step_00000009.pt") for run in ("straight", "resumed"))
    assert a["scaler"] == b["scaler"]
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


CORRUPTION_CFG = {"train.steps": 6, "checkpoint.every_steps": 2, "checkpoint.keep_last": 3}


def _run_with_checkpoints_at_2_4_6(tmp_path: Path) -> Path:
    train(tiny_config(**CORRUPTION_CFG), TOKENS, VAL, tmp_path, [CSVLogger(tmp_path / "csv")])
    return tmp_path / "checkpoints"


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _drop_sidecar(path: Path) -> None:
    path.with_name(path.name + ".sha256").unlink()


@pytest.mark.parametrize("corrupt", [_truncate, _flip_a_byte, _drop_sidecar])
def test_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys, corrupt):
    ckpt_dir = _run_with_checkpoints_at_2_4_6(tmp_path)
    assert [s for s, _ in list_checkpoints(ckpt_dir)] == [2, 4, 6]
    corrupt(ckpt_dir / "step_00000006.pt")
    capsys.readouterr()

    path, payload = load_latest(ckpt_dir, load_checkpoint(ckpt_dir / "step_00000002.pt")["identity"])
    assert path.name == "step_00000004.pt" and payload["step"] == 4
    assert "step_00000006.pt is unusable" in capsys.readouterr().err

    summary = train(tiny_config(**CORRUPTION_CFG), TOKENS, VAL, tmp_path, [CSVLogger(tmp_path / "csv")])
    assert summary["start_step"] == 4 and summary["steps"] == 6
    assert load_checkpoint(ckpt_dir / "step_00000006.pt")["step"] == 6  # rewritten, valid again
    # Rows 5 and 6 of the first run were dropped at the resume and written again, once.
    steps = [line.split(",")[0] for line in (tmp_path / "csv/train.csv").read_text().splitlines()[1:]]
    assert steps == ["1", "2", "3", "4", "5", "6"]


def test_failed_checkpoint_write_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    good = tmp_path / "step_00000001.pt"
    save_checkpoint(good, {"step": 1, "w": torch.arange(4.0)})

    def disk_full(obj, f):
        f.write(b"half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    for target in (tmp_path / "step_00000002.pt", good):  # a new step, and re-saving the same step
        with pytest.raises(OSError):
            save_checkpoint(target, {"step": 2})
    monkeypatch.undo()

    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001.pt", "step_00000001.pt.sha256"]
    assert torch.equal(load_checkpoint(good)["w"], torch.arange(4.0))


def test_checkpoint_loads_with_weights_only_and_restores_every_rng(tmp_path):
    cfg = tiny_config(**{"train.steps": 3, "precision.mode": "fp16", "precision.emulate": "always"})
    train(cfg, TOKENS, VAL, tmp_path)
    payload = torch.load(tmp_path / "checkpoints/step_00000003.pt", weights_only=True)
    assert payload["step"] == 3 and payload["loader"]["batches_served"] == 3
    assert {"model", "optimizer", "scaler", "rng", "telemetry", "callbacks", "config"} <= set(payload)
    assert payload["scaler"]["scale"] > 0 and payload["config"]["precision"]["mode"] == "fp16"

    path = tmp_path / "rng.pt"
    save_checkpoint(path, {"rng": capture_rng()})
    expected = (torch.rand(3), np.random.rand(3), random.random())
    restore_rng(torch.load(path, weights_only=True)["rng"])
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(expected[0], again[0]) and np.array_equal(expected[1], again[1])
    assert expected[2] == again[2]


def test_keeps_the_last_k_rolling_checkpoints_and_every_milestone(tmp_path):
    # every_minutes tiny: a wall-clock save is due after every step.
    cfg = tiny_config(
        **{"train.steps": 10, "checkpoint.every_minutes": 1e-9, "checkpoint.keep_last": 2, "checkpoint.milestones": [3]}
    )
    train(cfg, TOKENS, VAL, tmp_path)
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoints")] == [3, 9, 10]
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if ".tmp" in p.name]


HARNESS = """
import sys, time
from model.callbacks import Callback, ProgressBar
from tasks.config import load_config
from model.data import open_tokens
from model.train import train

class Slow(Callback):  # keeps the run alive long enough to be signalled
    def on_step_end(self, trainer):
        time.sleep(0.05)

params, train_path, val_path, out = sys.argv[1:]
train(load_config(params), open_tokens(train_path, "uint16"), open_tokens(val_path, "uint16"), out,
      [ProgressBar(), Slow()])
"""


def test_sigterm_saves_a_checkpoint_exits_75_and_a_rerun_resumes_to_the_end(tmp_path, capsys):
    cfg = tiny_config(**{"train.steps": 60})
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(dataclasses.asdict(cfg)))
    TOKENS.tofile(tmp_path / "train.bin")
    VAL.tofile(tmp_path / "val.bin")
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [str(params), str(tmp_path / "train.bin"), str(tmp_path / "val.bin"), str(out)]

    proc = subprocess.Popen(
        [sys.executable, "-c", HARNESS, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stdout:  # not a TTY: one plain line per logged step
        if line.startswith("step 3/"):
            proc.send_signal(signal.SIGTERM)
            break
    proc.stdout.read()
    assert proc.wait(timeout=60) == EXIT_CODES["preempted"], proc.stderr.read()
    path, payload = load_latest(out / "checkpoints", _identity_of(out / "checkpoints"))
    assert 3 <= payload["step"] < 60 and path.name == f"step_{payload['step']:08d}.pt"

    capsys.readouterr()
    # The rerun goes through the CLI, in this process (a second interpreter start costs seconds).
    assert main(["--params", str(params), "--train-tokens", args[1], "--val-tokens", args[2], "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert f"loaded {path} at step {payload['step']}" in printed.err
    summary = json.loads(printed.out[printed.out.index("{") :])
    assert summary["start_step"] == payload["step"] and summary["steps"] == 60
