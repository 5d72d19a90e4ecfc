"""The checks of the machinery: findings registered with a ``check`` (true by construction, or
measured without training) that are never counted among the findings. Their outcome
(:func:`check_outcome`) badges them wherever they appear; the first screen lists them apart
(:func:`checks_lines`)."""

from __future__ import annotations

from tasks.report.method import Finding
from tasks.report.sections.section import badge
from tasks.report.sections.words import label, measured
from tasks.report.verdict import NOT_TESTED, REPRODUCED

PASSED, FAILED = "check passed", "check failed"
"""A check's outcomes besides not tested (:func:`check_outcome`)."""


def check_outcome(f: Finding) -> str:
    """A check's outcome: passed when every claim holds, not tested when its precondition failed."""
    return {REPRODUCED: PASSED, NOT_TESTED: NOT_TESTED}.get(f.verdict, FAILED)


def shown_verdict(f: Finding) -> str:
    """The badge a finding's heading and rows carry: its verdict, or a check's outcome."""
    return check_outcome(f) if f.check else f.verdict


def proper(findings: list[Finding]) -> list[Finding]:
    """The findings that count: every registered finding but the checks of the machinery."""
    return [f for f in findings if not f.check]


def checks_lines(checks: list[Finding]) -> list[str]:
    """The checks of the machinery, apart from the findings, each with its numbers and why it is one."""
    if not checks:
        return []
    lines = [
        f"**{len(checks)} checks of the machinery**, not counted among the findings (true by construction, or "
        "measured without training):",
        "",
    ]
    for f in checks:
        numbers = "; ".join(f"{c.what}: {measured(c)}" for c in f.claims) or (f.precondition_failed or "no claim")
        lines.append(f"- {badge(check_outcome(f))} **[{label(f)}](#{f.key})**. {numbers}. *Why a check:* {f.check}.")
    return [*lines, ""]
