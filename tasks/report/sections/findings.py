"""The findings, claim by claim: the forest plot and a table with a row per claim
(:func:`findings_section`), the seeds each family trained in rounds (:func:`rounds_section`), then a
section per finding (:func:`finding_section`); and the forest plot's rows (:func:`forest_rows`)."""

from __future__ import annotations

from typing import Any

from tasks.report.findings import FAMILY_OF
from tasks.report.method import Finding, number
from tasks.report.sections.checks import shown_verdict
from tasks.report.sections.section import SIGNED, Figures, Section, badge, interval, p_value, table, unit
from tasks.report.sections.words import claim_outcome, label, predicted, what_was_found, why
from tasks.report.verdict import EQUIVALENCE, NOT_TESTED, Claim

FINDING_FIGURES = {
    "xiong_init": ["ablate/depth_probe.png"],
    "xiong": ["ablate/xiong.png"],
    "fp16": ["ablate/precision.png"],
    "overflow": ["ablate/overflow.png"],
    "beta2": ["ablate/beta2.png"],
    "wortsman": ["ablate/wortsman.png", "ablate/trajectories.png"],
    "mu_transfer": ["search/*.png"],
    "spike": ["spike/*.png"],
}
"""The figures (globs under reports/) shown in each finding's section; a declared finding names
its own (``figures``)."""


def findings_section(findings: list[Finding]) -> Section:
    """The forest plot and a table with a row per claim."""
    lines: list[str | Figures] = [
        "Each claim is badged by its own outcome (`HOLDS`, `FRAGILE`: not under the data perturbation, "
        "`NEGLIGIBLE`, `NOT SHOWN`, `CONTRADICTED`, `NOT TESTED`: its gate failed), decided on Holm p; a "
        "finding is reproduced when every tested claim holds, negligible when every one is below its SESOI.",
        "",
        Figures(("report/forest.png",)),
        "",
        *_findings_table(findings),
        "",
    ]
    return Section("Findings", lines)


def rounds_section(ablate: dict[str, Any], findings: list[Finding]) -> Section | None:
    """The seeds each family trained in rounds, why it stopped, and the study's arm-steps against its
    cap; None for a study without rounds."""
    sequence = ablate.get("sequential")
    if not sequence:
        return None
    by_family = {FAMILY_OF[f.key]: f for f in findings if f.key in FAMILY_OF} | {
        f.key: f for f in findings if f.declared is not None
    }
    rows = []
    for family, stop in sequence["families"].items():
        f = by_family.get(family)
        outcomes = "; ".join(f"{c.what}: {why(c, brief=True)}" for c in f.claims) if f else "-"
        rows.append(
            [
                family,
                str(stop["seeds"]),
                str(stop["look"] + 1) if "look" in stop else "-",
                stop.get("why", "-"),
                outcomes,
            ]
        )
    spent, cap = sequence["arm_steps"], sequence["cap_arm_steps"]
    lines = [
        f"Each family trained its seeds in rounds of {', '.join(map(str, sequence['rounds']))} and stopped at the first "
        "look where every claim crossed a registered boundary (O'Brien-Fleming spending, looks combined by "
        "Bonferroni: tasks/report/sequential.py) or a gate failed; the rest went on while the study's arm-steps "
        f"stayed within its cap ({sequence['budget_seeds']} seeds of every family). Arm-steps: **{spent:,}** of "
        f"the cap's {cap:,} ({spent / cap:.0%}).",
        "",
        *table(["family", "seeds", "stopped at look", "why", "claims"], rows),
        "",
    ]
    return Section("Seeds in rounds", lines)


def _figures_of(f: Finding) -> Figures:
    return Figures(tuple(FINDING_FIGURES.get(f.key) or f.registered.get("figures") or ()))


def _findings_table(findings: list[Finding]) -> list[str]:
    """A row per claim: its finding (on the first row), its number, its own outcome and why."""
    rows = []
    for f in findings:
        head = [f"[{label(f)}](#{f.key})", badge(shown_verdict(f))]
        if not f.claims:
            rows.append([*head, "-", "-", "-", "-", "-", badge(f.verdict), f.precondition_failed or "no claim"])
        for i, c in enumerate(f.claims):
            outcome = claim_outcome(f, c)
            rows.append(
                [
                    *(head if i == 0 else ["", ""]),
                    c.what,
                    f"{number(c.estimate, SIGNED)}{unit(c)}",
                    interval(c.ci95),
                    p_value(c.p) + (" (TOST)" if c.kind == EQUIVALENCE and c.p is not None else ""),
                    p_value(c.p_adjusted),
                    badge(outcome),
                    outcome_why(f, c, outcome, brief=True),
                ]
            )
    header = ["finding", "verdict", "claim", "estimate", "95 % interval", "p", "Holm p", "claim's outcome", "why"]
    return table(header, rows)


def outcome_why(f: Finding, c: Claim, outcome: str, brief: bool = False) -> str:
    """Why the claim came out as it did: its own gate or the finding's precondition when not tested,
    else the rule's tests, and the failed replication of a FRAGILE claim. ``brief`` (the table's
    row) leaves out a gate's justification, which the finding's own section gives in full."""
    if outcome == NOT_TESTED:
        reason = c.not_tested or f.precondition_failed or ""
        return reason.split(" needed (")[0] + " needed" if brief and " needed (" in reason else reason
    return why(c) + (f"; FRAGILE: {c.fragile}" if c.fragile else "")


def finding_section(f: Finding) -> Section:
    """A finding under its plain label and verdict, linked to by its key: what it tested and found,
    each claim with its prediction, why it holds or not and its power, the claims' table, the
    registered design, the numbers as computed and its figures."""
    r = f.registered
    lines: list[str | Figures] = [
        f"*Tested:* {r['claim']}. *Found:* {what_was_found(f)}.",
        "",
        *([f"*A check of the machinery, not a finding:* {f.check}.", ""] if f.check else []),
    ]
    given: set[str] = set()  # a shared gate's justification, given in full at its first claim only
    for c in f.claims:
        outcome = claim_outcome(f, c)
        justification = (c.not_tested or "").partition(" needed (")[2]
        reason = outcome_why(f, c, outcome, brief=justification in given)
        given.add(justification)
        lines.append(f"- {badge(outcome)} {c.what}: predicted {predicted(c)}; {reason}. {_power(c)}.")
    if f.claims:
        lines += ["", *_claims_table(f), ""]
    lines += [
        f"*Design.* *Source:* {r['source']}. *Arms:* {r['arms']}. *Metric:* {r['metric']}. *Test:* {r['test']}. "
        f"*Predicted:* {r['expected']}. *Precondition:* {r['precondition']}. *Why:* {r['justification']}.",
        "",
        f"*Numbers as computed* (for checking): {f.numbers}",
        "",
    ]
    lines += [_figures_of(f), ""]
    return Section(label(f), lines, anchor=f.key, verdict=shown_verdict(f))


def _power(c: Claim) -> str:
    """The claim's power in words: a direction claim's MDE against SESOI / 2, an equivalence's TOST power."""
    if c.kind == EQUIVALENCE:
        if c.power is None:
            return "TOST power unknown"
        needed = f"{c.seeds_needed} seeds" if c.seeds_needed else "more than 100,000 seeds"
        return f"TOST power at no true difference: {c.power:.1%} at these seeds; 80 % needs {needed} at this SD"
    power = {True: "powered", False: "underpowered: above SESOI / 2", None: "power unknown"}[c.powered]
    return f"Smallest effect it could detect (MDE, 80 % power): {number(c.mde, '{:.3g}')} ({power})"


def _claims_table(f: Finding) -> list[str]:
    """Per claim a row for all the seeds, then one per half: n, estimate, interval, p."""
    rows = []
    for c in f.claims:
        halves = _halves_tested(f, c)
        ns = [n for h in halves.values() if isinstance(n := h.get("n"), int)]
        total = str(sum(ns)) if ns and len(ns) == len(halves) else "-"
        p = p_value(c.p) + (" (TOST)" if c.kind == EQUIVALENCE and c.p is not None else "")
        rows.append([c.what, "all", total, number(c.estimate, SIGNED), interval(c.ci95), p])
        for half, estimate in c.halves.items():
            tested = halves.get(half) or {}
            rows.append(
                [
                    "",
                    half,
                    str(tested.get("n", "-")),
                    number(estimate, SIGNED),
                    interval(tested.get("ci95")),
                    "-"
                    if c.kind == EQUIVALENCE
                    else p_value(tested.get("p")),  # a half is judged by its estimate there
                ]
            )
    return table(["claim", "seeds", "n", "estimate", "95 % interval", "p"], rows)


def _halves_tested(f: Finding, c: Claim) -> dict[str, dict[str, Any]]:
    """The claim's test within each half: under its own name, or (an equivalence claim, whose halves
    are those of the difference it bounds) the entry whose estimates are the claim's."""
    if c.what in f.halves:
        return f.halves[c.what]
    for tested in f.halves.values():
        if tested and all((tested.get(h) or {}).get("estimate") == v for h, v in c.halves.items()):
            return tested
    return {}


def forest_rows(findings: list[Finding]) -> list[dict[str, Any]]:
    """One row per claim for the forest plot (tasks/report/figures.py): the finding's key, plain
    label and verdict, and the claim with its own outcome (:func:`claim_outcome`), which badges
    its row."""
    return [
        {
            "finding": f.key,
            "label": label(f),
            "outcome": claim_outcome(f, c),
            "claim": c.what,
            "estimate": c.estimate,
            "ci95": c.ci95,
            "expected": c.expected,
            "kind": c.kind,
            "margin": c.sesoi if c.kind == "equivalence" else None,
            "sesoi": c.sesoi,
            "verdict": shown_verdict(f),
            "unit": c.unit,
        }
        for f in findings
        for c in f.claims
    ]
