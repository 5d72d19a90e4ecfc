"""A fan-out stage's progress line: done/total, the outcomes so far, elapsed time and an ETA."""

from __future__ import annotations

import re

from tasks.runtime import progress as progress_module
from tasks.runtime.progress import Progress, clock


class Lines:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, line: str) -> None:
        self.lines.append(line)


def test_clock_reads_minutes_and_hours():
    assert clock(5) == "0:05" and clock(125) == "2:05" and clock(3723) == "1:02:03"


def test_each_finished_unit_logs_done_over_total_its_outcome_and_an_eta_from_the_mean_so_far(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: now[0])
    log = Lines()
    p = Progress("ablate", "arm", 4, log)
    assert p.eta() is None and "ETA unknown" in p.line()
    now[0] = 110.0
    p.finished("base/s0", "completed")
    now[0] = 130.0
    p.finished("post_ln/s0", "diverged")
    assert log.lines[0] == "arm base/s0: completed · ablate: 1/4 arms done (1 completed) · elapsed 0:10 · ETA 0:30"
    # two done in 30 s: 15 s each, two left
    assert log.lines[1] == (
        "arm post_ln/s0: diverged · ablate: 2/4 arms done (1 completed, 1 diverged) · elapsed 0:30 · ETA 0:30"
    )
    assert all(re.search(r"\d+/4 arms done", line) for line in log.lines)
    p.close()


def test_a_unit_with_an_irregular_plural_is_counted_in_it():
    log = Lines()
    Progress("spike", "branch", 2, log, plural="branches").finished("control", "completed")
    assert "spike: 1/2 branches done (1 completed)" in log.lines[0]
