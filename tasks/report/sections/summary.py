"""The report's first screen: what was learned, a line per finding (what was tested, what came out,
the number that decided it), the count of each verdict, the checks of the machinery apart, any
warning about the arithmetic, and what the page holds below."""

from __future__ import annotations

from typing import Any

from tasks.config import Config
from tasks.report.lineage import commits_line, stale
from tasks.report.method import Finding
from tasks.report.sections.checks import checks_lines, proper
from tasks.report.sections.runs import ARMS_PAGE
from tasks.report.sections.section import Section, badge
from tasks.report.sections.words import label, what_was_found
from tasks.report.verdict import CONTRADICTED, INCONCLUSIVE, NEGLIGIBLE, NOT_TESTED, REPRODUCED

TITLE = "spikelab study report"
VERDICTS = (REPRODUCED, NEGLIGIBLE, CONTRADICTED, NOT_TESTED, INCONCLUSIVE)
"""The verdicts counted, in the order the first screen and metrics/report.json give them."""


def summary_section(
    cfg: Config, findings: list[Finding], arithmetic: dict[str, Any], origin: dict[str, Any]
) -> Section:
    """The first screen, under the page's title; ``origin``: the commits the numbers came from
    (tasks/report/sections/method.py: provenance)."""
    counts = ", ".join(f"{sum(f.verdict == v for f in proper(findings))} {v}" for v in VERDICTS)
    warnings = [f"> **Arithmetic warning:** {w}." for w in arithmetic["warnings"]]
    older = stale(origin["trained"])
    code = [
        f"Code: {commits_line(origin['trained'], origin['commit'])}."
        + (
            f" **Outputs older than their code:** {', '.join(older)} (why, below: where the numbers come from)."
            if older
            else ""
        ),
        "",
    ]
    reanalysis = origin.get("reanalysis")  # rules written after these results were read
    lines = [
        f"**{len(proper(findings))} pre-registered findings** on the training stability of small GPT-style "
        f"models (profile {cfg.profile}): **{counts}**. What each tested and what came out:",
        "",
        *([f"> **Exploratory: a re-analysis after results.** {reanalysis}", ""] if reanalysis else []),
        *_summary_lines(proper(findings)),
        "",
        *checks_lines([f for f in findings if f.check]),
        *warnings,
        *([""] if warnings else []),
        *code,
        "Below: how a verdict is reached, where the numbers come from, the findings claim by claim, the "
        "changes made after results were seen, then the arms, the search, spike and pretraining stages and "
        f"the MLflow runs. Every arm's command: [{ARMS_PAGE.as_posix()}]({ARMS_PAGE.as_posix()}). Every "
        "number: metrics/report.json.",
        "",
    ]
    return Section(TITLE, lines, level=1)


def _summary_lines(findings: list[Finding]) -> list[str]:
    """A line per finding: its verdict, its plain label linked to its section, what it tested and
    what came out (at most two claims named of each kind)."""
    return [
        f"- {badge(f.verdict)} **[{label(f)}](#{f.key})**. *Tested:* {f.registered['claim']}. "
        f"*Found:* {what_was_found(f, most=2)}."
        for f in findings
    ]
