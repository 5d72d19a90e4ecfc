"""The findings the study tests, each read off the stages' outputs as its pre-registered design
says (tasks/report/preregistration.yaml: method, arms, metric, test, direction, SESOI, precondition),
with its verdict from the one rule (tasks/report/verdict.py).

The seed is the unit: arms of one seed share initialisation, data order and validation batches,
so a finding takes per-seed differences (a family crossing an LR grid averages its per-(seed, LR)
differences within each seed first, tasks/ablate/stats.py: seed_means) and tests them with the
paired t-test, pooled over every seed and, beside it, within each registered half (discovery,
confirmation). A diverged arm is a result: its loss is the loss at initialisation
(tasks/ablate/stats.py: capped_loss), and divergence is reported apart as a rate. Every variant a
claim compares must end ``plateau_margin`` nats below the unigram baseline (those the finding
predicts to fail aside, ``may_fail``): an arm that learned no more than unigram statistics tests nothing.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from scipy import stats as scipy_stats

from tasks.ablate.grid import Arm, base_values, factor_values
from tasks.ablate.stats import (
    derived,
    divergence_rates,
    lr_sensitivity,
    paired,
    seed_means,
    tost_paired,
)
from tasks.config import Config
from tasks.report.design import design
from tasks.report.verdict import EQUIVALENCE, Claim, verdict
from tasks.spike.config import OUTCOMES

FAMILY_OF = {"xiong": "xiong", "fp16": "precision", "overflow": "overflow", "beta2": "beta2", "wortsman": "wortsman"}
"""The family of arms each trained finding reads (tasks/ablate/grid.py: FAMILIES)."""

Halves = dict[str, list[int]]
"""The registered halves of a stage's seeds: {"discovery": [...], "confirmation": [...]}."""


@dataclasses.dataclass
class Finding:
    """A finding's verdict with what decided it: its claims (each pooled over every seed, with each
    half's estimate), the precondition that failed (if one did), the numbers a reader checks, and
    the arms it read; ``halves`` holds each claim's comparison within each half of the seeds."""

    key: str
    verdict: str
    claims: list[Claim]
    precondition_failed: str | None
    numbers: str
    arms: list[str]
    base_val_loss: float | None = None
    details: dict[str, Any] = dataclasses.field(default_factory=dict)
    halves: dict[str, dict[str, dict[str, Any]]] = dataclasses.field(default_factory=dict)
    declared: dict[str, Any] | None = None
    """A declared family's registration (studies.yaml: tasks/report/declared.py), else None."""

    @property
    def registered(self) -> dict[str, Any]:
        """The finding's pre-registered design: preregistration.yaml's entry, or its declaration."""
        if self.declared is not None:
            return self.declared
        registered: dict[str, Any] = design()["findings"][self.key]
        return registered

    def to_json(self) -> dict[str, Any]:
        r = self.registered
        return {
            "verdict": self.verdict,
            "claim": r["claim"],
            "source": r["source"],
            "test": r["test"],
            "expected": r["expected"],
            "precondition_failed": self.precondition_failed,
            "sesoi": {c.what: c.sesoi for c in self.claims},
            "mde": {c.what: c.mde for c in self.claims},
            "powered": {c.what: c.powered for c in self.claims},
            "claims": [
                {**dataclasses.asdict(c), "holds": c.holds, "contradicted": c.contradicted} for c in self.claims
            ],
            "halves": self.halves,
            "numbers": self.numbers,
            "base_val_loss": self.base_val_loss,
            "arms": self.arms,
            "details": self.details,
        }


def decide(
    key: str,
    claims: list[Claim],
    numbers: str,
    arms: list[str],
    precondition_failed: str | None = None,
    base_val_loss: float | None = None,
    details: dict[str, Any] | None = None,
    halves: dict[str, dict[str, dict[str, Any]]] | None = None,
) -> Finding:
    return Finding(
        key,
        verdict(claims, precondition_failed),
        claims,
        precondition_failed,
        numbers,
        arms,
        base_val_loss,
        details or {},
        halves or {},
    )


# ----------------------------------------------------------------------------------------------
# Seeds as units, halves, claims
# ----------------------------------------------------------------------------------------------


def ablation_halves(cfg: Config) -> Halves:
    return _halves(cfg.ablation.seeds, cfg.ablation.confirm_seeds)


def _halves(discovery: Sequence[int], confirmation: Sequence[int]) -> Halves:
    """The registered halves, the confirmation half only where it has seeds (a profile may have none)."""
    out = {"discovery": list(discovery)}
    if confirmation:
        out["confirmation"] = list(confirmation)
    return out


def within(values: Mapping[tuple, float], seeds: Sequence[int]) -> dict[tuple, float]:
    """The per-seed values of the units whose seed is in ``seeds``."""
    return {u: v for u, v in values.items() if u[0] in seeds}


def pooled_and_halves(values: dict[tuple, float], halves: Halves) -> dict[str, Any]:
    """The paired t-test of per-seed values (differences) against 0, pooled over every seed, with the
    same test within each half under ``halves``."""
    return {
        **_against_zero(values),
        "halves": {name: _against_zero(within(values, seeds)) for name, seeds in halves.items()},
    }


def _against_zero(values: dict[tuple, float]) -> dict[str, Any]:
    return paired(values, {u: 0.0 for u in values})


def per_seed_difference(a: dict[tuple, float], b: dict[tuple, float]) -> dict[tuple, float]:
    """a − b per unit, averaged within each seed (the seed is the unit)."""
    return seed_means(subtract(a, b))


def sesoi(key: str, claim: str) -> float:
    """The registered smallest effect of interest of ``claim`` of finding ``key``."""
    value: float = design()["findings"][key]["claims"][claim]["sesoi"]
    return value


def direction(key: str, claim: str, what: str, tested: dict[str, Any], expected: int, unit: str = "nats") -> Claim:
    """A directional claim from :func:`pooled_and_halves`, with its registered SESOI and each half's estimate."""
    return Claim(
        what,
        tested.get("estimate"),
        tested.get("p"),
        expected,
        sesoi=sesoi(key, claim),
        ci95=tested.get("ci95"),
        halves={h: c.get("estimate") for h, c in tested.get("halves", {}).items()},
        mde=tested.get("mde"),
        unit=unit,
    )


def equivalence(key: str, claim: str, what: str, values: dict[tuple, float], halves: Halves, unit: str) -> Claim:
    """An equivalence claim on per-seed values: TOST against ±SESOI pooled; each half's estimate."""
    margin = sesoi(key, claim)
    tested = pooled_and_halves(values, halves)
    tost = tost_paired(list(values.values()), margin)
    return Claim(
        what,
        tested.get("estimate"),
        tost.get("p"),
        0,
        kind=EQUIVALENCE,
        sesoi=margin,
        ci95=tested.get("ci95"),
        halves={h: c.get("estimate") for h, c in tested["halves"].items()},
        mde=tested.get("mde"),
        unit=unit,
    )


def halves_of(claims: Mapping[str, dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per claim, its comparison within each half (for the report)."""
    return {what: tested.get("halves", {}) for what, tested in claims.items()}


# ----------------------------------------------------------------------------------------------
# The arms, as metrics/ablate.json lists them
# ----------------------------------------------------------------------------------------------


class Arms:
    """The ablate stage's arms, looked up by family and factors; values keyed by their pairing
    unit: the seed, and any factor not fixed by the lookup (e.g. the LR of a family that crosses an
    LR grid), so two lookups that differ in one factor pair arm by arm."""

    def __init__(self, ablate: dict[str, Any]):
        self.arms = ablate["arms"]

    def select(self, family: str, **factors: Any) -> list[dict[str, Any]]:
        return [
            a for a in self.arms if a["family"] == family and all(a["factors"].get(k) == v for k, v in factors.items())
        ]

    def values(self, family: str, figure: str, **factors: Any) -> dict[tuple, Any]:
        """``figure`` of every arm that ran, keyed by (seed, free factors...); failed arms are left out."""
        out = {}
        for a in self.select(family, **factors):
            if a.get("metrics"):
                free = tuple(v for k, v in sorted(a["factors"].items()) if k not in factors)
                out[(a["seed"], *free)] = derived(a["metrics"])[figure]
        return out

    def names(self, family: str, **factors: Any) -> list[str]:
        return [a["name"] for a in self.select(family, **factors)]

    def mean(self, family: str, figure: str, **factors: Any) -> float | None:
        values = [v for v in self.values(family, figure, **factors).values() if v is not None]
        return float(np.mean(values)) if values else None


def subtract(a: dict[tuple, float], b: dict[tuple, float]) -> dict[tuple, float]:
    """Per pairing unit, a − b, over the units both have."""
    return {u: a[u] - b[u] for u in sorted(a.keys() & b.keys())}


def plateau_gate(base_loss: float | None, unigram: float | None, what: str) -> str | None:
    """The precondition every trained family shares: its base arm ended past the unigram plateau."""
    margin = design()["plateau_margin"]
    if unigram is None:
        return "no unigram baseline (data/tokens missing)"
    if base_loss is None:
        return f"{what} has no finite loss"
    if base_loss > unigram - margin:
        return (
            f"{what} ended at {base_loss:.3f} nats, not {margin:g} below the unigram baseline "
            f"{unigram:.3f} (it has not learned past unigram statistics)"
        )
    return None


def _cmp(c: dict[str, Any], unit: str = "nats") -> str:
    """A paired comparison in a line: estimate [95 % CI], p, MDE, n."""
    if c.get("estimate") is None:
        test: str = c.get("test", "untested")
        return test
    ci = f" [{c['ci95'][0]:+.3g}, {c['ci95'][1]:+.3g}]" if c.get("ci95") else ""
    p = f", p={c['p']:.3g}" if c.get("p") is not None else f", {c['test']}"
    mde = f", MDE {c['mde']:.3g}" if c.get("mde") is not None else ""
    return f"Δ={c['estimate']:+.3g} {unit}{ci}{p}{mde}, n={c['n']}"


def _rate(d: dict[str, Any]) -> str:
    (ea, eb), n = d["events"], d["n"]
    p = f", McNemar p={d['p']:.3g}" if d.get("p") is not None else ""
    return f"{ea}/{n} vs {eb}/{n}{p}"


def _diverged(arms: Arms, family: str, **factors: Any) -> dict[tuple, bool]:
    return {u: bool(v) for u, v in arms.values(family, "diverged", **factors).items()}


def variants_of(cfg: Config, family: str, **fixed: Any) -> list[dict[str, Any]]:
    """Every variant (factor values) of ``family`` in the config, those in ``fixed`` held."""
    factors = {k: ([fixed[k]] if k in fixed else v) for k, v in factor_values(cfg.ablation)[family].items()}
    return [dict(zip(factors, values)) for values in itertools.product(*factors.values())]


def predicted_to_fail(key: str, factors: Mapping[str, Any]) -> bool:
    """Whether the finding registers this variant as predicted to fail (``may_fail``), which exempts
    it from the plateau gate."""
    may_fail = design()["findings"][key].get("may_fail") or []
    return any(all(factors.get(k) == v for k, v in exempt.items()) for exempt in may_fail)


def variants_gate(
    key: str, arms: Arms, family: str, compared: Sequence[dict[str, Any]], unigram: float | None
) -> str | None:
    """The plateau gate on every variant a claim compares (mean capped loss over all its seeds),
    except those the finding registers as predicted to fail (``may_fail``): the first that fails, or None."""
    for factors in compared:
        if predicted_to_fail(key, factors):
            continue
        what = f"the compared variant {_variant(family, factors)}"
        if failed := plateau_gate(arms.mean(family, "capped_loss", **factors), unigram, what):
            return failed
    return None


def _claims_numbers(tested: Mapping[str, dict[str, Any]], unit: str = "nats") -> str:
    """Each claim's pooled test, then each half's, in a line."""
    return "; ".join(
        f"{what}: {_cmp(t, unit)}" + "".join(f" | {half} {_cmp(h, unit)}" for half, h in t.get("halves", {}).items())
        for what, t in tested.items()
    )


# ----------------------------------------------------------------------------------------------
# The findings
# ----------------------------------------------------------------------------------------------


def xiong_init(cfg: Config, ablate: dict[str, Any], **_: Any) -> Finding:
    probe = (ablate.get("depth_probe") or {}).get("xavier") or {}
    if not {"pre_ln", "post_ln"} <= set(cfg.ablation.blocks) or len(cfg.ablation.probe_depths) < 3:
        return _missing("xiong_init", "ablation.blocks needs pre_ln and post_ln, ablation.probe_depths three or more")
    if not probe.get("last_layer"):
        return decide("xiong_init", [], "the depth probe did not run", [], "no depth probe in metrics/ablate.json")
    last = probe["last_layer"]  # block -> depth -> seed -> gradient norm, under the paper's init
    depths = sorted(int(d) for d in last["post_ln"])
    ratio = {
        (int(s), d): math.log(last["post_ln"][str(d)][s] / last["pre_ln"][str(d)][s])
        for d in depths
        for s in last["post_ln"][str(d)]
    }
    halves = ablation_halves(cfg)
    deepest = {(s,): r for (s, d), r in ratio.items() if d == depths[-1]}
    slopes = {
        (s,): float(scipy_stats.linregress(np.log(depths), [ratio[s, d] for d in depths]).slope)
        for s in sorted({s for s, _ in ratio})
    }
    tested = {
        f"log(Post-LN / Pre-LN) last-layer grad norm at depth {depths[-1]}": pooled_and_halves(deepest, halves),
        "per-seed slope of that log ratio on log depth": pooled_and_halves(slopes, halves),
    }
    (what_deep, deep), (what_slope, slope) = tested.items()
    claims = [
        direction("xiong_init", "deepest", what_deep, deep, +1, "log ratio"),
        direction("xiong_init", "slope", what_slope, slope, +1, "slope"),
    ]
    mean_ratio = {d: float(np.exp(np.mean([r for (s, dd), r in ratio.items() if dd == d]))) for d in depths}
    numbers = (
        "Post-LN / Pre-LN last-layer gradient norm at init, geometric mean over seeds: "
        + ", ".join(f"L={d}: {mean_ratio[d]:.2f}x" for d in depths)
        + f"; {_claims_numbers(tested, 'log')} (Theorem 1 predicts a slope of +0.5)"
    )
    return decide(
        "xiong_init",
        claims,
        numbers,
        [f"depth probe: L={d}" for d in depths],
        details={"ratio_by_depth": mean_ratio},
        halves=halves_of(tested),
    )


def xiong(cfg: Config, ablate: dict[str, Any], unigram: float | None, **_: Any) -> Finding:
    arms, a = Arms(ablate), cfg.ablation
    if not {"pre_ln", "post_ln"} <= set(a.blocks) or 0.0 not in a.xiong_warmups or len(a.xiong_warmups) < 2:
        return _missing("xiong", "ablation.blocks needs post_ln, ablation.xiong_warmups 0 and a warmup")
    halves = ablation_halves(cfg)
    warm = next(w for w in a.xiong_warmups if w)
    loss = {(b, w): arms.values("xiong", "capped_loss", block=b, warmup=w) for b in a.blocks for w in (0.0, warm)}
    effect = {b: subtract(loss[b, 0.0], loss[b, warm]) for b in ("post_ln", "pre_ln")}  # per (seed, LR)
    tested = {
        "Post-LN: no warmup − warmup, final loss": pooled_and_halves(seed_means(effect["post_ln"]), halves),
        "warmup's effect, Post-LN − Pre-LN (interaction)": pooled_and_halves(
            per_seed_difference(effect["post_ln"], effect["pre_ln"]), halves
        ),
    }
    pre = pooled_and_halves(seed_means(effect["pre_ln"]), halves)
    (what_post, post), (what_inter, interaction) = tested.items()
    claims = [
        direction("xiong", "post_ln", what_post, post, +1),
        direction("xiong", "interaction", what_inter, interaction, +1),
    ]
    diverged = divergence_rates(
        _diverged(arms, "xiong", block="post_ln", warmup=0.0), _diverged(arms, "xiong", block="post_ln", warmup=warm)
    )
    numbers = (
        f"final val loss (capped at ln V), per seed the mean over LRs {', '.join(f'{lr:g}' for lr in a.xiong_lrs)}: "
        f"{_claims_numbers(tested)}; Pre-LN no warmup − warmup {_cmp(pre)}; Post-LN diverged without vs with "
        f"warmup, per (seed, LR) {_rate(diverged)}; depth {a.xiong_depth}, {a.xiong_steps:,} steps (warmup "
        f"{warm:.0%} of them; ablation.xiong_steps, sized by tasks/ablate/sizing.py), the paper's model (Xavier "
        "init, LayerNorm, GELU)"
    )
    return decide(
        "xiong",
        claims,
        numbers,
        arms.names("xiong"),
        variants_gate("xiong", arms, "xiong", variants_of(cfg, "xiong"), unigram),
        arms.mean("xiong", "capped_loss", **base_values(a, "xiong")),
        {"pre_ln": pre, "divergence": diverged, **tested},
        halves_of(tested),
    )


def fp16(cfg: Config, ablate: dict[str, Any], unigram: float | None, **_: Any) -> Finding:
    arms, a, registered = Arms(ablate), cfg.ablation, design()["findings"]["fp16"]
    if not {"fp32", "fp16", "fp16_unscaled"} <= set(a.precisions):
        return _missing("fp16", "ablation.precisions needs fp32, fp16 and fp16_unscaled")
    halves = ablation_halves(cfg)
    loss = {p: arms.values("precision", "capped_loss", precision=p) for p in a.precisions}
    unscaled_values = per_seed_difference(loss["fp16_unscaled"], loss["fp16"])
    scaled_values = per_seed_difference(loss["fp16"], loss["fp32"])
    tested = {
        "unscaled − scaled fp16, final loss": pooled_and_halves(unscaled_values, halves),
        "scaled fp16 − fp32, final loss": pooled_and_halves(scaled_values, halves),
    }
    margin = sesoi("fp16", "scaled")
    claims = [
        direction(
            "fp16", "unscaled", "unscaled − scaled fp16, final loss", tested["unscaled − scaled fp16, final loss"], +1
        ),
        equivalence("fp16", "scaled", f"scaled fp16 ≡ fp32 within ±{margin:g} nats", scaled_values, halves, "nats"),
    ]
    underflow = [
        v for v in arms.values("precision", "grad_underflow_share", precision="fp32").values() if v is not None
    ]
    share = float(np.mean(underflow)) if underflow else None
    shift = (ablate.get("conditions") or {}).get("loss_shift") or {}
    compared = [{"precision": p} for p in ("fp32", "fp16", "fp16_unscaled")]
    failed = variants_gate("fp16", arms, "precision", compared, unigram)
    if failed is None and shift.get("k") is None:
        failed = (
            f"no loss shift up to 2^-16 put {a.underflow_target:.0%} of activation gradients below 2^-24 in the "
            "one-step probe (the condition was not reached)"
        )
    if failed is None and (share is None or share < registered["threshold"]):
        failed = (
            "no activation-gradient underflow to lose: "
            + ("the range probe did not run" if share is None else f"{share:.2%} of nonzero activation-gradient values")
            + f" below 2⁻²⁴ in the fp32 arms (threshold {registered['threshold']:.0%})"
        )
    means = ", ".join(f"{p} {number(arms.mean('precision', 'capped_loss', precision=p))}" for p in a.precisions)
    numbers = (
        f"loss x 2^-{shift.get('k', '?')} (one-step probe: {_share_at(shift)} of the worst block's activation "
        f"gradients below 2⁻²⁴ there, target {a.underflow_target:.0%}); final val loss (capped), mean over seeds: "
        f"{means}; {_claims_numbers(tested)}; TOST ±{margin:g} p={number(claims[1].p, '{:.3g}')}; activation-gradient "
        f"values below 2⁻²⁴ in the fp32 arms (worst layer, mean over probes): {'-' if share is None else f'{share:.3%}'}"
        f" (threshold {registered['threshold']:.0%})"
    )
    return decide(
        "fp16",
        claims,
        numbers,
        arms.names("precision"),
        failed,
        arms.mean("precision", "capped_loss", precision=a.precisions[0]),
        {"underflow_share": share, "threshold": registered["threshold"], "loss_shift": shift, **tested},
        halves_of(tested),
    )


def _share_at(shift: dict[str, Any]) -> str:
    k = shift.get("k")
    return "-" if k is None else f"{shift['shares'][str(k)]:.1%}"


def overflow(cfg: Config, ablate: dict[str, Any], unigram: float | None, **_: Any) -> Finding:
    arms, a = Arms(ablate), cfg.ablation
    if not {"bf16", "fp16"} <= set(a.overflow_precisions):
        return _missing("overflow", "ablation.overflow_precisions needs bf16 and fp16")
    halves = ablation_halves(cfg)
    effect = {
        p: subtract(
            arms.values("overflow", "capped_loss", precision=p, spike="param"),
            arms.values("overflow", "capped_loss", precision=p, spike="none"),
        )
        for p in ("bf16", "fp16")
    }
    what = "the injection's effect on final loss, fp16 − bf16"
    tested = {what: pooled_and_halves(per_seed_difference(effect["fp16"], effect["bf16"]), halves)}
    claims = [direction("overflow", "interaction", what, tested[what], +1)]
    overflowed = [
        v for v in arms.values("overflow", "act_overflow_share", precision="bf16", spike="param").values() if v
    ]
    multipliers = [v for v in arms.values("overflow", "injected_multiplier", spike="param").values() if v is not None]
    failed = variants_gate("overflow", arms, "overflow", variants_of(cfg, "overflow"), unigram)
    if failed is None and not overflowed:
        failed = "no activation passed 65,504 in the injected bf16 arms (fp16's range was never reached)"
    broken = divergence_rates(
        {u: bool(v) for u, v in arms.values("overflow", "diverged", precision="fp16", spike="param").items()},
        {u: bool(v) for u, v in arms.values("overflow", "diverged", precision="bf16", spike="param").items()},
    )
    numbers = (
        f"block 0's weights x the probe's multiplier at step {a.inject_step} (multipliers "
        f"{sorted({f'2^{round(math.log2(m))}' for m in multipliers}) or '-'}): effect on final loss fp16 "
        f"{_mean(effect['fp16'])}, bf16 {_mean(effect['bf16'])}; {_claims_numbers(tested)}; runs broken under "
        f"the injection fp16 vs bf16 {_rate(broken)}; injected bf16 arms with activations above 65,504: "
        f"{len(overflowed)}"
    )
    return decide(
        "overflow",
        claims,
        numbers,
        arms.names("overflow"),
        failed,
        arms.mean("overflow", "capped_loss", precision="bf16", spike="none"),
        {"divergence": broken, "multipliers": multipliers, **tested},
        halves_of(tested),
    )


def beta2(cfg: Config, ablate: dict[str, Any], unigram: float | None, **_: Any) -> Finding:
    arms, a = Arms(ablate), cfg.ablation
    if not {0.95, 0.999} <= set(a.beta2s):
        return _missing("beta2", "ablation.beta2s needs 0.95 and 0.999")
    halves = ablation_halves(cfg)
    difference = {
        figure: per_seed_difference(arms.values("beta2", figure, beta2=0.999), arms.values("beta2", figure, beta2=0.95))
        for figure in ("spikes_per_1k", "update_rms_max", "capped_loss")
    }
    tested = {
        "natural spikes per 1,000 steps, 0.999 − 0.95": pooled_and_halves(difference["spikes_per_1k"], halves),
        "largest update RMS, 0.999 − 0.95": pooled_and_halves(difference["update_rms_max"], halves),
    }
    (what_spikes, spikes), (what_rms, rms) = tested.items()
    claims = [
        direction("beta2", "spikes", what_spikes, spikes, +1, "spikes/1k"),
        direction("beta2", "update_rms", what_rms, rms, +1, "RMS"),
    ]
    final = pooled_and_halves(difference["capped_loss"], halves)
    numbers = (
        f"clean runs of {a.beta2_steps} steps at LR ablation.lr = {a.lr:g} (fixed) x"
        f"{', x'.join(f'{m:g}' for m in a.beta2_lr_mults)}, per seed the mean over those LRs: spikes per 1,000 "
        f"steps {_mean(arms.values('beta2', 'spikes_per_1k', beta2=0.999))} vs "
        f"{_mean(arms.values('beta2', 'spikes_per_1k', beta2=0.95))}; largest update RMS "
        f"{_mean(arms.values('beta2', 'update_rms_max', beta2=0.999))} vs "
        f"{_mean(arms.values('beta2', 'update_rms_max', beta2=0.95))}; {_claims_numbers(tested, '')}; final loss "
        f"{_cmp(final)}"
    )
    return decide(
        "beta2",
        claims,
        numbers,
        arms.names("beta2"),
        variants_gate("beta2", arms, "beta2", variants_of(cfg, "beta2"), unigram),
        arms.mean("beta2", "capped_loss", **base_values(a, "beta2")),
        {"capped_loss": final, **tested},
        halves_of(tested),
    )


def lr_sensitivities(arms: Arms, cfg: Config, stabilizer: str) -> dict[tuple, float]:
    """Per seed, the LR sensitivity of ``stabilizer`` over ``ablation.lrs`` (a seed missing an arm has none)."""
    by_seed: dict[tuple, dict[float, float]] = {}
    for (seed, lr), loss in arms.values("wortsman", "capped_loss", stabilizer=stabilizer).items():
        by_seed.setdefault((seed,), {})[lr] = loss
    init = math.log(cfg.tokenizer.vocab_size)
    return {s: lr_sensitivity(v, init) for s, v in by_seed.items() if len(v) == len(cfg.ablation.lrs)}


def critical_lr(arms: Arms, stabilizer: str) -> dict[int, float | None]:
    """Per seed, the lowest LR at which the arm diverged (None: none did)."""
    out: dict[int, float | None] = {}
    for (seed, lr), diverged in sorted(arms.values("wortsman", "diverged", stabilizer=stabilizer).items()):
        out.setdefault(seed, None)
        if diverged and out[seed] is None:
            out[seed] = lr
    return out


def best_lr(arms: Arms, cfg: Config, stabilizer: str) -> float | None:
    """The LR of the grid where ``stabilizer``'s mean capped loss over seeds is lowest."""
    means = {lr: arms.mean("wortsman", "capped_loss", stabilizer=stabilizer, lr=lr) for lr in cfg.ablation.lrs}
    finite = {lr: loss for lr, loss in means.items() if loss is not None}
    return min(finite, key=finite.__getitem__, default=None)


def wortsman(cfg: Config, ablate: dict[str, Any], unigram: float | None, **_: Any) -> Finding:
    arms, a = Arms(ablate), cfg.ablation
    others = [s for s in ("qk_norm", "z_loss") if s in a.stabilizers]
    if "none" not in a.stabilizers or not others or len(a.lrs) < 2:
        return _missing("wortsman", "ablation.stabilizers needs none and qk_norm or z_loss; ablation.lrs two or more")
    halves = ablation_halves(cfg)
    sens = {s: lr_sensitivities(arms, cfg, s) for s in ["none", *others]}
    tested = {f"LR sensitivity, {s} − none": pooled_and_halves(subtract(sens[s], sens["none"]), halves) for s in others}
    claims = [
        direction("wortsman", s, f"LR sensitivity, {s} − none", tested[f"LR sensitivity, {s} − none"], -1)
        for s in others
    ]
    best = {s: best_lr(arms, cfg, s) for s in ["none", *others]}
    compared = [{"stabilizer": s, "lr": lr} for s, lr in best.items() if lr is not None]
    failed = variants_gate("wortsman", arms, "wortsman", compared, unigram)
    if failed is None and len(compared) < len(best):
        failed = f"no finite loss on the LR grid for {[s for s, lr in best.items() if lr is None]}"
    critical = {s: critical_lr(arms, s) for s in ["none", *others]}
    numbers = "; ".join(
        [
            f"LR sensitivity over LRs {', '.join(f'{lr:g}' for lr in a.lrs)}: "
            + ", ".join(f"{s} {_mean(sens[s])}" for s in sens),
            _claims_numbers(tested),
            "best LR per stabilizer: " + ", ".join(f"{s} {number(lr, '{:g}')}" for s, lr in best.items()),
            "lowest LR that diverged, per seed: "
            + ", ".join(f"{s} {[critical[s][k] for k in sorted(critical[s])]}" for s in critical),
        ]
    )
    none_best = best["none"]
    return decide(
        "wortsman",
        claims,
        numbers,
        arms.names("wortsman"),
        failed,
        arms.mean("wortsman", "capped_loss", stabilizer="none", lr=none_best) if none_best is not None else None,
        {
            "sensitivity": {s: list(v.values()) for s, v in sens.items()},
            "best_lr": best,
            "critical_lr": critical,
            **tested,
        },
        halves_of(tested),
    )


def search_halves(cfg: Config) -> Halves:
    return _halves(cfg.search.seeds, cfg.search.confirm_seeds)


def seed_slopes(entry: dict[str, Any]) -> dict[tuple, float]:
    """Per seed, the least-squares slope of its optimum log₂ LR on log₂ width (a seed missing a width has none)."""
    widths = sorted(entry["widths"], key=int)
    seeds = set.intersection(*(set(entry["widths"][w]["per_seed"]) for w in widths)) if widths else set()
    x = [math.log2(int(w)) for w in widths]
    return {
        (int(s),): float(scipy_stats.linregress(x, [entry["widths"][w]["per_seed"][s] for w in widths]).slope)
        for s in sorted(seeds, key=int)
    }


def mu_transfer(cfg: Config, search: dict[str, Any] | None, unigram: float | None, **_: Any) -> Finding:
    if not search or not {"sp", "mup"} <= search.keys():
        return decide("mu_transfer", [], "the search stage compared no SP and μP", [], "no SP and μP search")
    halves = search_halves(cfg)
    slopes = {p: seed_slopes(search[p]) for p in ("sp", "mup")}
    tested = {
        "SP: per-seed slope of log₂ η* on log₂ width": pooled_and_halves(slopes["sp"], halves),
        "μP: per-seed slope of log₂ η* on log₂ width": pooled_and_halves(slopes["mup"], halves),
    }
    margin = sesoi("mu_transfer", "mup")
    claims = [
        direction(
            "mu_transfer",
            "sp",
            "SP: per-seed slope of log₂ η* on log₂ width",
            tested["SP: per-seed slope of log₂ η* on log₂ width"],
            -1,
            "slope",
        ),
        equivalence("mu_transfer", "mup", f"μP: per-seed slope within ±{margin:g}", slopes["mup"], halves, "slope"),
    ]
    s = cfg.search
    seeds = len(s.seeds) + len(s.confirm_seeds)
    failed = None
    if s.lr_points < 7 or seeds < 3 or len(s.widths) < 3:
        failed = f"the search has {s.lr_points} LR points, {seeds} seeds, {len(s.widths)} widths (needs >= 7, 3, 3)"
    entries = [(p, w, e) for p in ("sp", "mup") for w, e in search[p]["widths"].items()]
    at_edge = [f"{p} width {w}" for p, w, e in entries if e.get("at_edge")]
    worst = max(e["loss_opt"] for _, _, e in entries)
    failed = failed or plateau_gate(worst, unigram, "the search's worst fitted optimum")
    if failed is None and at_edge:
        failed = f"a fitted optimum at the grid's edge ({', '.join(at_edge)}): the grid does not bracket it"
    numbers = (
        f"{_claims_numbers(tested, 'slope')}; TOST ±{margin:g} p={number(claims[1].p, '{:.3g}')}; widths "
        f"{', '.join(sorted(search['sp']['widths'], key=int))}; optima at the grid's edge: {len(at_edge)} of "
        f"{len(entries)}; loss at the optimum up to {worst:.3f} nats"
    )
    return decide(
        "mu_transfer",
        claims,
        numbers,
        ["search stage: " + ", ".join(search.get("studies", []))],
        failed,
        worst,
        {"slopes": {p: list(v.values()) for p, v in slopes.items()}, "at_edge": at_edge, **tested},
        halves_of(tested),
    )


SPIKE_MIN_SEEDS = 4
"""Seeds at which each cause's ``continue`` branch must have left a gap (registered): fewer, and
there is no spike worth recovering from to compare the policies on."""

SPIKE_CAUSES = {"data": "stream", "param": "once", "lr": "step"}
"""The three causes (injection kinds) and what each must be tied to: data-tied (poisoned batches,
skipping them clears it), state-tied (a corrupted state, restoring a clean one clears it),
step-tied (no replay clears it)."""

SPIKE_BETTER = (("data", "skip_batch"), ("data", "rollback"), ("param", "rollback"), ("lr", "lower_lr"))
"""The registered claims: policy − continue on the final gap < 0, where what the policy assumes
about the spike holds for its cause (seed 004: skip the data, restart from before, lower the LR)."""

SPIKE_CLAIM_IDS = {
    ("data", "skip_batch"): "data_skip_batch",
    ("data", "rollback"): "data_rollback",
    ("param", "rollback"): "state_rollback",
    ("lr", "lower_lr"): "step_lower_lr",
}
"""Each claim's key in the registered design (its SESOI): the causes by what they are tied to."""

SPIKE_NO_BETTER = (("param", "skip_batch"), ("lr", "rollback"), ("lr", "skip_batch"))
"""Registered predictions of no improvement, shown with their estimate and interval, not claims:
replaying the steps meets a step-tied spike again, and skip_batch's restart point (the state just
before the flagged step) may already hold a corrupted state."""


def spike_gaps(matrix: dict[str, Any], cause: str, policy: str) -> dict[tuple, float]:
    """Per seed (as a pairing unit), the branch's final gap, where it has one (a branch that gave
    up has none: never imputed). The halves are split later (pooled_and_halves)."""
    cells = matrix.get(cause, {}).get(policy, {})
    return {(int(seed),): cell["final_gap"] for seed, cell in cells.items() if cell["final_gap"] is not None}


def spike_precondition(spike: dict[str, Any], epsilon: float) -> str | None:
    """Why the spike finding cannot be tested, or None: a cause missing or tied to the wrong thing,
    or a cause whose ``continue`` branch left a gap at fewer than SPIKE_MIN_SEEDS seeds."""
    matrix = spike["matrix"]
    for cause, tied in SPIKE_CAUSES.items():
        if cause not in matrix or "continue" not in matrix[cause]:
            return f"the spike stage ran no {cause} injection with a continue branch (spike.kinds)"
        ties = {entry[cause]["injection"]["tied_to"] for entry in spike["seeds"].values()}
        if ties != {tied}:
            return f"the {cause} injection was tied to {sorted(ties)}, not to the {tied}: another cause"
    for cause in SPIKE_CAUSES:
        gapped = [s for s, gap in spike_gaps(matrix, cause, "continue").items() if gap > epsilon]
        if len(gapped) < SPIKE_MIN_SEEDS:
            return (
                f"{cause}: continue ended more than {epsilon:.0%} above the control at {len(gapped)} of "
                f"{len(matrix[cause]['continue'])} seeds (needs >= {SPIKE_MIN_SEEDS})"
            )
    return None


def spike_outcomes(matrix: dict[str, Any], cause: str, policy: str) -> str:
    """A cell's outcome counts over seeds, e.g. ``0 recovered / 3 gap / 1 gave up``."""
    cells = matrix.get(cause, {}).get(policy, {}).values()
    return " / ".join(f"{sum(c['outcome'] == o for c in cells)} {o.replace('_', ' ')}" for o in OUTCOMES)


def spike(cfg: Config, spike: dict[str, Any] | None, unigram: float | None = None, **_: Any) -> Finding:
    """Per cause, the policies whose assumption fits it against continue (SPIKE_BETTER: claims) and
    those whose assumption does not (SPIKE_NO_BETTER: predictions, shown), on the final gap
    (relative, smoothed training loss), paired by seed over the seeds where both branches have one
    (a branch that gave up is its own outcome, counted, never imputed). Not tested unless every
    cause's continue branch left a gap at >= SPIKE_MIN_SEEDS seeds. Beside each claim, its estimate
    on the discovery and on the confirmation seeds alone (``details``)."""
    if not spike or "matrix" not in spike:
        return decide("spike", [], "the spike stage did not run", [], "the spike stage did not run")
    matrix, epsilon = spike["matrix"], cfg.recovery.recover_epsilon
    origins = [entry["origin_run"]["val_loss"] for entry in spike["seeds"].values()]
    at_origin = float(np.mean(origins)) if origins and None not in origins else None
    failed = plateau_gate(at_origin, unigram, "the origin runs at their checkpoint (mean over seeds)")
    failed = failed or spike_precondition(spike, epsilon)
    halves = _halves(spike.get("discovery_seeds", []), spike.get("confirm_seeds", []))

    def tested(cause: str, policy: str) -> dict[str, Any]:
        """policy − continue per seed (one origin run per seed), where both branches have a gap."""
        differences = subtract(spike_gaps(matrix, cause, policy), spike_gaps(matrix, cause, "continue"))
        return pooled_and_halves(differences, halves)

    comparisons = {pair: tested(*pair) for pair in (*SPIKE_BETTER, *SPIKE_NO_BETTER)}
    claims = [
        direction("spike", SPIKE_CLAIM_IDS[c, p], f"{c}×{p} − continue, final gap", comparisons[c, p], -1, "relative")
        for c, p in SPIKE_BETTER
    ]
    details: dict[str, Any] = {f"{c}/{p}": comparisons[c, p] for c, p in (*SPIKE_BETTER, *SPIKE_NO_BETTER)}
    numbers = "; ".join(
        [
            *(
                f"{cause}: continue {spike_outcomes(matrix, cause, 'continue')}, mean final gap "
                f"{_mean(spike_gaps(matrix, cause, 'continue'))}"
                for cause in SPIKE_CAUSES
                if cause in matrix
            ),
            *(
                f"{c}×{p} − continue (predicted better): {_cmp(comparisons[c, p], '')}; {spike_outcomes(matrix, c, p)}"
                for c, p in SPIKE_BETTER
            ),
            *(
                f"{c}×{p} − continue (predicted no better): {_cmp(comparisons[c, p], '')}; "
                f"{spike_outcomes(matrix, c, p)}"
                for c, p in SPIKE_NO_BETTER
            ),
        ]
    )
    seeds = ", ".join(str(s) for half in halves.values() for s in half)
    arms = [
        f"spike stage: seeds {seeds}, causes {', '.join(matrix)}, x{cfg.spike.magnitude:g} for {cfg.spike.duration} steps"
    ]
    return decide(
        "spike",
        claims,
        numbers,
        arms,
        failed,
        details=details,
        halves=halves_of({f"{c}×{p} − continue, final gap": comparisons[c, p] for c, p in SPIKE_BETTER}),
    )


def _variant(family: str, values: dict[str, Any]) -> str:
    """A base arm's variant name, as the arms are named (tasks/ablate/grid.py: Arm.variant)."""
    return Arm(family, tuple(values.values()), 0).variant


def _missing(key: str, why: str) -> Finding:
    return decide(key, [], f"not in this grid: {why}", [], f"not in this grid: {why}")


def _mean(values: Mapping[Any, float | None]) -> str:
    finite = [v for v in values.values() if v is not None and math.isfinite(v)]
    return f"{np.mean(finite):.3g}" if finite else "-"


def number(value: float | None, fmt: str = "{:.4f}") -> str:
    """``value`` formatted, or "-" where there is none (the report's tables use it too)."""
    return "-" if value is None else fmt.format(value)


FINDINGS: tuple[Callable[..., Finding], ...] = (xiong_init, xiong, fp16, overflow, beta2, wortsman, mu_transfer, spike)
"""The findings in the report's order (the keys of tasks/report/preregistration.yaml)."""


def evaluate(
    cfg: Config,
    ablate: dict[str, Any],
    search: dict[str, Any] | None,
    spike_metrics: dict[str, Any] | None,
    unigram: float | None,
) -> list[Finding]:
    """Every built-in finding (a declared family's: tasks/report/declared.py)."""
    return [f(cfg=cfg, ablate=ablate, search=search, spike=spike_metrics, unigram=unigram) for f in FINDINGS]
