"""The ablation grid and the study's statistics, on fixed inputs: the grid expands to exactly the
configured arms, each arm's config is valid and carries its factors, the tests and intervals
match values computed by hand, the verdict rule, LR sensitivity and the spike response."""

from __future__ import annotations

import json
import math

import pytest

from model.typed_config import ConfigError
from tasks.ablate.grid import ARM_CODE, CODE_ROOT, arm_config, arm_key, base_arm, code_digest, expand, spike_response
from tasks.ablate.stats import compare, describe, fisher, lr_sensitivity, recovery_censored, slope_test
from tasks.config import Config
from tasks.report.findings import INCONCLUSIVE, NOT_REPRODUCED, REPRODUCED, Claim, evaluate, is_broken, verdict
from tasks.runtime.files import _finite_or_null


def grid(**ablation) -> Config:
    return Config().replace(**{f"ablation.{k}": v for k, v in ablation.items()})


def test_the_default_grid_is_the_base_arm_and_each_familys_variations_once_per_seed():
    a = Config().ablation
    arms = expand(a)
    # block x warmup (2x2) + 3 more precisions + 1 more beta2 + stabilizer x lr (3x4, the base LR not in lrs)
    assert len(arms) == (4 + 3 + 1 + 12) * len(a.seeds) == 60
    assert len({(tuple(arm.factors.values()), arm.seed) for arm in arms}) == len(arms), "an arm listed twice"
    base = base_arm(a, 0)
    assert base.families == () and expand(a)[0].factors == base.factors
    assert set(expand(a)[0].families) == {"block_warmup", "precision", "beta2"}  # the base LR is not on the LR grid
    names = [arm.name(base) for arm in arms]
    assert len(set(names)) == len(names)
    assert "post_ln·warmup=0/s2" in names and "qk_norm·lr=0.3/s0" in names and "fp16_unscaled/s1" in names


def test_the_base_lr_on_the_lr_grid_shares_the_base_arm():
    arms = expand(grid(lrs=[0.01, 0.1], seeds=[0]).ablation)
    assert len(arms) == 4 + 3 + 1 + (3 * 2 - 1)
    assert set(arms[0].families) == {"block_warmup", "precision", "beta2", "stabilizer_lr"}


def test_the_arm_code_digest_covers_existing_files_of_this_checkout():
    assert (CODE_ROOT / "dvc.yaml").is_file()
    assert all((CODE_ROOT / entry).exists() for entry in ARM_CODE), ARM_CODE
    assert len(code_digest()) == 16 and code_digest() == code_digest()


def test_adding_a_value_adds_exactly_its_arms():
    before = {(tuple(a.factors.values()), a.seed) for a in expand(Config().ablation)}
    after = {(tuple(a.factors.values()), a.seed) for a in expand(grid(beta2s=[0.95, 0.999, 0.99]).ablation)}
    assert before < after and len(after - before) == 3  # β₂ = 0.99 x 3 seeds


def test_each_arm_config_is_valid_and_carries_its_factors():
    cfg = Config()
    for arm in expand(cfg.ablation):
        c = arm_config(cfg, arm)
        assert (c.model.block, c.optim.beta2, c.schedule.warmup_steps, c.optim.lr, c.train.seed) == (
            arm.block,
            arm.beta2,
            arm.warmup,
            arm.lr,
            arm.seed,
        )
        assert c.precision.mode == ("fp16" if arm.precision.startswith("fp16") else arm.precision)
        assert c.precision.loss_scaling == (arm.precision != "fp16_unscaled")
        assert c.model.qk_norm == (arm.stabilizer == "qk_norm")
        assert c.model.z_loss == (cfg.ablation.z_loss if arm.stabilizer == "z_loss" else 0.0)
        assert (c.model.d_model, c.train.steps, c.train.cpu_threads) == (cfg.ablation.d_model, cfg.ablation.steps, 1)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("ablation.precisions", ["bf16", "fp8"], "ablation.precisions[1]"),
        ("ablation.inject_step", 299, "ablation.inject_step"),
        ("ablation.warmups", [20, 300], "ablation.warmups"),
        ("ablation.beta2s", [0.95, 0.95], "repeats a value"),
        ("ablation.d_model", 30, "ablation.d_model"),
        ("ablation.lrs", [], "ablation.lrs: must not be empty"),
    ],
)
def test_a_bad_grid_is_refused_naming_the_key(key, value, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Config().replace(**{key: value})


# ----------------------------------------------------------------------------------------------
# Statistics against hand-computed values
# ----------------------------------------------------------------------------------------------


def test_describe_gives_mean_sd_and_the_t_interval():
    d = describe([1.0, 2.0, 3.0, None, float("inf")])
    assert (d["n"], d["missing"], d["mean"], d["sd"]) == (3, 2, 2.0, 1.0)
    half = 4.302652729911275 * 1.0 / math.sqrt(3)  # t(0.975, df=2) x SD / sqrt(n)
    assert d["ci95"] == pytest.approx([2.0 - half, 2.0 + half])
    assert describe([5.0])["ci95"] is None


def test_compare_is_welchs_test_with_hedges_g():
    a, b = [1.0, 2.0, 3.0, 4.0], [2.0, 4.0, 6.0]
    c = compare(a, b)
    va, vb = 5 / 3, 4.0  # sample variances
    t = (2.5 - 4.0) / math.sqrt(va / 4 + vb / 3)
    pooled = math.sqrt((3 * va + 2 * vb) / 5)
    assert c["diff"] == pytest.approx(-1.5) and c["t"] == pytest.approx(t)
    assert c["hedges_g"] == pytest.approx(-1.5 / pooled * (1 - 3 / (4 * 7 - 9)))
    assert 0.2 < c["p"] < 0.4  # Welch df ~ 3.4, |t| ~ 1.14
    assert compare([1.0], [2.0, 3.0])["p"] is None


def test_compare_with_an_infinite_value_keeps_the_sign_and_runs_no_test():
    c = compare([1.0, math.inf, 2.0], [1.0, 1.1, 0.9])
    assert c["diff"] == math.inf and c["p"] is None and c["test"].startswith("none")
    assert compare([math.inf, 1.0], [math.inf, 2.0])["diff"] is None  # inf - inf: no sign either


def json_round_trip(data):
    """What a later stage reads back from metrics/*.json (tasks/runtime/files.py: write_json)."""
    return json.loads(json.dumps(_finite_or_null(data), allow_nan=False))


def test_a_spike_whose_loss_never_came_back_finite_counts_as_infinite_after_the_json_round_trip():
    cfg = Config()
    base = base_arm(cfg.ablation, 0)
    rows_ = rows([5.0] * 150 + [None] * 150)
    arms = []
    for arm in expand(cfg.ablation):
        broken = arm.precision == "fp16" or arm.beta2 == 0.999
        response = spike_response(rows_ if broken else rows([5.0] * 300), 150, 3, 10, 0.03, end=300)
        metrics = {"val_loss": 5.0, "init_loss": 6.0, "diverged": False, "nonfinite_steps": 0, **response}
        arms.append(
            {
                "name": arm.name(base),
                "seed": arm.seed,
                "factors": arm.factors,
                "status": "completed",
                "metrics": metrics,
            }
        )
    findings = {f.key: f for f in evaluate(cfg, json_round_trip({"arms": arms}), None, None)}
    assert "scaled none finite + 3 non-finite" in findings["fp16"].numbers  # not "no runs", not a crash
    assert "(Δ=+inf, none (a non-finite value: no t-test))" in findings["beta2"].numbers  # the worst, not missing
    assert findings["beta2"].verdict == INCONCLUSIVE  # the right direction, untested


def test_a_loss_scalers_overflow_skip_is_not_breakage_but_no_finite_loss_at_the_end_is():
    assert not is_broken({"diverged": False, "nonfinite_steps": 1, "val_loss": 5.9})
    assert is_broken({"diverged": False, "nonfinite_steps": 148, "val_loss": None})  # every step overflowed
    assert is_broken({"diverged": True, "nonfinite_steps": 28, "val_loss": None})


def test_fisher_and_the_slope_test_are_scipys():
    assert fisher(3, 3, 0, 3)["p"] == pytest.approx(0.1)  # 2 / C(6,3)
    s = slope_test([0, 1, 2, 3], [1.0, 3.0, 5.0, 7.1])
    assert s["slope"] == pytest.approx(2.03) and s["p"] < 1e-3 and s["ci95"][0] < 2.03 < s["ci95"][1]


def test_lr_sensitivity_caps_at_the_loss_at_init_and_counts_divergence():
    # losses 3.0, 2.5, nan (diverged), 9.0 (above init 7): capped 3.0, 2.5, 7, 7; best 2.5
    value = lr_sensitivity({1e-3: 3.0, 1e-2: 2.5, 1e-1: float("nan"), 1.0: 9.0}, init_loss=7.0)
    assert value == pytest.approx((0.5 + 0.0 + 4.5 + 4.5) / 4)


@pytest.mark.parametrize(
    ("claims", "expected"),
    [
        ([Claim("a", 1.0, 0.01), Claim("b", 2.0, 0.001)], REPRODUCED),
        ([Claim("a", 1.0, 0.01), Claim("b", 2.0, 0.2)], INCONCLUSIVE),
        ([Claim("a", -1.0, 0.3), Claim("b", -2.0, 0.2)], NOT_REPRODUCED),  # nothing points the way
        ([Claim("a", 1.0, 0.01), Claim("b", -2.0, 0.01)], NOT_REPRODUCED),  # one significantly opposite
        ([Claim("a", -1.0, 0.01, expected=-1)], REPRODUCED),
        ([Claim("a", 1.0, None)], INCONCLUSIVE),
    ],
)
def test_the_verdict_rule(claims, expected):
    assert verdict(claims) == expected


def test_a_failed_precondition_is_not_reproduced():
    assert verdict([Claim("a", 1.0, 0.001)], precondition_failed="bf16 broke too") == NOT_REPRODUCED


def rows(losses, start=1):
    return [{"step": start + i, "loss": v, "grad_norm": 1.0, "flagged": False} for i, v in enumerate(losses)]


def test_spike_response_measures_peak_and_recovery_against_the_loss_before_it():
    losses = [4.0] * 10 + [8.0, 6.0, 5.0] + [4.0] * 30  # injected at step 11
    r = spike_response(rows(losses), start=11, duration=3, smooth=5, epsilon=0.03, end=43)
    assert r["pre_spike_loss"] == 4.0 and r["peak_ratio"] == 2.0
    assert r["recovered"] and r["recovery_steps"] == 3 + 5 - 1  # the 5-step mean is back once the spike left it


def test_a_run_that_never_recovers_is_censored_and_a_nan_has_no_recovery():
    never = spike_response(rows([4.0] * 10 + [6.0] * 20), start=11, duration=3, smooth=5, epsilon=0.03, end=30)
    assert not never["recovered"] and never["recovery_steps"] is None and never["censored_at"] == 20
    nan = spike_response(rows([4.0] * 10 + [None] * 5), start=11, duration=3, smooth=5, epsilon=0.03, end=30)
    assert nan["peak_ratio"] == float("inf") and not nan["recovered"]


def test_a_run_that_diverged_soon_after_the_spike_counts_every_planned_step_as_unrecovered():
    # It stopped logging 5 steps after the spike; counting only its logged steps would make it the
    # quickest to "recover" in the grid.
    early = spike_response(rows([4.0] * 10 + [6.0] * 5), start=11, duration=3, smooth=5, epsilon=0.03, end=300)
    assert early["censored_at"] == 290
    assert recovery_censored(early) == 290.0


def test_a_comparison_with_no_spread_between_seeds_is_untested_not_significant():
    c = compare([6.9, 6.9, 6.9], [5.0, 5.0, 5.0])  # e.g. every seed diverged to the cap vs a flat control
    assert c["diff"] == pytest.approx(1.9) and c["p"] is None and "no spread" in c["test"]
    assert verdict([Claim("capped loss", c["diff"], c["p"])]) == INCONCLUSIVE


def policy(kind_type, gap=0.0):
    return {"type": kind_type, "final_gap": gap}


@pytest.mark.parametrize(
    "policies, expected",
    [
        ({"continue": policy(2, 0.2), "rollback": policy(1), "skip_batch": policy(1)}, INCONCLUSIVE),  # n=1: untested
        ({"continue": policy(2, 0.2), "rollback": policy(2, 0.1), "skip_batch": policy(1)}, INCONCLUSIVE),
        ({"continue": policy(2, 0.2), "rollback": policy(2, 0.1), "skip_batch": policy(2, 0.1)}, NOT_REPRODUCED),
        ({"continue": policy(1), "rollback": policy(1), "skip_batch": policy(1)}, NOT_REPRODUCED),  # no gap to close
    ],
)
def test_the_spike_policy_finding_goes_through_the_one_verdict_rule(policies, expected):
    finding = {f.key: f for f in evaluate(Config(), {"arms": []}, None, {"lr": policies})}["spike"]
    assert finding.verdict == expected
    assert finding.verdict != REPRODUCED  # one run per policy can never reproduce a finding


def test_post_ln_arms_that_diverged_without_warmup_are_counted():
    cfg = Config()
    base = base_arm(cfg.ablation, 0)
    arms = []
    for arm in expand(cfg.ablation):
        diverged = arm.factors["block"] == "post_ln" and arm.factors["warmup"] == 0
        metrics = {
            "val_loss": None if diverged else 5.0,
            "init_loss": 6.9,
            "diverged": diverged,
            **spike_response(rows([5.0] * 300), 150, 3, 10, 0.03, end=300),
        }
        arms.append(
            {
                "name": arm.name(base),
                "seed": arm.seed,
                "factors": arm.factors,
                "status": "diverged" if diverged else "completed",
                "metrics": metrics,
            }
        )
    xiong = {f.key: f for f in evaluate(cfg, {"arms": arms}, None, None)}["xiong"]
    assert "diverged without warmup: post-LN 3, pre-LN 0" in xiong.numbers


@pytest.mark.parametrize(
    ("key", "value", "new_key"),
    [
        ("train.diverge_after", 5, True),  # when an arm stops as diverged
        ("spike.detect_zscore", 3.0, True),  # which steps its detector flags
        ("train.log_every", 7, False),  # how often it is observed: the cached result stands
    ],
)
def test_an_arm_is_rerun_when_a_setting_that_shapes_its_result_changes(key, value, new_key):
    cfg = arm_config(Config(), base_arm(Config().ablation, 0))
    data = {"train": "a" * 64, "val": "b" * 64}
    assert (arm_key(cfg.replace(**{key: value}), data, "code") != arm_key(cfg, data, "code")) == new_key
