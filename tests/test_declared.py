"""A researcher's own ablation declared in studies.yaml (tasks/design/studies.py): every bad
declaration refused before any training, naming its key; declared arms built like the built-in
ones; each kind of claim tested and judged by the study's one rule (tasks/report/declared.py)."""

from __future__ import annotations

import copy
import re
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from model.typed_config import ConfigError
from tasks.ablate.grid import arm_config, expand
from tasks.config import Config, load_config
from tasks.design.families import Gate
from tasks.design.studies import (
    CLAIM_KEYS,
    FAMILY_KEYS,
    GATE_KEYS,
    KINDS,
    METRICS,
    STUDIES,
    builtin_families,
    read_studies,
)
from tasks.report.declared import declared_finding
from tasks.report.verdict import RATE

REPO = Path(__file__).resolve().parents[1]

FAMILY: dict[str, Any] = {
    "question": "Does independent weight decay lower LR sensitivity?",
    "factors": {"optim.weight_decay_mode": ["coupled", "independent"], "optim.lr": [0.001, 0.003, 0.01]},
    "fixed": {"optim.weight_decay": 0.1},
    "steps": 40,
    "claims": {
        "lower_sensitivity": {
            "kind": "sensitivity",
            "metric": "capped_loss",
            "over": "optim.lr",
            "a": {"optim.weight_decay_mode": "independent"},
            "b": {"optim.weight_decay_mode": "coupled"},
            "expected": -1,
            "sesoi": 0.05,
            "justification": "a twentieth of a nat across the grid is the least that changes an LR choice",
        }
    },
}


@pytest.fixture(scope="module")
def cfg():
    return load_config(REPO / "params.yaml", "smoke")


def declare(tmp_path: Path, cfg, family: dict[str, Any] | None = None, name: str = "wd"):
    (tmp_path / STUDIES).write_text(yaml.safe_dump({"families": {name: family or FAMILY}}, sort_keys=False))
    return read_studies(tmp_path, cfg)


def edited(path: str, value: Any) -> dict[str, Any]:
    """FAMILY with the dotted ``path`` (family keys, then a claim's) set to ``value`` (None: removed)."""
    family = copy.deepcopy(FAMILY)
    *parents, leaf = path.split("/")
    node = family
    for part in parents:
        node = node[part]
    if value is None:
        del node[leaf]
    else:
        node[leaf] = value
    return family


def reference_section() -> str:
    """docs/ablate-reference.md's section on what a declaration may say, up to the next heading."""
    text = (REPO / "docs" / "ablate-reference.md").read_text(encoding="utf-8")
    section = text.partition("\n## Every key a declared family may use\n")[2]
    assert section, "docs/ablate-reference.md lost its section on a declaration's keys"
    return section.partition("\n## ")[0]


@pytest.mark.parametrize("name", sorted({*FAMILY_KEYS, *CLAIM_KEYS, *GATE_KEYS, *KINDS, *METRICS}))
def test_every_key_and_metric_a_declaration_may_use_is_documented(name):
    # issue 57: the gate's words were only in the pre-registration; a name the code accepts and the
    # reference omits is one a user cannot find
    assert f"`{name}`" in reference_section(), f"docs/ablate-reference.md does not show `{name}`"


def test_no_studies_file_declares_nothing(tmp_path, cfg):
    assert read_studies(tmp_path, cfg) == []


def test_the_committed_studies_file_is_valid(cfg):
    read_studies(REPO, cfg)


@pytest.mark.parametrize(
    "path, value, message",
    [
        ("factors/optim.lrr", [0.1], "families.wd.factors.optim.lrr: unknown config key 'optim.lrr'"),
        ("factors/optim.lr", ["fast"], "families.wd.factors.optim.lr: .*optim.lr"),
        ("factors/optim.lr", [], "families.wd.factors.optim.lr: must be a non-empty list"),
        ("factors/optim.lr", [0.001, 0.001], "repeats a value"),
        ("factors/train.seed", [1, 2], "train.seed is the study's own"),
        ("factors/data.path", ["x"], "data.path is the study's own"),
        ("claims/lower_sensitivity/metric", "loss_of_interest", "metric: unknown metric 'loss_of_interest'"),
        ("claims/lower_sensitivity/sesoi", None, "lower_sensitivity.sesoi: missing"),
        ("claims/lower_sensitivity/sesoi", -0.01, "sesoi: must be a number >= 0"),
        ("claims/lower_sensitivity/justification", None, "lower_sensitivity.justification: missing"),
        ("claims/lower_sensitivity/a", {"optim.weight_decay_mode": "none"}, "is not among the values the family"),
        ("claims/lower_sensitivity/a", {"model.block": "post_ln"}, "model.block is not a factor of family wd"),
        ("claims/lower_sensitivity/kind", "ranking", "kind: 'ranking' is not one of"),
        ("claims/lower_sensitivity/expected", 0, "expected: the predicted sign, 1 or -1"),
        ("claims/lower_sensitivity/over", "optim.beta2", "over: 'optim.beta2' is not a factor"),
        ("seeds", [0, 1, 0], "seeds: seed 0 is listed twice"),
        ("confirm_seeds", [5, 0], "confirm_seeds: seed 0 is also a discovery seed"),
        ("fixed/optim.lr", 0.1, "also set by a factor"),
        ("colour", "blue", "families.wd.colour: unknown key"),
        ("claims", {}, "claims: declare at least one claim"),
        ("steps", "${ablation.nope}", "steps: '\\$\\{ablation.nope\\}' is no reference to a key of ablation"),
        ("steps", "${ablation.lrs[9]}", "ablation.lrs has no item 9"),
        ("factors/m.x", {"values": [0.1], "sets": "optim.lr"}, "factors.m.x: a named factor's name has no dot"),
        ("factors/m", {"values": ["a"], "sets": "model.norm", "levels": {"a": {}}}, "exactly one of sets, levels"),
        ("factors/m", {"values": ["a"], "levels": {"b": {"model.norm": "layernorm"}}}, "\\['a'\\] are not among"),
        ("factors/m", {"values": ["a"], "levels": {"a": {"model.nrom": "layernorm"}}}, "levels.a.model.nrom: unknown"),
        ("factors/m", {"values": ["a"], "levels": {"a": {"model.norm": "batchnorm"}}}, "levels.a: .*model.norm"),
        ("factors/m", {"values": ["none", "lr"], "injection": True}, "an injection factor is `injection: true`"),
        ("factors/m", {"values": [1.0], "sets": "schedule.warmup_steps", "times": "steps"}, "not a fraction of"),
        ("factors/m", {"values": [0.1], "sets": "optim.lr", "times": "twice"}, "times: a number or steps"),
        ("factors/m", {"values": [-1.0], "sets": "optim.lr", "times": 0.01}, "factors.m.values: .*optim.lr"),
        ("factors/m", {"values": ["a"], "sets": "optim.lr", "times": 0.5}, "m.values: numbers, to multiply"),
        ("factors/m", {"values": [0.1], "sets": ["optim.lr"]}, "m.sets: one config key"),
        ("factors/m", {"values": [["a"]], "levels": {"a": {}}}, "are not among its levels"),
        ("factors/m", {"values": [0.5], "sets": "optim.lr"}, "m: sets optim.lr, which optim.lr sets too"),
        ("factors/m", {"values": [0.5], "sets": "optim.weight_decay"}, "fixed: \\['optim.weight_decay'\\] also set"),
        ("steps", "${ablation.arm_scale}", "is no reference to a key of ablation"),
        ("claims/lower_sensitivity/may_fail", {"optim.lr": 0.01}, "may_fail: a list of variants"),
        ("claims/lower_sensitivity/may_fail", [{"optim.lr": 0.03}], "optim.lr=0.03 is not among the values"),
        ("claims/lower_sensitivity/if_crossed", True, "if_crossed: unknown key"),
    ],
)
def test_a_bad_declaration_is_refused_naming_its_key(tmp_path, cfg, path, value, message):
    with pytest.raises(ConfigError, match=message):
        declare(tmp_path, cfg, edited(path, value))


def test_references_read_the_profile_and_named_factors_set_their_keys(tmp_path, cfg):
    family = copy.deepcopy(FAMILY)
    family["steps"] = "${ablation.xiong_steps}"
    family["factors"] = {
        "warm": {"values": "${ablation.xiong_warmups}", "sets": "schedule.warmup_steps", "times": "steps"},
        "norm": {
            "values": ["ln", "rms"],
            "levels": {"ln": {"model.norm": "layernorm"}, "rms": {"model.norm": "rmsnorm"}},
        },
        "lr": {"values": [0.01], "sets": "optim.lr", "times": "${ablation.lr}"},
    }
    family["claims"] = {"rms": {"kind": "contrast", "metric": "capped_loss", "a": {"norm": "rms"}, "b": {"norm": "ln"}}}
    family["claims"]["rms"] |= {"expected": -1, "sesoi": 0.05, "justification": "j"}
    (declared,) = declare(tmp_path, cfg, family)
    a = cfg.ablation
    assert declared.steps == a.xiong_steps and declared.factors["warm"] == a.xiong_warmups
    arms = [arm for arm in expand(cfg, [declared]) if arm.family == "wd"]
    assert f"wd/warm={a.xiong_warmups[0]:g}·rms·lr=0.01/s{a.seeds[0]}" in {arm.name for arm in arms}
    keys = declared.overrides(a, {"warm": a.xiong_warmups[0], "norm": "rms", "lr": 0.01}, a.seeds[0])
    assert keys["schedule.warmup_steps"] == round(a.xiong_warmups[0] * a.xiong_steps)
    assert keys["model.norm"] == "rmsnorm" and keys["optim.lr"] == pytest.approx(0.01 * a.lr)
    assert keys["train.steps"] == a.xiong_steps


def test_two_injection_factors_are_refused(tmp_path, cfg):
    family = copy.deepcopy(FAMILY)
    family["factors"] |= {f"s{i}": {"values": ["none", "param"], "injection": True} for i in (1, 2)}
    with pytest.raises(ConfigError, match="two injection factors"):
        declare(tmp_path, cfg, family)


@pytest.mark.parametrize(
    ("key", "value", "family", "claims"),
    [
        ("ablation.xiong_warmups", [0.0, 0.1], "xiong", 0),  # the warmup arm is no longer the first value
        ("ablation.blocks", ["post_ln"], "xiong", 0),
        ("ablation.precisions", ["fp32", "bf16", "fp16"], "precision", 0),  # no unscaled arm: the finding, not half
        ("ablation.stabilizers", ["none", "qk_norm"], "wortsman", 1),  # z-loss's claim is optional (if_crossed)
        ("ablation.lrs", [0.01], "wortsman", 0),
        ("ablation.beta2_lr_mults", [1.0], "beta2", 2),  # a may_fail variant not crossed exempts nothing
    ],
)
def test_a_profile_that_shrinks_a_built_in_grid_keeps_only_the_claims_it_can_state(key, value, family, claims):
    (found,) = [f for f in builtin_families(Config().replace(**{key: value})) if f.name == family]
    assert len(found.claims) == claims
    if claims == 0 and family != "wortsman":
        assert "is not among the values the family crosses" in found.missing or "same variant" in found.missing


@pytest.mark.parametrize(
    ("bound", "mean", "met"),
    [("at_least", 0.01, True), ("at_least", 0.0099, False), ("above", 0.0, False), ("above", 1e-300, True)]
    + [("at_most", 0.01, True), ("at_most", 0.0101, False), ("above", None, False)],
)
def test_a_gate_is_met_at_its_bounds_edge_as_its_bound_says(bound, mean, met):
    value = 0.0 if bound == "above" else 0.01
    assert Gate("m", {}, ((bound, value),), "j").met(mean) is met


@pytest.mark.parametrize(("mean", "met"), [(0.05, True), (0.2, True), (0.0499, False), (0.2001, False)])
def test_a_band_gate_is_met_from_its_lower_to_its_upper_bound_inclusive(mean, met):
    assert Gate("m", {}, (("at_least", 0.05), ("at_most", 0.2)), "j").met(mean) is met


@pytest.mark.parametrize(("mean", "met"), [(5.5, True), (5.4999, False), (7.0, True)])
def test_an_on_plateau_gate_is_met_from_unigram_minus_the_margin_up(mean, met):
    assert Gate("capped_loss", {}, (("on_plateau", 0.0),), "j").met(mean, unigram=6.0, margin=0.5) is met
    assert not Gate("capped_loss", {}, (("on_plateau", 0.0),), "j").met(mean, unigram=None, margin=0.5)


@pytest.mark.parametrize(
    ("gate", "error"),
    [
        ({"at_least": 0.3, "at_most": 0.2}, "gate: the band's at_least is above its at_most"),
        ({"at_least": 0.1, "above": 0.2}, "gate: give one of at_least, above, at_most, on_plateau, or a band"),
        ({"on_plateau": 5}, "gate.on_plateau: must be true"),
        ({"at_least": 1, "at_some": "optim.beta2"}, "gate.at_some: 'optim.beta2' is not a factor of family wd"),
        ({"at_least": 1, "at_some": "optim.weight_decay_mode"}, "gate.at_some: optim.weight_decay_mode is fixed by"),
    ],
)
def test_a_malformed_gate_is_refused_naming_its_key(tmp_path, cfg, gate, error):
    gate = {"metric": "capped_loss", "variant": {"optim.weight_decay_mode": "coupled"}, **gate, "justification": "j"}
    with pytest.raises(ConfigError, match=re.escape(error)):
        declare(tmp_path, cfg, edited("claims/lower_sensitivity/gate", gate))


def test_a_built_in_familys_name_is_refused(tmp_path, cfg):
    with pytest.raises(ConfigError, match="families.wortsman: 'wortsman' is a built-in family"):
        declare(tmp_path, cfg, name="wortsman")


def test_an_equivalence_margin_of_zero_is_refused_and_a_contrast_sesoi_of_zero_is_not(tmp_path, cfg):
    claim = {**FAMILY["claims"]["lower_sensitivity"], "kind": "equivalence", "sesoi": 0}
    del claim["over"], claim["expected"]
    with pytest.raises(ConfigError, match="equivalence claim's margin must be > 0"):
        declare(tmp_path, cfg, edited("claims/lower_sensitivity", claim))
    contrast = {**claim, "kind": "contrast", "expected": 1}
    assert declare(tmp_path, cfg, edited("claims/lower_sensitivity", contrast))[0].claims[0].sesoi == 0


def test_a_slope_needs_three_points_of_its_factor_and_takes_exactly_three(tmp_path, cfg):
    slope = {"kind": "slope", "metric": "capped_loss", "over": "optim.lr", "expected": 1, "sesoi": 0.1}
    slope |= {"justification": "j", "log": True}
    family = edited("claims/lower_sensitivity", slope)
    assert declare(tmp_path, cfg, family)[0].claims[0].kind == "slope"
    family["factors"]["optim.lr"] = [0.001, 0.01]
    with pytest.raises(ConfigError, match="over: optim.lr has 2 values; a slope needs more"):
        declare(tmp_path, cfg, family)


def test_declared_arms_cross_every_factor_at_every_seed_on_the_arm_scale(tmp_path, cfg):
    (family,) = declare(tmp_path, cfg)
    arms = [arm for arm in expand(cfg, [family]) if arm.family == "wd"]
    assert len(arms) == 2 * 3 * len(cfg.ablation.all_seeds)
    arm = arms[-1]
    assert arm.name == f"wd/optim.weight_decay_mode=independent·optim.lr=0.01/s{cfg.ablation.all_seeds[-1]}"
    run = arm_config(cfg, arm, family)
    assert (run.optim.weight_decay_mode, run.optim.lr, run.optim.weight_decay) == ("independent", 0.01, 0.1)
    assert (run.model.d_model, run.train.steps, run.train.seed) == (cfg.ablation.d_model, 40, arm.seed)
    assert run.schedule.warmup_steps == round(cfg.ablation.warmup_fraction * 40)


# ----------------------------------------------------------------------------------------------
# Claims judged: synthetic arms as metrics/ablate.json lists them
# ----------------------------------------------------------------------------------------------


def arms_of(family, loss) -> dict[str, Any]:
    """metrics/ablate.json's arms for ``family``, each arm's capped loss ``loss(factors, seed)``."""
    rows = []
    for arm in expand(family_config, [family]):
        if arm.family != family.name:
            continue
        value = loss(arm.factors, arm.seed)
        metrics = {"status": "completed", "diverged": False, "val_loss": value, "init_loss": 7.0}
        rows.append(
            {"name": arm.name, "family": arm.family, "seed": arm.seed, "factors": arm.factors, "metrics": metrics}
        )
    return {"arms": rows}


SYNTHETIC_SEEDS = {"ablation.seeds": [16, 17, 18, 19], "ablation.confirm_seeds": [20, 21, 22, 23, 24, 25, 26, 27]}
"""The seeds the synthetic families below draw their noise with, pinned: a registration that moves the
study's seeds must not move a test's verdict at its edge (a contrast exactly at its SESOI)."""
family_config = load_config(REPO / "params.yaml", "default", SYNTHETIC_SEEDS)  # 8 seeds: 4 discovery, 4 confirmation


def judged(tmp_path, family_body, loss, unigram: float = 6.0):
    (family,) = declare(tmp_path, family_config, family_body)
    return declared_finding(family_config, arms_of(family, loss), unigram, family)


def noise(seed: int, factors: dict[str, Any], scale: float = 0.01) -> float:
    """Seeded per arm: the same arm draws the same value in every run of the test."""
    return float(np.random.default_rng([seed, zlib.crc32(repr(sorted(factors.items())).encode())]).normal(0, scale))


def test_a_sensitivity_claim_holds_when_one_variant_is_flatter_over_the_grid(tmp_path):
    def loss(f, seed):
        slope = 0.1 if f["optim.weight_decay_mode"] == "independent" else 0.6
        return 4.0 + slope * abs(np.log10(f["optim.lr"]) + 2.5) + noise(seed, f)

    finding = judged(tmp_path, FAMILY, loss)
    assert finding.verdict == "reproduced", finding.numbers
    assert finding.claims[0].estimate < -0.05


def test_the_same_claim_is_contradicted_when_the_effect_runs_the_other_way(tmp_path):
    def loss(f, seed):
        slope = 0.6 if f["optim.weight_decay_mode"] == "independent" else 0.1
        return 4.0 + slope * abs(np.log10(f["optim.lr"]) + 2.5) + noise(seed, f)

    assert judged(tmp_path, FAMILY, loss).verdict == "contradicted"


@pytest.mark.parametrize(("effect", "verdict"), [(0.03, "negligible"), (0.05, "inconclusive")])
def test_a_contrast_shown_smaller_than_its_sesoi_is_negligible_and_one_at_the_sesoi_inconclusive(
    tmp_path, effect, verdict
):
    claim = {"kind": "contrast", "metric": "capped_loss", "a": {"optim.weight_decay_mode": "independent"}}
    claim |= {"b": {"optim.weight_decay_mode": "coupled"}, "expected": -1, "sesoi": 0.05, "justification": "j"}
    body = edited("claims/lower_sensitivity", claim)

    def loss(f, seed):  # lower by ``effect``: real and consistent; below the SESOI, or at it
        return 4.0 - (effect if f["optim.weight_decay_mode"] == "independent" else 0.0) + noise(seed, f, 0.001)

    finding = judged(tmp_path, body, loss)
    assert finding.verdict == verdict and finding.claims[0].p < 0.05
    assert max(finding.claims[0].ci95) >= -0.05  # the interval never clears the SESOI


def test_an_interaction_compares_a_contrast_across_two_values_of_a_third_factor(tmp_path):
    body = edited("factors/model.qk_norm", [False, True])
    claim = {"kind": "interaction", "metric": "capped_loss", "a": {"optim.weight_decay_mode": "independent"}}
    claim |= {"b": {"optim.weight_decay_mode": "coupled"}, "across": {"model.qk_norm": [False, True]}}
    claim |= {"expected": -1, "sesoi": 0.05, "justification": "j"}
    body["claims"] = {"helps_without_qk_norm": claim}

    def loss(f, seed):  # independent decay helps by 0.3 nats without qk-norm, not at all with it
        helps = f["optim.weight_decay_mode"] == "independent" and not f["model.qk_norm"]
        return 4.0 - (0.3 if helps else 0.0) + noise(seed, f)

    finding = judged(tmp_path, body, loss)
    assert finding.verdict == "reproduced" and finding.claims[0].estimate == pytest.approx(-0.3, abs=0.03)


def test_an_equivalence_holds_inside_its_margin(tmp_path):
    claim = {"kind": "equivalence", "metric": "capped_loss", "a": {"optim.weight_decay_mode": "independent"}}
    claim |= {"b": {"optim.weight_decay_mode": "coupled"}, "sesoi": 0.05, "justification": "j"}
    body = edited("claims/lower_sensitivity", claim)
    finding = judged(tmp_path, body, lambda f, seed: 4.0 + noise(seed, f))
    assert finding.verdict == "reproduced", finding.numbers


def test_a_slope_on_log_lr_is_the_least_squares_slope_per_seed(tmp_path):
    claim = {"kind": "slope", "metric": "capped_loss", "over": "optim.lr", "log": True, "expected": 1}
    claim |= {"sesoi": 0.1, "justification": "j"}
    body = edited("claims/lower_sensitivity", claim)
    finding = judged(tmp_path, body, lambda f, seed: 4.0 + 0.5 * np.log(f["optim.lr"]) + noise(seed, f))
    assert finding.verdict == "reproduced" and finding.claims[0].estimate == pytest.approx(0.5, abs=0.01)


def test_a_mechanism_gate_not_met_leaves_the_claim_not_tested(tmp_path):
    gate = {"metric": "attn_logit_max", "variant": {"optim.weight_decay_mode": "coupled"}, "at_least": 50}
    gate["justification"] = "attention-logit growth is the mechanism"
    body = edited("claims/lower_sensitivity/gate", gate)

    def loss(f, seed):
        return 4.0 + (0.6 if f["optim.weight_decay_mode"] == "coupled" else 0.1) * abs(np.log10(f["optim.lr"]) + 2.5)

    finding = judged(tmp_path, body, loss)  # the synthetic arms record no attention logits
    assert finding.verdict == "not tested"
    assert "the mechanism did not occur: attn_logit_max" in (finding.precondition_failed or "")


@pytest.mark.parametrize(("stuck_at", "tested"), [(5.5, True), (5.49, False)])
def test_a_gate_at_some_level_is_met_where_one_level_meets_it_and_the_report_names_that_level(
    tmp_path, stuck_at, tested
):
    gate = {"metric": "capped_loss", "variant": {"optim.weight_decay_mode": "coupled"}, "on_plateau": True}
    gate |= {"at_some": "optim.lr", "justification": "coupled decay fails to train at some LR"}
    body = edited("claims/lower_sensitivity/gate", gate)

    def loss(f, seed):  # coupled decay at LR 0.01 ends at ``stuck_at`` in every seed; the bound is 6.0 - 0.5
        if f["optim.weight_decay_mode"] == "coupled" and f["optim.lr"] == 0.01:
            return stuck_at
        return 4.0 + 0.1 * abs(np.log10(f["optim.lr"]) + 2.5) + noise(seed, f, 0.001)

    finding = judged(tmp_path, body, loss, unigram=6.0)
    assert "capped_loss of optim.weight_decay_mode=coupled at optim.lr 0.01" in finding.numbers
    assert finding.details["gates"]["lower_sensitivity"]["met"] is tested
    if tested:
        assert finding.verdict == "reproduced", finding.numbers
    else:
        assert finding.verdict == "not tested"
        assert (
            "(at optim.lr 0.01, the nearest), on the plateau at some optim.lr where the compared variants trained"
            in (finding.precondition_failed or "")
        )


def test_every_gate_reads_only_the_levels_at_which_the_claims_compared_variants_trained(tmp_path):
    """The z-loss gate's form, now every gate's rule: coupled decay at LR 0.01 sits on the plateau
    (5.8, the bound 5.5) and only there meets the gate's at_least 4.1; read where the compared
    variants trained, no level does, and the claim is not tested."""
    gate = {"metric": "capped_loss", "variant": {"optim.weight_decay_mode": "coupled"}, "at_least": 4.1}
    gate |= {"at_some": "optim.lr", "justification": "the mechanism, where the arm trained"}
    body = edited("claims/lower_sensitivity/gate", gate)

    def loss(f, seed):
        if f["optim.weight_decay_mode"] == "coupled" and f["optim.lr"] == 0.01:
            return 5.8 + noise(seed, f, 0.001)
        return 4.0 + 0.1 * abs(np.log10(f["optim.lr"]) + 2.5) + noise(seed, f, 0.001)

    finding = judged(tmp_path, body, loss, unigram=6.0)
    assert finding.details["gates"]["lower_sensitivity"]["met"] is False
    assert "0.01" not in finding.details["gates"]["lower_sensitivity"]["levels"]
    assert finding.verdict == "not tested"
    assert "at least 4.1 at some optim.lr where the compared variants trained" in (finding.precondition_failed or "")


def test_a_gate_no_longer_takes_a_trained_key_every_gate_reads_trained_levels(tmp_path, cfg):
    gate = {"metric": "capped_loss", "variant": {}, "at_least": 1, "at_some": "optim.lr", "trained": True}
    with pytest.raises(ConfigError, match="trained"):
        declare(tmp_path, cfg, edited("claims/lower_sensitivity/gate", gate | {"justification": "j"}))


def test_a_compared_variant_on_the_unigram_plateau_leaves_the_claim_not_tested(tmp_path):
    finding = judged(tmp_path, FAMILY, lambda f, seed: 5.8 + noise(seed, f), unigram=6.0)  # 0.2 below, margin 0.5
    assert finding.verdict == "not tested" and "unigram baseline" in (finding.precondition_failed or "")


def test_one_grid_point_of_a_contrast_on_the_plateau_leaves_it_not_tested_though_the_variants_mean_is_past_it(
    tmp_path,
):
    claim = {"kind": "contrast", "metric": "capped_loss", "expected": -1, "sesoi": 0.05, "justification": "j"}
    claim |= {"a": {"optim.weight_decay_mode": "independent"}, "b": {"optim.weight_decay_mode": "coupled"}}
    body = edited("claims/lower_sensitivity", claim)

    def loss(f, seed):  # independent decay at LR 0.01 ends 0.2 below unigram; its mean over LRs, 4.6
        stuck = f["optim.weight_decay_mode"] == "independent" and f["optim.lr"] == 0.01
        return (5.8 if stuck else 4.0) + noise(seed, f)

    finding = judged(tmp_path, body, loss, unigram=6.0)
    assert finding.verdict == "not tested"
    assert "optim.weight_decay_mode=independent·optim.lr=0.01" in (finding.precondition_failed or "")


@pytest.mark.parametrize(("best", "tested"), [(5.49, True), (5.51, False)])
def test_a_sensitivity_is_gated_on_each_sides_best_grid_point_its_worst_points_being_its_effect(tmp_path, best, tested):
    def loss(f, seed):  # coupled decay: LR 0.001 at ``best``, the others on the plateau (unigram 6.0, margin 0.5)
        coupled = f["optim.weight_decay_mode"] == "coupled"
        return (best if f["optim.lr"] == 0.001 else 5.95) if coupled else 4.0 + noise(seed, f)

    finding = judged(tmp_path, FAMILY, loss, unigram=6.0)
    assert (finding.verdict != "not tested") == tested, finding.precondition_failed
    if not tested:
        assert "optim.weight_decay_mode=coupled·optim.lr=0.001" in (finding.precondition_failed or "")


def test_a_factor_given_both_dotted_and_nested_is_refused(tmp_path, cfg):
    family = edited("factors/optim", {"lr": [0.01]})
    with pytest.raises(ConfigError, match="factors.optim.lr: given twice"):
        declare(tmp_path, cfg, family)


def test_nested_factors_read_as_their_dotted_keys(tmp_path, cfg):
    family = copy.deepcopy(FAMILY)
    family["factors"] = {"optim": {"weight_decay_mode": ["coupled", "independent"], "lr": [0.001, 0.003, 0.01]}}
    assert declare(tmp_path, cfg, family)[0].factors == FAMILY["factors"]


def test_the_committed_findings_are_recomputed_number_for_number_from_the_committed_metrics():
    """The report's code on the committed metrics gives every committed verdict, failed
    precondition, base loss, estimate, interval, p and MDE again (the guard for the built-in
    findings' re-expression in the declared form)."""
    import json

    from tasks.report.findings import evaluate

    cfg = load_config(REPO / "params.yaml")
    ablate, search, spike = (
        json.loads((REPO / f"metrics/{n}.json").read_text()) for n in ("ablate", "search", "spike")
    )
    committed = json.loads((REPO / "metrics/report.json").read_text())["findings"]
    found = evaluate(cfg, ablate, search, spike, ablate["unigram_val_loss"])
    assert sorted(f.key for f in found) == sorted(committed)
    for finding in found:
        again = json.loads(json.dumps(finding.to_json(), default=str))
        for field in ("verdict", "precondition_failed", "base_val_loss"):
            assert same(again[field], committed[finding.key][field]), (finding.key, field)
        for claim, was in zip(again["claims"], committed[finding.key]["claims"], strict=True):
            for field in ("what", "estimate", "p", "ci95", "mde", "sesoi", "holds", "halves"):
                assert same(claim[field], was[field]), (finding.key, claim["what"], field, claim[field], was[field])


def same(a: Any, b: Any) -> bool:
    """Equal, numbers to the last bits a JSON round trip keeps."""
    if isinstance(a, float) and isinstance(b, (int, float)) and not isinstance(b, bool):
        return a == pytest.approx(b, rel=1e-12)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


DIVERGES = edited(
    "claims",
    {
        "worse": {
            "kind": "contrast",
            "metric": "capped_loss",
            "a": {"optim.weight_decay_mode": "coupled", "optim.lr": 0.01},
            "b": {"optim.weight_decay_mode": "independent", "optim.lr": 0.01},
            "expected": 1,
            "sesoi": 0.05,
            "justification": "a twentieth of a nat",
            "may_fail": [{"optim.weight_decay_mode": "coupled"}],
        }
    },
)


def diverging_at(seeds: list[int]):
    """Coupled decay at LR 0.01 ends 9 nats (above ln V = 7: diverged) at ``seeds``, trains elsewhere."""

    def loss(f, seed):
        if f["optim.weight_decay_mode"] == "coupled" and f["optim.lr"] == 0.01 and seed in seeds:
            return 9.0
        return 4.0 + noise(seed, f)

    return loss


@pytest.mark.parametrize("extra", [0, 1])
def test_a_loss_claim_whose_variant_diverged_in_more_than_half_its_seeds_is_a_divergence_rate(tmp_path, extra):
    """Exactly half the seeds diverged: still a loss difference; one more: the claim is the
    difference in diverged share, by the exact McNemar test, never the cap minus a trained loss."""
    (family,) = declare(tmp_path, family_config, DIVERGES)
    seeds = family.all_seeds[: len(family.all_seeds) // 2 + extra]
    finding = judged(tmp_path, DIVERGES, diverging_at(seeds))
    (claim,) = finding.claims
    assert (claim.kind == RATE) is bool(extra)
    if extra:
        assert claim.estimate == pytest.approx(len(seeds) / len(family.all_seeds))
        assert claim.p == pytest.approx(2 * 0.5 ** len(seeds))  # every discordant pair the same way
        assert "worse diverged" in finding.numbers


def test_a_variant_that_diverged_at_every_seed_reproduces_the_claim_as_a_rate(tmp_path):
    (family,) = declare(tmp_path, family_config, DIVERGES)
    finding = judged(tmp_path, DIVERGES, diverging_at(family.all_seeds))
    assert finding.claims[0].kind == RATE and finding.claims[0].not_tested is None
    assert finding.verdict == "reproduced", finding.numbers
