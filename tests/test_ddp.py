"""Pretraining under torchrun DDP (gloo on CPU, 2 ranks): the same curve as one process with the
global batch, rank 0 alone writes, resume, and decisions taken by every rank at the same step.

Each torchrun is bounded in time and its process group killed in a ``finally``."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import yaml
from trainer_kit import Recorder, float_bits, markov_tokens, tiny_config

from model.checkpoint import list_checkpoints, load_checkpoint
from model.train import train
from tests.test_services import free_port

pytestmark = [
    pytest.mark.scaleout,
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()),
        reason="torch.distributed with the gloo backend is not in this torch build",
    ),
]

ROOT = Path(__file__).resolve().parents[1]
TOKENS, VAL = np.split(markov_tokens(24_000, vocab=64), [20_000])
STEPS = 20
CFG = tiny_config(
    **{
        "train.steps": STEPS,
        "train.batch_size": 8,  # the global batch: 4 per rank
        "train.eval_every": 10,
        "checkpoint.every_steps": 5,
    }
)
TOLERANCE = 1e-5  # relative, fp32: per-rank means averaged vs one mean, then 20 steps of AdamW
TORCHRUN_TIMEOUT_S = 90

HARNESS = """
import json, sys
from model.callbacks import Callback
from model.data import open_tokens
from model.distributed import init_world, leave_world
from model.stops import EXIT_CODES, RunEnded
from model.train import train
from tasks.config import load_config

class OnOneRank(Callback):  # actions "rank:step:what,...": what happens to one rank alone at a step
    def __init__(self, world, actions):
        self.mine = {(int(s), what) for r, s, what in (a.split(":") for a in actions.split(",")) if int(r) == world.rank}
        self.losses, self.summary = [], None
    def on_step_start(self, trainer):
        if (trainer.step + 1, "signal") in self.mine:
            trainer.signalled = True  # as SIGTERM reaching this rank only
        if (trainer.step + 1, "nan") in self.mine:  # this rank's data goes bad from here on
            trainer.model.readout.register_forward_hook(lambda module, inputs, out: out * float("nan"))
    def on_after_step(self, trainer, result):
        self.losses.append(result.loss.item())
    def on_step_end(self, trainer):
        if (trainer.step, "stop") in self.mine:
            trainer.request_stop(f"asked on rank {trainer.world.rank}")
    def on_train_end(self, summary):
        self.summary = summary

params, train_path, val_path, out, actions = sys.argv[1:]
world = init_world("cpu")
probe = OnOneRank(world, actions)
try:
    train(load_config(params), open_tokens(train_path, "uint16"), open_tokens(val_path, "uint16"), out, [probe])
except RunEnded:
    pass
finally:
    leave_world()
seen = {k: probe.summary[k] for k in ("status", "steps", "stop_reason", "diverged_at", "skipped")}
with open(f"{out}.rank{world.rank}.json", "w") as f:
    json.dump({**seen, "losses": probe.losses}, f)
sys.exit(EXIT_CODES[seen["status"]])
"""


def torchrun(target: list[str], logs: Path, nproc: int = 2) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nproc`` on loopback, each rank's stdout/stderr in ``logs``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc)),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"),
        *("--log-dir", str(logs), "--redirects", "3", *target),
    ]
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=TORCHRUN_TIMEOUT_S)  # a hung collective fails here
        return subprocess.CompletedProcess(command, proc.returncode, out)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks
            proc.wait()


def rank_output(logs: Path, rank: int, stream: str = "stdout") -> str:
    (path,) = logs.glob(f"*/attempt_0/{rank}/{stream}.log")
    return path.read_text()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ddp")
    (d / "params.yaml").write_text(yaml.safe_dump(dataclasses.asdict(CFG)))
    TOKENS.tofile(d / "train.bin")
    VAL.tofile(d / "val.bin")
    return d


def cli(d: Path, out: str) -> list[str]:
    files = ("--params", str(d / "params.yaml"), "--train-tokens", str(d / "train.bin"), "--val-tokens")
    return ["-m", "model.train", *files, str(d / "val.bin"), "--out", str(d / out)]


def harness(d: Path, out: str, actions: str, params: str = "params.yaml") -> list[str]:
    script = d / "harness.py"
    script.write_text(HARNESS)
    return [str(script), *(str(d / name) for name in (params, "train.bin", "val.bin", out)), actions]


def seen_by_each_rank(d: Path, out: str) -> list[dict]:
    return [json.loads((d / f"{out}.rank{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def straight(inputs) -> Path:
    """The uninterrupted 2-rank run, through the CLI."""
    done = torchrun(cli(inputs, "straight"), inputs / "logs-straight")
    assert done.returncode == 0, done.stdout
    return inputs / "straight"


def csv_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_two_ranks_follow_the_loss_curve_of_one_process_with_the_global_batch(inputs, straight):
    one = Recorder()
    train(CFG, TOKENS, VAL, inputs / "single", [one])
    for key, file in (("train/loss", "train.csv"), ("val/loss", "val.csv")):
        single = one.series(key)
        ddp = [(int(r["step"]), float(r["loss"])) for r in csv_rows(straight / "plots" / file)]
        assert [s for s, _ in ddp] == [s for s, _ in single]
        worst = max(abs(a - b) / abs(a) for (_, a), (_, b) in zip(single, ddp))
        assert worst < TOLERANCE, f"{key}: max relative difference {worst:.2e}"


def test_rank_0_alone_writes_checkpoints_metrics_and_progress(inputs, straight):
    assert [s for s, _ in list_checkpoints(straight / "checkpoints")] == [15, 20]  # keep_last 2, once each
    assert sorted(p.name for p in straight.iterdir()) == [".lock", "checkpoints", "plots"]
    assert [r["step"] for r in csv_rows(straight / "plots/train.csv")] == [str(s) for s in range(1, STEPS + 1)]
    logs = inputs / "logs-straight"
    assert f"step {STEPS}/{STEPS}" in rank_output(logs, 0) and '"status": "completed"' in rank_output(logs, 0)
    assert rank_output(logs, 1) == ""


def test_a_stop_and_a_signal_on_different_ranks_end_both_at_one_step_and_the_resume_is_bitwise_the_straight_run(
    inputs, straight
):
    # Rank 1 asks to stop in on_step_end of step 7, after that step's agreement (so it waits for
    # step 8's); rank 0 alone is signalled during step 8. Both end after step 8, preempted.
    stopped = torchrun(harness(inputs, "resumed", "1:7:stop,0:8:signal"), inputs / "logs-stop")
    assert stopped.returncode != 0  # torchrun reports a rank's exit 75 (preempted) as a failure
    seen = [(s["status"], s["steps"]) for s in seen_by_each_rank(inputs, "resumed")]
    assert seen == [("preempted", 8)] * 2
    assert [s for s, _ in list_checkpoints(inputs / "resumed/checkpoints")] == [5, 8]

    resumed = torchrun(cli(inputs, "resumed"), inputs / "logs-resume")
    assert resumed.returncode == 0, resumed.stdout
    assert "loaded" in rank_output(inputs / "logs-resume", 0, "stderr")
    a, b = (load_checkpoint(run / "checkpoints/step_00000020.pt") for run in (straight, inputs / "resumed"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    moments = lambda c: [t for s in c["optimizer"]["state"].values() for t in s.values()]  # noqa: E731
    assert all(torch.equal(x, y) for x, y in zip(moments(a), moments(b)))
    exact = lambda rows: [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows]  # noqa: E731
    assert exact(csv_rows(inputs / "resumed/plots/train.csv")) == exact(csv_rows(straight / "plots/train.csv")[8:])


def test_a_nonfinite_loss_on_one_rank_is_skipped_by_both_and_both_diverge_at_one_step(inputs):
    (inputs / "diverge.yaml").write_text(yaml.safe_dump(dataclasses.asdict(CFG.replace(**{"train.diverge_after": 2}))))
    done = torchrun(harness(inputs, "diverged", "1:3:nan", params="diverge.yaml"), inputs / "logs-diverge")
    assert done.returncode != 0
    ranks = seen_by_each_rank(inputs, "diverged")
    assert [(s["status"], s["steps"], s["diverged_at"], s["skipped"]) for s in ranks] == [("diverged", 4, 4, 2)] * 2
    assert float_bits(ranks[0]["losses"]) == float_bits(ranks[1]["losses"])  # the same all-reduced loss
