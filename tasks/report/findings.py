"""The findings the study tests, each against the stages' outputs, with a verdict decided by one
rule written down before any result was seen (and not tuned since):

  reproduced      every claim of the finding holds in the expected direction with p < 0.05
  not reproduced  a claim goes significantly the other way, or no claim's estimate points the
                  expected way, or a precondition of the finding fails (named in the numbers)
  inconclusive    anything else: the right direction without significance, or too few runs

A diverged arm is a result: its loss is the loss at init (tasks/ablate/stats.py: capped_loss).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from tasks.ablate.grid import base_arm
from tasks.ablate.stats import ALPHA, compare, derived, fisher, lr_sensitivity, slope_test
from tasks.config import Config

REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE = "reproduced", "not reproduced", "inconclusive"

CHANGED_AFTER_RESULTS = (
    "The injected spike's magnitude, set on the base arm alone: x10 for 3 steps (the first choice) gave a "
    "peak ratio of 1.03, inside step-to-step noise; x30 gave 1.10; x100 (the spike stage's) 1.63, so the "
    "default is x100.",
    "What counts as a broken fp16 run: first 'diverged or any non-finite step', which counted the one "
    "overflow step a dynamic loss scaler skips by design (scaled fp16 seed 2, normal loss) as breakage; "
    "now 'diverged, or no finite loss at the end'. The verdict is the same under both (scaled fp16 broke "
    "in 3/3 runs by the first rule, 2/3 by the second: the precondition fails either way).",
    "A review after the first full study found five defects (this one and the next four), fixed with grid, "
    "sizes, seeds and thresholds unchanged before the study was rerun. The spike-policy verdict had its own "
    "rule (any policy not back to the control: not reproduced) instead of the one above, under which one "
    "run per policy is at best inconclusive: it went from not reproduced to inconclusive.",
    "An arm that diverged after the spike was censored at its last logged step, so it looked quick "
    "to recover; it now counts every step to the run's planned end.",
    "The trainer's divergence rule read a run whose fp16 loss scale collapsed (every step an "
    "overflow, weights frozen) as completed; overflow steps now count toward train.diverge_after, so those "
    "scaled fp16 arms read diverged (the fp16 finding already counted them broken).",
    "A comparison with no spread between seeds was taken as significant (p = 0); it is now untested.",
    "The arms' cache key lacked the divergence and spike-detector settings; it now has them.",
)
"""Every change made to the study after a result was seen, printed in the report. Nothing else
(grid, sizes, seeds, thresholds, tests) was changed after seeing results."""


@dataclasses.dataclass
class Claim:
    """One directional comparison a finding rests on: ``expected`` is the sign the finding predicts
    for ``estimate``."""

    what: str
    estimate: float | None
    p: float | None
    expected: int = 1

    @property
    def holds(self) -> bool:
        return (
            self.estimate is not None
            and self.p is not None
            and _sign(self.estimate) == self.expected
            and self.p < ALPHA
        )

    @property
    def contradicted(self) -> bool:
        return (
            self.estimate is not None
            and self.p is not None
            and _sign(self.estimate) == -self.expected
            and self.p < ALPHA
        )

    @property
    def points_the_way(self) -> bool:
        return self.estimate is not None and _sign(self.estimate) == self.expected


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


def verdict(claims: Sequence[Claim], precondition_failed: str | None = None) -> str:
    if precondition_failed or any(c.contradicted for c in claims) or not any(c.points_the_way for c in claims):
        return NOT_REPRODUCED
    if claims and all(c.holds for c in claims):
        return REPRODUCED
    return INCONCLUSIVE


@dataclasses.dataclass
class Finding:
    key: str
    claim: str
    source: str
    verdict: str
    numbers: str
    test: str
    arms: list[str]
    details: dict[str, Any]


# ----------------------------------------------------------------------------------------------
# Arms of the grid
# ----------------------------------------------------------------------------------------------


class Grid:
    """The ablate stage's arms, looked up by their factors (those not given held at the base)."""

    def __init__(self, cfg: Config, ablate: dict[str, Any]):
        self.cfg, self.arms = cfg, ablate["arms"]
        self.base = base_arm(cfg.ablation, 0).factors

    def select(self, **factors: Any) -> list[dict[str, Any]]:
        want = {**self.base, **factors}
        return sorted((a for a in self.arms if a["factors"] == want), key=lambda a: a["seed"])

    def values(self, figure: str, **factors: Any) -> list[float]:
        """``figure`` of every seed of the variant; a failed arm (no result) is left out and listed."""
        return [arm_figures(a["metrics"])[figure] for a in self.select(**factors) if a.get("metrics")]

    def names(self, **factors: Any) -> list[str]:
        return [a["name"] for a in self.select(**factors)]

    def by_seed(self, figure: str, **factors: Any) -> dict[int, float]:
        return {a["seed"]: arm_figures(a["metrics"])[figure] for a in self.select(**factors) if a.get("metrics")}


def arm_figures(metrics: dict[str, Any]) -> dict[str, Any]:
    """An arm's figures as read back from metrics/ablate.json, where strict JSON wrote an infinite
    peak ratio (the loss went non-finite after the injection: tasks/ablate/grid.py, spike_response) as
    null: restored to inf, so such an arm counts as the worst spike, not as a missing one."""
    figures = derived(metrics)
    if figures.get("peak_ratio") is None and figures.get("pre_spike_loss") is not None:
        figures["peak_ratio"] = math.inf
    return figures


def _fmt(values: Sequence[float]) -> str:
    """Mean and count of the finite values, and how many were not finite (never dropped silently)."""
    if not values:
        return "no runs"
    finite = [v for v in values if v is not None and math.isfinite(v)]
    text = f"{sum(finite) / len(finite):.3f} (n={len(finite)})" if finite else "none finite"
    return text + (f" + {len(values) - len(finite)} non-finite" if len(finite) < len(values) else "")


def _cmp_text(c: dict[str, Any]) -> str:
    g = f", g={c['hedges_g']:.2f}" if c.get("hedges_g") is not None else ""
    p = f", p={c['p']:.3g}" if c.get("p") is not None else f", {c['test']}"
    return (f"Δ={c['diff']:+.3f}" if c.get("diff") is not None else "Δ undefined") + g + p


def xiong(grid: Grid) -> Finding:
    a = grid.cfg.ablation
    if len(a.blocks) < 2 or "post_ln" not in a.blocks or 0 not in a.warmups or len(a.warmups) < 2:
        return _missing("xiong", "ablation.blocks needs pre_ln and post_ln, ablation.warmups 0 and a warmup")
    warm = next(w for w in a.warmups if w)
    loss = {(b, w): grid.by_seed("capped_loss", block=b, warmup=w) for b in ("pre_ln", "post_ln") for w in (0, warm)}
    post = compare(list(loss["post_ln", 0].values()), list(loss["post_ln", warm].values()))
    pre = compare(list(loss["pre_ln", 0].values()), list(loss["pre_ln", warm].values()))
    seeds = sorted(set.intersection(*(set(v) for v in loss.values())))
    harm = {b: [loss[b, 0][s] - loss[b, warm][s] for s in seeds] for b in ("pre_ln", "post_ln")}
    interaction = compare(harm["post_ln"], harm["pre_ln"])
    claims = [
        Claim("post-LN: no warmup − warmup", post["diff"], post["p"]),
        Claim("warmup's effect, post-LN − pre-LN (per seed)", interaction["diff"], interaction["p"]),
    ]
    diverged = {
        b: sum(1 for m in grid.select(block=b, warmup=0) if m.get("status") == "diverged")
        for b in ("pre_ln", "post_ln")
    }
    numbers = (
        f"final val loss (capped), no warmup vs {warm} steps: post-LN {_fmt(list(loss['post_ln', 0].values()))} "
        f"vs {_fmt(list(loss['post_ln', warm].values()))} ({_cmp_text(post)}); pre-LN "
        f"{_fmt(list(loss['pre_ln', 0].values()))} vs {_fmt(list(loss['pre_ln', warm].values()))} "
        f"({_cmp_text(pre)}); interaction {_cmp_text(interaction)}; diverged without warmup: "
        f"post-LN {diverged['post_ln']}, pre-LN {diverged['pre_ln']}; LR {a.lr:g}"
    )
    arms = [n for b in ("pre_ln", "post_ln") for w in (0, warm) for n in grid.names(block=b, warmup=w)]
    return Finding(
        "xiong",
        "Post-LN needs warmup at a learning rate where Pre-LN trains without it",
        "Xiong et al. 2020",
        verdict(claims),
        numbers,
        "Welch t-tests on the final validation loss (capped at ln V), and on the per-seed warmup "
        "effect post-LN vs pre-LN (the interaction)",
        arms,
        {"post_ln": post, "pre_ln": pre, "interaction": interaction},
    )


def is_broken(m: dict[str, Any]) -> bool:
    """Diverged (the trainer's rule), or ended with no finite validation loss (e.g. scaled fp16 whose
    forward overflows every step after a spike: the scaler skips them all). A step skipped on an
    overflow is not breakage: dynamic loss scaling probes its scale that way by design."""
    return bool(m["diverged"]) or m.get("val_loss") is None or not math.isfinite(m["val_loss"])


def fp16(grid: Grid) -> Finding:
    a = grid.cfg.ablation
    needed = {"bf16", "fp16", "fp16_unscaled"}
    if not needed <= set(a.precisions):
        return _missing("fp16", f"ablation.precisions needs {sorted(needed)}")
    loss = {p: grid.values("capped_loss", precision=p) for p in needed}
    ran = {p: [arm["metrics"] for arm in grid.select(precision=p) if arm.get("metrics")] for p in needed}
    broken = {p: sum(1 for m in ms if is_broken(m)) for p, ms in ran.items()}
    runs = {p: len(ms) for p, ms in ran.items()}
    vs_bf16, vs_scaled = (compare(loss["fp16_unscaled"], loss[p]) for p in ("bf16", "fp16"))
    breaks = fisher(broken["fp16_unscaled"], runs["fp16_unscaled"], broken["bf16"], runs["bf16"])
    peak = {p: grid.values("peak_ratio", precision=p) for p in needed}
    claims = [
        Claim("unscaled fp16 − bf16, loss", vs_bf16["diff"], vs_bf16["p"]),
        Claim("unscaled fp16 − scaled fp16, loss", vs_scaled["diff"], vs_scaled["p"]),
    ]
    precondition = (
        f"bf16 or scaled fp16 broke too ({broken['bf16']}, {broken['fp16']} runs)"
        if broken["bf16"] or broken["fp16"]
        else None
    )
    numbers = (
        f"final val loss (capped): unscaled fp16 {_fmt(loss['fp16_unscaled'])}, bf16 {_fmt(loss['bf16'])}, "
        f"scaled fp16 {_fmt(loss['fp16'])}; vs bf16 {_cmp_text(vs_bf16)}, vs scaled {_cmp_text(vs_scaled)}; "
        f"runs broken (diverged, or no finite loss at the end): unscaled "
        f"{broken['fp16_unscaled']}/{runs['fp16_unscaled']}, "
        f"bf16 {broken['bf16']}/{runs['bf16']}, scaled {broken['fp16']}/{runs['fp16']} (Fisher vs bf16 "
        f"p={breaks['p']:.3g}); spike peak ratio: unscaled {_fmt(peak['fp16_unscaled'])}, bf16 "
        f"{_fmt(peak['bf16'])}, scaled {_fmt(peak['fp16'])}" + (f"; {precondition}" if precondition else "")
    )
    return Finding(
        "fp16",
        "fp16 without loss scaling breaks (underflow or overflow to NaN) where bf16 and scaled "
        "fp16 do not, above all under a spike",
        "Micikevicius et al. 2017; seeds",
        verdict(claims, precondition),
        numbers,
        "Welch t-tests on the final validation loss (capped); Fisher's exact test on broken runs",
        [n for p in sorted(needed) for n in grid.names(precision=p)],
        {"vs_bf16": vs_bf16, "vs_scaled": vs_scaled, "broken": broken, "fisher": breaks},
    )


def beta2(grid: Grid) -> Finding:
    a = grid.cfg.ablation
    if not {0.95, 0.999} <= set(a.beta2s):
        return _missing("beta2", "ablation.beta2s needs 0.95 and 0.999")
    peak = {b: grid.values("peak_ratio", beta2=b) for b in (0.95, 0.999)}
    rec = {b: grid.values("recovery_steps_censored", beta2=b) for b in (0.95, 0.999)}
    c_peak, c_rec = compare(peak[0.999], peak[0.95]), compare(rec[0.999], rec[0.95])
    claims = [
        Claim("peak ratio, 0.999 − 0.95", c_peak["diff"], c_peak["p"]),
        Claim("recovery steps, 0.999 − 0.95", c_rec["diff"], c_rec["p"]),
    ]
    numbers = (
        f"injected spike ({a.inject} x{a.inject_magnitude:g} at step {a.inject_step}): peak ratio "
        f"β₂=0.999 {_fmt(peak[0.999])} vs 0.95 {_fmt(peak[0.95])} ({_cmp_text(c_peak)}); steps to recover "
        f"{_fmt(rec[0.999])} vs {_fmt(rec[0.95])} ({_cmp_text(c_rec)}; never-recovered runs count every step "
        f"to the planned end)"
    )
    return Finding(
        "beta2",
        "β₂ = 0.999 spikes higher and recovers slower than β₂ = 0.95",
        "PaLM; Bai et al. 2025; seed 004",
        verdict(claims),
        numbers,
        "Welch t-tests on the peak ratio and on the steps to recover",
        [n for b in (0.95, 0.999) for n in grid.names(beta2=b)],
        {"peak": c_peak, "recovery": c_rec},
    )


def lr_sensitivities(grid: Grid, stabilizer: str) -> dict[int, float]:
    """Per seed, the LR sensitivity of ``stabilizer`` over ``ablation.lrs``; a seed with a failed arm
    (no result, as in :meth:`Grid.values`) has no sensitivity."""
    a = grid.cfg.ablation
    by_seed: dict[int, dict[float, float]] = {}
    for lr in a.lrs:
        for seed, loss in grid.by_seed("capped_loss", stabilizer=stabilizer, lr=lr).items():
            by_seed.setdefault(seed, {})[lr] = loss
    init = math.log(grid.cfg.tokenizer.vocab_size)
    return {s: lr_sensitivity(losses, init) for s, losses in sorted(by_seed.items()) if len(losses) == len(a.lrs)}


def wortsman(grid: Grid) -> Finding:
    a = grid.cfg.ablation
    others = [s for s in ("qk_norm", "z_loss") if s in a.stabilizers]
    if "none" not in a.stabilizers or not others or len(a.lrs) < 2:
        return _missing("wortsman", "ablation.stabilizers needs none and qk_norm/z_loss, ablation.lrs two or more")
    sens = {s: lr_sensitivities(grid, s) for s in ["none", *others]}
    comparisons = {s: compare(list(sens[s].values()), list(sens["none"].values())) for s in others}
    claims = [Claim(f"LR sensitivity, {s} − none", c["diff"], c["p"], expected=-1) for s, c in comparisons.items()]
    numbers = "; ".join(
        [f"LR sensitivity over LRs {', '.join(f'{lr:g}' for lr in a.lrs)}: none {_fmt(list(sens['none'].values()))}"]
        + [f"{s} {_fmt(list(sens[s].values()))} ({_cmp_text(c)})" for s, c in comparisons.items()]
    )
    return Finding(
        "wortsman",
        "qk-norm and z-loss lower LR sensitivity",
        "Wortsman et al. 2023",
        verdict(claims),
        numbers,
        "LR sensitivity per seed (mean over the LR grid of min(loss, loss at init) − the grid's best); "
        "Welch t-tests against no stabilizer",
        [n for s in ["none", *others] for lr in a.lrs for n in grid.names(stabilizer=s, lr=lr)],
        {"sensitivity": {s: v for s, v in sens.items()}, "comparisons": comparisons},
    )


def mu_transfer(search: dict[str, Any] | None) -> Finding:
    claim, source = "under μP the optimal LR stays put across width; under SP it shifts", "Yang & Hu 2021"
    if not search or not {"sp", "mup"} <= search.keys():
        return Finding(
            "mu_transfer", claim, source, INCONCLUSIVE, "the search stage compared no SP and μP", "-", [], {}
        )
    fits = {}
    for p in ("sp", "mup"):
        points = [
            (math.log2(int(w)), opt) for w, entry in search[p]["widths"].items() for opt in entry["per_seed"].values()
        ]
        fits[p] = slope_test([x for x, _ in points], [y for _, y in points])
    sp, mup = fits["sp"], fits["mup"]
    claims = [Claim("SP: slope of log₂ η* on log₂ width", sp["slope"], sp["p"], expected=-1)]
    moved = f"μP's optimum moves too (slope {mup['slope']:+.2f}, p={mup['p']:.3g})" if mup["p"] < ALPHA else None
    numbers = (
        f"slope of log₂ η* vs log₂ width: SP {sp['slope']:+.2f} (95 % CI {sp['ci95'][0]:+.2f}..{sp['ci95'][1]:+.2f}, "
        f"p={sp['p']:.3g}); μP {mup['slope']:+.3f} (95 % CI {mup['ci95'][0]:+.2f}..{mup['ci95'][1]:+.2f}, "
        f"p={mup['p']:.3g}); widths {', '.join(sorted(search['sp']['widths'], key=int))}; transferred LR "
        f"{search.get('transfer', {}).get('lr', float('nan')):.3g}, loss gap to a direct sweep "
        f"{search.get('transfer', {}).get('loss_gap', float('nan')):+.3f}" + (f"; {moved}" if moved else "")
    )
    return Finding(
        "mu_transfer",
        claim,
        source,
        verdict(claims, moved),
        numbers,
        "linear regression of the per-seed optimum on log₂ width (scipy linregress), t-test of slope = 0",
        ["search stage: " + ", ".join(search.get("studies", []))],
        fits,
    )


def spike_policies(spike: dict[str, Any] | None, cfg: Config) -> Finding:
    """Seed 004's classification of each policy's run against the clean control, through the same
    rule as every finding. Each policy has one run, so no claim is tested (p is None): the verdict
    is at best inconclusive, and not reproduced when nothing points the expected way."""
    claim = "rollback / skip-batch bring the run back to the clean control; continue leaves a gap after a type-2 spike"
    source = "PaLM §5.1; seed 004"
    test = (
        f"seed 004's classification against the clean control (ε={cfg.recovery.recover_epsilon:g}, "
        f"W={cfg.recovery.recover_steps}); one run per policy, so no significance test applies"
    )
    if not spike:
        return Finding("spike", claim, source, INCONCLUSIVE, "the spike stage did not run", test, [], {})
    rows, gapped, claims = [], [], []
    for kind, by_policy in spike.items():
        if not isinstance(by_policy, dict) or "continue" not in by_policy:
            continue
        cont = by_policy["continue"]
        rows.append(
            f"{kind}: continue type {cont['type']} (gap {cont['final_gap']:+.1%})"
            + "".join(
                f", {p} type {by_policy[p]['type']} (gap {by_policy[p]['final_gap']:+.1%})"
                for p in ("rollback", "skip_batch")
                if p in by_policy
            )
        )
        if cont["type"] == 2:  # the spike the claim is about: continuing left a gap
            gapped.append(kind)
            claims += [
                Claim(f"{kind}: {p} back to the control (type 1)", 1 if by_policy[p]["type"] == 1 else -1, None)
                for p in ("rollback", "skip_batch")
                if p in by_policy
            ]
    precondition = None if gapped else "no injection left continue with a gap (type 2)"
    numbers = "; ".join(rows) or "no injection with a continue branch"
    return Finding(
        "spike",
        claim,
        source,
        verdict(claims, precondition),
        numbers + (f"; {precondition}" if precondition else ""),
        test,
        [f"spike stage: {k}/{p}" for k in gapped for p in ("continue", "rollback", "skip_batch")],
        {"type2_under_continue": gapped},
    )


def _missing(key: str, why: str) -> Finding:
    claims = {
        "xiong": ("Post-LN needs warmup at a learning rate where Pre-LN trains without it", "Xiong et al. 2020"),
        "fp16": ("fp16 without loss scaling breaks where bf16 and scaled fp16 do not", "Micikevicius et al. 2017"),
        "beta2": ("β₂ = 0.999 spikes higher and recovers slower than β₂ = 0.95", "PaLM; Bai et al. 2025"),
        "wortsman": ("qk-norm and z-loss lower LR sensitivity", "Wortsman et al. 2023"),
    }
    claim, source = claims[key]
    return Finding(key, claim, source, INCONCLUSIVE, f"not in this grid: {why}", "-", [], {})


FINDINGS: tuple[Callable[..., Finding], ...] = (xiong, fp16, beta2, wortsman)
"""The findings read off the ablation grid, in the report's order (then μ-transfer and spike)."""


def evaluate(
    cfg: Config, ablate: dict[str, Any], search: dict[str, Any] | None, spike: dict[str, Any] | None
) -> list[Finding]:
    grid = Grid(cfg, ablate)
    out = [f(grid) for f in FINDINGS]
    out.insert(3, mu_transfer(search))
    out.append(spike_policies(spike, cfg))
    return out
