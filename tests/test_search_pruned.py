"""The pruned search (issue #47), live: Optuna's MedianPruner within each (parametrization, width,
seed) group, its trials in ascending LR, each after the ones it is compared with
(tasks/search/groups.py, tasks/search/queue.py: claim). What it stops does not depend on the
schedule and is what the replay (tasks/search/pruning.py) stops; a stopped trial is recorded with
its step and left out of the fits; an optimum is at the edge only at the grid's ends; bad settings
are refused naming their key."""

from __future__ import annotations

import dataclasses
import random
import re
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from model.typed_config import ConfigError
from tasks.search import pruning
from tasks.search.findings import points_of, pruned_trials, summarize, sweep_optima, sweep_summary
from tasks.search.fit import (
    AT_GRID_END,
    NEXT_TO_STOPPED,
    Point,
    fit_optimum,
    optima_per_seed,
    slope,
    transfer_check,
    width_summary,
)
from tasks.search.groups import MedianRule, SearchPruner, grid_point, group_view
from tasks.search.queue import claim, load_study, open_storage, optuna_storage, pruner
from tasks.search.spec import lr_grid, search_digest, sweep_specs, transfer_spec
from tasks.search.study import run_workers
from tests.test_search import REPO, finished, run_in_process, search_config, tiny_project
from tests.trainer_kit import tiny_config

optuna.logging.set_verbosity(optuna.logging.WARNING)

STEPS = tuple(range(100, 801, 100))
GRID = [round(-13.0 + i * 4 / 3, 6) for i in range(7)]  # the default grid: -13 ... -5 in 7 points
SEEDS = (0, 1)


def curve(log2_lr: float, seed: int) -> dict[int, float]:
    """Synthetic validation losses: seed 1's LR curve sits 0.8 nats above seed 0's with its minimum
    elsewhere (so a median over both seeds would stop other trials than one within each), and seed
    0's fourth LR stalls after its first report (stopped at a later step, as in test_pruning.py)."""
    optimum, offset = (-9.2, 0.0) if seed == 0 else (-7.5, 0.8)
    final = 5.0 + offset + 0.1 * (log2_lr - optimum) ** 2
    if seed == 0 and log2_lr == GRID[3]:
        return {s: final + 1.0 * (1 - 100 / 800) for s in STEPS}
    return {s: final + 1.0 * (1 - s / 800) for s in STEPS}


def search_pruner(startup: int = 3, warmup: int = 0) -> SearchPruner:
    return SearchPruner(100.0, MedianRule(startup, warmup), STEPS[-1])


def queued_study(path: Path, make_pruner) -> tuple[optuna.storages.BaseStorage, optuna.Study]:
    """A journal study holding the grid × seeds queued LR-major, as tasks/search/queue.py queues it."""
    storage = open_storage(f"journal:{path}")
    study = optuna.create_study(study_name="group-order", storage=storage)
    for lr in GRID:
        for seed in SEEDS:
            study.enqueue_trial({"log2_lr": lr}, user_attrs={"seed": seed})
    return storage, optuna.load_study(study_name="group-order", storage=storage, pruner=make_pruner())


def simulate(path: Path, schedule: int, make_pruner=search_pruner, gated: bool = True) -> dict[tuple, int | None]:
    """Up to three trials in flight at once, claimed and advanced report by report in an order
    drawn from ``schedule``, as parallel workers would interleave them. Returns each point's step
    stopped at (None: ran to the end). ``gated=False`` claims queued trials in queue order
    without the group order (what a plain queue would do)."""
    storage, study = queued_study(path, make_pruner)
    rng = random.Random(schedule)
    in_flight: dict[int, tuple[optuna.Trial, float, int, int]] = {}
    out: dict[tuple, int | None] = {}
    while True:
        if not in_flight or (len(in_flight) < 3 and rng.random() < 0.5):
            claimed = claim(storage, study) if gated else ungated_claim(study)
            if claimed is not None:
                trial_id, trial = claimed
                lr, seed = trial.suggest_float("log2_lr", GRID[0], GRID[-1]), trial.user_attrs["seed"]
                in_flight[trial_id] = (trial, lr, seed, 0)
                continue
            if not in_flight:
                return out
        trial_id = rng.choice(sorted(in_flight))
        trial, lr, seed, i = in_flight.pop(trial_id)
        step = STEPS[i]
        trial.report(curve(lr, seed)[step], step)
        if trial.should_prune():
            study.tell(trial, state=TrialState.PRUNED)
            out[(lr, seed)] = step
        elif i == len(STEPS) - 1:
            study.tell(trial, curve(lr, seed)[step])
            out[(lr, seed)] = None
        else:
            in_flight[trial_id] = (trial, lr, seed, i + 1)


def ungated_claim(study: optuna.Study) -> tuple[int, optuna.Trial] | None:
    if not study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
        return None
    trial = study.ask()  # pops the next queued trial
    return trial._trial_id, trial


def replayed() -> dict[tuple, int | None]:
    """The replay's verdicts on the same curves, each group alone in ascending LR."""
    records = [
        pruning.TrialRecord("sp", 16, seed, lr, tuple(curve(lr, seed).items()), curve(lr, seed)[800], "completed", 800)
        for lr in GRID
        for seed in SEEDS
    ]
    records = [dataclasses.replace(r, order=i) for i, r in enumerate(records)]
    return {(t.record.log2_lr, t.record.seed): t.pruned_at for t in pruning.replay(records)}


# --------------------------------------------------------------------------------------------
# The order within a group, and decisions that do not depend on the schedule
# --------------------------------------------------------------------------------------------


def test_a_groups_next_lr_is_claimed_only_once_the_one_before_it_has_ended(tmp_path):
    storage, study = queued_study(tmp_path / "j", search_pruner)
    _, first = claim(storage, study)
    _, other = claim(storage, study)
    points = [pruning_point(t) for t in (first, other)]
    assert points == [(GRID[0], 0), (GRID[0], 1)]  # each group's lowest LR
    assert claim(storage, study) is None  # both groups' next LRs wait for them
    assert claim(storage, study, seed=0) is None
    first.suggest_float("log2_lr", GRID[0], GRID[-1])
    study.tell(first, 5.0)
    _, second = claim(storage, study)
    assert pruning_point(second) == (GRID[1], 0)


def pruning_point(trial: optuna.Trial) -> tuple[float, int]:
    fixed = trial.study._storage.get_trial_system_attrs(trial._trial_id)["fixed_params"]
    return fixed["log2_lr"], trial.user_attrs["seed"]


def test_what_the_pruner_stops_is_the_same_in_every_schedule_and_is_what_the_replay_stops(tmp_path):
    expected = replayed()
    stopped = {point: step for point, step in expected.items() if step is not None}
    # seed 0: its two largest LRs at their first report, the stalled one when the median passes it;
    # seed 1 (its optimum a grid step higher): its largest LR only.
    assert stopped == {(GRID[3], 0): 600, (GRID[5], 0): 100, (GRID[6], 0): 100, (GRID[6], 1): 100}
    schedules = [simulate(tmp_path / f"s{i}", schedule=i) for i in range(6)]
    assert all(s == expected for s in schedules)


def test_without_the_group_view_and_order_optunas_median_pruner_stops_other_trials(tmp_path):
    # The negative control: the same schedules with a plain study-wide MedianPruner on a plain
    # queue compare seeds with each other and with whatever finished first.
    plain = [
        simulate(tmp_path / f"p{i}", schedule=i, make_pruner=lambda: optuna.pruners.MedianPruner(3), gated=False)
        for i in range(6)
    ]
    assert any(s != replayed() for s in plain)


def test_the_pruner_refuses_to_judge_a_trial_before_its_groups_lower_lrs_have_ended(tmp_path):
    storage, study = queued_study(tmp_path / "j", search_pruner)
    _, low = claim(storage, study)  # seed 0's lowest LR, left running
    trials = study.get_trials(deepcopy=False)
    later = next(t for t in trials if t.state == TrialState.WAITING and pruning_point_frozen(t) == (GRID[1], 0))
    with pytest.raises(RuntimeError, match="runs before its group's LRs"):
        group_view(trials, later, study.direction)
    other_seed = next(t for t in trials if t.state == TrialState.WAITING and pruning_point_frozen(t) == (GRID[1], 1))
    with pytest.raises(RuntimeError):
        group_view(trials, other_seed, study.direction)  # seed 1's lowest LR has not run either
    assert pruning_point(low) == (GRID[0], 0)


def pruning_point_frozen(t: optuna.trial.FrozenTrial) -> tuple[float, int]:
    return grid_point(t)


def test_the_median_never_stops_a_trial_at_its_last_report_the_bound_does():
    study = optuna.create_study(pruner=search_pruner())
    for i, lr in enumerate(GRID[:4]):
        study.enqueue_trial({"log2_lr": lr}, user_attrs={"seed": 0})
        trial = study.ask()
        trial.suggest_float("log2_lr", GRID[0], GRID[-1])
        if i < 3:
            for s in STEPS:
                trial.report(5.0, s)
            study.tell(trial, 5.0)
    trial.report(5.0, 700)
    assert not trial.should_prune()
    trial.report(9.0, 800)  # far worse than the median, at its last report: its final value
    assert not trial.should_prune()
    bound = SearchPruner(8.0, MedianRule(3, 0), 800)
    assert bound.prune(study, study.trials[-1]) and bound.last == "threshold"


# --------------------------------------------------------------------------------------------
# The fits: complete trials only; an optimum at the grid's end or next to a stopped LR is censored
# --------------------------------------------------------------------------------------------


def grid_points(pruned: set[int], best: int, seed: int = 0, diverged: frozenset[int] = frozenset()) -> list[Point]:
    """The grid's points for one seed, a parabola with its minimum at GRID[best]; ``pruned``: indices
    stopped; ``diverged``: indices that diverged (the loss at init)."""

    def point(i: int, lr: float) -> Point:
        if i in pruned:
            return Point(lr, seed, None, "pruned", 1.0)
        if i in diverged:
            return Point(lr, seed, 6.93, "diverged", 1.0)
        return Point(lr, seed, 5.0 + (i - best) ** 2, "completed", 1.0)

    return [point(i, lr) for i, lr in enumerate(GRID)]


def test_an_optimum_next_to_a_stopped_lr_is_a_bound_at_the_best_completed_lr_not_a_parabola_across_the_gap():
    (o,) = optima_per_seed(grid_points({5, 6}, best=4)).values()
    assert (o.log2_lr, o.loss, o.censored) == (GRID[4], 5.0, NEXT_TO_STOPPED)
    (o,) = optima_per_seed(grid_points({3}, best=4)).values()  # a stopped lower neighbour too
    assert o.censored == NEXT_TO_STOPPED
    # One grid LR further from the stopped ones, both neighbours ran to the end: a point.
    (o,) = optima_per_seed(grid_points({6}, best=4)).values()
    assert o.censored is None and o.log2_lr == pytest.approx(GRID[4])
    # The grid is the grid also when the stopped points are not among the points fitted.
    complete = [p for p in grid_points({5, 6}, best=4) if p.status == "completed"]
    assert width_summary(complete, GRID)["censored"] == {"0": NEXT_TO_STOPPED}
    assert width_summary(complete)["censored"] == {"0": AT_GRID_END}  # against its own points: their end


def test_an_optimum_at_the_grids_end_is_censored_whatever_ran_beside_it():
    for best in (0, 6):
        (o,) = optima_per_seed(grid_points(set(), best)).values()
        assert (o.log2_lr, o.censored) == (GRID[best], AT_GRID_END)
    (o,) = optima_per_seed(grid_points(set(), best=1)).values()
    assert o.censored is None, "one grid step inside the end, both neighbours complete: a point"


def test_a_diverged_neighbour_brackets_the_optimum_which_is_then_the_best_grid_point():
    (o,) = optima_per_seed(grid_points(set(), best=4, diverged=frozenset({5, 6}))).values()
    assert (o.log2_lr, o.loss, o.censored) == (GRID[4], 5.0, None)


def test_a_seed_censored_at_any_width_has_no_slope_and_the_others_keep_theirs():
    def at(width_index: int, seed: int, pruned: set[int]) -> list[Point]:
        return grid_points(pruned, best=2 + width_index, seed=seed)

    by_width = {
        w: width_summary([*at(i, 0, set()), *at(i, 1, {5} if w == 128 else set())], GRID)
        for i, w in enumerate((32, 64, 128))
    }
    assert by_width[128]["censored"] == {"1": NEXT_TO_STOPPED}
    fitted = slope(by_width)
    assert fitted["slope_per_seed"] == [pytest.approx((GRID[4] - GRID[2]) / 2)], "seed 1 left out"


def test_the_transfer_check_leaves_out_a_seed_whose_direct_optimum_is_censored():
    direct = [*grid_points(set(), best=3, seed=0), *grid_points({4, 5, 6}, best=3, seed=1)]
    transfer = [Point(GRID[3], s, 5.02, "completed", 1.0) for s in (0, 1)]
    check = transfer_check(direct, transfer, 1.0, GRID[3])
    assert check["gap_per_seed"] == {"0": pytest.approx(0.02)}
    assert check["direct_censored"] == {"1": NEXT_TO_STOPPED}


def test_the_grid_loss_leaves_out_the_second_stages_lrs_the_summary_reads_them():
    refined = [*grid_points(set(), best=3), Point(GRID[3] + 0.3, 0, 4.5, "completed", 1.0)]
    summary = sweep_summary(refined, GRID)
    assert summary["grid_loss_opt"] == pytest.approx(5.0) and summary["loss_opt"] < 4.6


def test_a_pruned_trial_is_recorded_with_its_step_and_never_enters_the_fit(tmp_path):
    # Its last report (4.0) is below every complete trial's final loss: were it fitted, the
    # optimum would move to it.
    cfg = tiny_config(**{"search.steps": 800})
    storage = open_storage(f"journal:{tmp_path / 'j'}")
    spec = sweep_specs(cfg, "d")[0]
    study = optuna.create_study(study_name=spec.name, storage=storage)
    for i, lr in enumerate(GRID):
        study.enqueue_trial({"log2_lr": lr}, user_attrs={"seed": 0})
        trial = study.ask()
        trial.suggest_float("log2_lr", GRID[0], GRID[-1])
        if i == 5:  # not next to the best grid LR (-9): the optimum stays a point
            trial.report(4.0, 300)
            trial.set_user_attr("pruned_at", 300)
            trial.set_user_attr("pruned_by", "median")
            trial.set_user_attr("steps", 300)
            trial.set_user_attr("status", "pruned")
            study.tell(trial, state=TrialState.PRUNED)
        else:
            trial.set_user_attr("status", "completed")
            study.tell(trial, 5.0 + 0.1 * (lr + 9.2) ** 2)
    points, _ = points_of(storage, spec)
    assert [p.status for p in points].count("pruned") == 1
    complete = [p for p in points if p.status == "completed"]
    summary = width_summary(points, GRID)
    assert summary["per_seed"]["0"] == fit_optimum([p.log2_lr for p in complete], [p.value for p in complete]).log2_lr
    # the completed trials' curve has its minimum 5.0 exactly; the pruned 4.0, fitted, would pull it
    # well below (the fit lands within rounding of 5.0: 4.999999999999998 on an AMD EPYC)
    assert summary["loss_opt"] == pytest.approx(5.0, abs=1e-9) and not summary["censored"]
    record = pruned_trials(cfg, storage, [spec])
    (group,) = record["groups"]
    assert group["pruned"] == [{"log2_lr": GRID[5], "step": 300, "by": "median"}]
    assert group["steps_saved"] == 500 and record["steps_saved"] == 500
    assert (
        record["trials"] == 7 and record["steps"] == 5600 and record["steps_saved_share"] == pytest.approx(500 / 5600)
    )


PRUNING = {  # a tiny search that the median prunes: the larger LRs trail at their first report
    "search.log2_lr_min": -12.0,
    "search.log2_lr_max": -2.0,
    "search.lr_points": 6,
    "search.steps": 8,
    "search.eval_every": 2,
    "search.seeds": [0, 1],
    "search.parametrizations": ["sp"],
    "mup.parametrization": "sp",
}


def test_the_search_stops_trials_records_where_and_fits_only_those_that_ran_to_the_end(tmp_path, monkeypatch):
    monkeypatch.setenv("SPIKELAB_STATE", str(tmp_path / "state"))
    cfg, project = search_config(tmp_path, **PRUNING), tiny_project(tmp_path / "project")
    sweeps = sweep_specs(cfg, "d")
    run_in_process(cfg, project, sweeps)
    transfer = transfer_spec(cfg, "d", sweep_optima(cfg, sweeps)[16]["log2_lr_opt"])
    run_in_process(cfg, project, [transfer])
    metrics = summarize(cfg, sweeps, transfer).metrics
    storage = open_storage(optuna_storage(cfg))
    record = metrics["pruning"]
    assert record["rule"]["median"] and record["rule"]["n_startup_trials"] == 3
    by_median = [(g, t) for g in record["groups"] for t in g["pruned"] if t["by"] == "median"]
    assert by_median, "the tiny search should stop a trial by the median"
    for spec in sweeps:
        trials = optuna.load_study(study_name=spec.name, storage=storage).get_trials(deepcopy=False)
        for t in trials:
            if t.state == TrialState.PRUNED:  # stopped where it says, and trained only that far
                assert t.user_attrs["pruned_at"] == t.user_attrs["steps"] == t.last_step < cfg.search.steps
        for seed in cfg.search.seeds:
            done = [t for t in trials if grid_point(t)[1] == seed and t.state == TrialState.COMPLETE]
            done = [t for t in done if t.user_attrs["status"] == "completed"]
            fitted = fit_optimum([t.params["log2_lr"] for t in done], [t.value for t in done], lr_grid(cfg))
            summary = metrics["sp"]["widths"][str(spec.width)]
            assert summary["per_seed"][str(seed)] == fitted.log2_lr
    assert record["trials"] == metrics["trials"]["run"] and record["pruned"] == metrics["trials"]["pruned"]
    assert record["steps_saved"] == sum(cfg.search.steps - t["step"] for g in record["groups"] for t in g["pruned"])


def test_pruning_decisions_do_not_depend_on_the_worker_count(tmp_path, live_services):
    project = tiny_project(tmp_path / "project")
    results = {}
    for workers in (1, 2):
        (tmp_path / f"w{workers}").mkdir()
        cfg = search_config(tmp_path / f"w{workers}", **{**PRUNING, "search.workers": workers})
        specs = sweep_specs(cfg, "d")
        run_workers(cfg, project, specs, None)
        storage = open_storage(optuna_storage(cfg))
        results[workers] = {spec.name: finished(storage, spec) for spec in specs}
        pruned = [t for trials in results[workers].values() for t in trials if t[2] == "PRUNED"]
        assert pruned and len({t[:2] for trials in results[workers].values() for t in trials}) == 12
    assert results[2] == results[1]


# --------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dotted", "key"),
    [
        ({"search.prune_startup_trials": 2}, "search.prune_startup_trials"),
        ({"search.prune_warmup_steps": -1}, "search.prune_warmup_steps"),
        ({"search.prune_warmup_steps": 800, "search.steps": 800}, "search.prune_warmup_steps"),
        ({"search.prune_median": "yes"}, "search.prune_median"),
        ({"search.prune_startup_trials": 3.5}, "search.prune_startup_trials"),
    ],
)
def test_bad_pruning_settings_are_refused_naming_the_key(dotted, key):
    with pytest.raises(ConfigError, match="^" + re.escape(key)):
        tiny_config(**dotted)


def test_the_default_settings_are_the_replays_and_params_yaml_says_so():
    s = tiny_config().search
    assert (s.prune_median, s.prune_startup_trials, s.prune_warmup_steps) == (
        True,
        pruning.N_STARTUP_TRIALS,
        pruning.N_WARMUP_STEPS,
    )
    declared = yaml.safe_load((REPO / "params.yaml").read_text())["search"]
    assert {k: declared[k] for k in ("prune_median", "prune_startup_trials", "prune_warmup_steps")} == {
        "prune_median": True,
        "prune_startup_trials": 3,
        "prune_warmup_steps": 0,
    }
    rule = pruner(tiny_config()).settings()
    assert rule["percentile"] == pruning.PERCENTILE and rule["interval_steps"] == pruning.INTERVAL_STEPS


def test_the_median_rules_settings_name_the_studies_and_without_it_they_are_the_unpruned_ones():
    data = {"train": "a", "val": "b"}
    on = search_digest(tiny_config(), data)
    assert search_digest(tiny_config(**{"search.prune_startup_trials": 4}), data) != on
    off = search_digest(tiny_config(**{"search.prune_median": False}), data)
    assert off != on
    assert search_digest(tiny_config(**{"search.prune_median": False, "search.prune_startup_trials": 4}), data) == off
    assert isinstance(pruner(tiny_config(**{"search.prune_median": False})), SearchPruner)
    assert pruner(tiny_config(**{"search.prune_median": False})).median is None


def test_a_loaded_study_prunes_by_its_group(tmp_path):
    cfg = search_config(tmp_path)
    spec = sweep_specs(cfg, "d")[0]
    storage = open_storage(optuna_storage(cfg))
    optuna.create_study(study_name=spec.name, storage=storage)
    assert isinstance(load_study(storage, spec, cfg).pruner, SearchPruner)


# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------


def test_the_reports_search_section_shows_the_trials_stopped_and_where():
    from tasks.report.render import render_markdown
    from tasks.report.sections.stages import search_section

    widths = {"16": {"log2_lr_opt": -9.0, "loss_opt": 5.0}}
    group = {"kind": "sweep", "parametrization": "sp", "width": 16, "trials": 7}
    search = {
        "sp": {"slope": -1.0, "slope_std": 0.1, "widths": widths},
        "pruning": {
            "rule": {**pruner(tiny_config()).settings(), "prune_above": 6.55},
            "trials": 14,
            "pruned": 3,
            "steps": 11200,
            "steps_saved": 1900,
            "steps_saved_share": 1900 / 11200,
            "groups": [
                {
                    **group,
                    "seed": 0,
                    "pruned": [
                        {"log2_lr": -6.333333, "step": 100, "by": "median"},
                        {"log2_lr": -5.0, "step": 100, "by": "threshold"},
                    ],
                    "steps_saved": 1400,
                },
                {**group, "seed": 1, "pruned": [{"log2_lr": -5.0, "step": 300, "by": "median"}], "steps_saved": 500},
                {**group, "kind": "transfer", "width": 32, "trials": 1, "seed": 0, "pruned": [], "steps_saved": 0},
            ],
        },
    }
    text = render_markdown([search_section(search)], Path("."))
    assert "**3 of 14 trials stopped**, 1,900 of 11,200 steps saved (17.0%)" in text
    assert "the first 3 always to the end" in text
    assert "| sp | 16 | 3 / 14 | 1,900 | seed 0: -6.33@100, -5.00@100 (threshold); seed 1: -5.00@300 |" in text
    assert "transfer" not in text.split("stopped at")[-1]  # a transfer study nothing stopped has no row
    unpruned = search_section({k: v for k, v in search.items() if k != "pruning"})
    assert "Pruning" not in render_markdown([unpruned], Path("."))
