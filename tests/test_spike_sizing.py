"""The spike study's sizing rule (tasks/spike/sizing.py): the detector replayed over a run's values
flags what the run's own detector flagged; the detector rule takes the smallest z-score that keeps
the sizing seeds' clean stretches within the false-alarm bound; one seed's probe on a tiny project."""

from __future__ import annotations

import pytest

from model.detect import make_detector
from tasks.spike.sizing import calibrate_zscore, probe_seed, replay_alarms
from tests.test_spike_study import STUDY, tiny_project
from tests.trainer_kit import tiny_config


def noisy(n: int, outliers: dict[int, float]) -> list[tuple[int, float, float]]:
    """A clean-looking stretch: loss and grad norm alternating around a level, with grad-norm
    outliers (step -> value) such as a clean run's natural 2-3x excursions."""
    return [(s, 3.0 + 0.01 * (s % 2), outliers.get(s, 0.5 + 0.01 * (s % 3))) for s in range(1, n + 1)]


def test_a_replayed_detector_flags_a_grad_norm_excursion_at_a_low_z_score_but_not_a_high_one():
    values = noisy(40, {30: 0.6})  # ~12 sd above a window whose sd is ~0.008
    assert replay_alarms(values, window=16, warmup=8, zscore=6.0, ratio=10.0) == [30]
    assert replay_alarms(values, window=16, warmup=8, zscore=24.0, ratio=10.0) == []


def test_the_detector_rule_takes_the_smallest_z_score_within_the_false_alarm_bound():
    cfg = tiny_config(**{**STUDY, "spike.sizing_zscores": [6.0, 12.0, 24.0], "spike.max_false_alarms": 0.0})
    clean = [noisy(40, {30: 0.6}), noisy(40, {})]  # one seed with an excursion of ~12 sd, one without
    chosen, counts = calibrate_zscore(clean, cfg)
    assert counts["6"] == [1, 0] and counts["24"] == [0, 0]
    assert chosen == (24.0 if counts["12"] != [0, 0] else 12.0)
    lenient = tiny_config(**{**STUDY, "spike.sizing_zscores": [6.0, 12.0, 24.0], "spike.max_false_alarms": 0.5})
    assert calibrate_zscore(clean, lenient)[0] == 6.0  # one alarm over two clean controls: 0.5 each
    strict = tiny_config(**{**STUDY, "spike.sizing_zscores": [6.0], "spike.max_false_alarms": 0.0})
    assert calibrate_zscore(clean, strict)[0] is None  # no candidate meets the bound: none is chosen


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    project = tmp_path_factory.mktemp("sizing")
    tiny_project(project)
    cfg = tiny_config(**{**STUDY, "spike.detect_lag": 4})  # the most the warm-up holds: 12 - 8
    return cfg, probe_seed(cfg, project, 5, project / "sizing")


def test_a_sizing_probe_reads_the_clean_stretch_of_the_warm_up_and_the_control_and_nothing_injected(probe):
    cfg, found = probe
    s, r = cfg.spike, cfg.recovery
    first = s.origin_step + 1
    assert [v[0] for v in found["clean"]] == list(range(first, first + s.warm_steps + r.eval_steps))
    assert set(found) == {"seed", "origin_val_loss", "clean", "alarms", "seconds", "warm", "injection_step", "ramped"}
    # The onset rule's injected branches are kept apart, one per candidate ramp (tasks/spike/sizing.py).
    assert set(found["ramped"]) == {str(ramp) for ramp in s.sizing_ramps}


def test_the_replayed_detector_raises_the_alarms_the_run_raised_on_its_clean_stretch(probe):
    cfg, found = probe
    d = make_detector(cfg.spike)
    assert replay_alarms(found["clean"], d.window, d.warmup, d.z, d.ratio, d.lag) == found["alarms"]
    assert replay_alarms(found["clean"], d.window, d.warmup, 1.0, 1.01, d.lag)  # a hair-trigger flags the same run
