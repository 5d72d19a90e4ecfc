"""The pruned-search replay (tasks/search/pruning.py) on synthetic groups of trials through Optuna's
real MedianPruner: what it stops, where, what that saves, and that the fits from complete trials
keep the unpruned optimum; reading the trials from an Optuna storage and recording them with the
search's own objective."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import optuna
import pytest
from optuna.trial import TrialState

from tasks.search import pruning
from tasks.search.fit import NEXT_TO_STOPPED
from tasks.search.pruning import TrialRecord, compare, replay, replay_group
from tasks.search.spec import lr_grid, search_digest, sweep_specs
from tests.test_search import SEARCH, tiny_project
from tests.trainer_kit import tiny_config

optuna.logging.set_verbosity(optuna.logging.WARNING)

STEPS = tuple(range(100, 801, 100))
CFG = tiny_config(
    **{
        "search.log2_lr_min": -13.0,
        "search.log2_lr_max": -5.0,
        "search.lr_points": 7,
        "search.steps": 800,
        "search.eval_every": 100,
        "search.widths": [16],
        "search.seeds": [0],
        "search.confirm_seeds": [],
        "search.parametrizations": ["sp"],
        "mup.parametrization": "sp",
        "mup.base_width": 16,
    }
)
GRID = lr_grid(CFG)  # -13 ... -5 in 7 points, 4/3 apart
OPTIMUM = -9.2


def final_loss(log2_lr: float) -> float:
    """A unimodal LR curve with its minimum between grid points (so the fit's vertex is off-grid)."""
    return 5.0 + 0.1 * (log2_lr - OPTIMUM) ** 2


def record(
    log2_lr: float,
    order: int,
    curve: dict[int, float] | None = None,
    status: str = "completed",
    value: float | None = None,
    steps: int = 800,
    seed: int = 0,
) -> TrialRecord:
    """A trial whose curve falls the same for every LR (so every step ranks the LRs as the end does)."""
    final = final_loss(log2_lr)
    curve = curve if curve is not None else {s: final + 1.0 * (1 - s / 800) for s in STEPS}
    return TrialRecord(
        "sp", 16, seed, log2_lr, tuple(curve.items()), final if value is None else value, status, steps, 1e9, order
    )


def grid_group(seed: int = 0) -> list[TrialRecord]:
    """One group in queue order: ascending LR."""
    return [record(lr, i, seed=seed) for i, lr in enumerate(GRID)]


def test_trials_below_the_groups_median_are_pruned_at_the_first_report_and_the_optimum_is_kept():
    replayed = replay(grid_group())
    stopped = {t.record.log2_lr: t.pruned_at for t in replayed if t.pruned}
    # After the three startup trials the median of the finished curves is the 4th-best final loss;
    # the two far-off large LRs are worse than it at their first report.
    assert stopped == {GRID[5]: 100, GRID[6]: 100}
    assert [t.steps_saved for t in replayed if t.pruned] == [700, 700]
    report = compare(CFG, replayed)
    assert report["pruned"] == 2 and report["trials"] == 7
    assert report["steps_saved"] == 1400 and report["steps_saved_share"] == pytest.approx(1400 / 5600)
    (group,) = report["per_group"]
    assert group["closeness"] == "equal" and group["difference_grid_steps"] == 0.0
    assert group["complete_only"]["log2_lr"] == pytest.approx(group["unpruned"]["log2_lr"])
    assert group["unpruned"]["log2_lr"] == pytest.approx(OPTIMUM, abs=1e-6)  # a parabola: the fit is exact
    assert report["optima"] == {"sp": {"16": {"equal": 1, "within": 0, "further": 0, "lost": 0}}}


def test_the_startup_trials_run_to_the_end_however_bad():
    # The group's three worst LRs first: they are not compared with anything.
    worst_first = [GRID[6], GRID[0], GRID[5], GRID[1], GRID[2], GRID[3], GRID[4]]
    replayed = replay_group([record(lr, i) for i, lr in enumerate(worst_first)])
    assert [t.pruned for t in replayed] == [False] * 7  # and every later LR is better than them
    assert pruning.N_STARTUP_TRIALS == 3


def test_a_trial_that_stops_improving_is_pruned_when_the_median_passes_its_best_not_before():
    # The median rule compares a trial's best loss so far: one that stalls at its step-100 loss is
    # stopped at the first report where the finished trials' median is below that.
    group = grid_group()
    stalled = {s: final_loss(GRID[3]) + 1.0 * (1 - 100 / 800) for s in STEPS}
    group[3] = record(GRID[3], 3, curve=stalled, value=stalled[800])
    replayed = replay_group(group)
    # The median of the three startup curves is -11.67's, 5.609 + 1 - s/800: below 5.879 from step 600.
    assert replayed[3].pruned_at == 600 and replayed[3].steps_saved == 200


def test_a_trial_that_blows_up_after_a_good_start_is_not_pruned_by_the_median_rule():
    # Its best loss so far stays the group's best: the search's ThresholdPruner and divergence rule
    # are what stop such a run, not the median.
    group = grid_group()
    late = {s: final_loss(GRID[3]) + 1.0 * (1 - s / 800) + (0.0 if s < 500 else 3.0) for s in STEPS}
    group[3] = record(GRID[3], 3, curve=late, value=late[800])
    assert not replay_group(group)[3].pruned


def test_equal_curves_are_never_pruned():
    flat = {s: 6.0 - s / 1000 for s in STEPS}
    group = [record(lr, i, curve=flat, value=flat[800]) for i, lr in enumerate(GRID)]
    replayed = replay_group(group)
    assert not any(t.pruned for t in replayed)  # equal to the median is not worse than it
    (g,) = compare(CFG, replayed)["per_group"]
    assert g["closeness"] == "equal"


def test_a_diverged_trial_saves_only_the_steps_it_ran_and_never_enters_the_fits():
    # tasks/search/trial.py: a diverged run stops early and is told ln(V); fit.py leaves it out.
    ln_v = math.log(1024)
    group = grid_group()
    group[6] = record(GRID[6], 6, curve={100: 7.5, 200: math.inf}, status="diverged", value=ln_v, steps=220)
    replayed = replay_group(group)
    assert replayed[6].pruned_at == 100 and replayed[6].steps_saved == 120
    report = compare(CFG, replayed)
    assert report["steps"] == 6 * 800 + 220 and report["steps_saved"] == 700 + 120
    assert report["per_group"][0]["closeness"] == "equal"


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")
def test_a_trial_whose_every_report_is_nan_is_pruned_at_its_first():
    group = grid_group()
    group[4] = record(GRID[4], 4, curve={100: math.nan}, status="diverged", value=math.log(1024), steps=120)
    replayed = replay_group(group)
    assert replayed[4].pruned_at == 100 and replayed[4].steps_saved == 20


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")
def test_a_diverged_startup_trial_finishes_but_gives_no_vote_where_it_reported_no_finite_loss():
    group = grid_group()
    group[0] = record(GRID[0], 0, curve={100: math.nan}, status="diverged", value=math.log(1024), steps=130)
    replayed = replay_group(group)
    assert not replayed[0].pruned  # a startup trial, told ln(V) as COMPLETE, as the search does
    # The median at step 100 is over the finite losses only: for -7.67 it is -10.33's (of -11.67,
    # -10.33, -9), which -7.67 trails; with -13's loss among them it would not (test above).
    assert replayed[4].pruned_at == 100
    (g,) = compare(CFG, replayed)["per_group"]
    # The diverged point is in neither fit; the unpruned one is the exact parabola's vertex, the
    # complete-only one the best grid point, now the last complete LR: within a grid step. It is
    # censored, a bound: its upper neighbour was stopped (fit.py: censoring).
    assert g["unpruned"]["log2_lr"] == pytest.approx(OPTIMUM, abs=1e-6)
    assert g["complete_only"] == {
        "log2_lr": GRID[3],
        "loss": pytest.approx(final_loss(GRID[3])),
        "censored": NEXT_TO_STOPPED,
    }
    assert g["closeness"] == "within"


def test_a_trial_the_search_itself_pruned_stays_pruned_and_saves_nothing_more():
    group = grid_group()
    # tasks/search/queue.py: pruner, the search's ThresholdPruner: no final value, 200 steps run.
    group[1] = dataclasses.replace(
        record(GRID[1], 1, curve={100: 6.0, 200: 5.9}), value=None, status="pruned", steps=200
    )
    replayed = replay_group(group)
    assert not replayed[1].pruned and replayed[1].steps_saved == 0


def test_pruning_the_optimums_neighbour_moves_the_optimum_and_says_how_far():
    group = grid_group()
    # The upper neighbour of the best grid point (-9) looks bad until its very last report.
    tricky = {s: 9.0 for s in STEPS[:-1]} | {800: final_loss(GRID[4])}
    group[4] = record(GRID[4], 4, curve=tricky)
    report = compare(CFG, replay_group(group))
    (g,) = report["per_group"]
    assert g["pruned"] == 3 and g["closeness"] in ("within", "further")
    assert g["difference_grid_steps"] == pytest.approx(g["difference_log2"] / (4 / 3))


def test_groups_replay_apart_and_in_queue_order():
    a, b = grid_group(seed=0), grid_group(seed=1)
    b[6] = record(GRID[6], 6, seed=1, curve={s: 1.0 for s in STEPS}, value=1.0)  # seed 1's best: its last LR
    shuffled = [*reversed(a), *b[::2], *b[1::2]]
    replayed = replay(shuffled)
    assert [t.record.order for t in replayed] == sorted(t.record.order for t in replayed)
    pruned = {(t.record.seed, t.record.log2_lr) for t in replayed if t.pruned}
    assert pruned == {(0, GRID[5]), (0, GRID[6]), (1, GRID[5])}  # seed 0's curves do not prune seed 1's


def test_the_slopes_come_from_the_complete_trials_by_the_searchs_slope():
    cfg = CFG.replace(**{"search.widths": [16, 32]})
    records = []
    for width, shift in ((16, 0.0), (32, -1.0)):  # the optimum halves per doubling: slope -1
        for i, lr in enumerate(GRID):
            r = record(lr, i + (width == 32) * 7)
            final = 5.0 + 0.1 * (lr - OPTIMUM - shift) ** 2
            records.append(
                TrialRecord(
                    "sp",
                    width,
                    0,
                    lr,
                    tuple((s, final + 1 - s / 800) for s in STEPS),
                    final,
                    r.status,
                    800,
                    1.0,
                    r.order,
                )
            )
    report = compare(cfg, replay(records))
    slopes = report["slopes"]["sp"]
    assert slopes["unpruned"]["slope"] == pytest.approx(-1.0)
    assert slopes["complete_only"]["slope"] == pytest.approx(-1.0)
    assert report["pruned"] > 0


def test_records_round_trip_through_json_lines_with_non_finite_losses(tmp_path):
    group = grid_group()
    group[2] = record(GRID[2], 2, curve={100: math.nan, 200: math.inf}, status="diverged", steps=200)
    path = tmp_path / "trials.jsonl"
    pruning.write_records(path, reversed(group))
    back = pruning.read_records(path)
    assert [r.order for r in back] == list(range(7))
    assert back[3] == group[3]
    assert math.isnan(back[2].curve[0][1]) and back[2].curve[1][1] == math.inf


def test_records_are_read_from_the_searchs_storage_in_queue_order(tmp_path):
    from tasks.search.study import data_hashes

    project = tiny_project(tmp_path)
    storage = optuna.storages.InMemoryStorage()
    cfg = CFG.replace(**{"search.widths": [32]})  # the target width (model.d_model) alone: one study
    (spec,) = sweep_specs(cfg, search_digest(cfg, data_hashes(project)))
    study = optuna.create_study(study_name=spec.name, storage=storage)
    for lr, seed in spec.points:
        study.enqueue_trial({"log2_lr": lr}, user_attrs={"seed": seed})
    for i, (lr, _) in enumerate(spec.points):
        trial = study.ask()
        trial.suggest_float("log2_lr", -13.0, -5.0)
        for s in STEPS[: 2 if i == 6 else None]:
            trial.report(final_loss(lr) + 1 - s / 800, s)
        trial.set_user_attr("steps", 200 if i == 6 else 800)
        trial.set_user_attr("status", "pruned" if i == 6 else "completed")
        if i == 6:
            study.tell(trial, state=TrialState.PRUNED)
        else:
            study.tell(trial, final_loss(lr))
    records = pruning.records_from_storage(cfg, project, storage)
    assert [(r.log2_lr, r.seed) for r in records] == list(spec.points)
    assert records[0].curve == tuple((s, final_loss(GRID[0]) + 1 - s / 800) for s in STEPS)
    assert records[6].status == "pruned" and records[6].value is None and records[6].steps == 200


def test_a_recorded_trial_is_the_searchs_objective_with_its_reports(tmp_path):
    project = tiny_project(tmp_path)
    cfg = tiny_config(**{**SEARCH, "search.lr_points": 2})  # the search tests' tiny search, two LRs
    spec = sweep_specs(cfg, "x")[0]
    lr, seed = spec.points[0]
    r = pruning._train_point(cfg, project, spec, lr, seed, 5)
    assert [s for s, _ in r.curve] == [3, 6]
    assert r.status == "completed" and r.steps == 6 and r.order == 5
    assert r.value == r.curve[-1][1] and np.isfinite(r.value)
