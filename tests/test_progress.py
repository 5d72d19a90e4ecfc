"""A fan-out stage's progress line: done/total, the outcomes so far, elapsed time and an ETA."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from tasks.data.config import DataConfig
from tasks.data.shards import map_shards, shard_path, shard_pool
from tasks.data.sources import read_corpus
from tasks.runtime import progress as progress_module
from tasks.runtime.progress import Progress, clock

DATA = Path(__file__).parent / "data"


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
    assert log.lines[0] == "ablate: 4 arms to run, 1 at a time"
    assert log.lines[1] == "arm base/s0: completed · ablate: 1/4 arms done (1 completed) · elapsed 0:10 · ETA 0:30"
    # two done in 30 s: 15 s each, two left
    assert log.lines[2] == (
        "arm post_ln/s0: diverged · ablate: 2/4 arms done (1 completed, 1 diverged) · elapsed 0:30 · ETA 0:30"
    )
    assert all(re.search(r"\d+/4 arms done", line) for line in log.lines[1:])
    p.close()


def test_a_unit_with_an_irregular_plural_is_counted_in_it():
    log = Lines()
    Progress("spike", "branch", 2, log, plural="branches").finished("control", "completed")
    assert "spike: 1/2 branches done (1 completed)" in log.lines[1]


def test_a_shard_pass_logs_each_shard_with_its_mb_and_documents_per_second_and_an_eta(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    shards = [shard_path(tmp_path, i) for i in range(3)]
    for shard in shards:
        shard.write_text('{"id": "a", "text": "b"}\n' * 1000)
    with shard_pool(1, "local") as pool:
        assert map_shards(pool, "filter-screen", lambda shard: shard.name, shards) == [s.name for s in shards]
    lines = [r.getMessage() for r in caplog.records if "filter-screen" in r.getMessage()][1:]  # after the work's line
    assert len(lines) == 3 and all(re.search(r"MB/s, [\d,]+ docs/s so far\): done", line) for line in lines)
    assert "3/3 shards done" in lines[-1] and "ETA" in lines[0]


def test_prepare_logs_each_shard_it_writes_with_its_rate(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    counts = read_corpus.fn(DataConfig(max_docs=300, shard_bytes=20_000), tmp_path, tmp_path / "raw")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("prepare: shard")]
    assert len(lines) == counts["shards"] > 1
    assert re.fullmatch(r"prepare: shard 00000-docs\.jsonl written \([\d.]+ MB/s, [\d,]+ docs/s so far\)", lines[0])


def test_with_costs_the_eta_weighs_the_work_left_by_cost_not_by_units(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: now[0])
    log = Lines()
    # a search's widest trial first: 16 units of cost in 160 s, then three trials of cost 1 left
    p = Progress("search", "trial", 4, log, total_cost=19.0)
    now[0] = 160.0
    p.finished("w128", "completed", 16.0)
    assert log.lines[-1].endswith("elapsed 2:40 · ETA 0:30")  # 10 s per unit of cost; by units: 8:00
    now[0] = 170.0
    p.finished("w32", "completed", 1.0)
    p.finished("w32", "completed", 1.0)
    p.finished("w32", "completed", 1.0)
    assert log.lines[-1].endswith("ETA 0:00")


def test_a_trials_cost_grows_with_its_width_squared_and_its_steps():
    from model.flops import training_flops
    from tasks.config import load_config
    from tests.test_declared import REPO

    cfg = load_config(REPO / "params.yaml", "smoke")
    narrow = training_flops(cfg)
    wide = training_flops(cfg.replace(**{"model.d_model": 4 * cfg.model.d_model}))
    longer = training_flops(cfg.replace(**{"train.steps": 2 * cfg.train.steps}))
    assert longer == 2 * narrow and 4 * narrow < wide <= 16 * narrow


def test_a_resumed_stage_first_says_what_it_kept_and_what_it_runs():
    log = Lines()
    Progress("search", "trial", 22, log, workers=2, kept=2, what="sweep: 8 LRs x 3 seeds")
    assert log.lines == [
        "search: 2 of 24 trials kept from the last run; 22 to run (sweep: 8 LRs x 3 seeds), 2 at a time"
    ]


def test_parallel_units_own_durations_divide_by_the_workers_that_run_at_once(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: now[0])
    p = Progress("ablate", "arm", 5, Lines(), workers=2)
    now[0] = 100.0  # 90 s of start-up, then a 10 s arm
    p.finished("a", "completed", seconds=10.0)
    assert p.eta() == 20.0  # four 10 s arms on two workers; the wall time since the start says 400
    p.finished("b", "completed", seconds=10.0)
    p.finished("c", "completed", seconds=10.0)
    p.finished("d", "completed", seconds=10.0)
    assert p.eta() == 10.0  # the last arm runs alone


def test_the_eta_after_the_first_trial_of_a_recorded_search_is_within_2x_of_the_time_it_took(monkeypatch):
    """A real search's trial ends (tests/data/search_timeline.json: 2 workers, a local Dask cluster
    started by the stage, each trial's own seconds and FLOPs), replayed: the first ETA shown is
    within 2x of the time the run still took, and every one after the first minute within 2.5x. The
    estimator of before (the wall time since the stage began, by cost) was not."""
    timeline = json.loads((DATA / "search_timeline.json").read_text())
    trials, end = timeline["trials"], timeline["end"]
    now = [0.0]
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: now[0])
    total = sum(t["cost"] for t in trials)
    p = Progress("search", "trial", len(trials), Lines(), total_cost=total, workers=timeline["workers"])
    ratios = []
    for i, t in enumerate(trials[:-1]):
        now[0] = t["at"]
        p.finished(t["name"], t["outcome"], t["cost"], t["seconds"])
        if i == 0 or (t["at"] >= 60 and end - t["at"] >= 10):  # the last seconds: below the 2 s polling
            ratios.append(p.eta() / (end - t["at"]))
    assert 0.5 <= ratios[0] <= 2.0, ratios  # the first ETA shown
    assert all(0.4 <= r <= 2.0 for r in ratios), (
        ratios
    )  # later: the trials' claim and tell overhead is not in their own time
    first = trials[0]
    before = first["at"] / first["cost"] * (total - first["cost"])
    assert before / (end - first["at"]) > 2.0
