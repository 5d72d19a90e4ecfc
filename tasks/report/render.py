"""The study's report, from the stages' outputs: ``reports/REPORT.md`` and the same page as one
self-contained ``reports/report.html`` (figures embedded, opens offline), plus the verdicts as
``metrics/report.json``.

Order, as a reader wants it: provenance (the code, config and design, and the arithmetic that
computed the numbers, with a warning when it is mixed or not the committed outputs':
tasks/report/arithmetic.py) and the rule; the findings (forest plot and table); one
section per finding with its pre-registered design, its claims and its figures; the change
history; then the detail: the arms per family, the search, spike and pretraining stages, the
MLflow runs. Verdicts
are text badges (``REPRODUCED`` in a code span, a coloured box in the HTML): no emoji font needed.
"""

from __future__ import annotations

import base64
import hashlib
import html
import re
import time
from pathlib import Path
from statistics import fmean
from typing import Any

from tasks.ablate.stats import ALPHA
from tasks.config import Config
from tasks.report.design import DESIGN_CODE, design, design_hash
from tasks.report.findings import FAMILY_OF, Finding, number
from tasks.report.verdict import CONTRADICTED, INCONCLUSIVE, NOT_TESTED, REPRODUCED
from tasks.spike.config import OUTCOMES

REPORTS = Path("reports")
VERDICTS = (REPRODUCED, CONTRADICTED, NOT_TESTED, INCONCLUSIVE)
SIGNED = "{:+.3g}"
"""How the report writes an estimate."""

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
"""The figures (globs under reports/) shown in each finding's section."""

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


def _images(project: Path, patterns: list[str]) -> list[str]:
    paths = sorted({p for pattern in patterns for p in (project / REPORTS).glob(pattern)})
    return [f"![{p.stem}]({p.relative_to(project / REPORTS).as_posix()})" for p in paths]


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
) -> str:
    counts = ", ".join(f"{sum(f.verdict == v for f in findings)} {v}" for v in VERDICTS)
    lines = [
        "# spikelab study report",
        "",
        f"Profile **{cfg.profile}** · code `{provenance['commit']}` · config hash `{provenance['config_hash']}` "
        f"(sha256 of params/resolved.yaml) · design hash `{design_hash()}` (sha256 of "
        f"the pre-registration and the code that decides verdicts: {', '.join(DESIGN_CODE)}) · built {provenance['built']}",
        "",
        *_arithmetic_lines(arithmetic),
        f"**{len(findings)} findings: {counts}.** Each finding was tested as its pre-registered design says "
        "(tasks/report/preregistration.yaml), with one rule for all: "
        f"{badge(NOT_TESTED)} when a named precondition failed; {badge(CONTRADICTED)} when a claim is shown the "
        f"other way (p < {ALPHA:g}, the 95 % interval beyond its smallest effect of interest, both halves of the "
        f"seeds that way); {badge(REPRODUCED)} when every claim holds: significant the predicted way, its 95 % "
        "interval clearing its smallest effect of interest (SESOI), and the discovery and confirmation seeds each "
        f'pointing that way (a "no effect" claim by two one-sided tests against ±SESOI); {badge(INCONCLUSIVE)} '
        "otherwise. The seed is the unit: per-seed differences (averaged over an LR grid within each seed), the "
        "paired t-test, its MDE at 80 % power (powered: MDE ≤ SESOI / 2). Diverged runs count at the loss at "
        "initialisation, and none is dropped. Unigram baseline on validation: "
        f"**{number(ablate.get('unigram_val_loss'), '{:.3f}')} nats**; every variant a claim compares must end "
        f"{design()['plateau_margin']:g} nats below it (those predicted to fail aside).",
        "",
        "## Findings",
        "",
        *_images(project, ["report/forest.png"]),
        "",
    ]
    lines += _table(
        ["finding", "verdict", "why", "SESOI", "MDE (powered?)", "discovery", "confirmation"],
        [
            [
                f"[{f.registered['claim']}](#{f.key})",
                badge(f.verdict),
                f.precondition_failed or "; ".join(_claim_line(c) for c in f.claims) or "-",
                "; ".join(number(c.sesoi, "{:.3g}") for c in f.claims) or "-",
                "; ".join(_mde(c) for c in f.claims) or "-",
                *(
                    "; ".join(_half(f.halves.get(c.what, {}).get(half)) for c in f.claims) or "-"
                    for half in ("discovery", "confirmation")
                ),
            ]
            for f in findings
        ],
    )
    lines.append("")
    for f in findings:
        lines += _finding_section(project, f)
    lines += [
        *_changes_section(),
        *_arms_section(cfg, ablate),
        *_search_section(project, search),
        *spike_section(project, spike),
        *_pretrain_section(project, pretrain),
        *_runs_section(ablate, stage_runs),
    ]
    return "\n".join(lines) + "\n"


def _arithmetic_lines(arithmetic: dict[str, Any]) -> list[str]:
    """Which machine(s) computed the numbers, one line per numeric path, after any warning."""
    warnings = [f"> **Arithmetic warning:** {w}." for w in arithmetic["warnings"]]
    paths = [
        f"- numeric path `{p}` ({', '.join(e['produced'])}): {e['machine']}" for p, e in arithmetic["inputs"].items()
    ]
    return [*warnings, *([""] if warnings else []), "Computed with this arithmetic:", "", *paths, ""]


def _state(c) -> str:
    return "holds" if c.holds else "contradicted" if c.contradicted else "does not hold"


def _claim_line(c) -> str:
    p = f"p={c.p:.3g}" if c.p is not None else "no test"
    ci = f" [{c.ci95[0]:+.3g}, {c.ci95[1]:+.3g}]" if c.ci95 else ""
    return f"{c.what}: {number(c.estimate, SIGNED)}{ci} ({p}, {_state(c)})"


def _mde(c) -> str:
    powered = {True: "yes", False: "no", None: "-"}[c.powered]
    return f"{number(c.mde, '{:.3g}')} ({powered})"


def _half(tested: dict[str, Any] | None) -> str:
    """A half's estimate, interval and p in a cell."""
    if not tested or tested.get("estimate") is None:
        return "-" if not tested else str(tested.get("test", "-"))
    ci = f" [{tested['ci95'][0]:+.3g}, {tested['ci95'][1]:+.3g}]" if tested.get("ci95") else ""
    p = f", p={tested['p']:.3g}" if tested.get("p") is not None else ""
    return f"{tested['estimate']:+.3g}{ci}{p} (n={tested['n']})"


def _finding_section(project: Path, f: Finding) -> list[str]:
    r = f.registered
    lines = [
        f'<a id="{f.key}"></a>',
        "",
        f"## {r['claim']} — {badge(f.verdict)}",
        "",
        f"*Source:* {r['source']}. *Arms:* {r['arms']}. *Metric:* {r['metric']}. *Test:* {r['test']}. "
        f"*Predicted:* {r['expected']}. *Precondition:* {r['precondition']}. *Why:* {r['justification']}.",
        "",
    ]
    if f.precondition_failed:
        lines += [f"**Not tested:** {f.precondition_failed}.", ""]
    lines += [f"Numbers: {f.numbers}", ""]
    if f.claims:
        lines += _table(
            [
                "claim",
                "all seeds: estimate",
                "95 % interval",
                "p",
                "SESOI",
                "MDE (powered?)",
                "discovery",
                "confirmation",
                "state",
            ],
            [
                [
                    c.what,
                    number(c.estimate, SIGNED),
                    f"[{c.ci95[0]:+.3g}, {c.ci95[1]:+.3g}]" if c.ci95 else "-",
                    number(c.p, "{:.3g}"),
                    number(c.sesoi, "{:.3g}"),
                    _mde(c),
                    _half(f.halves.get(c.what, {}).get("discovery")),
                    _half(f.halves.get(c.what, {}).get("confirmation")),
                    _state(c),
                ]
                for c in f.claims
            ],
        )
        lines.append("")
    return [*lines, *_images(project, FINDING_FIGURES.get(f.key, [])), ""]


def _arms_section(cfg: Config, ablate: dict[str, Any]) -> list[str]:
    counts = ablate["counts"]
    lines = [
        "## The arms, family by family",
        "",
        f"{len(ablate['arms'])} arms ({counts['completed']} completed, {counts['diverged']} diverged, "
        f"{counts['stopped']} stopped, "
        f"{counts['failed']} failed after retries{': ' + ', '.join(ablate['failed']) if ablate['failed'] else ''}), "
        f"each trained from scratch at width {cfg.ablation.d_model}, {cfg.ablation.seq_len}-token context, "
        f"discovery seeds {cfg.ablation.seeds}, confirmation seeds {cfg.ablation.confirm_seeds}. Per variant: mean "
        "over seeds [95 % t-interval].",
        "",
    ]
    header = ["family", "variant", "seeds", "status", *(h for _, h, _ in FAMILY_COLUMNS)]
    rows = []
    for name, entry in ablate["variants"].items():
        statuses = ", ".join(f"{entry['status'].count(s)} {s}" for s in sorted(set(entry["status"])))
        family, variant = name.split("/", 1)
        rows.append(
            [family, variant, str(len(entry["seeds"])), statuses]
            + [_interval(entry["figures"].get(k, {}), fmt) for k, _, fmt in FAMILY_COLUMNS]
        )
    return [*lines, *_table(header, rows), ""]


def _interval(d: dict[str, Any], fmt: str) -> str:
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
    rows = [
        [
            p,
            f"{search[p]['slope']:+.3f} ± {search[p]['slope_std']:.3f}",
            ", ".join(
                f"{w}: {search[p]['widths'][w]['log2_lr_opt']:.2f} ({search[p]['widths'][w]['loss_opt']:.3f} nats)"
                for w in sorted(search[p]["widths"], key=int)
            ),
        ]
        for p in ("sp", "mup")
        if p in search
    ]
    lines = ["## μ-transfer (search stage)", ""]
    lines += _table(["parametrization", "slope (± SD over seeds)", "log₂ η* (loss there) per width"], rows)
    transfer = search.get("transfer", {})
    if transfer:
        lines += [
            "",
            f"Transferred LR {transfer.get('lr', float('nan')):.4g}; loss gap to a direct sweep at the "
            f"target width {transfer.get('loss_gap', float('nan')):+.4f} nats; compute ratio "
            f"{transfer.get('compute_ratio', float('nan')):.2f}.",
        ]
    return [*lines, ""]


def spike_section(project: Path, spike: dict[str, Any] | None) -> list[str]:
    if not spike or "matrix" not in spike:
        return ["## Spike study", "", "The spike stage has not run.", ""]
    matrix, policies = spike["matrix"], spike["policies"]
    rows = [
        [f"{cause} ({_tied_to(spike, cause)})", *(_spike_cell(matrix[cause].get(p, {})) for p in policies)]
        for cause in spike["causes"]
    ]
    seeds = ", ".join(str(s) for s in spike["discovery_seeds"])
    confirm = ", ".join(str(s) for s in spike["confirm_seeds"]) or "none"
    lines = [
        f"## Spike study (independent origin runs: discovery seeds {seeds}; confirmation seeds {confirm})",
        "",
        f"False alarms on the clean controls: {spike.get('false_positives')}. Per cause and policy, over the seeds: "
        "how many branches recovered (back within ε in time) / ended with a gap (back late, settled above, or "
        "diverged) / gave up (the retry cap), and the mean final gap to the seed's control of those that "
        "did not give up (a branch that gave up has none).",
        "",
        *_table(["cause", *policies], rows),
    ]
    postmortems = sorted((project / REPORTS / "postmortems").glob("*.md"))
    return [
        *lines,
        "",
        f"Post-mortems (seed {spike['postmortem_seed']}): "
        + (", ".join(f"[{p.stem}](postmortems/{p.name})" for p in postmortems) or "none"),
        "",
    ]


CAUSE_OF_TIE = {"stream": "data-tied", "once": "state-tied", "step": "step-tied"}
"""How the report names a cause by what its injection is tied to (model/spike/injections.py)."""


def _tied_to(spike: dict[str, Any], cause: str) -> str:
    entry = next(iter(spike["seeds"].values()))
    return CAUSE_OF_TIE[entry[cause]["injection"]["tied_to"]]


def _spike_cell(by_seed: dict[str, dict[str, Any]]) -> str:
    """recovered / gap / gave up over the seeds, and the mean final gap of those that have one."""
    cells = list(by_seed.values())
    counts = "/".join(str(sum(c["outcome"] == o for c in cells)) for o in OUTCOMES)
    gaps = [c["final_gap"] for c in cells if c["final_gap"] is not None]
    return f"{counts}, gap {fmean(gaps):+.1%}" if gaps else counts


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
        "made after any of its results was seen (tasks/report/preregistration.yaml, `changes_after_results`):",
        "",
        *([f"{i}. {c}" for i, c in enumerate(changes, 1)] or ["None."]),
        "",
    ]


def _runs_section(ablate: dict[str, Any], stage_runs: dict[str, str]) -> list[str]:
    lines = ["## MLflow runs", ""]
    lines += [f"- {stage}: [{url}]({url})" for stage, url in stage_runs.items()] or ["- no tracking server answered"]
    lines += ["", "Arms (child runs of the ablate stage's run; each reproduces with its command):", ""]
    lines += _table(
        ["arm", "status", "MLflow", "command"],
        [
            [
                a["name"],
                a["status"],
                f"[run]({a['mlflow']})" if a.get("mlflow", "").startswith("http") else str(a.get("mlflow")),
                f"`{a['command']}`",
            ]
            for a in ablate["arms"]
        ],
    )
    return [*lines, ""]


# ----------------------------------------------------------------------------------------------
# HTML
# ----------------------------------------------------------------------------------------------

BADGE_COLOURS = {REPRODUCED: "#1a7f37", CONTRADICTED: "#cf222e", NOT_TESTED: "#6e7781", INCONCLUSIVE: "#9a6700"}

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


def report_json(findings: list[Finding], ablate: dict[str, Any], arithmetic: dict[str, Any]) -> dict[str, Any]:
    """metrics/report.json: per finding its verdict, test, source, smallest detectable effects and
    claims; the unigram baseline and each family's base-arm loss; counts per verdict; the
    arithmetic of the report and of the runs it used, and its warnings (``provenance``)."""
    return {
        "provenance": arithmetic,
        "design_hash": design_hash(),
        "unigram_val_loss": ablate.get("unigram_val_loss"),
        "base_val_loss": {FAMILY_OF[f.key]: f.base_val_loss for f in findings if f.key in FAMILY_OF},
        "findings": {f.key: f.to_json() for f in findings},
        "counts": {v: sum(1 for f in findings if f.verdict == v) for v in VERDICTS},
    }


def forest_rows(findings: list[Finding]) -> list[dict[str, Any]]:
    """One row per claim for the forest plot (tasks/report/figures.py)."""
    return [
        {
            "finding": f.key,
            "claim": c.what,
            "estimate": c.estimate,
            "ci95": c.ci95,
            "expected": c.expected,
            "kind": c.kind,
            "margin": c.sesoi if c.kind == "equivalence" else None,
            "sesoi": c.sesoi,
            "verdict": f.verdict,
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
