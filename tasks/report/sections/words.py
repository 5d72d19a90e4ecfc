"""Findings and claims in words, for every section that names them: a finding's plain label
(:data:`LABELS`), a claim's own outcome (:func:`claim_outcome`: holds, contradicted, not shown, not
tested), its estimate and prediction in words, which test of the verdict rule (tasks/report/verdict.py)
it passed or failed (:func:`why`), what came out of a finding in a sentence (:func:`what_was_found`),
and a declared claim with no statement of its own named from its factor values (:func:`in_words`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from tasks.design.families import DeclaredClaim, DeclaredFamily, default_statement, shown
from tasks.design.stats import ALPHA
from tasks.design.studies import builtin_names
from tasks.report.method import Finding
from tasks.report.sections.section import interval, p_value, signed, unit
from tasks.report.sequential import CONTINUE
from tasks.report.verdict import (
    CONTRADICTED,
    EQUIVALENCE,
    INCONCLUSIVE,
    NEGLIGIBLE,
    NOT_TESTED,
    RATE,
    REPRODUCED,
    Claim,
    significant,
)

HOLDS, NOT_SHOWN, FRAGILE = "holds", "not shown", "fragile"
"""A claim's own outcomes besides contradicted and not tested (:func:`claim_outcome`); FRAGILE: it
holds on the full data and not under the registered data perturbation."""

LABELS = {
    "xiong_init": "Post-LN vs Pre-LN gradients at initialisation (Xiong et al. 2020)",
    "xiong": "Post-LN needs warmup (Xiong et al. 2020)",
    "fp16": "fp16 needs loss scaling (Micikevicius et al. 2017)",
    "overflow": "fp16 overflows where bf16 does not (Micikevicius et al. 2017)",
    "beta2": "Adam's β₂ and loss spikes (Shazeer & Stern 2018; Wortsman et al. 2023)",
    "wortsman": "LR sensitivity with qk-layernorm and z-loss (Wortsman et al. 2023)",
    "mu_transfer": "μP learning-rate transfer across width (Yang & Hu 2021)",
    "spike": "Spike recovery by cause (PaLM; the recovery playbook)",
}
"""Each built-in finding in plain words, with its source; a declared finding uses its ``title``
or its key and source (:func:`label`)."""


def label(f: Finding) -> str:
    """The finding in plain words: its registered ``title``, the built-in label, or its key and source."""
    r = f.registered
    if r.get("title"):
        return str(r["title"])
    return LABELS.get(f.key) or f"{f.key.replace('_', ' ')} ({_short_source(str(r.get('source', '')))})"


def _short_source(source: str) -> str:
    return source.split(" (")[0].split(";")[0].strip() or "no source"


def claim_outcome(f: Finding, c: Claim) -> str:
    """The claim's own outcome, by the verdict rule's tests on it alone: :func:`outcome`."""
    return outcome(c, f.precondition_failed)


def outcome(c: Claim, precondition_failed: str | None) -> str:
    """A claim's outcome: not tested (its finding's precondition or its own gate failed),
    contradicted, holds (fragile where it did not replicate under the data perturbation),
    negligible (shown smaller than its SESOI), else not shown."""
    if precondition_failed or c.not_tested:
        return NOT_TESTED
    if c.contradicted:
        return CONTRADICTED
    if c.holds:
        return FRAGILE if c.fragile else HOLDS
    return NEGLIGIBLE if c.negligible else NOT_SHOWN


def measured(c: Claim) -> str:
    """The estimate in words: number, unit, 95 % interval, p."""
    if c.estimate is None:
        return "no estimate"
    test = {EQUIVALENCE: "TOST p", RATE: "exact McNemar p"}.get(c.kind, "p")
    parts = [
        f"95 % CI {interval(c.ci95)}" if c.ci95 else "",
        f"{test} = {p_value(c.p)}{holm_text(c)}" if c.p is not None else "no test",
    ]
    return f"{signed(c.estimate)}{unit(c)} ({', '.join(x for x in parts if x)})"


def holm_text(c: Claim) -> str:
    """``, Holm 0.012``: the claim's p adjusted over its finding's tested claims, where it differs."""
    return "" if c.p_adjusted is None or c.p_adjusted == c.p else f", Holm {p_value(c.p_adjusted)}"


def predicted(c: Claim) -> str:
    if c.kind == RATE:
        return "equal divergence" if c.expected == 0 else f"a {'higher' if c.expected > 0 else 'lower'} diverged share"
    if c.kind == EQUIVALENCE:
        return f"within ±{c.sesoi:g}"
    return f"{'>' if c.expected > 0 else '<'} 0, beyond {c.expected * c.sesoi:+g}"


SHORTFALLS = ("other way", "no test", "not significant", "not equivalent", "halves", "too small")
"""The ways a claim falls short of the rule, most telling first (the summary names those first)."""


def why(c: Claim, brief: bool = False) -> str:
    """Which of the verdict rule's tests (tasks/report/verdict.py) the claim passed or failed, in
    words: every failure, or with ``brief`` the most telling in a few words."""
    if c.sequential is not None:
        return _sequential_why(c, brief)
    if c.kind == RATE:
        return _rate_why(c, brief)
    if c.holds:
        return "holds" if brief else _holds(c)
    if c.negligible:
        return "smaller than the SESOI" if brief else _negligible(c)
    if c.contradicted:
        return (
            "contradicted"
            if brief
            else "shown the other way: significant, beyond the smallest effect of interest, both halves agreeing"
        )
    if c.estimate is None:
        return "no estimate: the comparison could not be made"
    failed = shortfalls(c)
    return failed[0][1] if brief else "; ".join(full for _, _, full in failed)


def _rate_why(c: Claim, brief: bool) -> str:
    """A claim read as a difference in divergence rate: its exact test on Holm's adjusted p."""
    shown = "holds" if c.holds else "contradicted" if c.contradicted else "not shown"
    if brief:
        return f"{shown} (diverged share)"
    return (
        f"{shown}: a compared variant diverged in most seeds, so the claim is read as the difference in "
        f"diverged share ({signed(c.estimate) if c.estimate is not None else 'none'}), exact McNemar "
        f"p = {p_value(c.p)}{holm_text(c)} against α = {ALPHA:g}"
    )


def _sequential_why(c: Claim, brief: bool) -> str:
    """A claim decided in rounds (tasks/report/sequential.py): the boundary it crossed, at which look
    and seeds, or that it crossed none before its family stopped."""
    s = c.sequential or {}
    outcome, seeds, boundary = s["outcome"], s["seeds"], s["boundary"]
    if outcome in (CONTINUE, INCONCLUSIVE):
        if brief:
            return "no boundary crossed"
        end = "by the last look" if outcome == INCONCLUSIVE else "when its family stopped (out of budget)"
        share = s.get("share", 1.0)
        holm = f" (Holm's share 1/{round(1 / share)} of α)" if share < 1 else ""
        return f"no boundary crossed at {seeds} seeds {end}{holm}"
    shown = {REPRODUCED: "holds", NEGLIGIBLE: "negligible", CONTRADICTED: "contradicted"}[outcome]
    if c.kind == EQUIVALENCE:
        shown = {NEGLIGIBLE: "holds"}.get(outcome, "contradicted: beyond the margin")
    if brief:
        return f"{shown} at {seeds} seeds"
    bound = (
        f"±{c.sesoi:g}"
        if outcome == NEGLIGIBLE
        else f"{c.sesoi:+g}"
        if c.kind == EQUIVALENCE
        else f"{c.expected * c.sesoi:+g}"
    )
    share = s.get("share", 1.0)
    holm = f", Holm's share 1/{round(1 / share)} of α" if share < 1 else ""
    return (
        f"{shown}: at look {s['look'] + 1} ({seeds} seeds) the one-sided test against {bound} crossed its "
        f"boundary, p < {boundary:.2g}{holm}"
    )


def _holds(c: Claim) -> str:
    if c.kind == EQUIVALENCE:
        return (
            f"holds: TOST p = {p_value(c.p)}{holm_text(c)} < {ALPHA:g} and each half of the seeds inside ±{c.sesoi:g}"
        )
    return (
        f"holds: p = {p_value(c.p)}{holm_text(c)} < {ALPHA:g}, the 95 % interval clears {c.expected * c.sesoi:+g}, "
        "and each half of the seeds points the predicted way"
    )


def _negligible(c: Claim) -> str:
    return (
        f"negligible: smaller than the smallest effect of interest either way (TOST against ±{c.sesoi:g}: "
        f"p = {p_value(c.tost_p)} < {ALPHA:g}), each half of the seeds inside ±{c.sesoi:g}"
    )


def shortfalls(c: Claim) -> list[tuple[str, str, str]]:
    """How a claim that does not hold falls short, test by test of the rule, most telling first:
    (kind from :data:`SHORTFALLS`, a few words, a sentence)."""
    found = _shortfalls_equivalence(c) if c.kind == EQUIVALENCE else _shortfalls_direction(c)
    return sorted(found, key=lambda f: SHORTFALLS.index(f[0])) or [
        ("too small", "short of the rule", "short of the rule")
    ]


def _shortfalls_direction(c: Claim) -> list[tuple[str, str, str]]:
    """A direction claim's: its sign, significance, the interval against the SESOI (the rule's
    Claim._clears), each half's sign (Claim._halves_point)."""
    assert c.estimate is not None
    sign = c.expected
    direction = "> 0" if sign > 0 else "< 0"
    if (c.estimate > 0) - (c.estimate < 0) != sign:
        strength = "significantly" if significant(c.decision_p) else "not significantly"
        return [("other way", "went the other way", f"went the other way, {strength} (predicted {direction})")]
    if c.p is None:
        return [("no test", "no test was possible", "no test was possible")]
    failed = []
    if not significant(c.p):
        failed.append(("not significant", "not significant", f"not significant (p = {p_value(c.p)} ≥ {ALPHA:g})"))
    elif not c._clears(sign):
        sesoi = f"{sign * c.sesoi:+g}"
        if c.ci95 is None:
            failed.append(("too small", "no interval", "no 95 % interval to hold against the SESOI"))
        else:
            near = signed(min(c.ci95) if sign > 0 else max(c.ci95))
            failed.append(
                (
                    "too small",
                    f"maybe too small to matter (the interval reaches {near}; SESOI {sesoi})",
                    f"significant, but maybe too small to matter: the 95 % interval reaches {near}, short of "
                    f"the smallest effect of interest (SESOI) {sesoi}",
                )
            )
    if not c._halves_point(sign):
        off = ", ".join(
            f"{h} {'no estimate' if v is None else signed(v)}"
            for h, v in c.halves.items()
            if v is None or (v > 0) - (v < 0) != sign
        )
        failed.append(("halves", "the seed halves disagree", f"a half of the seeds points the other way ({off})"))
    return failed


def _shortfalls_equivalence(c: Claim) -> list[tuple[str, str, str]]:
    """An equivalence claim's: the TOST, then each half inside the margin."""
    failed = []
    if c.p is None:
        failed.append(("no test", "no test was possible", "no test was possible"))
    elif not significant(c.decision_p):
        failed.append(
            (
                "not equivalent",
                f"equivalence not shown (the data allow a difference beyond ±{c.sesoi:g})",
                f"equivalence not shown (TOST p = {p_value(c.p)}{holm_text(c)} ≥ {ALPHA:g}): the data do not rule out a difference "
                f"beyond ±{c.sesoi:g}",
            )
        )
    outside = ", ".join(
        f"{h} {'no estimate' if v is None else signed(v)}"
        for h, v in c.halves.items()
        if v is None or abs(v) >= c.sesoi
    )
    if outside:
        failed.append(
            ("halves", "a half outside the margin", f"a half of the seeds lies outside ±{c.sesoi:g} ({outside})")
        )
    return failed


GROUPS = (
    (CONTRADICTED, "Shown the other way"),
    (NOT_SHOWN, "Not shown"),
    (NEGLIGIBLE, "Shown smaller than its SESOI"),
    (FRAGILE, "Held on the full data, not under the data perturbation (FRAGILE)"),
    (HOLDS, "Held"),
)
"""Each claim outcome a finding's sentence groups its claims by, in its order, with its words."""

LEADS = {
    REPRODUCED: "Every claim held",
    NEGLIGIBLE: "Every claim shown smaller than its smallest effect of interest (SESOI)",
}
"""The lead of a finding whose verdict one outcome of every claim decides; else the counts lead."""


def what_was_found(f: Finding, most: int | None = None) -> str:
    """What came out, in a sentence worded by the verdict: its lead (every claim held, every claim
    shown smaller than its SESOI, or how many claims came out each way), then each claim by its
    outcome (the other way, not shown, smaller than its SESOI, held; most telling first within
    each) with its number; ``most``: at most that many claims named of each."""
    if f.precondition_failed:
        return f"not tested: {f.precondition_failed}"
    if not f.claims:
        return "no claim could be tested"
    by_outcome = {outcome: [c for c in f.claims if claim_outcome(f, c) == outcome] for outcome, _ in GROUPS}
    by_outcome[NOT_SHOWN].sort(key=_rank)
    groups = [(words, by_outcome[o][:most]) for o, words in GROUPS if by_outcome[o]]
    untested = sum(claim_outcome(f, c) == NOT_TESTED for c in f.claims)  # each gated alone: counted, not named
    rest = len(f.claims) - untested - sum(len(claims) for _, claims in groups)
    more = f"; and {rest} more (below)" if rest else ""
    if len(groups) == 1 and not untested and f.verdict in LEADS:
        return f"{LEADS[f.verdict]}: " + "; ".join(_claim_said(c) for c in groups[0][1]) + more
    counts = ", ".join(f"{len(by_outcome[o])} {words.lower()}" for o, words in GROUPS if by_outcome[o])
    counts += f", {untested} not tested" if untested else ""
    lead = f"Of {len(f.claims)} claims, {counts}"
    said = ". ".join(f"{words}: " + "; ".join(_claim_said(c) for c in claims) for words, claims in groups)
    return f"{lead}. {said}{more}"


def _claim_said(c: Claim) -> str:
    """A claim in the opening line: what it compares, its number, and the test that decided it
    when it did not hold (a negligible claim's TOST)."""
    if c.holds:
        return f"{c.what}: {measured(c)}"
    if c.negligible and c.kind != EQUIVALENCE and c.sequential is None:
        return f"{c.what}: {measured(c)}, TOST p = {p_value(c.tost_p)} against ±{c.sesoi:g}"
    return f"{c.what}: {measured(c)}, {why(c, brief=True)}"


def _rank(c: Claim) -> int:
    if c.contradicted or c.estimate is None:
        return -1
    return SHORTFALLS.index(shortfalls(c)[0][0])


METRICS = {
    "capped_loss": "final loss",
    "val_loss": "validation loss",
    "spikes_per_1k": "spikes per 1,000 steps",
    "update_rms_max": "largest update RMS",
}
"""Metrics in words; another metric is named by its key."""

VALUES: dict[str, dict[Any, str]] = {
    "block": {"post_ln": "Post-LN", "pre_ln": "Pre-LN"},
    "precision": {"fp16_unscaled": "unscaled fp16", "fp16": "fp16 with loss scaling"},
    "stabilizer": {"none": "no stabiliser", "qk_norm": "qk-layernorm", "z_loss": "z-loss"},
    "spike": {"none": "no injected spike", "param": "an injected parameter spike"},
}
"""Factor values in words, by factor; a value not listed falls to :data:`NUMBERS` or ``key=value``."""


def _lr(value: Any) -> str:
    mantissa, exponent = f"{float(value):e}".split("e")
    return f"at LR {float(mantissa):g}e{int(exponent)}"


NUMBERS: dict[str, Callable[[Any], str]] = {
    "warmup": lambda v: "without warmup" if v == 0 else f"with {100 * float(v):g} % warmup",
    "lr": _lr,
    "optim.lr": _lr,
    "lr_mult": lambda v: f"at {float(v):g}x the LR",
    "beta2": lambda v: f"β₂ = {float(v):g}",
    "precision": str,
}
"""Numeric factors in words, by factor (precision's other values are their own names)."""

OVER = {"lr": "the LR", "optim.lr": "the LR", "width": "width"}
"""The factor a sensitivity or slope reads across, in words."""


def factor_words(key: str, value: Any) -> str:
    """One factor value for a reader (``Post-LN``, ``without warmup``, ``at LR 1e-3``), the same
    for built-in and declared families; a factor the vocabulary lacks reads ``key=value``."""
    if value in VALUES.get(key, {}):
        return VALUES[key][value]
    if key in NUMBERS:
        return NUMBERS[key](value)
    return f"{key}={shown(value)}"


def variant_words(factors: dict[str, Any]) -> str:
    return " ".join(factor_words(k, v) for k, v in factors.items())


def claim_words(c: DeclaredClaim) -> str:
    """A declared claim for a reader, from its kind and factor values: what a and b share stays
    with a, and b is named by what differs (``final loss higher for Post-LN without warmup at LR
    1e-3 than with 10 % warmup``)."""
    metric = METRICS.get(c.metric, c.metric)
    sign = {1: "higher", -1: "lower", 0: "the same"}[c.expected]
    a, b = variant_words(c.a), variant_words({k: v for k, v in c.b.items() if c.a.get(k) != v})
    if c.kind == "contrast":
        return f"{metric} {sign} for {a} than {b}"
    if c.kind == "equivalence":
        return f"{metric} the same for {a} as {b}"
    if c.kind == "interaction":
        ((factor, (first, second)),) = c.across.items()
        return f"{metric} {a} − {b} {sign} for {factor_words(factor, first)} than for {factor_words(factor, second)}"
    over = OVER.get(c.over or "", c.over)
    if c.kind == "sensitivity":
        return f"{metric}'s sensitivity to {over} {sign} with {a} than with {b}"
    return f"{metric} {'rises' if c.expected > 0 else 'falls'} with {over}" + (f" ({a})" if a else "")


def _generated(c: DeclaredClaim) -> bool:
    """Whether the claim's statement is the one its declaration makes when it names none."""
    return c.statement == default_statement(c.kind, c.metric, c.a, c.b, c.over, c.across, c.expected)


def in_words(findings: list[Finding], families: list[DeclaredFamily]) -> list[Finding]:
    """The findings as the report names them: each claim whose family declared no statement for
    it named by :func:`claim_words` (its halves keyed so too). The numbers are the same objects'; a
    claim keeps its declared name in metrics/report.json, which is written from the findings as
    tested."""
    family_of = {key: name for name, key in builtin_names().items()}
    said = {(family.name, c.statement): claim_words(c) for family in families for c in family.claims if _generated(c)}

    def worded(f: Finding) -> Finding:
        name = family_of.get(f.key, f.key)
        words = {c.what: said[(name, c.what)] for c in f.claims if (name, c.what) in said}
        if not words:
            return f
        claims = [dataclasses.replace(c, what=words.get(c.what, c.what)) for c in f.claims]
        return dataclasses.replace(f, claims=claims, halves={words.get(k, k): v for k, v in f.halves.items()})

    return [worded(f) for f in findings]
