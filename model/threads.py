"""How many intra-op threads a CPU run takes when ``train.cpu_threads`` is 0: the cores it may run on
(its affinity) that nothing else is busy on. An OpenMP team waits for its slowest thread at every
barrier, so one thread sharing a core with another process holds the whole team back: on this
2-core machine, with one busy neighbour, pretraining ran at 4.3k tokens/s on 2 threads against
8.1k on 1. Counting only idle cores keeps 2 threads where both are free (14k tokens/s).
The choice is made once, at the start of a run. The number of threads can change a CPU run's bits:
tests/test_threads.py's 6-step model agrees on 1 and 2, but the default grid's fp32 arm over 200
steps did not, in either numerics mode (benchmarks/bench_numerics.py); each run records its count
(model/provenance.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

BUSY = 0.5
"""A core busier than this share of the sample window (by other processes) is not counted."""


def cpu_times(text: str) -> dict[int, tuple[int, int]]:
    """Per-CPU (busy, total) jiffies from /proc/stat's ``cpuN`` lines."""
    times = {}
    for line in text.splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name != "cpu":
            values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
            idle = values[3] + values[4]
            times[int(name[3:])] = (sum(values) - idle, sum(values))
    return times


def idle_among(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]], cpus: set[int]) -> int:
    """The CPUs of ``cpus`` that were busy less than :data:`BUSY` of the time between two samples."""
    idle = 0
    for cpu in cpus:
        if cpu not in before or cpu not in after:
            continue
        busy, total = (a - b for a, b in zip(after[cpu], before[cpu]))
        idle += total <= 0 or busy / total < BUSY
    return idle


def idle_cores(window_s: float = 0.25) -> int:
    """The cores of this process's affinity that were mostly idle over ``window_s`` (at least 1;
    all of them where /proc/stat cannot be read)."""
    cpus = os.sched_getaffinity(0)
    stat = Path("/proc/stat")
    try:
        before = cpu_times(stat.read_text())
        time.sleep(window_s)
        after = cpu_times(stat.read_text())
    except OSError:
        return len(cpus)
    return max(1, idle_among(before, after, cpus))
