"""What every section module builds and shares: the :class:`Section` both renderers consume
(tasks/report/render.py), the :class:`Figures` it shows, and the Markdown helpers for badges,
tables and numbers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tasks.report.verdict import Claim

REPORTS = Path("reports")
"""Where the pages and their figures are, under the project."""
SIGNED = "{:+.3g}"
"""How the report writes an estimate."""

UNITS = {"nats": " nats", "spikes/1k": " spikes/1k steps"}
"""How a claim's unit follows its number; other units (a log ratio, a slope, a relative gap, an
RMS) are in the claim's own words."""


@dataclass(frozen=True)
class Figures:
    """The figures matching ``patterns`` (globs under reports/), shown where they stand among a
    section's lines: linked in the Markdown, embedded in the HTML, named when git ignores them."""

    patterns: tuple[str, ...]


@dataclass(frozen=True)
class Section:
    """A part of the report under one heading: ``title`` (with ``verdict``'s badge after it when
    given), an ``anchor`` others link to (a finding's key), and its body: Markdown lines and
    :class:`Figures` in order."""

    title: str
    lines: Sequence[str | Figures]
    anchor: str | None = None
    verdict: str | None = None
    level: int = 2

    @property
    def heading(self) -> str:
        """The heading's Markdown."""
        badged = f" — {badge(self.verdict)}" if self.verdict else ""
        return f"{'#' * self.level} {self.title}{badged}"


def badge(verdict: str) -> str:
    """A verdict or outcome as a code span; the HTML colours it (tasks/report/render.py)."""
    return f"`{verdict.upper()}`"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table; a cell's pipes escaped and its newlines flattened."""
    clean = [[str(c).replace("|", "\\|").replace("\n", " ") for c in row] for row in rows]
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in clean)]


def signed(x: float) -> str:
    return SIGNED.format(x)


def p_value(p: float | None) -> str:
    if p is None:
        return "-"
    return f"{p:.0e}" if p < 1e-3 else f"{p:.2g}"


def unit(c: Claim) -> str:
    return UNITS.get(c.unit, "")


def interval(ci: list[float] | None) -> str:
    return f"{signed(ci[0])} to {signed(ci[1])}" if ci else "-"
