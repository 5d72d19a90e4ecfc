"""The spike finding's secondary analysis (tasks/report/natural.py, tasks/ablate/natural.py): natural
spikes scored by the same policies. Its pure rules at their edges on synthetic runs (fewer acted runs
than the registered minimum are NOT TESTED, exactly the minimum is tested, a run where the policy
never acted leaves its pair), its arms (continue is the beta2 family's own run, by its key), and one
tiny arm with a policy attached that acts on its detector's flags and only from the first of them."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from model.typed_config import ConfigError
from tasks.ablate.arm import run_arm, run_command
from tasks.ablate.grid import arm_config, arm_key, families
from tasks.ablate.natural import condition, is_control, natural_arms, natural_record
from tasks.config import Config, load_config
from tasks.report.natural import (
    BETTER,
    EQUIVALENT,
    NOT_SHOWN,
    WORSE,
    actions_of,
    analyse,
    min_runs,
    natural_claim,
    natural_label,
)
from tasks.report.recovery import margin
from tasks.report.sections.natural import natural_section

ROOT = Path(__file__).resolve().parents[1]
DATA = {"train": "a" * 64, "val": "b" * 64}
VETO = {"step": 300, "policy": "skip_step", "action": "update vetoed (weights and Adam state untouched)"}


def run(loss: float, acted: bool = True) -> dict:
    return {"capped_loss": loss, "flagged": 1 if acted else 0, "actions": [VETO] if acted else []}


def runs(gaps: list[float], acted: int | None = None, base: float = 6.0) -> tuple[dict, dict]:
    """(policy runs, continue runs) on seeds 0.., the policy's loss ``base`` x (1 + gap); the first
    ``acted`` of them acted (all by default)."""
    acted = len(gaps) if acted is None else acted
    policy = {str(s): run(base * (1 + g), s < acted) for s, g in enumerate(gaps)}
    return policy, {str(s): run(base, False) for s in range(len(gaps))}


SMALL = [0.001, -0.002, 0.0015, -0.0005, 0.001]


def test_the_registered_minimum_is_the_spike_findings_count_and_the_margin_its_recovery_margin():
    assert min_runs() == 4 and margin() == 0.03


def test_fewer_acted_runs_than_the_minimum_is_not_tested_however_clear_the_gaps():
    claim = natural_claim("skip_step", *runs(SMALL[:4], acted=3), least=4, within=0.03)
    assert claim.not_tested == "skip_step acted in 3 of 4 runs, fewer than the registered 4"
    assert natural_label(claim).startswith("not tested (") and claim.p is None


def test_exactly_the_minimum_of_acted_runs_is_tested():
    claim = natural_claim("skip_step", *runs(SMALL[:4]), least=4, within=0.03)
    assert claim.not_tested is None and claim.p is not None and claim.p < 0.05
    assert natural_label(claim) == EQUIVALENT


def test_a_run_where_the_policy_never_acted_leaves_its_pair_whatever_its_gap():
    policy, control = runs([*SMALL[:4], 0.5], acted=4)  # seed 4: never flagged, yet half a loss apart
    claim = natural_claim("lower_lr", policy, control, least=4, within=0.03)
    assert natural_label(claim) == EQUIVALENT and claim.estimate is not None and abs(claim.estimate) < 0.003


def test_a_policy_that_never_acted_is_not_tested_and_counted_as_such():
    policy, control = runs(SMALL[:4], acted=0)
    assert natural_claim("lower_lr", policy, control, least=4, within=0.03).not_tested
    assert actions_of(policy) == {
        "runs": 4,
        "acted": 0,
        "flagged": 0,
        "actions": 0,
        "vetoed": 0,
        "let_through": 0,
        "lowered_lr": 0,
    }


@pytest.mark.parametrize(
    ("gaps", "label"),
    [
        ([0.10, 0.11, 0.12, 0.10], WORSE),
        ([-0.10, -0.11, -0.12, -0.10], BETTER),
        ([0.0, 0.06, -0.05, 0.02], NOT_SHOWN),
    ],
)
def test_a_policy_is_worse_or_better_only_by_more_than_the_margin_and_not_shown_in_between(gaps, label):
    assert natural_label(natural_claim("skip_step", *runs(gaps), least=4, within=0.03)) == label


def test_the_record_is_analysed_policy_by_policy_with_what_each_did():
    skip, control = runs(SMALL[:4])
    lower, _ = runs(SMALL[:4], acted=2)
    record = {
        "policies": ["skip_step", "lower_lr"],
        "runs": {"continue": control, "skip_step": skip, "lower_lr": lower},
    }
    out = analyse(record)
    assert out["skip_step"]["verdict"] == EQUIVALENT and out["skip_step"]["acted"] == 4
    assert out["skip_step"]["vetoed"] == 4 and set(out["skip_step"]["gaps"]) == {"0", "1", "2", "3"}
    assert out["lower_lr"]["verdict"].startswith("not tested") and out["lower_lr"]["acted"] == 2


def test_the_default_study_retrains_the_registered_condition_per_first_round_seed_and_policy():
    cfg = Config()
    arms = natural_arms(cfg)
    assert len(arms) == len(cfg.ablation.seeds) * 2 and {p for _, p in arms} == {"skip_step", "lower_lr"}
    assert all(arm.family == "beta2" and arm.factors == condition() for arm, _ in arms)
    assert sorted({arm.seed for arm, _ in arms}) == sorted(cfg.ablation.seeds)


def test_a_profile_whose_beta2_grid_lacks_the_condition_or_names_no_policy_trains_none():
    assert natural_arms(load_config(ROOT / "params.yaml", "smoke", {})) == []  # smoke: no 4x multiplier
    assert natural_arms(Config().replace(**{"ablation.natural_policies": []})) == []


def test_continue_is_the_beta2_familys_own_arm_and_each_policy_a_run_of_its_own():
    cfg = Config()
    family = families(cfg)["beta2"]
    arm, _ = natural_arms(cfg)[0]
    arm_cfg = arm_config(cfg, arm, family)
    family_key = arm_key(arm_cfg, DATA, "code", "none", 0)
    keys = {p: arm_key(arm_cfg, DATA, "code", "none", 0, p) for p in ("none", "skip_step", "lower_lr")}
    assert keys["none"] == family_key
    assert len(set(keys.values())) == 3
    lower = arm_cfg.replace(**{"recovery.lr_factor": 0.25})
    assert arm_key(lower, DATA, "code", "none", 0, "lower_lr") != keys["lower_lr"]
    assert arm_key(lower, DATA, "code", "none", 0) == family_key  # no policy: its settings shape nothing


def test_the_record_takes_continue_from_the_familys_arms_and_leaves_failed_runs_out():
    cfg = Config()
    seed = cfg.ablation.seeds[0]
    control = {"family": "beta2", "seed": seed, "factors": condition(), "status": "completed", "key": "k"}
    other = control | {"factors": {"beta2": 0.95, "lr_mult": 4.0}, "key": "o"}
    failed = control | {"policy": "skip_step", "status": "failed", "key": "f"}
    record = natural_record(cfg, [control, other], [failed])
    assert list(record["runs"]["continue"]) == [str(seed)] and record["runs"]["continue"][str(seed)]["key"] == "k"
    assert record["runs"]["skip_step"] == {} and record["policies"] == ["skip_step", "lower_lr"]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (["skip_step", "skip_step"], "ablation.natural_policies: .* repeats a policy"),
        (["rollback"], "ablation.natural_policies"),
    ],
)
def test_a_bad_policy_list_is_refused_naming_the_key(value, message):
    with pytest.raises(ConfigError, match=message):
        Config().replace(**{"ablation.natural_policies": value})


def test_an_arm_with_a_policy_acts_on_its_detectors_flags_and_is_the_plain_arm_until_the_first(tmp_path):
    """A tiny arm whose detector flags often (a low z-score): skip_step vetoes flagged updates, so
    the run leaves the plain arm's from the first flag on and not before."""
    tiny_tokens(tmp_path)
    sets = {
        "train.steps": 30,
        "train.device": "cpu",
        "train.cpu_threads": 1,
        "precision.mode": "fp32",
        "spike.detect_warmup": 4,
        "spike.detect_window": 8,
        "spike.detect_zscore": 0.5,
        "spike.detect_ratio": 1.01,
    }
    cfg = load_config(ROOT / "params.yaml", "smoke", sets)
    plain = run_arm(cfg, tmp_path, tmp_path / "plain")
    skip = run_arm(cfg, tmp_path, tmp_path / "skip", policy="skip_step")
    first = next(r["step"] for r in plain["rows"] if r["flagged"])
    assert skip["policy"] == "skip_step" and skip["actions"] and skip["actions"][0]["step"] == first
    assert plain["actions"] == [] and plain["key"] != skip["key"]
    same = [(r["step"], r["loss"]) for r in plain["rows"] if r["step"] <= first]
    assert same == [(r["step"], r["loss"]) for r in skip["rows"] if r["step"] <= first]
    assert plain["weights_sha256"] != skip["weights_sha256"]


def test_the_report_shows_each_policys_verdict_gap_and_acted_runs_and_nothing_without_the_arms():
    skip, control = runs(SMALL[:4])
    lower, _ = runs(SMALL[:4], acted=1)
    record = {
        "condition": condition(),
        "seeds": [0, 1, 2, 3],
        "policies": ["skip_step", "lower_lr"],
        "runs": {"continue": control, "skip_step": skip, "lower_lr": lower},
    }
    section = natural_section({"natural": record})
    assert section is not None
    rows = [line for line in section.lines if isinstance(line, str) and line.startswith("| skip_step")]
    assert len(rows) == 1 and EQUIVALENT in rows[0] and "4 of 4 runs" in rows[0] and "4 flagged: 4 vetoed" in rows[0]
    assert any("| lower_lr | not tested (lower_lr acted in 1 of 4 runs" in line for line in section.lines)
    assert natural_section({}) is None


def tiny_tokens(root: Path) -> None:
    """A tokenize output of random Zipf tokens under ``root``: what an arm trains on."""
    rng = np.random.default_rng(0)
    manifest = root / "data/tokens/manifest.json"
    manifest.parent.mkdir(parents=True)
    splits = {}
    for split, n in (("train", 40_000), ("val", 5_000)):
        values = (rng.zipf(1.3, n) % 256).astype(np.uint16)
        (manifest.parent / f"{split}.bin").write_bytes(values.tobytes())
        splits[split] = {"path": f"{split}.bin", "sha256": hashlib.sha256(values.tobytes()).hexdigest()}
    manifest.write_text(json.dumps({"dtype": "uint16", "eot_id": 0, "splits": splits}))


def test_the_stage_plans_a_policy_arm_per_seed_whose_command_trains_it_under_its_key_beside_continues(tmp_path):
    """flows/ablate.py's plan of the natural arms at smoke's sizes with the 4x multiplier crossed:
    continue's key is the family's planned arm's, and a policy arm's own command trains it."""
    from flows.ablate import ARM_MODULE, natural_plan, plan

    tiny_tokens(tmp_path)
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    shutil.copytree(ROOT / "profiles", tmp_path / "profiles")
    overrides = {"ablation.beta2_lr_mults": [1.0, 4.0], "train.device": "cpu"}
    cfg = load_config(tmp_path / "params.yaml", "smoke", overrides)
    rows = natural_plan(cfg, tmp_path, overrides, 0)
    assert [(r["seed"], r["policy"]) for r in rows] == [
        (s, p) for s in cfg.ablation.seeds for p in ("skip_step", "lower_lr")
    ]
    family_rows = [r for r in plan(cfg, tmp_path, overrides, 0) if is_control(r, cfg.ablation.seeds)]
    skip = rows[0]
    control = next(r for r in family_rows if r["seed"] == skip["seed"])
    out = control["command"].index("--out") + 1  # each run its own directory, named by its key
    assert control["command"][out] != skip["command"][out]
    same = [*skip["command"][:out], control["command"][out], *skip["command"][out + 1 :]]
    assert control["command"] == [c for c in same if c != "--policy=skip_step"]
    assert control["key"] != skip["key"] and not skip["cached"]
    result = run_command(skip["command"][1 + len(ARM_MODULE) :], tmp_path)
    assert result["key"] == skip["key"] and result["policy"] == "skip_step"
