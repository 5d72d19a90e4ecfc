"""The study's report, from the stages' outputs: ``reports/REPORT.md``, the same page as one
self-contained ``reports/report.html`` (figures embedded, opens offline), every arm with its
command in ``reports/report/arms.md``, and the verdicts as ``metrics/report.json``.

Order, as a reader wants it: what was learned (one line per finding: what was tested, what came
out, the number that decided it); how verdicts are reached (the rule); where the numbers come
from (the code, config and design, and the arithmetic that computed them, with a warning when it
is mixed or not the committed outputs': tasks/report/arithmetic.py); the findings (forest plot
and a table, a row per claim); one section per finding with its claims, its pre-registered design
and its figures; the change history; then the detail: the arms per family, the search, spike and
pretraining stages, the MLflow runs.

Presentation rules. Each finding is named in plain words (:data:`LABELS`), not by its key. Each
claim is badged by its own outcome (:func:`claim_outcome`: holds, contradicted, not shown, not
tested), the finding by its verdict; a claim that falls short says which test of the rule it
failed (:func:`why`). A table cell holds one number, or an interval. Figures git ignores (the
DVC outputs of reports/search) are named, not embedded: the committed page shows no broken
image. MLflow runs are given by run ID with the server that held them, since a link to
127.0.0.1 resolves only on the machine that ran the study. Verdicts are text badges (``REPRODUCED``
in a code span, a coloured box in the HTML): no emoji font needed.
"""

from __future__ import annotations

import base64
import hashlib
import html
import re
import subprocess
import time
from pathlib import Path
from statistics import fmean
from typing import Any

from tasks.config import Config
from tasks.design.preregistration import DESIGN_CODE, design, design_hash
from tasks.design.stats import ALPHA
from tasks.report.findings import FAMILY_OF, scored_gap
from tasks.report.method import Finding, number
from tasks.report.sequential import CONTINUE
from tasks.report.verdict import (
    CONTRADICTED,
    EQUIVALENCE,
    INCONCLUSIVE,
    NEGLIGIBLE,
    NOT_TESTED,
    REPRODUCED,
    Claim,
    significant,
)
from tasks.spike.config import OUTCOMES

REPORTS = Path("reports")
ARMS_PAGE = Path("report/arms.md")
"""Every arm with its status, MLflow run and command, under reports/ (in the report stage's
``reports/report`` output): 300-odd rows that would bury REPORT.md."""
VERDICTS = (REPRODUCED, NEGLIGIBLE, CONTRADICTED, NOT_TESTED, INCONCLUSIVE)
HOLDS, NOT_SHOWN = "holds", "not shown"
"""A claim's own outcomes besides contradicted and not tested (:func:`claim_outcome`)."""
PASSED, FAILED = "check passed", "check failed"
"""A check of the machinery's outcome (:func:`check_outcome`): it is never counted as a finding."""
SIGNED = "{:+.3g}"
"""How the report writes an estimate."""

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

UNITS = {"nats": " nats", "spikes/1k": " spikes/1k steps"}
"""How a claim's unit follows its number; other units (a log ratio, a slope, a relative gap, an
RMS) are in the claim's own words."""

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

FAMILY_COLUMNS = (
    ("capped_loss", "val loss (capped)", "{:.3f}"),
    ("spikes_per_1k", "spikes / 1k steps", "{:.2f}"),
    ("update_rms_max", "max update RMS", "{:.2f}"),
    ("attn_logit_max", "max attn logit", "{:.3g}"),
    ("log_z_max", "max log Z", "{:.2f}"),
    ("grad_underflow_share", "grads < 2⁻²⁴", "{:.2%}"),
)
"""The per-variant columns of the arms' tables: figure, header, format of the mean."""


def badge(verdict: str) -> str:
    return f"`{verdict.upper()}`"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    clean = [[str(c).replace("|", "\\|").replace("\n", " ") for c in row] for row in rows]
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in clean)]


# ----------------------------------------------------------------------------------------------
# Words for findings and claims
# ----------------------------------------------------------------------------------------------


def label(f: Finding) -> str:
    """The finding in plain words: its registered ``title``, the built-in label, or its key and source."""
    r = f.registered
    if r.get("title"):
        return str(r["title"])
    return LABELS.get(f.key) or f"{f.key.replace('_', ' ')} ({_short_source(str(r.get('source', '')))})"


def _short_source(source: str) -> str:
    return source.split(" (")[0].split(";")[0].strip() or "no source"


def check_outcome(f: Finding) -> str:
    """A check's outcome: passed when every claim holds, not tested when its precondition failed."""
    return {REPRODUCED: PASSED, NOT_TESTED: NOT_TESTED}.get(f.verdict, FAILED)


def shown_verdict(f: Finding) -> str:
    """The badge a finding's heading and rows carry: its verdict, or a check's outcome."""
    return check_outcome(f) if f.check else f.verdict


def proper(findings: list[Finding]) -> list[Finding]:
    """The findings that count: every registered finding but the checks of the machinery."""
    return [f for f in findings if not f.check]


def claim_outcome(f: Finding, c: Claim) -> str:
    """The claim's own outcome, by the verdict rule's tests on it alone: not tested (the finding's
    precondition failed), contradicted, holds, negligible (shown smaller than its SESOI), else not shown."""
    if f.precondition_failed:
        return NOT_TESTED
    if c.contradicted:
        return CONTRADICTED
    if c.holds:
        return HOLDS
    return NEGLIGIBLE if c.negligible else NOT_SHOWN


def _num(x: float) -> str:
    return SIGNED.format(x)


def _p(p: float | None) -> str:
    if p is None:
        return "-"
    return f"{p:.0e}" if p < 1e-3 else f"{p:.2g}"


def _unit(c: Claim) -> str:
    return UNITS.get(c.unit, "")


def _interval(ci: list[float] | None) -> str:
    return f"{_num(ci[0])} to {_num(ci[1])}" if ci else "-"


def _measured(c: Claim) -> str:
    """The estimate in words: number, unit, 95 % interval, p."""
    if c.estimate is None:
        return "no estimate"
    test = "TOST p" if c.kind == EQUIVALENCE else "p"
    parts = [f"95 % CI {_interval(c.ci95)}" if c.ci95 else "", f"{test} = {_p(c.p)}" if c.p is not None else "no test"]
    return f"{_num(c.estimate)}{_unit(c)} ({', '.join(x for x in parts if x)})"


def _predicted(c: Claim) -> str:
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


def _sequential_why(c: Claim, brief: bool) -> str:
    """A claim decided in rounds (tasks/report/sequential.py): the boundary it crossed, at which look
    and seeds, or that it crossed none before its family stopped."""
    s = c.sequential or {}
    outcome, seeds, boundary = s["outcome"], s["seeds"], s["boundary"]
    if outcome in (CONTINUE, INCONCLUSIVE):
        if brief:
            return "no boundary crossed"
        end = "by the last look" if outcome == INCONCLUSIVE else "when its family stopped (out of budget)"
        return f"no boundary crossed at {seeds} seeds {end}"
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
    return (
        f"{shown}: at look {s['look'] + 1} ({seeds} seeds) the one-sided test against {bound} crossed its "
        f"boundary, p < {boundary:.2g}"
    )


def _rounds_section(ablate: dict[str, Any], findings: list[Finding]) -> list[str]:
    """The seeds each family trained in rounds, why it stopped, and the study's arm-steps against its cap."""
    sequence = ablate.get("sequential")
    if not sequence:
        return []
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
    return [
        "## Seeds in rounds",
        "",
        f"Each family trained its seeds in rounds of {', '.join(map(str, sequence['rounds']))} and stopped at the first "
        "look where every claim crossed a registered boundary (O'Brien-Fleming spending, looks combined by "
        "Bonferroni: tasks/report/sequential.py) or a gate failed; the rest went on while the study's arm-steps "
        f"stayed within its cap ({sequence['budget_seeds']} seeds of every family). Arm-steps: **{spent:,}** of "
        f"the cap's {cap:,} ({spent / cap:.0%}).",
        "",
        *_table(["family", "seeds", "stopped at look", "why", "claims"], rows),
        "",
    ]


def _holds(c: Claim) -> str:
    if c.kind == EQUIVALENCE:
        return f"holds: TOST p = {_p(c.p)} < {ALPHA:g} and each half of the seeds inside ±{c.sesoi:g}"
    return (
        f"holds: p = {_p(c.p)} < {ALPHA:g}, the 95 % interval clears {c.expected * c.sesoi:+g}, "
        "and each half of the seeds points the predicted way"
    )


def _negligible(c: Claim) -> str:
    return (
        f"negligible: smaller than the smallest effect of interest either way (TOST against ±{c.sesoi:g}: "
        f"p = {_p(c.tost_p)} < {ALPHA:g}), each half of the seeds inside ±{c.sesoi:g}"
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
    predicted = "> 0" if sign > 0 else "< 0"
    if (c.estimate > 0) - (c.estimate < 0) != sign:
        strength = "significantly" if significant(c.p) else "not significantly"
        return [("other way", "went the other way", f"went the other way, {strength} (predicted {predicted})")]
    if c.p is None:
        return [("no test", "no test was possible", "no test was possible")]
    failed = []
    if not significant(c.p):
        failed.append(("not significant", "not significant", f"not significant (p = {_p(c.p)} ≥ {ALPHA:g})"))
    elif not c._clears(sign):
        sesoi = f"{sign * c.sesoi:+g}"
        if c.ci95 is None:
            failed.append(("too small", "no interval", "no 95 % interval to hold against the SESOI"))
        else:
            near = _num(min(c.ci95) if sign > 0 else max(c.ci95))
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
            f"{h} {'no estimate' if v is None else _num(v)}"
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
    elif not significant(c.p):
        failed.append(
            (
                "not equivalent",
                f"equivalence not shown (the data allow a difference beyond ±{c.sesoi:g})",
                f"equivalence not shown (TOST p = {_p(c.p)} ≥ {ALPHA:g}): the data do not rule out a difference "
                f"beyond ±{c.sesoi:g}",
            )
        )
    outside = ", ".join(
        f"{h} {'no estimate' if v is None else _num(v)}" for h, v in c.halves.items() if v is None or abs(v) >= c.sesoi
    )
    if outside:
        failed.append(
            ("halves", "a half outside the margin", f"a half of the seeds lies outside ±{c.sesoi:g} ({outside})")
        )
    return failed


def _found(f: Finding, most: int | None = None) -> str:
    """What came out, in a sentence: how many claims held, then each claim that did not (most
    telling first) with its number and why, then those that held; ``most``: at most that many
    claims named of each."""
    if f.precondition_failed:
        return f"not tested: {f.precondition_failed}"
    if not f.claims:
        return "no claim could be tested"
    short = sorted((c for c in f.claims if not c.holds), key=lambda c: _rank(c))
    held = [c for c in f.claims if c.holds]
    groups = [(label, claims[:most]) for label, claims in (("Did not hold", short), ("Held", held)) if claims]
    said = ". ".join(f"{label}: " + "; ".join(_claim_said(c) for c in claims) for label, claims in groups)
    rest = len(f.claims) - sum(len(claims) for _, claims in groups)
    lead = "every claim held" if not short else f"{len(held)} of {len(f.claims)} claims held"
    return f"{lead}. {said}" + (f"; and {rest} more (below)" if rest else "")


def _claim_said(c: Claim) -> str:
    """A claim in the opening line: what it compares, its number, and why when it did not hold."""
    return f"{c.what}: {_measured(c)}" + ("" if c.holds else f", {why(c, brief=True)}")


def _rank(c: Claim) -> int:
    if c.contradicted or c.estimate is None:
        return -1
    return SHORTFALLS.index(shortfalls(c)[0][0])


def _checks_lines(checks: list[Finding]) -> list[str]:
    """The checks of the machinery, apart from the findings, each with its numbers and why it is one."""
    if not checks:
        return []
    lines = [
        f"**{len(checks)} checks of the machinery**, not counted among the findings (true by construction, or "
        "measured without training):",
        "",
    ]
    for f in checks:
        numbers = "; ".join(f"{c.what}: {_measured(c)}" for c in f.claims) or (f.precondition_failed or "no claim")
        lines.append(f"- {badge(check_outcome(f))} **[{label(f)}](#{f.key})**. {numbers}. *Why a check:* {f.check}.")
    return [*lines, ""]


def _summary_lines(findings: list[Finding]) -> list[str]:
    return [
        f"- {badge(f.verdict)} **[{label(f)}](#{f.key})**. *Tested:* {f.registered['claim']}. "
        f"*Found:* {_found(f, most=2)}."
        for f in findings
    ]


# ----------------------------------------------------------------------------------------------
# Figures: embedded when git keeps them
# ----------------------------------------------------------------------------------------------


def git_ignored(project: Path, paths: list[Path]) -> set[Path]:
    """Those of ``paths`` (under ``project``) that git ignores there: untracked and matched by a
    .gitignore. None when ``project`` is not a git checkout or git is missing."""
    if not paths:
        return set()
    names = [p.relative_to(project).as_posix() for p in paths]
    try:
        done = subprocess.run(
            ["git", "check-ignore", "-z", "--stdin"],
            cwd=project,
            input="\0".join(names) + "\0",
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return set()
    if done.returncode not in (0, 1):  # 128: not a git checkout
        return set()
    return {project / name for name in done.stdout.split("\0") if name}


def _images(project: Path, patterns: list[str]) -> list[str]:
    """The figures matching ``patterns`` under reports/, embedded; those git ignores (a DVC
    output's) named instead, so the committed page shows no broken image."""
    root = project / REPORTS
    paths = sorted({p for pattern in patterns for p in root.glob(pattern)})
    unmatched = [root / pattern for pattern in patterns if not any(root.glob(pattern))]
    ignored = git_ignored(project, [*paths, *unmatched])  # git matches a pattern's name as a path
    lines = [f"![{p.stem}]({p.relative_to(root).as_posix()})" for p in paths if p not in ignored]
    if ignored:
        names = ", ".join(f"`reports/{p.relative_to(root).as_posix()}`" for p in sorted(ignored))
        lines += ["", f"Figures not in git (DVC outputs: `dvc pull` or `dvc repro` makes them): {names}."]
    return lines


def _figures_of(f: Finding) -> list[str]:
    return FINDING_FIGURES.get(f.key) or list(f.registered.get("figures") or [])


# ----------------------------------------------------------------------------------------------
# The page
# ----------------------------------------------------------------------------------------------


def render_markdown(
    cfg: Config,
    project: Path,
    findings: list[Finding],
    ablate: dict[str, Any],
    search: dict[str, Any] | None,
    spike: dict[str, Any] | None,
    pretrain: dict[str, Any] | None,
    provenance: dict[str, str],
    stage_runs: dict[str, str],
    arithmetic: dict[str, Any],
    sensitivity: dict[str, Any] | None = None,
    times: dict[str, float | None] | None = None,
) -> str:
    counts = ", ".join(f"{sum(f.verdict == v for f in proper(findings))} {v}" for v in VERDICTS)
    checks = [f for f in findings if f.check]
    warnings = [f"> **Arithmetic warning:** {w}." for w in arithmetic["warnings"]]
    lines = [
        "# spikelab study report",
        "",
        f"**{len(proper(findings))} pre-registered findings** on the training stability of small GPT-style "
        f"models (profile {cfg.profile}): **{counts}**. What each tested and what came out:",
        "",
        *_summary_lines(proper(findings)),
        "",
        *_checks_lines(checks),
        *warnings,
        *([""] if warnings else []),
        "Below: how a verdict is reached, where the numbers come from, the findings claim by claim, the "
        "changes made after results were seen, then the arms, the search, spike and pretraining stages and "
        f"the MLflow runs. Every arm's command: [{ARMS_PAGE.as_posix()}]({ARMS_PAGE.as_posix()}). Every "
        "number: metrics/report.json.",
        "",
        *_method_section(ablate),
        *_provenance_section(cfg, provenance, arithmetic, times or {}),
        "## Findings",
        "",
        "Each claim is badged by its own outcome (`HOLDS`, `NEGLIGIBLE`, `NOT SHOWN`, `CONTRADICTED`, "
        "`NOT TESTED`); a finding is reproduced only when every one of its claims holds, negligible when "
        "every one is shown smaller than its SESOI.",
        "",
        *_images(project, ["report/forest.png"]),
        "",
        *_findings_table(findings),
        "",
        *_rounds_section(ablate, findings),
    ]
    for f in findings:
        lines += _finding_section(project, f)
    lines += _sensitivity_section(sensitivity)
    lines += [
        *_changes_section(),
        *_arms_section(cfg, ablate),
        *_search_section(project, search),
        *spike_section(project, spike),
        *_pretrain_section(project, pretrain),
        *_runs_section(stage_runs),
    ]
    return "\n".join(lines) + "\n"


def _method_section(ablate: dict[str, Any]) -> list[str]:
    return [
        "## How a verdict is reached",
        "",
        "Each finding was tested as its pre-registered design says (tasks/design/preregistration.yaml), with "
        f"one rule for all: {badge(NOT_TESTED)} when a named precondition failed; {badge(CONTRADICTED)} when a "
        f"claim is shown the other way (p < {ALPHA:g}, the 95 % interval beyond its smallest effect of interest, "
        f"both halves of the seeds that way); {badge(REPRODUCED)} when every claim holds: significant the "
        "predicted way, its 95 % interval clearing its smallest effect of interest (SESOI), and the discovery "
        'and confirmation seeds each pointing that way (a "no effect" claim by two one-sided tests against '
        f"±SESOI); {badge(NEGLIGIBLE)} when every claim is shown smaller than its SESOI either way (two "
        "one-sided tests against ±SESOI, each half of the seeds inside it): the effect the source predicts is "
        f"absent or too small to act on at this scale; {badge(INCONCLUSIVE)} otherwise. The seed is the unit: per-seed differences (averaged over an "
        "LR grid within each seed), the paired t-test, its MDE (the smallest effect it detects with 80 % power; "
        "powered: MDE ≤ SESOI / 2; an equivalence's power is the TOST's own). Diverged runs count at the loss at initialisation, and none is dropped. "
        f"Unigram baseline on validation: **{number(ablate.get('unigram_val_loss'), '{:.3f}')} nats**; every "
        f"variant a claim compares must end {design()['plateau_margin']:g} nats below it (those predicted to "
        "fail aside).",
        *(
            [
                "",
                "Version 3: the families' seeds came in rounds, so a claim of a family of arms is decided by the "
                "group-sequential rule instead: after each round its one-sided tests against ±SESOI (the same "
                "holds / contradicted / negligible) at the level the registered spending leaves that look, which "
                "keeps the fixed design's error rates over all looks ([Seeds in rounds](#seeds-in-rounds)); the "
                "halves are shown, not required.",
            ]
            if ablate.get("sequential")
            else []
        ),
        "",
    ]


def stage_times(outputs: dict[str, dict[str, Any] | None]) -> dict[str, float | None]:
    """Each training stage's wall seconds as its metrics file records it (the search's under
    ``time``); None where the stage did not run or its file records no wall time (a version-3
    spike stage recorded only its CPU seconds)."""
    times: dict[str, float | None] = {}
    for stage, metrics in outputs.items():
        wall = (metrics or {}).get("wall_s", (metrics or {}).get("time", {}).get("wall_s"))
        times[stage] = None if wall is None else float(wall)
    return times


def _provenance_section(
    cfg: Config, provenance: dict[str, str], arithmetic: dict[str, Any], times: dict[str, float | None]
) -> list[str]:
    shown = ", ".join(f"{s} {'not recorded' if t is None else f'{t / 60:.1f} min'}" for s, t in times.items())
    return [
        "## Where the numbers come from",
        "",
        f"- Profile **{cfg.profile}**, code `{provenance['commit']}`, built {provenance['built']}",
        f"- config hash `{provenance['config_hash']}` (sha256 of params/resolved.yaml)",
        f"- design hash `{design_hash()}` (sha256 of the pre-registration and the code that decides verdicts: "
        f"{', '.join(DESIGN_CODE)})",
        *_arithmetic_lines(arithmetic),
        *([f"- wall time per stage, as each stage's metrics record it: {shown}"] if times else []),
        "",
    ]


def _arithmetic_lines(arithmetic: dict[str, Any]) -> list[str]:
    """Which machine(s) computed the numbers, one line per numeric path."""
    return [
        f"- numeric path `{p}` ({', '.join(e['produced'])}): {e['machine']}" for p, e in arithmetic["inputs"].items()
    ]


def _findings_table(findings: list[Finding]) -> list[str]:
    """A row per claim: its finding (on the first row), its number, its own outcome and why."""
    rows = []
    for f in findings:
        head = [f"[{label(f)}](#{f.key})", badge(shown_verdict(f))]
        if not f.claims:
            rows.append([*head, "-", "-", "-", "-", badge(f.verdict), f.precondition_failed or "no claim"])
        for i, c in enumerate(f.claims):
            outcome = claim_outcome(f, c)
            rows.append(
                [
                    *(head if i == 0 else ["", ""]),
                    c.what,
                    f"{number(c.estimate, SIGNED)}{_unit(c)}",
                    _interval(c.ci95),
                    _p(c.p) + (" (TOST)" if c.kind == EQUIVALENCE and c.p is not None else ""),
                    badge(outcome),
                    (f.precondition_failed or "") if outcome == NOT_TESTED else why(c),
                ]
            )
    return _table(["finding", "verdict", "claim", "estimate", "95 % interval", "p", "claim's outcome", "why"], rows)


def _finding_section(project: Path, f: Finding) -> list[str]:
    r = f.registered
    lines = [
        f'<a id="{f.key}"></a>',
        "",
        f"## {label(f)} — {badge(shown_verdict(f))}",
        "",
        f"*Tested:* {r['claim']}. *Found:* {_found(f)}.",
        "",
        *([f"*A check of the machinery, not a finding:* {f.check}.", ""] if f.check else []),
    ]
    for c in f.claims:
        outcome = claim_outcome(f, c)
        lines.append(
            f"- {badge(outcome)} {c.what}: predicted {_predicted(c)}; "
            f"{f.precondition_failed if outcome == NOT_TESTED else why(c)}. {_power(c)}."
        )
    if f.claims:
        lines += ["", *_claims_table(f), ""]
    lines += [
        f"*Design.* *Source:* {r['source']}. *Arms:* {r['arms']}. *Metric:* {r['metric']}. *Test:* {r['test']}. "
        f"*Predicted:* {r['expected']}. *Precondition:* {r['precondition']}. *Why:* {r['justification']}.",
        "",
        f"*Numbers as computed* (for checking): {f.numbers}",
        "",
    ]
    return [*lines, *_images(project, _figures_of(f)), ""]


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
        p = _p(c.p) + (" (TOST)" if c.kind == EQUIVALENCE and c.p is not None else "")
        rows.append([c.what, "all", total, number(c.estimate, SIGNED), _interval(c.ci95), p])
        for half, estimate in c.halves.items():
            tested = halves.get(half) or {}
            rows.append(
                [
                    "",
                    half,
                    str(tested.get("n", "-")),
                    number(estimate, SIGNED),
                    _interval(tested.get("ci95")),
                    "-" if c.kind == EQUIVALENCE else _p(tested.get("p")),  # a half is judged by its estimate there
                ]
            )
    return _table(["claim", "seeds", "n", "estimate", "95 % interval", "p"], rows)


def _halves_tested(f: Finding, c: Claim) -> dict[str, dict[str, Any]]:
    """The claim's test within each half: under its own name, or (an equivalence claim, whose halves
    are those of the difference it bounds) the entry whose estimates are the claim's."""
    if c.what in f.halves:
        return f.halves[c.what]
    for tested in f.halves.values():
        if tested and all((tested.get(h) or {}).get("estimate") == v for h, v in c.halves.items()):
            return tested
    return {}


def _arms_section(cfg: Config, ablate: dict[str, Any]) -> list[str]:
    counts = ablate["counts"]
    lines = [
        "## The arms, family by family",
        "",
        f"{len(ablate['arms'])} arms ({counts['completed']} completed, {counts['diverged']} diverged, "
        f"{counts['stopped']} stopped, "
        f"{counts['failed']} failed after retries{': ' + ', '.join(ablate['failed']) if ablate['failed'] else ''}), "
        f"each trained from scratch at width {cfg.ablation.d_model}, {cfg.ablation.seq_len}-token context, "
        f"discovery seeds {cfg.ablation.seeds}, confirmation seeds {cfg.ablation.confirm_seeds}. Every arm with "
        f"its status, MLflow run and the command that reproduces it: [{ARMS_PAGE.as_posix()}]"
        f"({ARMS_PAGE.as_posix()}). Per variant: the mean over seeds and its 95 % t-interval.",
        "",
    ]
    header = ["family", "variant", "seeds", "status", *(h for _, h, _ in FAMILY_COLUMNS)]
    rows = []
    for name, entry in ablate["variants"].items():
        statuses = ", ".join(f"{entry['status'].count(s)} {s}" for s in sorted(set(entry["status"])))
        family, variant = name.split("/", 1)
        rows.append(
            [family, variant, str(len(entry["seeds"])), statuses]
            + [_mean_interval(entry["figures"].get(k, {}), fmt) for k, _, fmt in FAMILY_COLUMNS]
        )
    return [*lines, *_table(header, rows), ""]


def _mean_interval(d: dict[str, Any], fmt: str) -> str:
    if d.get("mean") is None:
        return "-"
    text = fmt.format(d["mean"])
    if d.get("ci95"):
        lo, hi = d["ci95"]
        text += f" [{fmt.format(lo)}, {fmt.format(hi)}]"
    return text + (f" ({d['missing']} not finite)" if d.get("missing") else "")


def _search_section(project: Path, search: dict[str, Any] | None) -> list[str]:
    if not search:
        return ["## μ-transfer (search stage)", "", "The search stage has not run.", ""]
    names = [p for p in ("sp", "mup") if p in search]
    slopes = [[p, f"{search[p]['slope']:+.3f}", f"{search[p]['slope_std']:.3f}"] for p in names]
    optima = [
        [p, w, f"{search[p]['widths'][w]['log2_lr_opt']:.2f}", f"{search[p]['widths'][w]['loss_opt']:.3f}"]
        for p in names
        for w in sorted(search[p]["widths"], key=int)
    ]
    lines = [
        "## μ-transfer (search stage)",
        "",
        "The slope of the optimal log₂ LR (η*) on log₂ width, over the seeds, and the optimum at each width "
        "(the study's trials are in optuna-dashboard and, as child runs of the search stage's run, in MLflow):",
        "",
        *_table(["parametrization", "slope", "SD over seeds"], slopes),
        "",
        *_table(["parametrization", "width", "log₂ η*", "loss at η* (nats)"], optima),
    ]
    transfer = search.get("transfer", {})
    if transfer:
        lines += [
            "",
            f"Transferred LR {transfer.get('lr', float('nan')):.4g}; loss gap to a direct sweep at the "
            f"target width {transfer.get('loss_gap', float('nan')):+.4f} nats; compute ratio "
            f"{transfer.get('compute_ratio', float('nan')):.2f}.",
        ]
    return [*lines, *_search_pruning_lines(search.get("pruning")), ""]


def _search_pruning_lines(pruning: dict[str, Any] | None) -> list[str]:
    """Which trials the search's pruner stopped, at which step: a line, then a row per parametrization
    and width (per seed, log₂ LR @ step). None for a search that recorded no pruning."""
    if not pruning:
        return []
    rule = pruning["rule"]
    if rule.get("median"):
        warmup = rule["n_warmup_steps"]
        how = (
            f"Optuna's MedianPruner within each parametrization × width × seed, its LRs in ascending order, the "
            f"first {rule['n_startup_trials']} always to the end, a trial judged at each report"
            + (f" from step {warmup}" if warmup else "")
            + f" but its last; and the loss bound {rule['prune_above']:.3g} nats"
        )
    else:
        how = f"the loss bound {rule['prune_above']:.3g} nats only (search.prune_median: false)"
    lines = [
        "",
        f"Pruning ({how}): **{pruning['pruned']} of {pruning['trials']} trials stopped**, "
        f"{pruning['steps_saved']:,} of {pruning['steps']:,} steps saved ({pruning['steps_saved_share']:.1%}). "
        "The optima and slopes above are fitted from the trials that ran to the end; an optimum is at the "
        "grid's edge only at its smallest or largest LR.",
    ]
    rows: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for g in pruning["groups"]:
        rows.setdefault((g["kind"], g["parametrization"], g["width"]), []).append(g)
    table = []
    for (kind, p, w), groups in rows.items():
        stopped = sum(len(g["pruned"]) for g in groups)
        if kind != "sweep" and not stopped:
            continue
        where = "; ".join(
            f"seed {g['seed']}: "
            + ", ".join(
                f"{t['log2_lr']:.2f}@{t['step']}" + ("" if t["by"] == "median" else f" ({t['by']})")
                for t in g["pruned"]
            )
            for g in groups
            if g["pruned"]
        )
        table.append(
            [
                p if kind == "sweep" else f"{p} ({kind})",
                str(w),
                f"{stopped} / {sum(g['trials'] for g in groups)}",
                f"{sum(g['steps_saved'] for g in groups):,}",
                where or "none",
            ]
        )
    if table:
        lines += [
            "",
            *_table(
                ["parametrization", "width", "stopped / trials", "steps saved", "stopped at (log₂ LR @ step)"], table
            ),
        ]
    return lines


def spike_section(project: Path, spike: dict[str, Any] | None) -> list[str]:
    if not spike or "matrix" not in spike:
        return ["## Spike study", "", "The spike stage has not run.", ""]
    matrix, policies = spike["matrix"], spike["policies"]
    counts = [
        [f"{cause} ({_tied_to(spike, cause)})", *(_spike_counts(matrix[cause].get(p, {})) for p in policies)]
        for cause in spike["causes"]
    ]
    gaps = [[cause, *(_spike_gap(matrix[cause].get(p, {})) for p in policies)] for cause in spike["causes"]]
    seeds = ", ".join(str(s) for s in spike["discovery_seeds"])
    confirm = ", ".join(str(s) for s in spike["confirm_seeds"]) or "none"
    lines = [
        f"## Spike study (independent origin runs: discovery seeds {seeds}; confirmation seeds {confirm})",
        "",
        f"False alarms on the clean controls: {spike.get('false_positives')}. Per cause and policy, over the seeds: "
        "how many branches recovered (back within ε in time) / ended with a gap (back late, settled above, or "
        "diverged) / gave up (the retry cap):",
        "",
        *_table(["cause", *policies], counts),
        "",
        "The mean scored gap to the seed's control (version 3: a branch that gave up is scored at the loss it "
        "gave up at, for every step it did not run; version 2's studies have only the final gap of the branches "
        "that did not give up):",
        "",
        *_table(["scored gap", *policies], gaps),
        *_detection_lines(spike),
    ]
    postmortems = sorted((project / REPORTS / "postmortems").glob("*.md"))
    return [
        *lines,
        "",
        f"Post-mortems (seed {spike['postmortem_seed']}): "
        + (", ".join(f"[{p.stem}](postmortems/{p.name})" for p in postmortems) or "none"),
        "",
    ]


def _detection_lines(spike: dict[str, Any]) -> list[str]:
    """The detector's rate per cause and the origins the plateau gate left out (version 3)."""
    detection = spike.get("detection")
    if not detection:
        return []
    rates = "; ".join(
        f"{cause} {d['detected']} of {d['injected']}"
        + (f" (missed at seeds {', '.join(map(str, d['missed_seeds']))})" if d["missed_seeds"] else "")
        for cause, d in detection.items()
    )
    excluded = (spike.get("plateau") or {}).get("excluded") or []
    left_out = f" Origins left out on the plateau: {', '.join(map(str, excluded))}." if excluded else ""
    return ["", f"Spikes the detector caught, per cause: {rates}.{left_out}"]


CAUSE_OF_TIE = {"stream": "data-tied", "once": "state-tied", "step": "step-tied"}
"""How the report names a cause by what its injection is tied to (model/spike/injections.py)."""


def _tied_to(spike: dict[str, Any], cause: str) -> str:
    entry = next(iter(spike["seeds"].values()))
    return CAUSE_OF_TIE[entry[cause]["injection"]["tied_to"]]


def _spike_counts(by_seed: dict[str, dict[str, Any]]) -> str:
    """recovered / gap / gave up over the seeds."""
    cells = list(by_seed.values())
    return "/".join(str(sum(c["outcome"] == o for c in cells)) for o in OUTCOMES)


def _spike_gap(by_seed: dict[str, dict[str, Any]]) -> str:
    """The mean scored gap (a give-up scored at the loss it gave up at; version 2: the final gap of
    the branches that have one)."""
    gaps = [g for c in by_seed.values() if (g := scored_gap(c)) is not None]
    return f"{fmean(gaps):+.1%}" if gaps else "-"


def _pretrain_section(project: Path, pretrain: dict[str, Any] | None) -> list[str]:
    if not pretrain:
        return []
    tel = pretrain.get("telemetry", {})
    return [
        "## Pretraining",
        "",
        f"Status {pretrain['status']}, {pretrain['steps']} steps, {pretrain['precision']}; final train loss "
        f"{pretrain['final_loss']:.4f}, validation loss {pretrain['val_loss']:.4f}; grad norm "
        f"{tel.get('grad_norm', float('nan')):.3g}, max attention logit {tel.get('attn_logit_max', float('nan')):.3g}.",
        "",
        *_images(project, ["pretrain/*.png"]),
        "",
    ]


def _changes_section() -> list[str]:
    changes = design().get("changes_after_results") or []
    return [
        "## Changes made after a result was seen",
        "",
        f"Design hash `{design_hash()}`. Every change to the design, the arms, sizes, seeds, thresholds or tests "
        "made after any of its results was seen (tasks/design/preregistration.yaml, `changes_after_results`):",
        "",
        *([f"{i}. {c}" for i, c in enumerate(changes, 1)] or ["None."]),
        "",
    ]


# ----------------------------------------------------------------------------------------------
# MLflow runs: by run ID, with the server that held them
# ----------------------------------------------------------------------------------------------

MLFLOW_RUN = re.compile(
    r"^(?P<server>https?://[^/#?]+)?.*?#/experiments/(?P<experiment>[^/?]+)/runs/(?P<run>[0-9a-f]+)"
)


def mlflow_run(ref: str | None) -> tuple[str | None, str | None, str] | None:
    """(server, experiment ID, run ID) of a run link (a UI URL or ``runs:/<id>``), or None."""
    if not ref:
        return None
    if ref.startswith("runs:/"):
        return None, None, ref.removeprefix("runs:/").split("/")[0]
    m = MLFLOW_RUN.match(ref)
    return (m["server"], m["experiment"], m["run"]) if m else None


def _where_runs_are(refs: list[tuple[str | None, str | None, str]]) -> str:
    """Where the runs ``refs`` live, in a sentence: run IDs resolve only in the store that holds them."""
    servers = sorted({s for s, _, _ in refs if s})
    experiments = sorted({e for _, e, _ in refs if e})
    held = f"the MLflow server at {', '.join(servers)} on the machine that ran it" if servers else "its tracking store"
    page = (
        f"`<MLflow URL>/#/experiments/{experiments[0]}/runs/<run ID>`"
        if len(experiments) == 1
        else "`<MLflow URL>/#/experiments/<experiment>/runs/<run ID>`"
    )
    return (
        f"The run IDs are those of the study's runs in {held}. On that machine (`spikelab services up`, then "
        f"`spikelab ui`), a run opens at {page}; another machine's MLflow does not hold them (its own `dvc repro` "
        "makes its own runs)."
    )


def _runs_section(stage_runs: dict[str, str]) -> list[str]:
    refs = {stage: mlflow_run(url) for stage, url in stage_runs.items()}
    found = [r for r in refs.values() if r]
    lines = ["## MLflow runs", ""]
    if found:
        lines += [_where_runs_are(found), ""]
    lines += [f"- {stage}: run `{r[2]}`" if r else f"- {stage}: {stage_runs[stage]}" for stage, r in refs.items()]
    if not refs:
        lines.append(
            "- The tracking store this report was built against holds no finished run of the stages it reads "
            "(a report rebuilt from the committed metrics/*.json elsewhere)."
        )
    lines += [
        "",
        f"Each arm's run ID (a child run of the ablate stage's run) is in [{ARMS_PAGE.as_posix()}]"
        f"({ARMS_PAGE.as_posix()}), with the command that reproduces the arm.",
        "",
    ]
    return lines


def render_arms(ablate: dict[str, Any]) -> str:
    """reports/report/arms.md: every arm, its status, its MLflow run ID and its command."""
    refs = [mlflow_run(a.get("mlflow")) for a in ablate["arms"]]
    found = [r for r in refs if r]
    lines = [
        "# The arms of the study",
        "",
        f"{len(ablate['arms'])} arms, each trained from scratch; each reproduces with its command, run from the "
        "project's root ([the report](../REPORT.md)).",
        "",
        *([_where_runs_are(found), ""] if found else []),
        *_table(
            ["arm", "status", "MLflow run", "command"],
            [
                [a["name"], a["status"], f"`{r[2]}`" if r else str(a.get("mlflow") or "-"), f"`{a['command']}`"]
                for a, r in zip(ablate["arms"], refs)
            ],
        ),
    ]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# HTML
# ----------------------------------------------------------------------------------------------

BADGE_COLOURS = {
    REPRODUCED: "#1a7f37",
    HOLDS: "#1a7f37",
    CONTRADICTED: "#cf222e",
    NOT_TESTED: "#6e7781",
    NEGLIGIBLE: "#0969da",
    PASSED: "#1a7f37",
    FAILED: "#cf222e",
    INCONCLUSIVE: "#9a6700",
    NOT_SHOWN: "#9a6700",
}
"""A verdict's or a claim outcome's badge colour in the HTML."""

STYLE = """body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;line-height:1.45}
table{border-collapse:collapse;font-size:.85em;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 6px;vertical-align:top}
th{background:#f3f3f3}img{max-width:100%;border:1px solid #eee;margin:.5em 0}code{font-size:.85em;word-break:break-all}
.badge{color:#fff;border-radius:4px;padding:1px 6px;font-weight:600;font-size:.8em;white-space:nowrap}"""


def render_html(markdown_text: str, reports_dir: Path) -> str:
    """The markdown as one page with every figure embedded (data URIs) and verdicts as coloured badges."""
    from markdown_it import MarkdownIt

    body = MarkdownIt("commonmark", {"html": True}).enable("table").render(markdown_text)

    def embed(match: re.Match[str]) -> str:
        path = reports_dir / html.unescape(match.group(1))
        if not path.is_file():
            return match.group(0)
        return f'src="data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()}"'

    body = re.sub(r'src="([^"]+\.png)"', embed, body)
    for verdict, colour in BADGE_COLOURS.items():
        body = body.replace(
            f"<code>{verdict.upper()}</code>",
            f'<span class="badge" style="background:{colour}">{verdict.upper()}</span>',
        )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>spikelab study report</title>"
        f"<style>{STYLE}</style></head><body>{body}</body></html>\n"
    )


def report_json(
    findings: list[Finding],
    ablate: dict[str, Any],
    arithmetic: dict[str, Any],
    times: dict[str, float | None] | None = None,
) -> dict[str, Any]:
    """metrics/report.json: per finding its verdict, test, source, smallest detectable effects and
    claims; the unigram baseline and each family's base-arm loss; counts per verdict; the
    arithmetic of the report and of the runs it used, and its warnings (``provenance``); each
    stage's wall seconds (``stage_times``, :func:`stage_times`)."""
    return {
        "stage_times": times or {},
        "provenance": arithmetic,
        "design_hash": design_hash(),
        "unigram_val_loss": ablate.get("unigram_val_loss"),
        "base_val_loss": {FAMILY_OF[f.key]: f.base_val_loss for f in findings if f.key in FAMILY_OF},
        "findings": {f.key: f.to_json() for f in findings},
        "counts": {v: sum(1 for f in proper(findings) if f.verdict == v) for v in VERDICTS},
        "checks": {f.key: check_outcome(f) for f in findings if f.check},
    }


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


def config_hash(project: Path, resolved: Path) -> str:
    path = project / resolved
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.is_file() else "unknown (no params/resolved.yaml)"


def provenance(project: Path, resolved: Path, commit: str | None) -> dict[str, str]:
    return {
        "commit": commit or "unknown (not a git checkout)",
        "config_hash": config_hash(project, resolved),
        "built": time.strftime("%Y-%m-%d %H:%M %Z"),
    }


def _sensitivity_section(sensitivity: dict[str, Any] | None) -> list[str]:
    """Data sensitivity (metrics/sensitivity.json, the sensitivity stage's): each built-in finding's
    estimate at the discovery seeds with a registered share of the training documents dropped, beside
    its estimate on the full data at the same seeds, and their per-seed difference with its interval.
    Nothing when the stage has not run."""
    if not sensitivity:
        return []
    p, found = sensitivity["perturbation"], sensitivity["findings"]
    rows, notes = [], []
    for key in sorted(found, key=lambda k: [*design()["findings"], k].index(k)):  # the pre-registration's order
        entry, name = found[key], LABELS.get(key, key)
        if not entry["claims"]:
            notes.append(f"- {name}: not in this grid ({entry.get('missing')}).")
        for i, c in enumerate(entry["claims"]):
            unit, d = UNITS.get(c.get("unit") or "", ""), c["difference"]
            rows.append(
                [
                    f"[{name}](#{key})" if i == 0 else "",
                    c["statement"],
                    f"{number(c['main']['estimate'], SIGNED)}{unit}",
                    f"{number(c['perturbed']['estimate'], SIGNED)}{unit}",
                    f"{number(d['estimate'], SIGNED)} [{_interval(d['ci95'])}] (n {d['n']})",
                ]
            )
        failed = entry.get("precondition_failed") or {}
        if bool(failed.get("main")) != bool(failed.get("perturbed")):
            side, why = ("full data", failed["main"]) if failed.get("main") else ("perturbed data", failed["perturbed"])
            notes.append(f"- {name}: its precondition failed on the {side} only: {why}.")
    return [
        "## Data sensitivity",
        "",
        f"Each finding's estimate at the discovery seeds ({', '.join(str(s) for s in sensitivity['seeds'])}) "
        f"trained again with {p['drop_share']:.0%} of the training documents dropped ({p['dropped']:,} of "
        f"{p['documents']:,}, drawn with seed {p['seed']}; validation unchanged), beside its estimate on the full "
        "data at the same seeds. The difference is per seed, perturbed − full, with its 95 % t-interval (none "
        "below 2 seeds). A registered perturbation, read by no verdict: it shows how far an estimate moves "
        "when the data does.",
        "",
        *_table(["finding", "claim", "full data", "perturbed", "difference [95 % interval]"], rows),
        "",
        *notes,
        *([""] if notes else []),
    ]
