"""The LR search's machinery on a tiny model and real Optuna journals: the objective is a plain
training run's validation loss, divergence is a result, the evaluated points do not depend on the
worker count, a killed search resumes, and the fits find a known optimum."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import optuna
import pytest
from optuna.trial import TrialState

from model.train import train
from tasks.search.findings import LR_FILE_HEADER, points_of, publish, summarize, sweep_optima
from tasks.search.fit import AT_GRID_END, Point, fit_optimum, slope, width_summary
from tasks.search.queue import (
    OBJECTIVE_NAME,
    claim,
    grid_point,
    load_study,
    open_storage,
    optuna_storage,
    prepare_study,
)
from tasks.search.spec import StudySpec, lr_grid, refine_lrs, search_digest, sweep_specs, transfer_spec, trial_config
from tasks.search.study import data_hashes, refine_specs, run_workers
from tasks.search.trial import Tokens, objective, run_trial
from tests.trainer_kit import markov_tokens, tiny_config

REPO = Path(__file__).resolve().parents[1]

SEARCH = {
    "search.widths": [16],
    "search.lr_points": 3,
    "search.log2_lr_min": -9.0,
    "search.log2_lr_max": -5.0,
    "search.steps": 6,
    "search.batch_size": 4,
    "search.eval_every": 3,
    "search.seeds": [0],
    "search.confirm_seeds": [],
    "mup.base_width": 16,
    "mup.parametrization": "mup",
    "tracking.experiment": "test",
}


def search_config(tmp_path: Path, **dotted):
    return tiny_config(**{**SEARCH, "search.storage": f"journal:{tmp_path / 'optuna.journal'}", **dotted})


def tiny_project(root: Path) -> Path:
    """A project holding only what the search reads: a tokenize manifest and its shards."""
    tokens = root / "data" / "tokens"
    tokens.mkdir(parents=True)
    splits = {}
    for split, data in (("train", markov_tokens(20_000)), ("val", markov_tokens(4_000, seed=1))):
        (tokens / f"{split}.bin").write_bytes(data.tobytes())
        splits[split] = {"path": f"{split}.bin", "sha256": hashlib.sha256(data.tobytes()).hexdigest()}
    (tokens / "manifest.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 257, "splits": splits}))
    return root


def first_spec(cfg, project: Path) -> StudySpec:
    return sweep_specs(cfg, search_digest(cfg, data_hashes(project)))[0]


def finished(storage, spec) -> list[tuple]:
    """(point, state, value) of every finished trial, as a sorted list."""
    trials = optuna.load_study(study_name=spec.name, storage=storage).get_trials(deepcopy=False)
    return sorted(
        (*grid_point(t), t.state.name, t.value) for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
    )


def first_trial_claimed(tmp_path: Path):
    """A tiny project's first study, prepared, and its first queued trial claimed as a worker would."""
    cfg, project = search_config(tmp_path), tiny_project(tmp_path)
    spec = first_spec(cfg, project)
    storage = open_storage(optuna_storage(cfg))
    prepare_study(storage, spec)
    study = load_study(storage, spec, cfg)
    _, trial = claim(storage, study)
    return cfg, project, spec, study, trial


def test_objective_scores_a_trial_with_the_val_loss_of_a_plain_training_run(tmp_path):
    cfg, project, spec, study, trial = first_trial_claimed(tmp_path)
    tokens = Tokens.of(project)
    score = objective(trial, cfg, spec.parametrization, spec.width, tokens)
    log2_lr, seed = spec.points[0]
    plain = train(trial_config(cfg, spec.parametrization, spec.width, log2_lr, seed), tokens.train, tokens.val)
    assert trial.params == {"log2_lr": log2_lr} and trial.user_attrs["seed"] == seed
    assert score == plain["val_loss"]


def test_the_study_names_its_objective_and_each_trial_records_its_seed_as_an_attribute_not_a_param(tmp_path):
    cfg, project, spec, study, trial = first_trial_claimed(tmp_path)
    objective(trial, cfg, spec.parametrization, spec.width, Tokens.of(project))
    log2_lr, seed = spec.points[0]
    reread = optuna.load_study(study_name=spec.name, storage=open_storage(optuna_storage(cfg)))
    assert reread.metric_names == [OBJECTIVE_NAME]  # optuna-dashboard's label, not "Objective 0"
    frozen = reread.get_trials(deepcopy=False)[trial.number]
    assert frozen.params == {"log2_lr": log2_lr}  # the LR is the only hyperparameter
    assert frozen.user_attrs["seed"] == seed and frozen.user_attrs["lr"] == 2.0**log2_lr


def test_a_trial_run_in_mlflow_carries_its_lr_width_parametrization_seed_and_steps_as_params(tmp_path, monkeypatch):
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("SPIKELAB_STATE", str(tmp_path / "state"))
    mlflow.set_tracking_uri(uri)
    try:
        client = mlflow.MlflowClient(uri)
        experiment = client.create_experiment("search-params")
        parent = client.create_run(experiment).info.run_id  # the stage's run, as a worker sees it
        cfg, project = search_config(tmp_path), tiny_project(tmp_path)
        spec = first_spec(cfg, project)
        storage = open_storage(optuna_storage(cfg))
        prepare_study(storage, spec)
        study = load_study(storage, spec, cfg)
        run_trial(study, claim(storage, study)[1], spec, cfg, Tokens.of(project), parent)
        (child,) = client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{parent}'")
    finally:
        mlflow.set_tracking_uri(None)  # back to MLFLOW_TRACKING_URI: "" would stick as a file store
    log2_lr, seed = spec.points[0]
    assert child.data.params == {
        "log2_lr": str(log2_lr),
        "lr": str(2.0**log2_lr),
        "width": str(spec.width),
        "parametrization": spec.parametrization,
        "seed": str(seed),
        "steps": str(cfg.search.steps),
        "kind": "sweep",
    }
    assert "loss/val" in child.data.metrics  # what the charts plot against those params


def test_a_diverging_trial_is_recorded_as_a_diverged_result_not_raised(tmp_path):
    cfg = search_config(tmp_path, **{"train.diverge_loss": 1.0, "train.log_every": 1})  # any real loss is above 1
    project = tiny_project(tmp_path)
    spec = first_spec(cfg, project)
    storage = open_storage(optuna_storage(cfg))
    prepare_study(storage, spec)
    study = load_study(storage, spec, cfg)
    status = run_trial(study, claim(storage, study)[1], spec, cfg, Tokens.of(project), None)
    (trial,) = study.get_trials(states=(TrialState.COMPLETE,))
    assert status == "diverged" and trial.user_attrs["status"] == "diverged"
    assert trial.value == pytest.approx(math.log(257))


def test_two_workers_on_one_journal_evaluate_exactly_the_trials_one_worker_does(tmp_path, live_services):
    """Trials are Prefect tasks on Dask worker processes: the test servers take their task runs."""
    project = tiny_project(tmp_path / "project")
    results = {}
    for workers in (1, 2):
        cfg = search_config(tmp_path / f"w{workers}", **{"search.workers": workers, "search.seeds": [0, 1]})
        (tmp_path / f"w{workers}").mkdir()
        specs = sweep_specs(cfg, "d")
        run_workers(cfg, project, specs, None)
        storage = open_storage(optuna_storage(cfg))
        results[workers] = {spec.name: finished(storage, spec) for spec in specs}
    n_points = 3 * 2
    for trials in results[2].values():
        assert len(trials) == n_points and len({t[:2] for t in trials}) == n_points  # no duplicate, none lost
    assert results[2] == results[1]


def test_a_search_group_that_crashes_before_any_trial_ends_says_so_in_one_line(tmp_path, live_services, caplog):
    caplog.set_level(logging.INFO)
    cfg = search_config(tmp_path, **{"search.workers": 1})
    project = tiny_project(tmp_path / "project")
    (project / "data" / "tokens" / "train.bin").unlink()  # the worker's first trial cannot map its shards
    with pytest.raises(RuntimeError, match="search trials failed"):
        run_workers(cfg, project, sweep_specs(cfg, "d")[:1], None)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sweep group")]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert re.fullmatch(
        r"sweep group 1/1: failed \(FileNotFoundError: .*train\.bin.*\) · search: 0/3 trials done · .*", lines[0]
    )


def test_a_killed_search_resumes_keeping_finished_trials_and_retrying_interrupted_ones(tmp_path, live_services):
    cfg = search_config(tmp_path, **{"search.workers": 1, "search.steps": 40, "search.lr_points": 4})
    project = tiny_project(tmp_path)
    specs = sweep_specs(cfg, "d")[:1]
    storage = open_storage(optuna_storage(cfg))
    prepare_study(storage, specs[0])
    job = (
        "import json, sys, pathlib; from tasks.config import config_from_dict; from tasks.search.spec import StudySpec; "
        "from tasks.search.study import run_workers; "
        "specs = [StudySpec(**{**s, 'points': tuple(map(tuple, s['points']))}) "
        "for s in json.loads(sys.argv[3])]; "
        "run_workers(config_from_dict(json.loads(sys.argv[1])), pathlib.Path(sys.argv[2]), specs, None)"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            job,
            json.dumps(dataclasses.asdict(cfg)),
            str(project),
            json.dumps([dataclasses.asdict(s) for s in specs]),
        ],
        cwd=REPO,
        start_new_session=True,
    )

    def running() -> int:
        study = optuna.load_study(study_name=specs[0].name, storage=storage)
        return len(study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))

    deadline = time.monotonic() + 120
    while not (finished(storage, specs[0]) and running()) and time.monotonic() < deadline:
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)  # the search and its worker, mid-trial
    proc.wait()
    before = finished(storage, specs[0])
    assert 1 <= len(before) < 4

    run_workers(cfg, project, specs, None)
    after = finished(storage, specs[0])
    trials = optuna.load_study(study_name=specs[0].name, storage=storage).get_trials()
    interrupted = [t for t in trials if t.state == TrialState.FAIL]
    assert set(before) <= set(after) and len(after) == 4 == len({t[:2] for t in after})
    assert interrupted and all(t.user_attrs["status"] == "interrupted" for t in interrupted)

    assert prepare_study(storage, specs[0]) == 0  # finished: nothing queued, nothing rerun
    assert len(optuna.load_study(study_name=specs[0].name, storage=storage).get_trials()) == len(trials)


def test_a_trial_killed_before_its_suggestion_keeps_its_queued_point():
    study = optuna.create_study()
    study.enqueue_trial({"log2_lr": -7.0}, user_attrs={"seed": 1})
    study.ask()  # killed here, before its LR's suggestion
    (frozen,) = study.get_trials(deepcopy=False)
    assert frozen.params == {} and grid_point(frozen) == (-7.0, 1)


def test_a_study_queued_with_the_seed_as_a_param_resumes_and_trains_each_point_once(tmp_path):
    """The storage of a search of before issue #57: one finished trial and one queued, both with the
    seed as a param. Resumed, the finished one is kept, the queued one trained with its seed, and
    the only trials added are the points neither holds."""
    cfg, project = search_config(tmp_path), tiny_project(tmp_path)
    spec = first_spec(cfg, project)
    storage = open_storage(optuna_storage(cfg))
    old = optuna.create_study(study_name=spec.name, storage=storage, direction="minimize")
    old.set_user_attr("log2_lr_range", list(spec.log2_lr_range))
    (lr0, seed), (lr1, _), (lr2, _) = spec.points
    old.add_trial(
        optuna.create_trial(
            params={"log2_lr": lr0, "seed": seed},
            distributions={
                "log2_lr": optuna.distributions.FloatDistribution(lr0, lr2),
                "seed": optuna.distributions.CategoricalDistribution([seed]),
            },
            value=5.0,
        )
    )
    old.enqueue_trial({"log2_lr": lr1, "seed": seed})
    assert prepare_study(storage, spec) == 2  # the old queued point and the new third one
    run_in_process(cfg, project, [spec])
    assert [t[:3] for t in finished(storage, spec)] == [
        (lr0, seed, "COMPLETE"),
        (lr1, seed, "COMPLETE"),
        (lr2, seed, "COMPLETE"),
    ]
    trials = optuna.load_study(study_name=spec.name, storage=storage).get_trials()
    assert len(trials) == 3 and trials[0].value == 5.0  # kept, not trained again
    assert [t.params for t in trials[1:]] == [{"log2_lr": lr1}, {"log2_lr": lr2}]


def test_a_finished_search_studys_trials_have_the_lr_as_their_only_param(tmp_path):
    """What optuna-dashboard's Hyperparameter Importance and Best Trial read: the LR, never the seed."""
    cfg = search_config(tmp_path, **{"search.seeds": [0, 1]})
    project = tiny_project(tmp_path)
    spec = first_spec(cfg, project)
    run_in_process(cfg, project, [spec])
    trials = optuna.load_study(study_name=spec.name, storage=open_storage(optuna_storage(cfg))).get_trials()
    assert len(trials) == 6 and all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
    assert all(set(t.params) == {"log2_lr"} for t in trials)
    assert sorted(grid_point(t) for t in trials) == sorted(spec.points)


def test_fit_finds_the_vertex_of_a_parabola_between_grid_points():
    grid = np.arange(-10.0, -3.0)
    fit = fit_optimum(grid, (grid + 6.3) ** 2 + 3.0)
    assert fit.log2_lr == pytest.approx(-6.3) and fit.loss == pytest.approx(3.0) and fit.censored is None
    assert fit_optimum(grid, -grid).censored == AT_GRID_END  # still falling at the largest LR: a bound


def test_the_second_stage_adds_half_of_its_lrs_inside_each_grid_step_beside_the_best_never_past_the_grid():
    grid = [-13.0, -11.5, -10.0, -8.5, -7.0]
    assert refine_lrs(grid, -10.0, 2) == [-10.75, -9.25]
    assert refine_lrs(grid, -10.0, 4) == [-11.0, -10.5, -9.5, -9.0]
    assert refine_lrs(grid, -13.0, 2) == [-12.25], "at the grid's end: the inside only (the optimum stays a bound)"
    assert refine_lrs(grid, -7.0, 2) == [-7.75]
    assert refine_lrs(grid, -10.0, 0) == []


@pytest.mark.parametrize("points", [-2, 1, 3])
def test_an_odd_or_negative_refine_count_is_refused_naming_the_key(points):
    from model.typed_config import ConfigError

    with pytest.raises(ConfigError, match=r"search.refine_points: must be an even number >= 0"):
        tiny_config(**{**SEARCH, "search.refine_points": points})


def test_the_second_stage_trains_the_lrs_around_each_seeds_best_in_the_same_study_and_the_fit_reads_them(tmp_path):
    cfg = search_config(tmp_path, **{"search.seeds": [0, 1], "search.refine_points": 2})
    project = tiny_project(tmp_path)
    sweeps = sweep_specs(cfg, search_digest(cfg, data_hashes(project)))
    mup = [s for s in sweeps if s.parametrization == "mup"]
    run_in_process(cfg, project, mup)
    storage = open_storage(optuna_storage(cfg))
    coarse = {spec.name: points_of(storage, spec)[0] for spec in mup}
    refined = refine_specs(cfg, sweeps)  # the transferred parametrization's sweeps only
    assert [r.name for r in refined] == [s.name for s in mup]
    run_in_process(cfg, project, refined)
    for spec in mup:
        points, _ = points_of(storage, spec)
        for seed in (0, 1):
            done = [p for p in coarse[spec.name] if p.seed == seed and p.status == "completed"]
            best = min(done, key=lambda p: p.completed_value).log2_lr
            expected = sorted([*lr_grid(cfg), *refine_lrs(lr_grid(cfg), best, 2)])
            assert sorted(p.log2_lr for p in points if p.seed == seed) == expected, "each point trained once"
    assert refine_specs(cfg.replace(**{"search.refine_points": 0}), sweeps) == []


def test_a_rerun_refines_around_the_grids_best_even_where_a_refined_lr_beat_it(tmp_path):
    cfg = search_config(tmp_path, **{"search.refine_points": 2})
    (spec, *_) = [s for s in sweep_specs(cfg, "d") if s.parametrization == "mup"]
    storage = open_storage(optuna_storage(cfg))
    study = optuna.create_study(study_name=spec.name, storage=storage)
    for lr, value in ((-9.0, 5.2), (-7.0, 5.0), (-5.0, 5.3), (-6.0, 4.0)):  # -6: a second-stage LR, the best
        study.enqueue_trial({"log2_lr": lr}, user_attrs={"seed": 0})
        trial = study.ask()
        trial.suggest_float("log2_lr", -9.0, -5.0)
        trial.set_user_attr("status", "completed")
        study.tell(trial, value)
    (refined, *_) = refine_specs(cfg, [spec])
    assert sorted(refined.points) == sorted([*spec.points, (-8.0, 0), (-6.0, 0)]), "around -7, the grid's best"


def test_slope_of_optima_halving_per_doubling_is_minus_one_with_spread_over_seeds():
    def points(center):
        return [
            Point(x, s, (x - center - 0.1 * s) ** 2, "completed", 0.0) for x in np.arange(-12.0, -2.0) for s in (0, 1)
        ]

    by_width = {w: width_summary(points(-5.0 - math.log2(w / 32))) for w in (32, 64, 128)}
    fitted = slope(by_width)
    assert fitted["slope"] == pytest.approx(-1.0) and fitted["slope_std"] == pytest.approx(0.0, abs=1e-9)
    assert by_width[32]["log2_lr_opt_std"] == pytest.approx(0.1 / math.sqrt(2))


def test_pretrain_trains_with_the_lr_the_search_wrote_unless_told_not_to(tmp_path):
    from model.typed_config import InputError
    from tasks.pretrain.train import pretrain_config
    from tasks.runtime.outputs import SEARCH_LR

    cfg = tiny_config()
    with pytest.raises(InputError, match="run the search stage first"):
        pretrain_config(cfg, tmp_path)
    (tmp_path / SEARCH_LR).parent.mkdir()
    (tmp_path / SEARCH_LR).write_text(LR_FILE_HEADER + "optim:\n  lr: 0.00123\n")
    assert pretrain_config(cfg, tmp_path).optim.lr == 0.00123
    assert pretrain_config(cfg.replace(**{"search.transfer_lr": False}), tmp_path).optim.lr == cfg.optim.lr


def run_in_process(cfg, project: Path, specs) -> None:
    """Every queued trial of ``specs``, trained here one after another (no workers, no server)."""
    storage, tokens = open_storage(optuna_storage(cfg)), Tokens.of(project)
    for spec in specs:
        prepare_study(storage, spec)
        study = load_study(storage, spec, cfg)
        while (claimed := claim(storage, study)) is not None:
            run_trial(study, claimed[1], spec, cfg, tokens, None)


def test_the_transfer_study_carries_the_findings_note_and_the_mu_transfer_figures(tmp_path, monkeypatch):
    from optuna.artifacts import get_all_artifact_meta
    from optuna_dashboard import get_note

    from tasks.runtime.paths import state
    from tasks.search.dashboard import annotate

    monkeypatch.setenv("SPIKELAB_STATE", str(tmp_path / "state"))  # the artifact store's home
    cfg = search_config(tmp_path, **{"search.parametrizations": ["sp", "mup"]})
    project = tiny_project(tmp_path)
    sweeps = sweep_specs(cfg, "d")
    run_in_process(cfg, project, sweeps)
    optima = sweep_optima(cfg, sweeps)
    transfer = transfer_spec(cfg, "d", optima[16]["log2_lr_opt"])
    run_in_process(cfg, project, [transfer])
    findings = summarize(cfg, sweeps, transfer)
    figures = publish(cfg, project, findings)
    for _ in range(2):  # a rerun attaches nothing twice
        annotate(cfg, findings, figures)

    storage = open_storage(optuna_storage(cfg))  # what the dashboard reads, opened afresh
    study = optuna.load_study(study_name=transfer.name, storage=storage)
    text, t = get_note(study), findings.metrics["transfer"]
    assert "μTransfer to width 32 (LR from widths 16)" in text
    assert f"**Transfer gap** {t['loss_gap']:+.3f} ± {t['loss_gap_std']:.3f} nats" in text
    for p in ("sp", "mup"):
        assert f"**{findings.metrics[p]['slope']:+.2f}**" in text
    assert f"| 16 | {findings.metrics['sp']['widths']['16']['log2_lr_opt']:.2f} ± " in text
    attached = get_all_artifact_meta(study, storage=storage)
    assert sorted(meta.filename for meta in attached) == ["mu_transfer.png", "transfer.png"]
    assert all((state().optuna_artifacts / meta.artifact_id).stat().st_size > 0 for meta in attached)


@pytest.mark.e2e
def test_the_dashboard_service_shows_the_search_studies_in_a_browser(live_services):
    from tasks.runtime import paths
    from tests import browser

    if reason := browser.missing():
        pytest.skip(reason)
    spec = StudySpec("test/search/mup/w16/dashboard", "sweep", "mup", 16, ((-7.0, 0), (-5.0, 0)))
    prepare_study(open_storage(optuna_storage(tiny_config())), spec)  # the state's journal
    driver = browser.chrome()
    try:
        browser.send_login(driver, live_services["MLFLOW_TRACKING_USERNAME"], live_services["MLFLOW_TRACKING_PASSWORD"])
        driver.get(paths.dashboard_url())
        browser.wait_for_text(driver, spec.name)
    finally:
        driver.quit()
