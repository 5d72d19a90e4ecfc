"""Threads and workers chosen from the cores a process may actually use: idle cores counted from
/proc/stat, worker counts from the CPU affinity, and a CPU run whose numbers do not depend on the
thread count it was given."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from model.threads import cpu_times, idle_among

REPO = Path(__file__).resolve().parents[1]

STAT_BEFORE = """cpu  300 0 100 700 0 0 0 0 0 0
cpu0 100 0 0 400 0 0 0 0 0 0
cpu1 200 0 100 300 0 0 0 0 0 0
intr 12345
"""
STAT_AFTER = """cpu  500 0 200 800 0 0 0 0 0 0
cpu0 110 0 0 490 0 0 0 0 0 0
cpu1 290 0 100 310 0 0 0 0 0 0
"""


def test_a_core_busy_with_another_process_is_not_counted_as_idle():
    before, after = cpu_times(STAT_BEFORE), cpu_times(STAT_AFTER)
    assert before == {0: (100, 500), 1: (300, 600)}
    # cpu0: 10 of 100 jiffies busy (idle); cpu1: 90 of 100 busy
    assert idle_among(before, after, {0, 1}) == 1
    assert idle_among(before, after, {1}) == 0  # the caller keeps at least one thread
    assert idle_among(before, after, {0, 1, 7}) == 1  # a CPU /proc/stat does not list is skipped


def _chosen(cpus: set[int], code: str) -> str:
    """Run ``code`` in a fresh interpreter restricted to ``cpus``; its last printed line."""
    script = f"import os; os.sched_setaffinity(0, {sorted(cpus)!r})\n{code}"
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def test_workers_and_threads_follow_a_restricted_cpu_affinity():
    one = {min(os.sched_getaffinity(0))}
    code = (
        "from tasks.runtime.workers import worker_count; from model.threads import idle_cores\n"
        "print(worker_count(0, 10), worker_count(0, 0), worker_count(3, 10), idle_cores(0.05))"
    )
    assert _chosen(one, code) == "1 1 3 1"  # an explicit worker count is kept
    every = os.sched_getaffinity(0)
    workers, _, _, idle = map(int, _chosen(every, code).split())
    assert workers == min(len(every), 10) and 1 <= idle <= len(every)


def _train_digest(threads: int) -> str:
    import torch

    from model.config import TrainingConfig
    from model.train import Trainer

    cfg = TrainingConfig().replace(
        **{
            "model.n_layer": 2,
            "model.d_model": 128,
            "model.n_head": 2,
            "model.seq_len": 64,
            "tokenizer.vocab_size": 1024,
            "train.steps": 6,
            "schedule.warmup_steps": 2,
            "checkpoint.milestones": [],
            "train.batch_size": 8,
            "train.cpu_threads": threads,
            "train.device": "cpu",
            "precision.mode": "fp32",
        }
    )
    tokens = np.random.default_rng(0).integers(0, 1024, 8192).astype(np.uint16)
    trainer = Trainer(cfg, tokens, tokens)
    trainer.run()
    assert torch.get_num_threads() == threads
    h = hashlib.sha256()
    for _, tensor in sorted(trainer.module.model.state_dict().items()):
        h.update(tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to compare 1 and 2 threads")
def test_a_cpu_run_has_the_same_weights_on_one_thread_and_on_two():
    import torch

    saved = torch.get_num_threads()
    try:
        assert _train_digest(1) == _train_digest(2)
    finally:
        torch.set_num_threads(saved)


def test_a_stages_local_cluster_serves_http_on_a_loopback_port_of_its_own_without_a_port_warning(recwarn):
    import socket

    from distributed import LocalCluster

    from tasks.runtime.workers import cluster_kwargs, configured_cluster

    taken = socket.socket()  # Dask's default HTTP port held, as another cluster on the machine would
    try:
        taken.bind(("", 8787))
        taken.listen()
    except OSError:
        pass  # held by someone already: the same case
    with taken, configured_cluster(), LocalCluster(**cluster_kwargs(1)) as cluster:
        host, port = cluster.scheduler.http_server.address, cluster.scheduler.http_server.port
    assert host == "127.0.0.1" and port != 8787
    assert not [w for w in recwarn if "already in use" in str(w.message)]
