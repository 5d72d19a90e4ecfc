"""The study's report, from the stages' outputs: ``reports/REPORT.md``, the same page as one
self-contained ``reports/report.html`` (figures embedded, opens offline), every arm with its
command in ``reports/report/arms.md`` (tasks/report/sections/runs.py), and the verdicts as
``metrics/report.json``.

The page is a list of sections (:func:`report_sections`), one module of tasks/report/sections/ per
part, in the order a reader wants: what was learned (summary.py: the first screen, a line per
finding); how verdicts are reached and where the numbers come from (method.py); the findings
(findings.py: forest plot, a table with a row per claim, one section per finding); the change
history (history.py); the stages' detail (stages.py); the MLflow runs (runs.py). The Markdown
(:func:`render_markdown`) and the HTML (:func:`render_html`) are rendered from the same sections.

Presentation rules. Each finding is named in plain words, not by its key; each claim is badged by
its own outcome, the finding by its verdict; a claim that falls short says which test of the rule
it failed (sections/words.py). A table cell holds one number, or an interval. Figures git ignores
(the DVC outputs of reports/search) are named, not embedded: the committed page shows no broken
image. Verdicts are text badges (``REPRODUCED`` in a code span, a coloured box in the HTML): no
emoji font needed.
"""

from __future__ import annotations

import base64
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tasks.config import Config
from tasks.design.preregistration import design_hash
from tasks.design.studies import builtin_families, read_studies
from tasks.report.findings import FAMILY_OF
from tasks.report.lineage import stale
from tasks.report.method import Finding
from tasks.report.sections.checks import FAILED, NOT_RUN, PASSED, check_outcome, proper
from tasks.report.sections.findings import finding_section, findings_section, rounds_section
from tasks.report.sections.history import changes_section, marked_exploratory, registrations_section, unregistered
from tasks.report.sections.method import method_section, provenance_section
from tasks.report.sections.natural import natural_section
from tasks.report.sections.runs import runs_section
from tasks.report.sections.section import REPORTS, Figures, Section
from tasks.report.sections.stages import (
    arms_section,
    pretrain_section,
    search_section,
    sensitivity_section,
    spike_section,
)
from tasks.report.sections.summary import VERDICTS, summary_section
from tasks.report.sections.versions import versions_section
from tasks.report.sections.words import HOLDS, NOT_SHOWN, in_words
from tasks.report.verdict import CONTRADICTED, INCONCLUSIVE, NEGLIGIBLE, NOT_TESTED, REPRODUCED
from tasks.runtime.paths import own_checkout_env


def report_sections(
    cfg: Config,
    project: Path,
    findings: list[Finding],
    ablate: dict[str, Any],
    search: dict[str, Any] | None,
    spike: dict[str, Any] | None,
    pretrain: dict[str, Any] | None,
    provenance: dict[str, Any],
    stage_runs: dict[str, str],
    arithmetic: dict[str, Any],
    sensitivity: dict[str, Any] | None = None,
    times: dict[str, float | None] | None = None,
    compared: dict[str, Any] | None = None,
) -> list[Section]:
    """The page's sections in order; a stage that has not run leaves out the sections only it fills.
    A claim is named in words (sections/words.py: in_words); metrics/report.json keeps its declared name."""
    findings = in_words(findings, builtin_families(cfg) + read_studies(project, cfg))
    sections = [
        summary_section(cfg, findings, arithmetic, provenance),
        method_section(ablate),
        provenance_section(cfg, provenance, arithmetic, times or {}),
        findings_section(findings),
        versions_section(compared),
        rounds_section(ablate, findings),
        *(finding_section(f) for f in findings),
        sensitivity_section(sensitivity),
        changes_section(),
        registrations_section(project, cfg.profile),
        arms_section(cfg, ablate),
        search_section(search),
        spike_section(project, spike),
        natural_section(ablate),
        pretrain_section(pretrain),
        runs_section(stage_runs),
    ]
    exploratory = unregistered({"ablate": ablate, "search": search, "spike": spike})
    return marked_exploratory([s for s in sections if s is not None], exploratory)


def render_markdown(sections: list[Section], project: Path) -> str:
    """reports/REPORT.md: each section's heading and lines, its figures linked relative to reports/."""
    root = project / REPORTS
    return "".join(_markdown(s, project, lambda p: p.relative_to(root).as_posix()) for s in sections)


def _markdown(section: Section, project: Path, image: Callable[[Path], str]) -> str:
    """A section as Markdown, each figure's image at the address ``image`` gives its file."""
    lines = [*([f'<a id="{section.anchor}"></a>', ""] if section.anchor else []), section.heading, ""]
    for line in section.lines:
        lines += figure_lines(project, line, image) if isinstance(line, Figures) else [line]
    return "\n".join(lines) + "\n"


def git_ignored(project: Path, paths: list[Path]) -> set[Path]:
    """Those of ``paths`` (under ``project``) that git ignores there: untracked and matched by a
    .gitignore. None when ``project`` is not a git checkout of its own (make demo's copy, inside the
    checkout's ignored .spikelab/, shows every figure) or git is missing."""
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
            env=own_checkout_env(project),
        )
    except (OSError, subprocess.TimeoutExpired):
        return set()
    if done.returncode not in (0, 1):  # 128: not a git checkout
        return set()
    return {project / name for name in done.stdout.split("\0") if name}


def figure_lines(project: Path, figures: Figures, image: Callable[[Path], str]) -> list[str]:
    """The figures matching ``figures``' patterns under reports/, as images at the address ``image``
    gives; those git ignores (a DVC output's) named instead, so the committed page shows no broken image."""
    root = project / REPORTS
    paths = sorted({p for pattern in figures.patterns for p in root.glob(pattern)})
    unmatched = [root / pattern for pattern in figures.patterns if not any(root.glob(pattern))]
    ignored = git_ignored(project, [*paths, *unmatched])  # git matches a pattern's name as a path
    lines = [f"![{p.stem}]({image(p)})" for p in paths if p not in ignored]
    if ignored:
        names = ", ".join(f"`reports/{p.relative_to(root).as_posix()}`" for p in sorted(ignored))
        lines += ["", f"Figures not in git (DVC outputs: `dvc pull` or `dvc repro` makes them): {names}."]
    return lines


BADGE_COLOURS = {
    REPRODUCED: "#1a7f37",
    HOLDS: "#1a7f37",
    CONTRADICTED: "#cf222e",
    NOT_TESTED: "#6e7781",
    NEGLIGIBLE: "#0969da",
    PASSED: "#1a7f37",
    FAILED: "#cf222e",
    NOT_RUN: "#6e7781",
    INCONCLUSIVE: "#9a6700",
    NOT_SHOWN: "#9a6700",
}
"""A verdict's or a claim outcome's badge colour in the HTML."""

STYLE = """body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;line-height:1.45}
table{border-collapse:collapse;font-size:.85em;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 6px;vertical-align:top}
th{background:#f3f3f3}img{max-width:100%;border:1px solid #eee;margin:.5em 0}code{font-size:.85em;word-break:break-all}
.badge{color:#fff;border-radius:4px;padding:1px 6px;font-weight:600;font-size:.8em;white-space:nowrap}"""


def render_html(sections: list[Section], project: Path) -> str:
    """reports/report.html: the same sections as one page, every figure embedded (a data URI) and
    verdicts as coloured badges."""
    from markdown_it import MarkdownIt

    converter = MarkdownIt("commonmark", {"html": True}).enable("table")
    body = "".join(_badged(converter.render(_markdown(s, project, _data_uri))) for s in sections)
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>spikelab study report</title>"
        f"<style>{STYLE}</style></head><body>{body}</body></html>\n"
    )


def _data_uri(png: Path) -> str:
    return f"data:image/png;base64,{base64.b64encode(png.read_bytes()).decode()}"


def _badged(body: str) -> str:
    """The HTML with each verdict's code span a coloured badge."""
    for verdict, colour in BADGE_COLOURS.items():
        body = body.replace(
            f"<code>{verdict.upper()}</code>",
            f'<span class="badge" style="background:{colour}">{verdict.upper()}</span>',
        )
    return body


def code_json(origin: dict[str, Any]) -> dict[str, Any]:
    """metrics/report.json's ``code``: ``built`` (the build stamp), ``trained`` (per stage), ``stale``."""
    return {"built": origin["commit"], "trained": origin["trained"], "stale": stale(origin["trained"])}


def report_json(
    findings: list[Finding],
    ablate: dict[str, Any],
    arithmetic: dict[str, Any],
    times: dict[str, float | None] | None = None,
    origin: dict[str, Any] | None = None,
    compared: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """metrics/report.json: per finding its verdict, test, source, smallest detectable effects and
    claims; the unigram baseline and each family's base-arm loss; counts per verdict; the
    arithmetic of the report and of the runs it used, and its warnings (``provenance``); each
    stage's wall seconds (``stage_times``, tasks/report/sections/method.py); the commit the report
    was built at and those the stages ran at, and which stages' outputs are older than their
    code (``code``, from ``origin``: tasks/report/sections/method.py, provenance); an earlier
    version's claims beside these (``versions``, tasks/report/versions.py) where there is one."""
    return {
        **({"code": code_json(origin)} if origin else {}),
        "stage_times": times or {},
        "provenance": arithmetic,
        "design_hash": design_hash(),
        "reanalysis": (origin or {}).get("reanalysis"),
        "unigram_val_loss": ablate.get("unigram_val_loss"),
        "base_val_loss": {FAMILY_OF[f.key]: f.base_val_loss for f in findings if f.key in FAMILY_OF},
        "findings": {f.key: f.to_json() for f in findings},
        "counts": {v: sum(1 for f in proper(findings) if f.verdict == v) for v in VERDICTS},
        "checks": {f.key: check_outcome(f) for f in findings if f.check},
        **({"versions": compared} if compared else {}),
    }
