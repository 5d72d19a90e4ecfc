"""The xiong family's sizing rule (tasks/ablate/sizing.py): it trains only the variants the plateau
gate reads, never the one predicted to fail, at sizing seeds only; it takes the smallest candidate
length at which every gated loss is at or below the plateau bound (exactly at it included), never
a length with a probe missing; one probe trains an arm as the stage does, on a tiny project."""

from __future__ import annotations

import json
import math

import pytest
from trainer_kit import tiny_config

from tasks.ablate.sizing import choose_steps, gated_arms, plateau_bound, probe, summary
from tasks.design.preregistration import design
from tests.test_search import tiny_project

BOUND = 5.5


def probes(losses: dict[int, list[float]]) -> list[dict]:
    return [{"steps": n, "seed": 100 + i, "capped_loss": v} for n, vs in losses.items() for i, v in enumerate(vs)]


def test_the_gated_arms_are_every_xiong_variant_but_post_ln_without_warmup_at_the_sizing_seeds_alone():
    cfg = tiny_config()
    arms = gated_arms(cfg, cfg.ablation.sizing_seeds)
    variants = {arm.factors["block"] + f"·{arm.factors['warmup']:g}" for arm in arms}
    assert variants == {"pre_ln·0.1", "pre_ln·0", "post_ln·0.1"}
    assert {arm.seed for arm in arms} == set(cfg.ablation.sizing_seeds)
    assert not {arm.seed for arm in arms} & set(cfg.ablation.all_seeds)
    assert len(arms) == 3 * len(cfg.ablation.xiong_lrs) * len(cfg.ablation.sizing_seeds)


def test_the_plateau_bound_is_the_registered_margin_below_the_unigram_baseline():
    assert plateau_bound(6.0) == pytest.approx(6.0 - design()["plateau_margin"])


def test_the_rule_takes_the_smallest_length_whose_every_gated_loss_is_at_the_bound_or_below():
    at_bound = probes({400: [5.4, 5.6], 800: [5.4, BOUND], 1200: [5.0, 5.1]})
    assert choose_steps(at_bound, expected=2, bound=BOUND) == 800, "a loss exactly at the bound passes"
    above = probes({400: [5.4, 5.6], 800: [5.4, math.nextafter(BOUND, 6.0)], 1200: [5.0, 5.1]})
    assert choose_steps(above, expected=2, bound=BOUND) == 1200, "one ulp above it fails"
    assert choose_steps(probes({400: [5.6, 5.7]}), expected=2, bound=BOUND) is None, "no length passes: none"


def test_a_length_with_a_probe_missing_is_never_chosen():
    partial = probes({800: [5.0], 1200: [5.0, 5.1]})
    assert choose_steps(partial, expected=2, bound=BOUND) == 1200


def test_a_probe_trains_a_gated_arm_as_the_stage_does_and_the_summary_reads_the_worst_loss(tmp_path):
    project = tiny_project(tmp_path / "project")
    manifest = project / "data" / "tokens" / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "eot_id": 0}))
    cfg = tiny_config(
        **{
            "ablation.d_model": 32,
            "ablation.n_head": 2,
            "ablation.seq_len": 16,
            "ablation.batch_size": 4,
            "ablation.xiong_depth": 2,
            "ablation.xiong_lrs": [3e-3],
            "ablation.sizing_seeds": [100],
        }
    )
    arm = gated_arms(cfg, [100])[0]
    found = probe(cfg, project, arm, 6, tmp_path / "runs")
    assert found["steps"] == 6 and found["seed"] == 100 and found["status"] == "completed"
    assert found["capped_loss"] == min(found["val_loss"], math.log(cfg.tokenizer.vocab_size))
    assert (tmp_path / "runs" / "6" / f"{arm.variant}-s100" / "result.json").is_file()
    others = [{**found, "capped_loss": found["capped_loss"] - 1.0} for _ in range(2)]  # the other gated variants
    result = summary(cfg, [found, *others], unigram=found["capped_loss"] + design()["plateau_margin"])
    assert result["worst_gated_loss"] == {"6": {"100": found["capped_loss"]}}
    assert result["probes_per_length"] == 3 and result["xiong_steps"] == 6, "the worst loss exactly at the bound"
