"""The spike study's logic (tasks/spike/study.py, tasks/spike/postmortem.py): classification, outcomes
and the excess-loss area on synthetic curves, a whole two-seed study (origin runs, then every cause x
policy branch) on a tiny synthetic project, read back from its matrix, metrics and post-mortems,
and each spike setting refused one step outside its range, naming the key."""

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
from tasks.runtime.outputs import SPIKE_METRICS, SPIKE_RUN
from tasks.spike.config import OUTCOMES
from tasks.spike.postmortem import SECTIONS, publish
from tasks.spike.study import Costs, classify, excess_area, matrix, outcome, run_seed, score, window_curves
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


def gave_up_branch() -> tuple[Branch, Branch]:
    """A control over 4 steps and a rollback branch that gave up after 2 of them."""
    control = Branch("continue", rows=rows([3.0, 3.0, 3.0, 3.0]), steps_run=4)
    gave_up = Branch("rollback", status="stopped", rows=rows([9.0, 8.0]), steps_run=5, segments=2)
    for branch in (control, gave_up):
        for row in branch.rows:
            row.update(skipped=0.0, grad_norm=1.0)
    return control, gave_up


def test_a_branch_that_gave_up_has_no_gap_or_area_instead_of_an_imputed_one():
    control, gave_up = gave_up_branch()
    injection = Injection("lr", 1, 0, 1, 100.0, tied_to="step")
    cfg = tiny_config().recovery
    scores = score(gave_up, control, injection, cfg, Costs(1.0, 1, 1.0, 1.0), cap=7.0)
    assert scores["outcome"] == "gave_up" and scores["status"] == "stopped" and scores["restarts"] == 1
    assert scores["final_gap"] is None and scores["excess_area"] is None


def test_the_matrix_counts_a_give_up_as_its_own_outcome(finished):
    studies, _, metrics = finished
    study = studies[0]
    control, gave_up = gave_up_branch()
    injection = Injection("lr", 1, 0, 1, 100.0, tied_to="step")
    scores = score(gave_up, control, injection, study.cfg.recovery, study.costs, cap=7.0)
    planted = dataclasses.replace(study, scores={"lr": {"rollback": scores}})
    cell = matrix([planted])["lr"]["rollback"][str(study.seed)]
    assert cell["outcome"] == "gave_up" and cell["final_gap"] is None and cell["excess_area"] is None


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
    "spike.data_batches": 2,
    "spike.sizing_data_batches": [2, 3, 4],  # each ends recovery.recover_steps before the window does
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


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """The study of two seeds (one discovery, one confirmation) on a tiny project, published."""
    project = tmp_path_factory.mktemp("project")
    train = tiny_project(project)
    cfg = tiny_config(**STUDY)
    studies = [run_seed(cfg, project, seed, project / SPIKE_RUN / f"seed_{seed}") for seed in cfg.spike.all_seeds]
    uris = {name: f"runs:/{name.replace('/', '-')}" for study in studies for name in study.identities}
    metrics = publish(project, studies, train, uris, provenance())
    return studies, project, metrics


def test_the_spike_metrics_name_the_arithmetic_that_trained_the_branches(finished):
    _, project, metrics = finished
    written = json.loads((project / SPIKE_METRICS).read_text())
    assert (
        written["provenance"]["numeric_path"] == metrics["provenance"]["numeric_path"] == provenance()["numeric_path"]
    )


def test_every_seed_scores_every_policy_of_every_cause_against_its_own_control(finished):
    studies, project, metrics = finished
    policies = studies[0].cfg.recovery.policies
    assert list(metrics["seeds"]) == ["0", "1"] and metrics["false_positives"] == 0
    assert (metrics["discovery_seeds"], metrics["confirm_seeds"]) == ([0], [1])
    for seed, entry in metrics["seeds"].items():
        assert entry["origin_run"]["role"] == ("discovery" if seed == "0" else "confirmation")
        assert entry["fork_step"] == 10 + 12 and entry["end_step"] == 10 + 12 + 12
        assert all(entry["data"][p]["latency"] == 0 for p in policies)  # the poison batch itself is flagged
        assert all(set(policies) <= entry[k].keys() for k in ("data", "param", "lr"))
    assert sorted(p.name for p in (project / "reports" / "spike").iterdir()) == ["data.png", "lr.png", "param.png"]


def test_the_matrix_holds_an_outcome_for_every_cause_policy_and_seed(finished):
    studies, _, metrics = finished
    policies = studies[0].cfg.recovery.policies
    assert set(metrics["matrix"]) == {"data", "param", "lr"}
    for by_policy in metrics["matrix"].values():
        assert list(by_policy) == policies
        for by_seed in by_policy.values():
            assert list(by_seed) == ["0", "1"]
            for cell in by_seed.values():
                assert cell["outcome"] in OUTCOMES
                assert (cell["final_gap"] is None) == (cell["outcome"] == "gave_up")
                assert cell["excess_area"] is None or cell["excess_area"] >= 0


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
    ("spike.data_batches", 1, 0),  # a data injection poisons at least one batch
    ("spike.sizing_seeds", [2], [1]),  # a confirmation seed cannot size
    ("spike.sizing_seeds", [0 + 2], [2, 2]),
    ("spike.sizing_seeds", [0 + 2], [-1]),
    ("spike.sizing_zscores", [0.5, 6.0], [0.0, 6.0]),  # a z-score above the mean
    ("spike.sizing_zscores", [5.0, 6.0], [6.0, 6.0]),  # strictly ascending
    ("spike.max_false_alarms", 0.0, -0.5),
    ("spike.sizing_data_batches", [1], [0]),
    ("spike.sizing_data_batches", [3, 4], [4, 3]),
    ("spike.sizing_data_batches", [12 - 8], [12 - 8 + 1]),  # recovery.eval_steps - recovery.recover_steps
    ("recovery.skip_batches", 2, 1),  # the skip window covers spike.data_batches
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


def test_a_data_injection_ends_the_recovery_time_before_the_window_does():
    at_edge = {**STUDY, "spike.data_batches": 4, "recovery.skip_batches": 4}  # eval_steps 12 - recover_steps 8
    assert tiny_config(**at_edge).spike.data_batches == 4
    with pytest.raises(ConfigError, match=r"^spike\.data_batches: 5 is above recovery\.eval_steps"):
        tiny_config(**{**at_edge, "spike.data_batches": 5, "recovery.skip_batches": 5})


def test_the_skip_window_need_not_cover_the_poison_where_no_policy_skips_or_no_data_cause_runs():
    short = {**STUDY, "recovery.skip_batches": 1}
    assert (
        tiny_config(**{**short, "recovery.policies": ["continue", "skip_step", "lower_lr"]}).recovery.skip_batches == 1
    )
    assert tiny_config(**{**short, "spike.kinds": ["param", "lr"]}).recovery.skip_batches == 1


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
    from tasks.report.render import spike_section

    studies, project, _ = finished
    policies = studies[0].cfg.recovery.policies
    lines = spike_section(project, json.loads((project / SPIKE_METRICS).read_text()))  # keys sorted there
    header = next(line for line in lines if line.startswith("| cause |"))
    assert header == "| " + " | ".join(["cause", *policies]) + " |"
    rows = {line.split(" | ")[0].lstrip("| "): line for line in lines if line.startswith("| ") and "-tied)" in line}
    assert list(rows) == ["data (data-tied)", "param (state-tied)", "lr (step-tied)"]
    for row in rows.values():
        for cell in row.strip(" |").split(" | ")[1:]:
            assert sum(int(n) for n in cell.split(",")[0].split("/")) == 2  # two seeds in every cell
