"""The findings the study tests, each read off the stages' outputs as its pre-registered design
says (tasks/report/preregistration.yaml: arms, metric, test, direction, α, margin, precondition),
with its verdict from the one rule (tasks/report/verdict.py).

Every comparison is paired: arms of one seed (and, where a family crosses an LR grid, one LR)
share initialisation, data order and validation batches, so a finding compares per-unit
differences (tasks/ablate/stats.py: paired). A diverged arm is a result: its loss is the loss at
initialisation (tasks/ablate/stats.py: capped_loss), and divergence is reported apart as a rate.
A family is tested only if its base arm ended ``plateau_margin`` nats below the unigram baseline:
an arm that learned no more than unigram statistics tests nothing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from tasks.ablate.grid import Arm, base_values
from tasks.ablate.stats import derived, divergence_rates, lr_sensitivity, paired, slope_test, tost_paired, tost_slope
from tasks.config import Config
from tasks.report.design import design
from tasks.report.verdict import Claim, verdict
from tasks.spike.config import OUTCOMES

FAMILY_OF = {"xiong": "xiong", "fp16": "precision", "overflow": "overflow", "beta2": "beta2", "wortsman": "wortsman"}
"""The family of arms each trained finding reads (tasks/ablate/grid.py: FAMILIES)."""


@dataclasses.dataclass
class Finding:
    """A finding's verdict with what decided it: its claims (each a paired comparison), the
    precondition that failed (if one did), the numbers a reader checks, and the arms it read."""

    key: str
    verdict: str
    claims: list[Claim]
    precondition_failed: str | None
    numbers: str
    arms: list[str]
    base_val_loss: float | None = None
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def registered(self) -> dict[str, Any]:
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
            "mde": {c.what: c.mde for c in self.claims},
            "claims": [dataclasses.asdict(c) for c in self.claims],
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
    )


def direction(what: str, comparison: dict[str, Any], expected: int, unit: str = "nats") -> Claim:
    """A directional claim from a paired comparison (tasks/ablate/stats.py: paired)."""
    return Claim(
        what,
        comparison.get("estimate"),
        comparison.get("p"),
        expected,
        ci95=comparison.get("ci95"),
        mde=comparison.get("mde"),
        unit=unit,
    )


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


# ----------------------------------------------------------------------------------------------
# The findings
# ----------------------------------------------------------------------------------------------


def xiong_init(cfg: Config, ablate: dict[str, Any], **_: Any) -> Finding:
    probe = (ablate.get("depth_probe") or {}).get("xavier") or {}
    if not {"pre_ln", "post_ln"} <= set(cfg.ablation.blocks) or len(cfg.ablation.probe_depths) < 2:
        return _missing("xiong_init", "ablation.blocks needs pre_ln and post_ln, ablation.probe_depths two or more")
    if not probe.get("last_layer"):
        return decide("xiong_init", [], "the depth probe did not run", [], "no depth probe in metrics/ablate.json")
    last = probe["last_layer"]  # block -> depth -> seed -> gradient norm, under the paper's init
    depths = sorted(int(d) for d in last["post_ln"])
    ratio = {
        (int(s), d): math.log(last["post_ln"][str(d)][s] / last["pre_ln"][str(d)][s])
        for d in depths
        for s in last["post_ln"][str(d)]
    }
    deepest = {(s,): r for (s, d), r in ratio.items() if d == depths[-1]}
    at_depth = paired(deepest, {u: 0.0 for u in deepest})
    slope = slope_test([math.log(d) for _, d in ratio], list(ratio.values()))
    claims = [
        direction(f"log(Post-LN / Pre-LN) last-layer grad norm at depth {depths[-1]}", at_depth, +1, "log ratio"),
        Claim("slope of that log ratio on log depth", slope["slope"], slope["p"], +1, ci95=slope["ci95"], unit="slope"),
    ]
    mean_ratio = {d: float(np.exp(np.mean([r for (s, dd), r in ratio.items() if dd == d]))) for d in depths}
    numbers = (
        "Post-LN / Pre-LN last-layer gradient norm at init, geometric mean over seeds: "
        + ", ".join(f"L={d}: {mean_ratio[d]:.2f}x" for d in depths)
        + f"; at L={depths[-1]} {_cmp(at_depth, 'log')}; slope on log L {_slope(slope)} (Theorem 1 predicts +0.5)"
    )
    return decide(
        "xiong_init", claims, numbers, [f"depth probe: L={d}" for d in depths], details={"ratio_by_depth": mean_ratio}
    )


def xiong(cfg: Config, ablate: dict[str, Any], unigram: float | None, **_: Any) -> Finding:
    arms, a = Arms(ablate), cfg.ablation
    if not {"pre_ln", "post_ln"} <= set(a.blocks) or 0.0 not in a.xiong_warmups or len(a.xiong_warmups) < 2:
        return _missing("xiong", "ablation.blocks needs post_ln, ablation.xiong_warmups 0 and a warmup")
    base = base_values(a, "xiong")
    warm = next(w for w in a.xiong_warmups if w)
    loss = {(b, w): arms.values("xiong", "capped_loss", block=b, warmup=w) for b in a.blocks for w in (0.0, warm)}
    post = paired(loss["post_ln", 0.0], loss["post_ln", warm])
    pre = paired(loss["pre_ln", 0.0], loss["pre_ln", warm])
    interaction = paired(
        subtract(loss["post_ln", 0.0], loss["post_ln", warm]), subtract(loss["pre_ln", 0.0], loss["pre_ln", warm])
    )
    claims = [
        direction("Post-LN: no warmup − warmup, final loss", post, +1),
        direction("warmup's effect, Post-LN − Pre-LN (interaction)", interaction, +1),
    ]
    diverged = divergence_rates(
        _diverged(arms, "xiong", block="post_ln", warmup=0.0), _diverged(arms, "xiong", block="post_ln", warmup=warm)
    )
    base_loss = arms.mean("xiong", "capped_loss", **base)
    numbers = (
        f"final val loss (capped at ln V), paired by (seed, LR): Post-LN no warmup − {warm:.0%} warmup "
        f"{_cmp(post)}; Pre-LN {_cmp(pre)}; interaction {_cmp(interaction)}; Post-LN diverged without vs "
        f"with warmup {_rate(diverged)}; depth {a.xiong_depth}, the paper's model (Xavier init, LayerNorm, GELU), "
        f"LRs {', '.join(f'{lr:g}' for lr in a.xiong_lrs)}"
    )
    return decide(
        "xiong",
        claims,
        numbers,
        arms.names("xiong"),
        plateau_gate(base_loss, unigram, f"the base arm ({_variant('xiong', base)})"),
        base_loss,
        {"post_ln": post, "pre_ln": pre, "interaction": interaction, "divergence": diverged},
    )


def fp16(cfg: Config, ablate: dict[str, Any], unigram: float | None, **_: Any) -> Finding:
    arms, a, registered = Arms(ablate), cfg.ablation, design()["findings"]["fp16"]
    if not {"fp32", "fp16", "fp16_unscaled"} <= set(a.precisions):
        return _missing("fp16", "ablation.precisions needs fp32, fp16 and fp16_unscaled")
    loss = {p: arms.values("precision", "capped_loss", precision=p) for p in a.precisions}
    unscaled = paired(loss["fp16_unscaled"], loss["fp16"])
    scaled_diffs = subtract(loss["fp16"], loss["fp32"])
    equivalence = tost_paired(list(scaled_diffs.values()), registered["margin"])
    scaled = paired(loss["fp16"], loss["fp32"])
    claims = [
        direction("unscaled − scaled fp16, final loss", unscaled, +1),
        Claim(
            f"scaled fp16 ≡ fp32 within ±{registered['margin']:g} nats",
            scaled.get("estimate"),
            equivalence.get("p"),
            0,
            kind="equivalence",
            p_difference=scaled.get("p"),
            ci95=scaled.get("ci95"),
            mde=scaled.get("mde"),
            unit="nats",
        ),
    ]
    underflow = [
        v for v in arms.values("precision", "grad_underflow_share", precision="fp32").values() if v is not None
    ]
    share = float(np.mean(underflow)) if underflow else None
    base_loss = arms.mean("precision", "capped_loss", precision=a.precisions[0])
    failed = plateau_gate(base_loss, unigram, f"the base arm ({a.precisions[0]})")
    if failed is None and (share is None or share < registered["threshold"]):
        failed = (
            "no activation-gradient underflow to lose: "
            + ("the range probe did not run" if share is None else f"{share:.2%} of nonzero activation-gradient values")
            + f" below 2⁻²⁴ in the fp32 arms (threshold {registered['threshold']:.0%})"
        )
    means = ", ".join(f"{p} {number(arms.mean('precision', 'capped_loss', precision=p))}" for p in a.precisions)
    numbers = (
        f"final val loss (capped), mean over seeds: {means}; unscaled − scaled {_cmp(unscaled)}; scaled − fp32 "
        f"{_cmp(scaled)}, TOST ±{registered['margin']:g} p={_p(equivalence)}; activation-gradient values below "
        f"2⁻²⁴ in the fp32 arms (worst layer): {'-' if share is None else f'{share:.3%}'}"
    )
    return decide(
        "fp16",
        claims,
        numbers,
        arms.names("precision"),
        failed,
        base_loss,
        {"underflow_share": share, "tost": equivalence},
    )


def overflow(cfg: Config, ablate: dict[str, Any], unigram: float | None, **_: Any) -> Finding:
    arms, a = Arms(ablate), cfg.ablation
    if not {"bf16", "fp16"} <= set(a.overflow_precisions):
        return _missing("overflow", "ablation.overflow_precisions needs bf16 and fp16")
    effect = {
        p: subtract(
            arms.values("overflow", "capped_loss", precision=p, spike="lr"),
            arms.values("overflow", "capped_loss", precision=p, spike="none"),
        )
        for p in ("bf16", "fp16")
    }
    interaction = paired(effect["fp16"], effect["bf16"])
    claims = [direction("spike's effect on final loss, fp16 − bf16", interaction, +1)]
    overflowed = [v for v in arms.values("overflow", "act_overflow_share", precision="bf16", spike="lr").values() if v]
    base_loss = arms.mean("overflow", "capped_loss", precision="bf16", spike="none")
    failed = plateau_gate(base_loss, unigram, "the base arm (bf16, clean)")
    if failed is None and not overflowed:
        failed = "the spike drove no activation past 65,504 in the spiked bf16 arms (fp16's range was never reached)"
    broken = divergence_rates(
        {u: bool(v) for u, v in arms.values("overflow", "diverged", precision="fp16", spike="lr").items()},
        {u: bool(v) for u, v in arms.values("overflow", "diverged", precision="bf16", spike="lr").items()},
    )
    numbers = (
        f"spike (LR x{a.inject_magnitude:g} for {a.inject_duration} steps from step {a.inject_step}, tied to steps): "
        f"effect on final loss fp16 {_mean(effect['fp16'])}, bf16 {_mean(effect['bf16'])}; fp16 − bf16 "
        f"{_cmp(interaction)}; diverged under the spike fp16 vs bf16 {_rate(broken)}; spiked bf16 arms with "
        f"activations above 65,504: {len(overflowed)}"
    )
    return decide("overflow", claims, numbers, arms.names("overflow"), failed, base_loss, {"divergence": broken})


def beta2(cfg: Config, ablate: dict[str, Any], unigram: float | None, **_: Any) -> Finding:
    arms, a = Arms(ablate), cfg.ablation
    if not {0.95, 0.999} <= set(a.beta2s):
        return _missing("beta2", "ablation.beta2s needs 0.95 and 0.999")
    comparisons = {
        figure: paired(arms.values("beta2", figure, beta2=0.999), arms.values("beta2", figure, beta2=0.95))
        for figure in ("spikes_per_1k", "update_rms_max", "capped_loss")
    }
    claims = [
        direction("natural spikes per 1,000 steps, 0.999 − 0.95", comparisons["spikes_per_1k"], +1, "spikes/1k"),
        direction("largest update RMS, 0.999 − 0.95", comparisons["update_rms_max"], +1, "RMS"),
    ]
    base_loss = arms.mean("beta2", "capped_loss", **base_values(a, "beta2"))
    numbers = (
        f"clean runs of {a.beta2_steps} steps, paired by (seed, LR x{', x'.join(f'{m:g}' for m in a.beta2_lr_mults)}): "
        f"spikes per 1,000 steps {_mean(arms.values('beta2', 'spikes_per_1k', beta2=0.999))} vs "
        f"{_mean(arms.values('beta2', 'spikes_per_1k', beta2=0.95))} ({_cmp(comparisons['spikes_per_1k'], '')}); "
        f"largest update RMS {_mean(arms.values('beta2', 'update_rms_max', beta2=0.999))} vs "
        f"{_mean(arms.values('beta2', 'update_rms_max', beta2=0.95))} ({_cmp(comparisons['update_rms_max'], '')}); "
        f"final loss {_cmp(comparisons['capped_loss'])}"
    )
    return decide(
        "beta2",
        claims,
        numbers,
        arms.names("beta2"),
        plateau_gate(base_loss, unigram, f"the base arm ({_variant('beta2', base_values(a, 'beta2'))})"),
        base_loss,
        comparisons,
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


def wortsman(cfg: Config, ablate: dict[str, Any], unigram: float | None, **_: Any) -> Finding:
    arms, a = Arms(ablate), cfg.ablation
    others = [s for s in ("qk_norm", "z_loss") if s in a.stabilizers]
    if "none" not in a.stabilizers or not others or len(a.lrs) < 2:
        return _missing("wortsman", "ablation.stabilizers needs none and qk_norm or z_loss; ablation.lrs two or more")
    sens = {s: lr_sensitivities(arms, cfg, s) for s in ["none", *others]}
    comparisons = {s: paired(sens[s], sens["none"]) for s in others}
    claims = [direction(f"LR sensitivity, {s} − none", c, -1) for s, c in comparisons.items()]
    best = {lr: arms.mean("wortsman", "capped_loss", stabilizer="none", lr=lr) for lr in a.lrs}
    finite = {lr: loss for lr, loss in best.items() if loss is not None}
    best_lr = min(finite, key=finite.__getitem__, default=None)
    base_loss = finite[best_lr] if best_lr is not None else None
    critical = {s: critical_lr(arms, s) for s in ["none", *others]}
    numbers = "; ".join(
        [f"LR sensitivity over LRs {', '.join(f'{lr:g}' for lr in a.lrs)}: none {_mean(sens['none'])}"]
        + [f"{s} {_mean(sens[s])} ({_cmp(c)})" for s, c in comparisons.items()]
        + [
            "lowest LR that diverged, per seed: "
            + ", ".join(f"{s} {[critical[s][k] for k in sorted(critical[s])]}" for s in critical)
        ]
    )
    return decide(
        "wortsman",
        claims,
        numbers,
        arms.names("wortsman"),
        plateau_gate(base_loss, unigram, f"the base arm (none, at its best LR {best_lr:g})" if best_lr else "none"),
        base_loss,
        {
            "sensitivity": {s: list(v.values()) for s, v in sens.items()},
            "comparisons": comparisons,
            "critical_lr": critical,
        },
    )


def mu_transfer(cfg: Config, search: dict[str, Any] | None, unigram: float | None, **_: Any) -> Finding:
    registered = design()["findings"]["mu_transfer"]
    if not search or not {"sp", "mup"} <= search.keys():
        return decide("mu_transfer", [], "the search stage compared no SP and μP", [], "no SP and μP search")
    fits, xy = {}, {}
    for p in ("sp", "mup"):
        points = [
            (math.log2(int(w)), opt) for w, entry in search[p]["widths"].items() for opt in entry["per_seed"].values()
        ]
        xy[p] = ([x for x, _ in points], [y for _, y in points])
        fits[p] = slope_test(*xy[p])
    equivalence = tost_slope(*xy["mup"], registered["margin"])
    sp, mup = fits["sp"], fits["mup"]
    claims = [
        Claim("SP: slope of log₂ η* on log₂ width", sp["slope"], sp["p"], -1, ci95=sp["ci95"], unit="slope"),
        Claim(
            f"μP: slope within ±{registered['margin']:g}",
            mup["slope"],
            equivalence["p"],
            0,
            kind="equivalence",
            p_difference=mup["p"],
            ci95=mup["ci95"],
            unit="slope",
        ),
    ]
    s = cfg.search
    failed = None
    if s.lr_points < 7 or len(s.seeds) < 3 or len(s.widths) < 3:
        failed = (
            f"the search has {s.lr_points} LR points, {len(s.seeds)} seeds, {len(s.widths)} widths (needs >= 7, 3, 3)"
        )
    worst = max(entry["loss_opt"] for p in ("sp", "mup") for entry in search[p]["widths"].values())
    failed = failed or plateau_gate(worst, unigram, "the search's worst fitted optimum")
    numbers = (
        f"slope of log₂ η* on log₂ width: SP {_slope(sp)}; μP {_slope(mup)}, TOST ±{registered['margin']:g} "
        f"p={_p(equivalence)}; widths {', '.join(sorted(search['sp']['widths'], key=int))}; "
        f"loss at the optimum up to {worst:.3f} nats"
    )
    return decide(
        "mu_transfer", claims, numbers, ["search stage: " + ", ".join(search.get("studies", []))], failed, worst, fits
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

SPIKE_NO_BETTER = (("param", "skip_batch"), ("lr", "rollback"), ("lr", "skip_batch"))
"""Registered predictions of no improvement, shown with their estimate and interval, not claims:
replaying the steps meets a step-tied spike again, and skip_batch's restart point (the state just
before the flagged step) may already hold a corrupted state."""


def spike_gaps(matrix: dict[str, Any], cause: str, policy: str, seeds: Sequence[int] | None = None) -> dict[int, float]:
    """Per seed, the branch's final gap, where it has one (a branch that gave up has none: never
    imputed); only ``seeds`` where given."""
    cells = matrix.get(cause, {}).get(policy, {})
    return {
        int(seed): cell["final_gap"]
        for seed, cell in cells.items()
        if cell["final_gap"] is not None and (seeds is None or int(seed) in seeds)
    }


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


def spike(cfg: Config, spike: dict[str, Any] | None, **_: Any) -> Finding:
    """Per cause, the policies whose assumption fits it against continue (SPIKE_BETTER: claims) and
    those whose assumption does not (SPIKE_NO_BETTER: predictions, shown), on the final gap
    (relative, smoothed training loss), paired by seed over the seeds where both branches have one
    (a branch that gave up is its own outcome, counted, never imputed). Not tested unless every
    cause's continue branch left a gap at >= SPIKE_MIN_SEEDS seeds. Beside each claim, its estimate
    on the discovery and on the confirmation seeds alone (``details``)."""
    if not spike or "matrix" not in spike:
        return decide("spike", [], "the spike stage did not run", [], "the spike stage did not run")
    matrix, epsilon = spike["matrix"], cfg.recovery.recover_epsilon
    failed = spike_precondition(spike, epsilon)

    def compare(cause: str, policy: str, seeds: Sequence[int] | None = None) -> dict[str, Any]:
        return paired(spike_gaps(matrix, cause, policy, seeds), spike_gaps(matrix, cause, "continue", seeds))

    comparisons = {pair: compare(*pair) for pair in (*SPIKE_BETTER, *SPIKE_NO_BETTER)}
    claims = [direction(f"{c}×{p} − continue, final gap", comparisons[c, p], -1, "relative") for c, p in SPIKE_BETTER]
    roles = {"discovery": spike.get("discovery_seeds", []), "confirmation": spike.get("confirm_seeds", [])}
    details: dict[str, Any] = {f"{c}/{p}": comparisons[c, p] for c, p in (*SPIKE_BETTER, *SPIKE_NO_BETTER)}
    details |= {f"{c}/{p}/{role}": compare(c, p, seeds) for c, p in SPIKE_BETTER for role, seeds in roles.items()}
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
    seeds = ", ".join(str(s) for s in (*roles["discovery"], *roles["confirmation"]))
    arms = [
        f"spike stage: seeds {seeds}, causes {', '.join(matrix)}, x{cfg.spike.magnitude:g} for {cfg.spike.duration} steps"
    ]
    return decide("spike", claims, numbers, arms, failed, details=details)


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


def _slope(fit: dict[str, Any]) -> str:
    """A slope with its 95 % interval and p, or why it has none."""
    if fit.get("p") is None:
        return f"{number(fit.get('slope'), '{:+.3f}')} ({fit['test']})"
    return f"{fit['slope']:+.3f} [{fit['ci95'][0]:+.3f}, {fit['ci95'][1]:+.3f}], p={fit['p']:.3g}"


def _p(test: dict[str, Any]) -> str:
    return f"{test['p']:.3g}" if test.get("p") is not None else "-"


FINDINGS: tuple[Callable[..., Finding], ...] = (xiong_init, xiong, fp16, overflow, beta2, wortsman, mu_transfer, spike)
"""The findings in the report's order (the keys of tasks/report/preregistration.yaml)."""


def evaluate(
    cfg: Config,
    ablate: dict[str, Any],
    search: dict[str, Any] | None,
    spike_metrics: dict[str, Any] | None,
    unigram: float | None,
) -> list[Finding]:
    return [f(cfg=cfg, ablate=ablate, search=search, spike=spike_metrics, unigram=unigram) for f in FINDINGS]
