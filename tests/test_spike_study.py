"""The spike study's logic (tasks/spike/study.py, tasks/spike/postmortem.py): classification and the
excess-loss area on synthetic curves, a whole two-origin study on a tiny synthetic project, read back
from its metrics and post-mortems, and a damaged milestone refused before anything is written."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest

from model.checkpoint import CheckpointError
from model.provenance import provenance
from model.spike.branch import Branch
from model.train import Trainer
from model.typed_config import UserError
from tasks.runtime.outputs import SPIKE_METRICS, SPIKE_RUN
from tasks.spike.postmortem import SECTIONS, publish
from tasks.spike.study import classify, excess_area, run_study, window_curves
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


def test_a_branch_that_gave_up_or_went_non_finite_counts_at_the_cap_from_there_on():
    control = Branch("continue", rows=rows([3.0, 3.0, 3.0, 3.0]))
    gave_up = Branch("skip_batch", status="stopped", rows=rows([4.0, float("nan")]))
    b, c = window_curves(gave_up, control, smooth=1, cap=7.0)
    assert b.tolist() == [4.0, 7.0, 7.0, 7.0] and c.tolist() == [3.0] * 4
    assert excess_area(b, c) == pytest.approx(1.0 + 3 * 4.0)


STUDY = {
    "train.steps": 40,
    "checkpoint.milestones": [10, 14],
    "checkpoint.every_steps": 5,
    "optim.lr": 3e-3,
    "schedule.kind": "constant",
    "spike.origins": [10, 14],
    "spike.warm_steps": 12,
    "spike.detect_window": 16,
    "spike.detect_warmup": 8,
    "spike.magnitude": 100.0,
    "spike.duration": 2,
    "spike.kinds": ["data", "lr"],
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


MILESTONE = "pretrain/step_00000010.pt"
MILESTONES = {10: MILESTONE, 14: "pretrain/step_00000014.pt"}


def tiny_project(project: Path) -> np.ndarray:
    """A tokenized project (Markov text, a poison pool of single-token runs) and a pretrain
    milestones at steps 10 and 14 (MILESTONES); returns the training tokens."""
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
    Trainer(tiny_config(**STUDY), train, val, [], project / "pretrain", identity="pretrain-id").run(until=14)
    return train


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """The study run on a tiny project, its outputs published."""
    project = tmp_path_factory.mktemp("project")
    train = tiny_project(project)
    milestones = {step: project / path for step, path in MILESTONES.items()}
    studies = run_study(tiny_config(**STUDY), project, milestones, project / "runs" / "spike")
    uris = {name: f"runs:/{name.replace('/', '-')}" for study in studies for name in study.identities}
    metrics = publish(project, studies, train, uris, provenance())
    return studies, project, metrics


def test_the_spike_metrics_name_the_arithmetic_that_trained_the_branches(finished):
    _, project, metrics = finished
    written = json.loads((project / SPIKE_METRICS).read_text())
    assert (
        written["provenance"]["numeric_path"] == metrics["provenance"]["numeric_path"] == provenance()["numeric_path"]
    )


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the tensors: torch.load alone would read it without a word
    path.write_bytes(data)


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # torch.load fails on it, naming no file


def drop_the_sidecar(path: Path) -> None:
    path.with_name(path.name + ".sha256").unlink()


@pytest.mark.parametrize("damage", [flip_a_byte, truncate, drop_the_sidecar])
def test_a_damaged_milestone_stops_the_study_naming_it_before_anything_is_written(tmp_path, damage):
    tiny_project(tmp_path)
    damage(tmp_path / MILESTONE)
    previous = tmp_path / SPIKE_METRICS
    previous.parent.mkdir()
    previous.write_text('{"from": "the previous run"}')

    with pytest.raises(CheckpointError, match=f"^checkpoint {re.escape(str(tmp_path / MILESTONE))} is unusable: ") as e:
        run_study(
            tiny_config(**STUDY), tmp_path, {s: tmp_path / p for s, p in MILESTONES.items()}, tmp_path / SPIKE_RUN
        )

    assert isinstance(e.value, UserError)  # the CLI prints that one line and exits 2
    assert previous.read_text() == '{"from": "the previous run"}'
    assert not (tmp_path / SPIKE_RUN).exists()  # stopped before the warm-up's first checkpoint


def test_every_origin_scores_every_policy_of_every_injection_against_its_own_control(finished):
    studies, project, metrics = finished
    policies = studies[0].cfg.recovery.policies
    assert list(metrics["origins"]) == ["10", "14"] and metrics["false_positives"] == 0
    for entry in metrics["origins"].values():
        assert all(set(policies) <= set(entry[k]) for k in ("data", "lr"))
        assert all(entry[k][p]["latency"] is not None for k in ("data", "lr") for p in policies)
        assert all(entry[k][p]["excess_area"] >= 0 for k in ("data", "lr") for p in policies)
    assert metrics["origins"]["14"]["origin_step"] == 14 + studies[0].cfg.spike.warm_steps
    assert sorted(p.name for p in (project / "reports" / "spike").iterdir()) == ["data.png", "lr.png"]


def test_the_lr_injection_is_tied_to_steps_and_the_data_injection_to_the_stream(finished):
    _, _, metrics = finished
    for entry in metrics["origins"].values():
        assert (entry["lr"]["injection"]["tied_to"], entry["data"]["injection"]["tied_to"]) == ("step", "stream")


def test_data_injection_serves_only_spike_causing_poison(finished):
    study = finished[0][0]
    batch = study.branches["data"]["continue"].batches[study.injections["data"].start]
    assert set(batch[0].unique().tolist()) == {256}  # the run, never the harmless range


def test_the_postmortem_has_every_template_section_and_the_numbers_of_the_first_origin(finished):
    studies, project, metrics = finished
    study, metrics = studies[0], metrics["origins"]["10"]
    assert sorted(p.name for p in (project / "reports" / "postmortems").glob("*.md")) == [
        "spike_1_data.md",
        "spike_2_lr.md",
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
    assert "runs:/10-data-continue" in text and "Batch index range:" in text
    assert (project / "reports" / "postmortems" / "spike_1_data_tokens.png").stat().st_size > 0
    assert json.loads((project / "metrics" / "spike.json").read_text())["origins"]["10"]["data"]["symptoms"] == s
    observed = metrics["data"]["continue"]
    assert f"- Type: {observed['type']} (" in text
    for policy, scores in metrics["data"].items():
        if policy in study.cfg.recovery.policies:
            assert f"  | {policy} | {scores['type']} | {scores['peak_ratio']:.2f} |" in text


@pytest.mark.parametrize(
    ("dotted", "key"),
    [
        ({"spike.origins": [10, 11]}, "spike.origins"),  # 11 is not a milestone
        ({"spike.data_reasons": ["too_short"]}, "spike.data_reasons"),  # harmless headings never injected
        ({"spike.warm_steps": 4}, "spike.warm_steps"),  # the detector would be blind
    ],
)
def test_the_spike_config_is_refused_naming_the_key(dotted, key):
    from model.typed_config import ConfigError

    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}:"):
        tiny_config(**{**STUDY, **dotted})
