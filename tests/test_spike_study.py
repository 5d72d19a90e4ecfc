"""The spike study's logic (tasks/spike/study.py, tasks/spike/postmortem.py): classification, outcomes,
the give-up score, detection and the excess-loss area on synthetic curves, the per-origin plateau
gate, a whole two-seed study (origin runs, then every cause x policy branch) on a tiny synthetic
project, read back from its matrix, metrics and post-mortems, and each spike setting refused one
step outside its range, naming the key."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from model.provenance import provenance
from model.spike.branch import Branch
from model.spike.injections import Injection
from model.typed_config import ConfigError
from tasks.config import load_config
from tasks.design.preregistration import design
from tasks.runtime.outputs import SPIKE_METRICS, SPIKE_RUN
from tasks.spike import postmortem
from tasks.spike.config import OUTCOMES
from tasks.spike.postmortem import SECTIONS, publish
from tasks.spike.scores import Costs, classify, detected, excess_area, outcome, score, window_curves
from tasks.spike.sizing import calibrate_ramp
from tasks.spike.study import make_injection, poison_draws, poison_length, run_seed
from tasks.spike.summary import detection, give_ups, matrix, plateau_gate, summary_metrics
from tests.trainer_kit import markov_tokens, tiny_config

CONTROL = [3.0 - 0.002 * t for t in range(100)]


def curve(shape) -> list[float]:
    return [c * shape(t) for t, c in enumerate(CONTROL)]


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        (lambda t: 1 + 1.5 * np.exp(-t / 5), 1),  # spikes 2.5x, back in ~20 steps
        (lambda t: 1.0, 1),  # no visible loss spike at all
        (lambda t: 1 + 1.5 * np.exp(-t / 5) + 0.1, 2),  # settles 10 % above
        (lambda t: 1 + 1.5 * np.exp(-t / 40), 2),  # back, but long after W
        (lambda t: 1 + 0.02 * t, 3),  # still climbing
        (lambda t: float("nan") if t > 50 else 2.0, 3),  # non-finite
    ],
)
def test_classification_of_synthetic_curves(shape, expected):
    result = classify(curve(shape), CONTROL, epsilon=0.03, within=60, smooth=5)
    assert result.type == expected, result.why


def test_a_recoverable_spike_reports_when_it_came_back():
    result = classify(curve(lambda t: 1 + 1.5 * np.exp(-t / 5)), CONTROL, epsilon=0.03, within=60, smooth=5)
    assert 15 <= result.steps_to_recover <= 30 and abs(result.final_gap) < 0.03


def test_the_excess_loss_area_sums_only_the_steps_above_the_control():
    branch = np.array([3.0, 5.0, 4.0, 3.0])
    control = np.array([3.0, 3.0, 3.5, 3.2])
    assert excess_area(branch, control) == pytest.approx(0 + 2.0 + 0.5 + 0)  # the step below counts 0, not -0.2


def rows(losses, first=1):
    return [{"step": first + i, "loss": loss} for i, loss in enumerate(losses)]


def test_a_branch_that_diverged_or_went_non_finite_counts_at_the_cap_from_there_on():
    control = Branch("continue", rows=rows([3.0, 3.0, 3.0, 3.0]))
    diverged = Branch("continue", status="diverged", rows=rows([4.0, float("nan")]))
    b, c = window_curves(diverged, control, smooth=1, cap=7.0)
    assert b.tolist() == [4.0, 7.0, 7.0, 7.0] and c.tolist() == [3.0] * 4
    assert excess_area(b, c) == pytest.approx(1.0 + 3 * 4.0)


@pytest.mark.parametrize(
    ("status", "spike_type", "expected"),
    [
        ("completed", 1, "recovered"),
        ("completed", 2, "gap"),  # back late or settled above
        ("completed", 3, "gap"),  # still climbing
        ("diverged", 3, "gap"),  # a diverged run is a result, scored at the cap
        ("stopped", 1, "gave_up"),  # the retry cap, whatever the steps it ran looked like
    ],
)
def test_each_branch_gets_one_outcome_from_its_status_and_type(status, spike_type, expected):
    assert outcome(status, spike_type) == expected


def test_a_branch_that_gave_up_stays_at_the_loss_it_gave_up_at_for_every_step_it_did_not_run():
    control = Branch("continue", rows=rows([3.0, 3.0, 3.0, 3.0]))
    gave_up = Branch("rollback", status="stopped", rows=rows([9.0, 6.0]))
    b, c = window_curves(gave_up, control, smooth=1, cap=7.0)
    assert b.tolist() == [7.0, 6.0, 6.0, 6.0] and c.tolist() == [3.0] * 4  # 9 is above the cap ln V = 7


def test_a_branch_that_gave_up_at_a_non_finite_loss_stays_at_the_cap():
    control = Branch("continue", rows=rows([3.0, 3.0, 3.0]))
    gave_up = Branch("skip_batch", status="stopped", rows=rows([4.0, float("inf")]))
    assert window_curves(gave_up, control, smooth=1, cap=7.0)[0].tolist() == [4.0, 7.0, 7.0]


def gave_up_branch() -> tuple[Branch, Branch]:
    """A control over 4 steps and a rollback branch that gave up after 2 of them."""
    control = Branch("continue", rows=rows([3.0, 3.0, 3.0, 3.0]), steps_run=4)
    gave_up = Branch("rollback", status="stopped", rows=rows([9.0, 6.0]), steps_run=5, segments=2)
    for branch in (control, gave_up):
        for row in branch.rows:
            row.update(skipped=0.0, grad_norm=1.0)
    return control, gave_up


def test_a_branch_that_gave_up_is_scored_in_the_comparison_and_counted_apart():
    control, gave_up = gave_up_branch()
    injection = Injection("lr", 1, 0, 1, 100.0, tied_to="step")
    cfg = tiny_config(**{"recovery.smooth_steps": 2}).recovery
    scores = score(gave_up, control, injection, cfg, Costs(1.0, 1, 1.0, 1.0), cap=7.0, detect_within=0)
    assert scores["outcome"] == "gave_up" and scores["status"] == "stopped" and scores["restarts"] == 1
    assert scores["scored_gap"] == pytest.approx(6.0 / 3.0 - 1.0)  # the last two steps held at 6
    assert scores["final_gap"] is None and scores["excess_area"] is None  # a completed window's readings


def test_a_completed_branch_scores_its_final_gap():
    control = Branch("continue", rows=rows([3.0, 3.0, 3.0]), steps_run=3)
    done = Branch("skip_step", rows=rows([3.3, 3.3, 3.3]), steps_run=3)
    for branch in (control, done):
        for row in branch.rows:
            row.update(skipped=0.0, grad_norm=1.0)
    injection = Injection("param", 1, 0, 1, 100.0, tied_to="once")
    cfg = tiny_config(**{"recovery.smooth_steps": 2}).recovery
    scores = score(done, control, injection, cfg, Costs(1.0, 1, 1.0, 1.0), cap=7.0, detect_within=0)
    assert scores["scored_gap"] == scores["final_gap"] == pytest.approx(0.1)


def flagged_at(*steps: int) -> Branch:
    return Branch("continue", detections=list(steps))


@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        ((9,), False),  # before the injection: not on it
        ((10,), True),  # the injection's first step
        ((12 + 5,), True),  # its last step (10 + 3 - 1) + detect_within
        ((12 + 6,), False),  # one step later: on what the spike left, not on the spike
        ((9, 18, 30), False),
    ],
)
def test_a_spike_is_detected_by_a_flag_from_its_first_step_to_detect_within_after_its_last(steps, expected):
    injection = Injection("lr", 10, 0, 3, 100.0, tied_to="step")
    assert detected(flagged_at(*steps), injection, within=5) is expected


def test_the_matrix_counts_a_give_up_as_its_own_outcome_with_its_score(finished):
    studies, _, metrics = finished
    study = studies[0]
    control, gave_up = gave_up_branch()
    injection = Injection("lr", 1, 0, 1, 100.0, tied_to="step")
    scores = score(gave_up, control, injection, study.cfg.recovery, study.costs, cap=7.0, detect_within=0)
    planted = dataclasses.replace(study, scores={"lr": {"rollback": scores}})
    cells = matrix([planted], study.cfg)
    cell = cells["lr"]["rollback"][str(study.seed)]
    assert cell["outcome"] == "gave_up" and cell["final_gap"] is None and cell["excess_area"] is None
    assert cell["scored_gap"] == scores["scored_gap"] > 0
    assert give_ups(cells)["lr"]["rollback"] == 1


def cell(caught: bool = True, latency: int | None = 0) -> dict:
    return {"outcome": "gap", "detected": caught, "latency": latency, "scored_gap": 0.05}


def test_the_detection_rate_counts_a_missed_spike_whose_branches_stay_scored():
    cells = {
        "lr": {"continue": {"0": cell(), "1": cell(caught=False)}, "rollback": {"0": cell(), "1": cell()}},
        "param": {"skip_step": {"0": cell(caught=False)}},  # no continue: the first policy is observed
    }
    rates = {cause: {k: v for k, v in found.items() if "latency" not in k} for cause, found in detection(cells).items()}
    assert rates["lr"] == {"injected": 2, "detected": 1, "rate": 0.5, "missed_seeds": [1]}
    assert rates["param"] == {"injected": 1, "detected": 0, "rate": 0.0, "missed_seeds": [0]}
    assert detection({"data": {"continue": {}}})["data"]["rate"] is None  # no origin left: no rate


def test_the_detection_reports_each_origins_latency_and_their_spread_over_the_flagged_ones():
    flagged = {"0": cell(latency=0), "1": cell(latency=7), "2": cell(latency=3), "3": cell(False, latency=None)}
    found = detection({"data": {"continue": flagged}})["data"]
    assert found["latency"] == {"0": 0, "1": 7, "2": 3, "3": None}
    assert found["latency_spread"] == {"min": 0, "median": 3.0, "max": 7, "distinct": 3}  # never flagged: left out
    at_once = detection({"data": {"continue": {"0": cell(), "1": cell()}}})["data"]["latency_spread"]
    assert at_once == {"min": 0, "median": 0.0, "max": 0, "distinct": 1}  # the policies acted at the first step
    assert detection({"data": {"continue": {"0": cell(False, latency=None)}}})["data"]["latency_spread"] is None


STUDY = {
    "ablation.d_model": 32,
    "ablation.n_layer": 2,
    "ablation.n_head": 2,
    "ablation.seq_len": 16,
    "ablation.batch_size": 4,
    "ablation.lr": 3e-3,
    "spike.seeds": [0],
    "spike.confirm_seeds": [1],
    "spike.run_steps": 40,
    "spike.origin_step": 10,
    "spike.warm_steps": 12,
    "spike.detect_window": 16,
    "spike.detect_warmup": 8,
    "spike.magnitude": 100.0,
    "spike.duration": 2,
    "spike.poison_batches_range": [2, 3],  # ends recovery.recover_steps before the window does
    "spike.min_origins_per_half": 1,
    "spike.kinds": ["data", "param", "lr"],
    "spike.sample_prompts": 2,
    "spike.sample_tokens": 4,
    "spike.data_reasons": ["generated_space_run"],
    "recovery.eval_steps": 12,
    "recovery.recover_steps": 8,
    "recovery.smooth_steps": 3,
    "recovery.checkpoint_every": 2,
    "recovery.rollback_steps": 4,
    "recovery.skip_batches": 3,
    "recovery.max_retries": 1,
}


def write_shard(path, tokens) -> dict:
    path.write_bytes(tokens.astype(np.uint16).tobytes())
    return {"path": path.name, "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "tokens": len(tokens)}


def tiny_project(project: Path) -> np.ndarray:
    """A tokenized project (Markov text, a poison pool of single-token runs then harmless text);
    returns the training tokens."""
    tokens_dir = project / "data" / "tokens"
    tokens_dir.mkdir(parents=True)
    train, val = markov_tokens(30_000), markov_tokens(4_000, seed=1)
    poison = np.concatenate([np.full(500, 256), np.arange(500) % 7])  # a run, then harmless text
    splits = {
        "train": write_shard(tokens_dir / "train.bin", train),
        "val": write_shard(tokens_dir / "val.bin", val),
        "poison": {
            **write_shard(tokens_dir / "poison.bin", poison),
            "reasons": {
                "generated_space_run": {"offset": 0, "tokens": 500},
                "too_short": {"offset": 500, "tokens": 500},
            },
        },
    }
    (tokens_dir / "manifest.json").write_text(
        json.dumps({"dtype": "uint16", "eot_id": 0, "vocab_size": 257, "splits": splits})
    )
    return train


PAST_PLATEAU = {"unigram_val_loss": 99.0}
"""A unigram baseline every tiny origin is far below: the tiny origins train too few steps to
leave the real one (the gate itself is tested on planted origins below)."""


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """The study of two seeds (one discovery, one confirmation) on a tiny project, published, its
    origins past the plateau."""
    project = tmp_path_factory.mktemp("project")
    train = tiny_project(project)
    cfg = tiny_config(**STUDY)
    studies = [run_seed(cfg, project, seed, project / SPIKE_RUN / f"seed_{seed}") for seed in cfg.spike.all_seeds]
    uris = {name: f"runs:/{name.replace('/', '-')}" for study in studies for name in study.identities}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(postmortem, "unigram_baseline", lambda manifest, seq_len: PAST_PLATEAU)
        metrics = publish(project, studies, train, uris, provenance(), 12.5)
    return studies, project, metrics


def test_the_spike_metrics_name_the_arithmetic_that_trained_the_branches_and_the_stages_wall_time(finished):
    _, project, metrics = finished
    written = json.loads((project / SPIKE_METRICS).read_text())
    assert written["wall_s"] == 12.5
    assert (
        written["provenance"]["numeric_path"] == metrics["provenance"]["numeric_path"] == provenance()["numeric_path"]
    )


def test_every_seed_scores_every_policy_of_every_cause_against_its_own_control(finished):
    studies, project, metrics = finished
    policies = studies[0].cfg.recovery.policies
    assert policies == ["continue", "skip_step", "skip_batch", "rollback", "rollback_lower_lr", "lower_lr", "swap_data"]
    assert list(metrics["seeds"]) == ["0", "1"] and metrics["false_positives"] == 0
    assert (metrics["discovery_seeds"], metrics["confirm_seeds"]) == ([0], [1])
    for seed, entry in metrics["seeds"].items():
        assert entry["origin_run"]["role"] == ("discovery" if seed == "0" else "confirmation")
        assert entry["fork_step"] == 10 + 12 and entry["end_step"] == 10 + 12 + 12
        assert all(entry["data"][p]["latency"] == 0 for p in policies)  # the poison batch itself is flagged
        assert all(set(policies) <= entry[k].keys() for k in ("data", "param", "lr"))
    assert sorted(p.name for p in (project / "reports" / "spike").iterdir()) == ["data.png", "lr.png", "param.png"]


def test_the_matrix_holds_an_outcome_and_a_scored_gap_for_every_cause_policy_and_seed(finished):
    studies, _, metrics = finished
    policies = studies[0].cfg.recovery.policies
    assert set(metrics["matrix"]) == {"data", "param", "lr"}
    for by_policy in metrics["matrix"].values():
        assert list(by_policy) == policies
        for by_seed in by_policy.values():
            assert list(by_seed) == ["0", "1"]
            for cell in by_seed.values():
                assert cell["outcome"] in OUTCOMES and np.isfinite(cell["scored_gap"])
                assert (cell["final_gap"] is None) == (cell["outcome"] == "gave_up")
                assert cell["final_gap"] in (None, cell["scored_gap"])
                assert cell["excess_area"] is None or cell["excess_area"] >= 0


@pytest.mark.parametrize("kind", ["param", "lr"])
def test_swap_data_on_a_cause_with_no_data_source_is_the_continue_branch(finished, kind):
    for study in finished[0]:
        swapped, kept = study.branches[kind]["swap_data"], study.branches[kind]["continue"]
        assert swapped.rows == kept.rows and swapped.detections == kept.detections
        assert all(a["action"].startswith("no data source to exclude") for a in swapped.actions)


def test_the_metrics_count_give_ups_and_detections_and_each_origins_latency_per_cause_over_the_matrix(finished):
    studies, _, metrics = finished
    for cause, by_policy in metrics["matrix"].items():
        assert metrics["give_ups"][cause] == {
            p: sum(c["outcome"] == "gave_up" for c in by_seed.values()) for p, by_seed in by_policy.items()
        }
        caught = [seed for seed, c in by_policy["continue"].items() if c["detected"]]
        assert metrics["detection"][cause]["injected"] == 2
        assert metrics["detection"][cause]["detected"] == len(caught)
        latency = {str(s.seed): s.scores[cause]["continue"]["latency"] for s in studies}
        assert metrics["detection"][cause]["latency"] == latency  # the branch's own first flag, per origin
    assert metrics["detection"]["data"]["rate"] == 1.0  # the first poisoned batch is flagged at every seed


def test_a_data_injection_comes_on_over_the_configured_ramp_and_no_other_cause_ramps():
    cfg = tiny_config(**{**STUDY, "spike.poison_ramp_batches": 2})
    assert make_injection("data", cfg, 10, 0).ramp == 2
    assert {make_injection(kind, cfg, 10, 0).ramp for kind in ("lr", "param")} == {0}


def onset_rows(first: int, last: int, jump_at: int | None) -> list[tuple[int, float, float]]:
    """(step, loss, grad norm) of a quiet run, its loss x2 from ``jump_at`` on (None: never)."""
    return [
        (s, (4.0 + 0.01 * (s % 2)) * (2 if jump_at is not None and s >= jump_at else 1), 1.0)
        for s in range(first, last)
    ]


def test_the_onset_rule_takes_the_longest_ramp_the_detector_flags_at_every_sizing_seed_in_time():
    cfg = tiny_config(
        **{**STUDY, "spike.poison_batches_range": [4, 4], "spike.sizing_ramps": [0, 2, 4], "spike.detect_within": 2}
    )
    start, warm = 30, onset_rows(1, 30, None)

    def probe(*jumps: int | None) -> dict:
        return {
            "injection_step": start,
            "warm": warm,
            "ramped": {str(r): onset_rows(30, 50, j) for r, j in zip((0, 2, 4), jumps)},
        }

    # the last step that counts: the stretch's end (33) + detect_within (2) = 35
    assert calibrate_ramp([probe(30, 35, 36)], 16.0, cfg) == (2, {"0": [0], "2": [5], "4": [None]})
    assert calibrate_ramp([probe(30, 35, 36), probe(30, None, 31)], 16.0, cfg)[0] == 0  # every seed, not most
    assert calibrate_ramp([probe(None, None, None)], 16.0, cfg)[0] is None


def test_the_onset_rule_replays_the_detector_with_its_lag_so_a_rise_that_lifts_a_trailing_window_is_caught():
    # A rise of 0.02 per step from step 30: 16σ of the quiet run is 0.083, crossed at its 4th step.
    rise = [(s, 4.0 + 0.01 * (s % 2) + 0.02 * max(0, s - 29), 1.0) for s in range(30, 50)]
    probe = {"injection_step": 30, "warm": onset_rows(1, 30, None), "ramped": {"0": onset_rows(30, 50, 30), "2": rise}}
    settings = {**STUDY, "spike.poison_batches_range": [4, 4], "spike.sizing_ramps": [0, 2], "spike.detect_within": 2}
    trailing = tiny_config(**settings)  # lag 0: the rise's first steps join the window and lift it
    assert calibrate_ramp([probe], 16.0, trailing) == (0, {"0": [0], "2": [None]})
    lagged = tiny_config(**{**settings, "spike.detect_lag": 4})
    assert calibrate_ramp([probe], 16.0, lagged) == (2, {"0": [0], "2": [3]})


def test_the_warm_up_must_hold_the_detectors_lag_and_its_warm_up_so_it_is_armed_at_the_injection():
    at_edge = {**STUDY, "spike.warm_steps": 12, "spike.detect_warmup": 8, "spike.detect_lag": 4}
    assert tiny_config(**at_edge).spike.detect_lag == 4
    with pytest.raises(ConfigError, match=r"^spike\.warm_steps: 12 is below spike\.detect_warmup \+ spike\.detect_lag"):
        tiny_config(**{**at_edge, "spike.detect_lag": 5})


def test_the_registered_poison_rule_prints_the_draws_of_the_seeds_the_default_study_runs():
    spike = load_config(REPO / "params.yaml", "default").spike
    rule = design()["findings"]["spike"]["conditions"]["poison"]["rule"]
    assert f"The study seeds draw {poison_draws(spike)} (" in rule  # new seeds, new draws: reprint them


def test_each_origin_draws_its_poisoned_stretch_and_the_data_branches_meet_that_many_poison_batches(finished):
    studies, _, metrics = finished
    for study in studies:
        n, injection = poison_length(study.cfg.spike, study.seed), study.injections["data"]
        assert injection.duration == n == metrics["poison_batches"][str(study.seed)]
        assert metrics["seeds"][str(study.seed)]["data"]["injection"]["duration"] == n


def test_each_origin_draws_its_own_poison_length_from_both_ends_of_its_range_and_again_the_same_for_a_seed():
    spike = tiny_config(**{**STUDY, "spike.poison_batches_range": [2, 4]}).spike
    assert (poison_length(spike, 2), poison_length(spike, 3)) == (2, 4)  # two origins, two lengths: no constant
    draws = [poison_length(spike, seed) for seed in range(40)]
    assert set(draws) == {2, 3, 4}  # both ends included, nothing outside
    assert draws == [poison_length(spike, seed) for seed in range(40)]  # the seed alone decides
    fixed = tiny_config(**{**STUDY, "spike.poison_batches_range": [3, 3]}).spike
    assert {poison_length(fixed, seed) for seed in range(10)} == {3}


def planted_origins(study, losses: dict[int, float | None], seeds: list[int], confirm: list[int], need: int = 2):
    """Studies with the planted validation losses at their origins, under these seed halves."""
    cfg = study.cfg.replace(
        **{"spike.seeds": seeds, "spike.confirm_seeds": confirm, "spike.min_origins_per_half": need}
    )
    return [
        dataclasses.replace(
            study,
            cfg=cfg,
            seed=seed,
            origin_run={**study.origin_run, "val_loss": loss, "role": "discovery" if seed in seeds else "confirmation"},
        )
        for seed, loss in losses.items()
    ]


def test_the_plateau_gate_passes_an_origin_at_the_bound_and_excludes_one_a_hair_above_naming_it(finished):
    studies = planted_origins(finished[0][0], {0: 5.0, 1: 5.0001, 2: 4.0, 3: None}, [0, 1], [2, 3], need=1)
    gate = plateau_gate(studies, unigram=5.5, margin=0.5)
    assert {s: o["passed"] for s, o in gate["origins"].items()} == {"0": True, "1": False, "2": True, "3": False}
    assert gate["excluded"] == [1, 3] and gate["bound"] == 5.0 and gate["why"] is None


def test_the_finding_is_not_tested_when_a_half_keeps_fewer_origins_past_the_plateau_than_registered(finished):
    losses = {0: 4.0, 1: 4.0, 2: 4.0, 3: 6.0}
    studies = planted_origins(finished[0][0], losses, [0, 1], [2, 3], need=2)
    assert plateau_gate(studies, unigram=5.5, margin=0.5)["why"] == (
        "confirmation: 1 of 2 origins past the plateau (needs >= 2)"
    )
    passing = planted_origins(finished[0][0], {**losses, 3: 4.0}, [0, 1], [2, 3], need=2)
    assert plateau_gate(passing, unigram=5.5, margin=0.5)["why"] is None
    alone = planted_origins(finished[0][0], {0: 4.0, 1: 4.0}, [0, 1], [], need=2)  # no confirmation half
    assert plateau_gate(alone, unigram=5.5, margin=0.5)["why"] is None


def test_an_origin_on_the_plateau_leaves_the_matrix_but_keeps_its_entry(finished):
    studies = planted_origins(finished[0][0], {0: 3.0, 1: 6.0}, [0], [1], need=1)
    metrics = summary_metrics(studies, unigram=5.5)
    assert metrics["plateau"]["excluded"] == [1] and "confirmation: 0 of 1" in metrics["plateau"]["why"]
    assert all(list(by_seed) == ["0"] for by_policy in metrics["matrix"].values() for by_seed in by_policy.values())
    assert list(metrics["seeds"]) == ["0", "1"]
    none_left = summary_metrics(planted_origins(finished[0][0], {0: 6.0}, [0], [], need=1), unigram=5.5)
    assert set(none_left["matrix"]) == {"data", "param", "lr"}  # the grid stays, empty
    assert none_left["matrix"]["data"]["continue"] == {} and none_left["detection"]["data"]["rate"] is None


def test_the_seeds_are_independent_origin_runs(finished):
    studies, _, metrics = finished
    runs = [metrics["seeds"][s]["origin_run"] for s in ("0", "1")]
    assert runs[0]["identity"] != runs[1]["identity"] and runs[0]["train_loss"] != runs[1]["train_loss"]
    assert [s.cfg.train.seed for s in studies] == [0, 1] and studies[0].cfg.model.d_model == STUDY["ablation.d_model"]


def test_each_cause_is_tied_to_what_it_names_data_to_the_stream_param_once_lr_to_steps(finished):
    _, _, metrics = finished
    for entry in metrics["seeds"].values():
        tied = {kind: entry[kind]["injection"]["tied_to"] for kind in ("data", "param", "lr")}
        assert tied == {"data": "stream", "param": "once", "lr": "step"}


def test_data_injection_serves_only_spike_causing_poison(finished):
    study = finished[0][0]
    batch = study.branches["data"]["continue"].batches[study.injections["data"].start]
    assert set(batch[0].unique().tolist()) == {256}  # the run, never the harmless range


def test_the_postmortem_has_every_template_section_and_the_numbers_of_the_first_seed(finished):
    studies, project, metrics = finished
    study, metrics = studies[0], metrics["seeds"]["0"]
    assert sorted(p.name for p in (project / "reports" / "postmortems").glob("*.md")) == [
        "spike_1_data.md",
        "spike_2_param.md",
        "spike_3_lr.md",
    ]
    text = (project / "reports" / "postmortems" / "spike_1_data.md").read_text()
    headings = re.findall(r"^## (.+)$", text, flags=re.M)
    assert headings == list(SECTIONS)
    assert re.match(r"# Spike #1 — \d{4}-\d\d-\d\d \d\d:\d\d UTC", text)
    s = metrics["data"]["symptoms"]

    def quoted(label):
        return float(re.search(rf"^- {re.escape(label)}: ([-\d.]+)", text, flags=re.M).group(1))

    assert quoted("Pre-spike loss") == round(s["pre_spike_loss"], 4)
    assert quoted("Peak loss") == round(s["peak_loss"], 4)
    assert quoted(f"Recovery loss ({study.cfg.recovery.recover_steps} steps later)") == round(s["recovery_loss"], 4)
    assert quoted("Grad norm peak") == round(s["grad_norm_peak"], 4)
    assert "runs:/s0-data-continue" in text and "Batch index range:" in text
    assert (project / "reports" / "postmortems" / "spike_1_data_tokens.png").stat().st_size > 0
    assert json.loads((project / "metrics" / "spike.json").read_text())["seeds"]["0"]["data"]["symptoms"] == s
    observed = metrics["data"]["continue"]
    assert f"- Type: {observed['type']} (" in text
    for policy, scores in metrics["data"].items():
        if policy in study.cfg.recovery.policies:
            assert f"  | {policy} | {scores['type']} | {scores['peak_ratio']:.2f} |" in text


EDGES = [
    # (key, the last valid value, one step outside it), on top of STUDY
    ("spike.seeds", [0], []),  # a study needs a discovery seed
    ("spike.seeds", [0], [0, 0]),  # a seed twice
    ("spike.seeds", [0], [-1]),
    ("spike.confirm_seeds", [2], [0]),  # a discovery seed cannot confirm
    ("spike.confirm_seeds", [0 + 1], [1, 1]),
    ("spike.origin_step", 1, 0),
    ("spike.run_steps", 10 + 12 + 12, 10 + 12 + 12 - 1),  # the window must end inside the schedule
    ("spike.warm_steps", 8, 7),  # spike.detect_warmup: the detector would be blind
    ("spike.workers", 0, -1),
    ("spike.param_block", 1, 2),  # ablation.n_layer blocks
    ("spike.poison_batches_range", [1, 1], [0, 1]),  # a data injection poisons at least one batch
    ("spike.poison_batches_range", [2, 2], [3, 2]),  # shortest first
    ("spike.poison_batches_range", [2, 3], [2]),  # two ends
    ("spike.poison_ramp_batches", 2, 3),  # no longer than the shortest stretch: every stretch reaches full poison
    ("spike.poison_ramp_batches", 0, -1),
    ("spike.detect_within", 0, -1),
    ("spike.detect_lag", 0, -1),
    ("spike.min_origins_per_half", 1, 0),
    ("spike.sizing_seeds", [2], [1]),  # a confirmation seed cannot size
    ("spike.sizing_seeds", [0 + 2], [2, 2]),
    ("spike.sizing_seeds", [0 + 2], [-1]),
    ("spike.sizing_zscores", [0.5, 6.0], [0.0, 6.0]),  # a z-score above the mean
    ("spike.sizing_zscores", [5.0, 6.0], [6.0, 6.0]),  # strictly ascending
    ("spike.max_false_alarms", 0.0, -0.5),
]


@pytest.mark.parametrize(("key", "last_valid", "outside"), EDGES)
def test_each_spike_setting_takes_its_last_valid_value_and_refuses_the_next_naming_the_key(key, last_valid, outside):
    assert tiny_config(**{**STUDY, key: last_valid}).to_flat_dict()[key] == last_valid
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}:"):
        tiny_config(**{**STUDY, key: outside})


def test_the_warm_up_must_reach_back_as_far_as_a_rollback_goes():
    at_edge = {**STUDY, "spike.warm_steps": 8, "recovery.rollback_steps": 8}
    assert tiny_config(**at_edge).spike.warm_steps == 8
    with pytest.raises(ConfigError, match=r"^spike\.warm_steps: 8 is below recovery\.rollback_steps=9"):
        tiny_config(**{**at_edge, "recovery.rollback_steps": 9})


def test_the_longest_poison_draw_ends_the_recovery_time_before_the_window_does():
    at_edge = {**STUDY, "spike.poison_batches_range": [1, 4], "recovery.skip_batches": 4}  # 12 - 8
    assert tiny_config(**at_edge).spike.poison_batches_range == [1, 4]
    with pytest.raises(ConfigError, match=r"\[1, 5\].*recovery\.eval_steps - recovery\.recover_steps = 4"):
        tiny_config(**{**at_edge, "spike.poison_batches_range": [1, 5], "recovery.skip_batches": 5})


def test_the_skip_window_is_fixed_apart_from_the_poison_and_may_be_shorter_than_its_longest_draw():
    # version 3: the window is PaLM's, never sized to the poison; a stretch longer than it meets the
    # policy again past it, spends the retry, and counts
    short = {**STUDY, "spike.poison_batches_range": [2, 4], "recovery.skip_batches": 1}
    assert tiny_config(**short).recovery.skip_batches == 1


def test_harmless_poison_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"^spike\.data_reasons:"):
        tiny_config(**{**STUDY, "spike.data_reasons": ["too_short"]})  # headings are never injected


REPO = Path(__file__).resolve().parents[1]


@pytest.mark.e2e
def test_the_stage_gives_every_cause_the_same_matrix_on_one_worker_as_on_two(tmp_path, live_services):
    """The stage itself at the smoke scale, its seeds fanned out as Prefect tasks onto Dask workers."""
    from flows.spike import spike_flow
    from tests.test_ablate_stage import on_test_servers

    tiny_project(tmp_path)
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    shutil.copytree(REPO / "profiles", tmp_path / "profiles")
    written = {}
    for workers in (1, 2):
        with on_test_servers(tmp_path):
            overrides = {"spike.workers": workers, "tracking.experiment": "spike-test"}
            assert spike_flow(profile="smoke", overrides=overrides, return_state=True).is_completed()
        written[workers] = json.loads((tmp_path / SPIKE_METRICS).read_text())
    one, two = written[1], written[2]
    assert set(one["matrix"]) == {"data", "param", "lr"} and list(one["seeds"]) == ["0", "1"]
    assert one["matrix"] == two["matrix"]
    assert {s: e["origin_run"] for s, e in one["seeds"].items()} == {
        s: e["origin_run"] for s, e in two["seeds"].items()
    }


def test_the_report_tables_each_cause_by_policy_with_outcome_counts_over_the_seeds(finished):
    from tasks.report.sections.stages import spike_section

    studies, project, _ = finished
    policies = studies[0].cfg.recovery.policies
    lines = spike_section(project, json.loads((project / SPIKE_METRICS).read_text())).lines  # keys sorted there
    header = next(line for line in lines if line.startswith("| cause |"))
    assert header == "| " + " | ".join(["cause", *policies]) + " |"
    rows = {line.split(" | ")[0].lstrip("| "): line for line in lines if line.startswith("| ") and "-tied)" in line}
    assert list(rows) == ["data (data-tied)", "param (state-tied)", "lr (step-tied)"]
    for row in rows.values():
        for cell in row.strip(" |").split(" | ")[1:]:
            assert sum(int(n) for n in cell.split(",")[0].split("/")) == 2  # two seeds in every cell
