"""The study's figures: the ablate stage's per-family PNGs and the report's forest plot, drawn from
constructed arms and claims (failed and diverged arms among them). What is checked is that each
figure is written, readable and only where its family has arms, never its pixels."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import matplotlib.image
import pytest

from tasks.ablate.figures import LossAxes, declared_panels, family_canvas, family_figures
from tasks.config import Config
from tasks.design.families import DeclaredFamily
from tasks.design.studies import builtin_families, parse_family
from tasks.report.figures import forest_plot

STEPS = 60
INIT = math.log(8192)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def arm(family: str, seed: int, *, failed: bool = False, diverged: bool = False, **factors) -> dict:
    """An arm as the stage hands it to the figures: a falling loss (None at the end of a diverged
    one), update RMS, flags, per-layer trajectories and range-probe rows; a failed arm has none."""
    base = {"name": f"{family}/{factors}/s{seed}", "family": family, "variant": str(factors), "seed": seed}
    base |= {"factors": factors}
    if failed:
        return base | {"status": "failed", "metrics": {}, "rows": [], "trajectories": [], "ranges": []}
    loss = [INIT * math.exp(-s / 40) + 3 + 0.05 * seed for s in range(1, STEPS + 1)]
    rows = [
        {
            "step": s,
            "loss": None if diverged and s > STEPS - 5 else v,
            "grad_norm": 1.0,
            "update_rms": 0.2 + 0.01 * s,
            "skipped": False,
            "flagged": s % 25 == 0,
        }
        for s, v in enumerate(loss, 1)
    ]
    trajectories = [
        {
            "step": s,
            "stats/attn_logit_max/block0": s / 5,
            "stats/attn_logit_max/block1": s / 4,
            "stats/attn_entropy/block0": 2 - s / 60,
            "stats/attn_entropy/block1": 1.8,
            "stats/logits/log_z": 9 - s / 20,
        }
        for s in range(10, STEPS + 1, 10)
    ]
    ranges = [
        {"step": s, "layer": f"block{b}.mlp", "quantity": q, "share": share}
        for s in range(20, STEPS + 1, 20)
        for b in (0, 1)
        for q, share in (
            ("act_grad_below_subnormal", 0.002 * (b + 1) * s),
            ("act_above_max", 0.0),
            ("mlp_pre_above_max", 0.0),
        )
    ]
    metrics = {
        "status": "diverged" if diverged else "completed",
        "diverged": diverged,
        "val_loss": None if diverged else loss[-1],
        "final_loss": None if diverged else loss[-1],
        "init_loss": INIT,
        "spikes_per_1k": 1000 * 2 / STEPS,
        "update_rms_max": 0.8,
    }
    traces = {"rows": rows, "trajectories": trajectories, "ranges": ranges}
    return base | {"status": metrics["status"], "metrics": metrics} | traces


def _study_arms() -> list[dict]:
    """A few arms of every family; Post-LN without warmup at the high LR diverges in seed 1, and so
    does the unstabilised wortsman arm at LR 0.1; one precision and one wortsman arm failed."""
    post_ln_diverges = ("post_ln", 0.0, 3e-3, 1)
    arms = [
        arm("xiong", seed, block=block, warmup=warmup, lr=lr, diverged=(block, warmup, lr, seed) == post_ln_diverges)
        for block in ("pre_ln", "post_ln")
        for warmup in (0.1, 0.0)
        for lr in (3e-3, 1e-3)
        for seed in (0, 1)
    ]
    arms += [arm("precision", seed, precision=p) for p in ("fp32", "bf16", "fp16", "fp16_unscaled") for seed in (0, 1)]
    arms += [arm("precision", 2, precision="fp16", failed=True)]
    arms += [
        arm("overflow", seed, precision=p, spike=s)
        for p in ("bf16", "fp16")
        for s in ("none", "param")
        for seed in (0, 1)
    ]
    arms += [arm("beta2", seed, beta2=b, lr_mult=m) for b in (0.95, 0.999) for m in (1.0, 4.0) for seed in (0, 1)]
    arms += [
        arm("wortsman", seed, stabilizer=st, lr=lr, diverged=lr == 1e-1 and st == "none")
        for st in ("none", "qk_norm", "z_loss")
        for lr in (1e-3, 1e-2, 1e-1)
        for seed in (0, 1)
    ]
    return arms + [arm("wortsman", 2, stabilizer="none", lr=1e-2, failed=True)]


DEPTH_SWEEP = {
    "last_layer": {
        b: {str(d): {"0": k * d**0.5, "1": k * d**0.5 * 1.1} for d in (2, 4, 8)}
        for b, k in (("pre_ln", 1.0), ("post_ln", 3.0))
    },
    "per_layer": {b: {"8": [k / (i + 1) for i in range(8)]} for b, k in (("pre_ln", 1.0), ("post_ln", 3.0))},
}
DEPTH_PROBE = {"depths": [2, 4, 8], "seeds": [0, 1], "xavier": DEPTH_SWEEP, "gpt2": DEPTH_SWEEP}
ALL_FIGURES = ["xiong", "depth_probe", "precision", "overflow", "beta2", "wortsman", "trajectories"]
ARMS = _study_arms()
CFG = Config().replace(**{"ablation.steps": STEPS})
DESIGN = {"plateau_margin": 0.5, "underflow_threshold": 0.01}
UNIGRAM = 5.97
GATE_METRICS = {"grad_underflow_share": 0.2, "act_overflow_share": 0.01, "attn_logit_max": 150.0, "log_z_max": 10.5}
"""The metrics the built-in families' gates read (log Z's drift derived from its extreme), on every arm."""


def assert_readable_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    height, width = matplotlib.image.imread(path).shape[:2]
    assert height > 100 and width > 100


def test_every_family_gets_its_figure_failed_and_diverged_arms_included(tmp_path):
    paths = family_figures(CFG, ARMS, DEPTH_PROBE, UNIGRAM, tmp_path, **DESIGN)
    assert [p.name for p in paths] == [f"{name}.png" for name in ALL_FIGURES]
    assert sorted(tmp_path.iterdir()) == sorted(paths)
    for path in paths:
        assert_readable_png(path)


@pytest.mark.parametrize("family, figures", [("xiong", ["xiong"]), ("wortsman", ["wortsman", "trajectories"])])
def test_a_family_without_arms_gets_no_figure(tmp_path, family, figures):
    others = [a for a in ARMS if a["family"] != family]
    paths = family_figures(CFG, others, DEPTH_PROBE, UNIGRAM, tmp_path, **DESIGN)
    assert {p.stem for p in paths} == set(ALL_FIGURES) - set(figures)


def test_no_depth_probe_no_depth_figure_and_stale_pngs_are_removed(tmp_path):
    (tmp_path / "stabilizer_lr.png").write_bytes(PNG_SIGNATURE)
    beta2 = [a for a in ARMS if a["family"] == "beta2"]
    paths = family_figures(CFG, beta2, {}, UNIGRAM, tmp_path, **DESIGN)
    assert [p.name for p in paths] == ["beta2.png"]
    assert [p.name for p in tmp_path.iterdir()] == ["beta2.png"]


def test_a_family_whose_arms_all_failed_still_gets_its_figure(tmp_path):
    failed = [arm("precision", seed, precision="fp32", failed=True) for seed in (0, 1)]
    (path,) = family_figures(CFG, failed, None, None, tmp_path, **DESIGN)
    assert_readable_png(path)


def claim(finding: str, verdict: str, estimate: float | None = 0.3, **fields) -> dict:
    """A claim row as the report hands it to the forest plot: a direction claim in nats unless told."""
    return {
        "finding": finding,
        "claim": f"{finding}: a claim as long as the design's, wrapped on the left of its row",
        "estimate": estimate,
        "ci95": None if estimate is None else [estimate - 0.2, estimate + 0.25],
        "expected": 1,
        "kind": "direction",
        "margin": None,
        "verdict": verdict,
        "unit": "nats",
    } | fields


def test_the_forest_plot_draws_every_verdict_a_missing_estimate_and_an_equivalence_claim(tmp_path):
    rows = [
        claim("xiong", "reproduced"),
        claim("xiong", "contradicted", estimate=-0.4),
        claim("fp16", "inconclusive", expected=-1, unit="spikes per 1,000 steps"),
        claim("fp16", "reproduced", estimate=0.004, expected=0, kind="equivalence", margin=0.02),
        claim("overflow", "not tested", estimate=None),
    ]
    path = forest_plot(rows, tmp_path / "forest.png")
    assert path == tmp_path / "forest.png"
    assert_readable_png(path)


def test_the_forest_plot_badges_every_outcome_a_claim_can_have(tmp_path):
    from tasks.report.sections.words import GROUPS

    outcomes = [outcome for outcome, _ in GROUPS] + ["not tested"]
    rows = [claim("beta2", "inconclusive", outcome=outcome) for outcome in outcomes]
    assert_readable_png(forest_plot(rows, tmp_path / "forest.png"))


def qk_rescue(gate: dict) -> DeclaredFamily:
    """The docs' declared family (docs/ablate.md), its claim gated by ``gate``."""
    lower_loss = {
        "kind": "contrast",
        "metric": "capped_loss",
        "a": {"model.qk_norm": True},
        "b": {"model.qk_norm": False},
        "expected": -1,
        "sesoi": 0.05,
        "justification": "a twentieth of a nat",
        "gate": gate | {"justification": "the mechanism qk-norm removes"},
    }
    body = {
        "question": "Does qk-norm lower the final loss without warmup?",
        "factors": {"model.qk_norm": [False, True], "optim.lr": [0.003, 0.3]},
        "fixed": {"model.block": "post_ln"},
        "claims": {"lower_loss": lower_loss},
    }
    return parse_family("qk_rescue", body, CFG, "studies.yaml: families.qk_rescue")


def declared_arms() -> list[dict]:
    arms = [
        arm("qk_rescue", s, **{"model.qk_norm": q, "optim.lr": lr})
        for q in (False, True)
        for lr in (0.003, 0.3)
        for s in (0, 1)
    ]
    for a in arms:
        a["metrics"]["attn_logit_max"] = 80.0 if a["factors"]["model.qk_norm"] is False else 8.0
    return arms


def gate_lines(ax) -> dict[str, float]:
    return {line.get_label(): line.get_ydata()[0] for line in ax.lines if line.get_label().startswith("gate of")}


def test_a_declared_familys_figure_draws_its_gates_metric_with_the_gates_bound(tmp_path):
    # issue 57: the figure showed the claim's capped_loss alone, not the logit growth its verdict rested on
    family = qk_rescue({"metric": "attn_logit_max", "variant": {"model.qk_norm": False}, "at_least": 50})
    loss = LossAxes(UNIGRAM, DESIGN["plateau_margin"], 1)
    claim_panel, gate_panel = declared_panels(family, declared_arms(), loss).axes
    assert claim_panel.get_ylabel().startswith("final validation loss") and gate_panel.get_ylabel() == "attn_logit_max"
    assert gate_panel.get_title() == "qk_rescue: the gate of lower_loss"
    assert gate_lines(gate_panel) == {"gate of lower_loss (model.qk_norm=false): at least 50": 50.0}
    assert gate_lines(claim_panel) == {}
    (path,) = family_figures(CFG, declared_arms(), None, UNIGRAM, tmp_path, **DESIGN, declared=[family])
    assert_readable_png(path)


def test_a_gate_on_the_claims_own_metric_is_drawn_on_its_panel_an_on_plateau_one_at_the_threshold():
    family = qk_rescue({"metric": "capped_loss", "variant": {"model.qk_norm": False}, "on_plateau": True})
    (panel,) = declared_panels(family, declared_arms(), LossAxes(UNIGRAM, 0.5, 1)).axes
    assert gate_lines(panel) == {"gate of lower_loss (model.qk_norm=false): on the plateau": UNIGRAM - 0.5}
    (bare,) = declared_panels(family, declared_arms(), LossAxes(None, 0.5, 1)).axes
    assert gate_lines(bare) == {}, "no unigram baseline, no threshold to draw"


@pytest.mark.parametrize("family", builtin_families(CFG), ids=lambda f: f.name)
def test_a_builtin_familys_figure_draws_each_gates_metric_below_its_own_panels(family):
    # issue 57: declared families drew the metric their verdict rested on, the built-in ones did not
    members = [
        a | {"metrics": a["metrics"] and a["metrics"] | GATE_METRICS} for a in ARMS if a["family"] == family.name
    ]
    fig, own = family_canvas(8, 5, family, members, LossAxes(UNIGRAM, DESIGN["plateau_margin"], 1))
    assert own is fig.subfigs[0]
    panels = fig.subfigs[1].axes
    gated = {c.gate.metric: c.gate for c in family.claims if c.gate is not None}
    loss_label = "final validation loss, capped at ln V (nats)"
    assert [ax.get_ylabel() for ax in panels] == [loss_label if m == "capped_loss" else m for m in gated]
    for ax, gate in zip(panels, gated.values()):
        bounds = {UNIGRAM - 0.5 if bound == "on_plateau" else value for bound, value in gate.bounds}
        drawn = {line.get_ydata()[0] for line in ax.lines if line.get_label().startswith("gate of")}
        assert drawn == bounds


def test_a_family_without_gates_keeps_one_figure():
    ungated = qk_rescue({"metric": "capped_loss", "variant": {"model.qk_norm": False}, "on_plateau": True})
    ungated = dataclasses.replace(ungated, claims=[dataclasses.replace(c, gate=None) for c in ungated.claims])
    fig, own = family_canvas(8, 5, ungated, declared_arms(), LossAxes(UNIGRAM, 0.5, 1))
    assert own is fig and not fig.subfigs
