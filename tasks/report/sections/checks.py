"""The checks of the machinery: findings registered with a ``check`` (true by construction, or
measured without training) that are never counted among the findings. Their outcome
(:func:`check_outcome`) badges them wherever they appear; the first screen lists them apart
(:func:`checks_lines`)."""

from __future__ import annotations

from tasks.ablate.config import MIN_FIRST_ROUND
from tasks.report.method import Finding
from tasks.report.sections.section import badge
from tasks.report.sections.words import label, measured
from tasks.report.verdict import NOT_TESTED, REPRODUCED

PASSED, FAILED, NOT_RUN = "check passed", "check failed", "not run at this size"
"""A check's outcomes besides not tested (:func:`check_outcome`)."""


def check_outcome(f: Finding) -> str:
    """A check's outcome: not run at this size when its seeds are too few for its test
    (:func:`too_small`), else passed when every claim holds, not tested when its precondition
    failed, and failed otherwise."""
    if too_small(f):
        return NOT_RUN
    return {REPRODUCED: PASSED, NOT_TESTED: NOT_TESTED}.get(f.verdict, FAILED)


def too_small(f: Finding) -> str | None:
    """Why a check's paired t-test cannot decide at this profile's size, else None: it compared
    fewer seeds than the smallest look the design allows (MIN_FIRST_ROUND, a t-test with 2 degrees
    of freedom). Below that a check neither passes nor fails: the smoke profile's 2 seeds say
    nothing about the machinery, so they must not read as a failure of it."""
    seeds = max((sum(h.get("n") or 0 for h in halves.values()) for halves in f.halves.values()), default=None)
    if seeds is None or seeds >= MIN_FIRST_ROUND:
        return None
    return f"{seeds} seeds; its t-test needs {MIN_FIRST_ROUND} or more (ablation.seeds and confirm_seeds)"


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
        if why := too_small(f):
            numbers = f"Not run at this size ({why}); measured: {numbers}"
        lines.append(f"- {badge(check_outcome(f))} **[{label(f)}](#{f.key})**. {numbers}. *Why a check:* {f.check}.")
    return [*lines, ""]
