"""The study's families of arms, on fixed inputs: the config expands to exactly the configured arms,
each arm trains in its family's conditions (the papers'), families that ask for the same run share
it, a bad config is refused naming its key, and what is read off an arm's trace."""

from __future__ import annotations

import hashlib
import json

import pytest

from model.typed_config import ConfigError
from tasks.ablate.arm import ArmProbes
from tasks.ablate.grid import (
    ARM_CODE,
    CODE_ROOT,
    arm_config,
    arm_key,
    arm_metrics,
    code_digest,
    expand,
    families,
    family_arm,
    injection_spec,
    natural_spikes,
    range_extremes,
)
from tasks.config import Config, load_config

DATA = {"train": "a" * 64, "val": "b" * 64}


def precision_fp32(cfg: Config) -> Config:
    """The precision family's fp32 arm at seed 0."""
    family = families(cfg)["precision"]
    return arm_config(cfg, family_arm(family, 0, precision="fp32"), family)


def study(**ablation) -> Config:
    return Config().replace(**{f"ablation.{k}": v for k, v in ablation.items()})


def test_the_default_study_is_each_familys_grid_once_per_seed():
    cfg = Config()
    a = cfg.ablation
    arms = expand(cfg)
    per_seed = {"xiong": 2 * 2 * 2, "precision": 4, "overflow": 2 * 2, "beta2": 2 * 2, "wortsman": 3 * 7}
    assert len(arms) == sum(per_seed.values()) * len(a.all_seeds)
    for family, n in per_seed.items():
        assert sum(arm.family == family for arm in arms) == n * len(a.all_seeds)
    names = [arm.name for arm in arms]
    assert len(set(names)) == len(names)
    assert "xiong/post_ln·warmup=0·lr=0.002/s3" in names and "wortsman/qk_norm·lr=0.3/s0" in names
    assert "overflow/fp16·param/s1" in names and "beta2/beta2=0.999·lr_mult=4/s2" in names


def test_adding_a_value_adds_exactly_its_arms():
    before = {a.name for a in expand(Config())}
    after = {a.name for a in expand(study(beta2s=[0.95, 0.999, 0.99]))}
    assert before < after and len(after - before) == 2 * 8  # β₂ = 0.99 x 2 LR multiples x 8 seeds (4 + 4)


def test_each_family_trains_in_the_conditions_its_source_names():
    cfg = Config()
    a, every = cfg.ablation, families(cfg)
    for arm in expand(cfg):
        c, f = arm_config(cfg, arm, every[arm.family]), arm.factors
        assert (c.model.d_model, c.train.seed, c.train.cpu_threads) == (a.d_model, arm.seed, 1)
        if arm.family == "xiong":  # SP init, depth, no warmup vs a fraction of the run
            assert c.mup.parametrization == "sp" and c.model.n_layer == a.xiong_depth
            assert (c.model.block, c.optim.lr, c.train.steps) == (f["block"], f["lr"], a.xiong_steps)
            assert c.schedule.warmup_steps == round(f["warmup"] * a.xiong_steps)
        elif arm.family in ("precision", "overflow"):  # one numeric path for every format
            assert c.precision.emulate == "always" and c.train.steps == a.steps
            assert c.precision.mode == ("fp16" if f["precision"].startswith("fp16") else f["precision"])
            assert c.precision.loss_scaling == (f["precision"] != "fp16_unscaled")
        elif arm.family == "beta2":  # at least two memories of the slow second moment
            assert c.train.steps >= 2 / (1 - 0.999) and c.optim.beta2 == f["beta2"]
            assert c.optim.lr == pytest.approx(a.lr * f["lr_mult"])
        else:  # Wortsman et al.: SP, independent weight decay, 5 % warmup
            assert c.mup.parametrization == "sp" and c.optim.weight_decay_mode == "independent"
            assert c.optim.weight_decay == a.independent_weight_decay
            assert c.schedule.warmup_steps == round(0.05 * a.wortsman_steps)
            assert c.model.qk_norm == (f["stabilizer"] == "qk_norm")
            assert c.model.z_loss == (a.z_loss if f["stabilizer"] == "z_loss" else 0.0)
        assert c.spike.kinds == [], "the spike stage's injections never reach an arm"


def test_only_the_overflow_family_takes_an_injection_a_weight_excursion_sized_by_its_probe():
    a = Config().ablation
    injected = [arm for arm in expand(Config()) if arm.spike != "none"]
    assert injected and {arm.family for arm in injected} == {"overflow"}
    spec = injection_spec("param", a)
    assert spec["kind"] == "param" and spec["tied_to"] == "once" and spec["start"] == a.steps // 2
    assert spec["magnitude"] == 0.0, "the multiplier is the arm's probe's, measured at the injection step"
    assert injection_spec("none", a) is None


def test_the_precision_and_overflow_families_take_the_probes_loss_shift_and_no_other_family_does():
    cfg = Config()
    every = families(cfg)
    for arm in expand(cfg):
        shift = arm_config(cfg, arm, every[arm.family], loss_shift=9).precision.loss_shift
        assert shift == (9 if arm.family in ("precision", "overflow") else 0), arm.name


def test_every_arm_trains_at_the_discovery_and_the_confirmation_seeds():
    a = Config().ablation
    assert {arm.seed for arm in expand(Config())} == set(a.seeds) | set(a.confirm_seeds)
    assert not set(a.seeds) & set(a.confirm_seeds)


def test_the_overflow_familys_clean_twins_are_the_precision_familys_runs():
    cfg = Config()
    key, every = {}, families(cfg)
    for arm in expand(cfg):
        probe = cfg.ablation.range_probe_every
        key[arm.name] = arm_key(arm_config(cfg, arm, every[arm.family]), DATA, "code", arm.spike, probe)
    assert key["overflow/fp16·none/s0"] == key["precision/fp16/s0"]
    assert key["overflow/fp16·param/s0"] != key["precision/fp16/s0"]
    assert key["precision/fp16/s0"] != key["precision/fp16/s1"]


def test_the_arm_code_digest_covers_existing_files_of_this_checkout():
    assert (CODE_ROOT / "dvc.yaml").is_file()
    assert all((CODE_ROOT / entry).exists() for entry in ARM_CODE), ARM_CODE
    assert len(code_digest()) == 16 and code_digest() == code_digest()


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("ablation.precisions", ["bf16", "fp8"], "ablation.precisions[1]"),
        ("ablation.inject_fraction", 1.0, "ablation.inject_fraction"),
        ("ablation.xiong_warmups", [0.1, 1.5], "ablation.xiong_warmups"),
        ("ablation.beta2s", [0.95, 0.95], "repeats a value"),
        ("ablation.d_model", 30, "ablation.d_model"),
        ("ablation.lrs", [], "ablation.lrs: must not be empty"),
        ("ablation.overflow_precisions", ["bf16", "fp16"], None),  # fine as it is
        ("ablation.seeds", [0, 0], "repeats a value"),
        ("ablation.confirm_seeds", [3, 4], "ablation.confirm_seeds: [3] also discovery seeds"),
        ("ablation.confirm_seeds", [], None),  # a profile may run no confirmation half
        ("ablation.underflow_target", 1.0, "ablation.underflow_target"),
        ("ablation.underflow_target", 0.999, None),
        ("ablation.underflow_target", 0.0, "ablation.underflow_target"),
        ("ablation.sizing_seeds", [7, 100], "ablation.sizing_seeds: [7] are study seeds"),  # a confirmation seed
        ("ablation.sizing_seeds", [8, 100], None),  # the first seed past the study's
        ("ablation.sizing_seeds", [100, 100], "names a seed twice"),
        ("ablation.sizing_seeds", [-1], "ablation.sizing_seeds"),
        ("ablation.sizing_xiong_steps", [1, 2], None),  # the shortest candidates there are
        ("ablation.sizing_xiong_steps", [0, 2], "ablation.sizing_xiong_steps"),
        ("ablation.sizing_xiong_steps", [800, 800], "not strictly ascending"),
        ("ablation.sizing_xiong_steps", [800, 400], "not strictly ascending"),
        ("ablation.families", ["beta2", "beta2"], "ablation.families: ['beta2', 'beta2'] names a family twice"),
        ("ablation.families", [], None),  # every family
    ],
)
def test_a_bad_study_is_refused_naming_the_key(key, value, message):
    if message is None:
        Config().replace(**{key: value})
        return
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Config().replace(**{key: value})


def test_a_profile_that_names_families_trains_those_and_no_arm_of_the_others():
    every = expand(Config())
    named = expand(study(families=["beta2", "wortsman"]))
    assert named == [arm for arm in every if arm.family in ("beta2", "wortsman")]
    assert expand(study(families=list(families(Config())))) == every, "naming every family is naming none"
    (one,) = {arm.family for arm in expand(study(families=["xiong"]))}
    assert one == "xiong"


def test_a_family_name_that_is_no_family_is_refused_naming_the_families():
    with pytest.raises(ConfigError, match=r"ablation.families: 'wortsmann' is not a family of the study \(xiong, "):
        expand(study(families=["wortsman", "wortsmann"]))


def test_a_spiked_format_must_have_its_clean_twin():
    with pytest.raises(ConfigError, match="ablation.overflow_precisions"):
        study(precisions=["fp32", "bf16"], overflow_precisions=["bf16", "fp16"])


@pytest.mark.parametrize(
    ("key", "value", "new_key"),
    [
        ("train.diverge_after", 5, True),  # when an arm stops as diverged
        ("ablation.detect_zscore", 3.0, True),  # which steps its detector flags
        ("spike.detect_zscore", 3.0, False),  # the spike study's detector: the arms' keeps its own z
        ("spike.detect_lag", 4, False),  # and the trailing window
        ("train.log_every", 7, False),  # how often it is observed: the cached result stands
    ],
)
def test_an_arm_is_rerun_when_a_setting_that_shapes_its_result_changes(key, value, new_key):
    cfg = precision_fp32(Config())
    before = arm_key(cfg, DATA, "code", "none", 100)
    assert (arm_key(cfg.replace(**{key: value}), DATA, "code", "none", 100) != before) == new_key


def test_the_arms_detector_keeps_the_trailing_window_and_z_the_beta2_spikes_were_registered_with(tmp_path):
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"eot_id": 0}), encoding="utf-8")
    cfg = Config().replace(**{"spike.detect_lag": 4, "spike.detect_zscore": 9.0, "ablation.detect_zscore": 16.0})
    detector = ArmProbes(cfg, manifest, None).detector
    assert (detector.lag, detector.z) == (0, 16.0)


def test_a_spike_or_a_probe_changes_the_arms_key():
    cfg = precision_fp32(Config())
    keys = {arm_key(cfg, DATA, "code", s, p) for s in ("none", "lr") for p in (0, 100)}
    assert len(keys) == 4


# ----------------------------------------------------------------------------------------------
# What is read off an arm's trace
# ----------------------------------------------------------------------------------------------


def trace(losses, flagged=(), rms=None) -> list[dict]:
    return [
        {
            "step": i + 1,
            "loss": loss,
            "grad_norm": 1.0,
            "update_rms": None if rms is None else rms[i],
            "skipped": False,
            "flagged": i + 1 in flagged,
        }
        for i, loss in enumerate(losses)
    ]


def test_natural_spikes_leave_out_the_warmup_and_the_injection_window():
    rows = trace([5.0] * 100, flagged={3, 40, 41, 70})
    assert natural_spikes(rows, after=6) == [40, 41, 70]
    assert natural_spikes(rows, after=6, skip=range(38, 45)) == [70]


def arm_result(losses, flagged=(), rms=None, status="completed", injection=None, ranges=()) -> dict:
    return {
        "rows": trace(losses, flagged, rms),
        "summary": {
            "status": status,
            "diverged_at": None,
            "val_loss": losses[-1],
            "skipped": 0,
            "overflows": 0,
            "wall_s": 1.0,
            "precision": "fp32",
        },
        "init_loss": 6.93,
        "stats": {"attn_logit_max": 3.0},
        "ranges": list(ranges),
        "injection": injection,
    }


def test_arm_metrics_count_spikes_per_thousand_steps_after_warmup_and_the_update_rms_after_it():
    cfg = precision_fp32(Config()).replace(**{"schedule.warmup_steps": 10, "train.steps": 110})
    rms = [9.0] * 10 + [1.0] * 99 + [2.5]  # warmup's large updates are not counted
    m = arm_metrics(arm_result([5.0] * 110, flagged={5, 50, 80}, rms=rms), cfg)
    assert m["natural_spikes"] == 2 and m["spikes_per_1k"] == pytest.approx(1000 * 2 / 100)
    assert m["update_rms_max"] == 2.5 and m["update_rms_mean"] == pytest.approx((99 + 2.5) / 100)
    assert m["final_loss"] == 5.0 and m["attn_logit_max"] == 3.0


def test_an_injected_spike_and_its_aftermath_are_not_natural_spikes():
    cfg = precision_fp32(Config()).replace(**{"schedule.warmup_steps": 0, "train.steps": 100})
    injection = {"start": 50, "duration": 3}
    m = arm_metrics(arm_result([5.0] * 100, flagged={50, 51, 55, 90}, injection=injection), cfg)
    assert m["natural_spikes"] == 1  # step 90; 50..62 is the injection's window


def test_a_loss_that_went_non_finite_at_the_end_has_no_final_loss():
    cfg = Config()
    m = arm_metrics(arm_result([5.0] * 20 + [None] * 10, status="diverged"), cfg)
    assert m["final_loss"] is None and m["diverged"] and m["nonfinite_steps"] == 10


def test_range_extremes_take_the_worst_layer_of_the_mean_over_probes():
    rows = [
        {"step": 1, "layer": "block0", "quantity": "act_grad_below_subnormal", "share": 0.02},
        {"step": 100, "layer": "block0", "quantity": "act_grad_below_subnormal", "share": 0.04},
        {"step": 1, "layer": "block1", "quantity": "act_grad_below_subnormal", "share": 0.05},
        {"step": 100, "layer": "block1", "quantity": "act_grad_below_subnormal", "share": 0.0},
        {"step": 100, "layer": "block1", "quantity": "act_above_max", "share": 1e-4},
    ]
    assert range_extremes(rows) == {"grad_underflow_share": pytest.approx(0.03), "act_overflow_share": 1e-4}
    assert range_extremes([]) == {"grad_underflow_share": None, "act_overflow_share": None}


@pytest.mark.parametrize("profile", ["default", "smoke", "gpu"])
def test_the_declared_built_in_families_plan_exactly_the_arms_the_coded_families_planned(profile):
    """tests/data/builtin_arms.json holds, per arm, a digest of what the families' former code gave
    it (factors, spike, range probe, every override): the declaration in preregistration.yaml must
    give each arm the same, so no committed arm's run identity moved. Its ``made_by`` says how: at
    version 2's seeds, then regenerated at version 3's fresh ones once the declaration still gave
    those digests at version 2's."""
    golden = json.loads((CODE_ROOT / "tests/data/builtin_arms.json").read_text())[profile]
    cfg = load_config(CODE_ROOT / "params.yaml", profile)
    every, planned = families(cfg), {}
    for arm in expand(cfg):
        family = every[arm.family]
        what = {"factors": arm.factors, "spike": arm.spike, "range_probe_every": family.range_probe_every}
        what["overrides"] = family.overrides(cfg.ablation, arm.factors, arm.seed, 7)
        planned[arm.name] = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
    assert planned == golden
