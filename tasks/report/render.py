"""The study's report, from the stages' outputs: ``reports/REPORT.md`` and the same page as one
self-contained ``reports/report.html`` (figures embedded, opens offline), plus the verdicts as
``metrics/report.json``. Sections: provenance (code version, profile, config hash), the findings
table (tasks/report/findings.py), the ablation's variants with their intervals and figures, the
μ-transfer, the spike study's policy table and post-mortems, pretraining, and the MLflow runs.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import html
import re
import time
from pathlib import Path
from typing import Any

from tasks.config import Config
from tasks.report.findings import CHANGED_AFTER_RESULTS, Finding, is_broken

REPORTS = Path("reports")
VERDICT_MARK = {"reproduced": "✅ reproduced", "not reproduced": "❌ not reproduced", "inconclusive": "❔ inconclusive"}

VARIANT_COLUMNS = (
    ("capped_loss", "val loss (capped)", "{:.3f}"),
    ("peak_ratio", "spike peak ratio", "{:.3f}"),
    ("recovery_steps_censored", "steps to recover", "{:.0f}"),
    ("natural_spikes", "natural spikes", "{:.1f}"),
    ("nonfinite_steps", "non-finite steps", "{:.1f}"),
    ("attn_logit_max", "max attn logit", "{:.0f}"),
    ("log_z_max", "max log Z", "{:.2f}"),
)
"""The per-variant columns: figure, header, format of the mean."""


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    clean = [[str(c).replace("|", "\\|").replace("\n", " ") for c in row] for row in rows]
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in clean)]


def _interval(d: dict[str, Any], fmt: str) -> str:
    if d.get("mean") is None:
        return "-"
    text = fmt.format(d["mean"])
    if d.get("ci95"):
        lo, hi = d["ci95"]
        text += f" [{fmt.format(lo)}, {fmt.format(hi)}]"
    return text + (f" ({d['missing']} not finite)" if d.get("missing") else "")


def _figures(directory: Path, project: Path) -> list[str]:
    return [f"![{p.stem}]({p.relative_to(project / REPORTS).as_posix()})" for p in sorted(directory.glob("*.png"))]


def config_hash(project: Path, resolved: Path) -> str:
    path = project / resolved
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.is_file() else "unknown (no params/resolved.yaml)"


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
) -> str:
    lines = [
        "# spikelab study report",
        "",
        f"Profile **{cfg.profile}** · code `{provenance['commit']}` · config hash `{provenance['config_hash']}` "
        f"(sha256 of params/resolved.yaml) · built {provenance['built']}",
        "",
        "Every number below is computed from the stages' outputs (`metrics/*.json`); verdicts follow one rule "
        "fixed before the results (tasks/report/findings.py): *reproduced* when every claim holds in the expected "
        "direction with p < 0.05, *not reproduced* when a claim goes significantly the other way, a "
        "precondition fails (named in the numbers) or no "
        "estimate points the expected way, *inconclusive* otherwise. Diverged runs count, at the loss at "
        "initialisation; none is dropped.",
        "",
        "Changed after seeing results (and nothing else):",
        "",
        *(f"{i}. {c}" for i, c in enumerate(CHANGED_AFTER_RESULTS, 1)),
        "",
        "## Findings",
        "",
    ]
    lines += _table(
        ["finding", "source", "verdict", "numbers", "test", "arms"],
        [
            [
                f.claim,
                f.source,
                VERDICT_MARK[f.verdict],
                f.numbers,
                f.test,
                f"{len(f.arms)}: " + ", ".join(f.arms[:6]) + (" …" if len(f.arms) > 6 else ""),
            ]
            for f in findings
        ],
    )
    lines += [
        "",
        *_ablation_section(cfg, project, ablate),
        *_search_section(project, search),
        *_spike_section(project, spike),
        *_pretrain_section(project, pretrain),
        *_runs_section(ablate, stage_runs),
    ]
    return "\n".join(lines) + "\n"


def _ablation_section(cfg: Config, project: Path, ablate: dict[str, Any]) -> list[str]:
    a, counts = cfg.ablation, ablate["counts"]
    lines = [
        "## Ablation grid",
        "",
        f"{len(ablate['arms'])} arms ({counts['completed']} completed, {counts['diverged']} diverged, "
        f"{counts['failed']} failed after retries{': ' + ', '.join(ablate['failed']) if ablate['failed'] else ''}), "
        f"each trained from scratch for {a.steps} steps at width {a.d_model}, {a.n_layer} blocks, "
        f"{a.seq_len}-token context, batch {a.batch_size}, seeds {a.seeds}, with one injected spike "
        f"({a.inject} x{a.inject_magnitude:g} for {a.inject_duration} steps from step {a.inject_step}). "
        "Per variant: mean over seeds [95 % t-interval].",
        "",
    ]
    lines += _scale_note(ablate)
    header = ["variant", "seeds", "status", *(h for _, h, _ in VARIANT_COLUMNS)]
    rows = []
    for variant, entry in ablate["variants"].items():
        statuses = ", ".join(f"{entry['status'].count(s)} {s}" for s in sorted(set(entry["status"])))
        rows.append(
            [
                variant,
                str(len(entry["seeds"])),
                statuses,
                *(_interval(entry["figures"][k], fmt) for k, _, fmt in VARIANT_COLUMNS),
            ]
        )
    lines += _table(header, rows)
    return [*lines, "", *_figures(project / REPORTS / "ablate", project), ""]


def _scale_note(ablate: dict[str, Any]) -> list[str]:
    """How far training got at this scale, so a reader can weigh effects the findings look for."""
    ran = [arm["metrics"] for arm in ablate["arms"] if arm.get("metrics")]
    finite = [m["val_loss"] for m in ran if not is_broken(m)]
    if not finite:
        return []
    init = max(m["init_loss"] for m in ran)
    return [
        f"What this scale can show: the {len(finite)} arms that ended with a finite loss ended between "
        f"{min(finite):.3f} and {max(finite):.3f} nats of validation loss, against {init:.3f} at "
        "initialisation: every arm is early in training, so the differences the findings test are small "
        "at this scale, and an inconclusive row lacks power rather than counting against its finding.",
        "",
    ]


def _search_section(project: Path, search: dict[str, Any] | None) -> list[str]:
    if not search:
        return ["## μ-transfer (search stage)", "", "The search stage has not run.", ""]
    lines = ["## μ-transfer (search stage)", ""]
    rows = [
        [
            p,
            f"{search[p]['slope']:+.3f} ± {search[p]['slope_std']:.3f}",
            ", ".join(
                f"{w}: {search[p]['widths'][w]['log2_lr_opt']:.2f}" for w in sorted(search[p]["widths"], key=int)
            ),
        ]
        for p in ("sp", "mup")
        if p in search
    ]
    lines += _table(["parametrization", "slope of log₂ η* vs log₂ width (± SD over seeds)", "log₂ η* per width"], rows)
    transfer = search.get("transfer", {})
    if transfer:
        lines += [
            "",
            f"Transferred LR {transfer.get('lr', float('nan')):.4g}; loss gap to a direct sweep at the "
            f"target width {transfer.get('loss_gap', float('nan')):+.4f} nats; compute ratio "
            f"{transfer.get('compute_ratio', float('nan')):.2f}.",
        ]
    return [*lines, "", *_figures(project / REPORTS / "search", project), ""]


def _spike_section(project: Path, spike: dict[str, Any] | None) -> list[str]:
    if not spike:
        return ["## Spike study", "", "The spike stage has not run.", ""]
    lines = [
        "## Spike study (from the pretrain milestone)",
        "",
        f"False alarms on the clean control: {spike.get('false_positives')}.",
        "",
    ]
    rows = []
    for kind, by_policy in spike.items():
        if isinstance(by_policy, dict) and "continue" in by_policy:
            for policy, s in by_policy.items():
                if isinstance(s, dict) and "type" in s:
                    peak = "not finite" if s["peak_ratio"] is None else f"{s['peak_ratio']:.2f}"  # JSON null
                    rows.append(
                        [
                            kind,
                            policy,
                            str(s["type"]),
                            peak,
                            str(s["steps_to_recover"]),
                            f"{s['final_gap']:+.2%}",
                            str(s.get("latency")),
                            f"{s['cost_usd']:.5f}",
                        ]
                    )
    lines += _table(
        [
            "injection",
            "policy",
            "type",
            "peak ratio",
            "steps to recover",
            "final gap",
            "detection latency",
            "cost (USD)",
        ],
        rows,
    )
    postmortems = sorted((project / REPORTS / "postmortems").glob("*.md"))
    lines += [
        "",
        "Post-mortems: " + (", ".join(f"[{p.stem}](postmortems/{p.name})" for p in postmortems) or "none"),
        "",
    ]
    return [*lines, *_figures(project / REPORTS / "spike", project), ""]


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
        *_figures(project / REPORTS / "pretrain", project),
        "",
    ]


def _runs_section(ablate: dict[str, Any], stage_runs: dict[str, str]) -> list[str]:
    lines = ["## MLflow runs", ""]
    lines += [f"- {stage}: [{url}]({url})" for stage, url in stage_runs.items()] or ["- no tracking server answered"]
    lines += ["", "Ablation arms (child runs of the ablate stage's run; each reproduces with its command):", ""]
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

STYLE = """body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;line-height:1.45}
table{border-collapse:collapse;font-size:.85em;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 6px;vertical-align:top}
th{background:#f3f3f3}img{max-width:100%;border:1px solid #eee;margin:.5em 0}code{font-size:.85em;word-break:break-all}"""


def render_html(markdown_text: str, reports_dir: Path) -> str:
    """The markdown as one page with every figure embedded (data URIs): nothing to fetch."""
    from markdown_it import MarkdownIt

    body = MarkdownIt("commonmark").enable("table").render(markdown_text)

    def embed(match: re.Match) -> str:
        path = reports_dir / html.unescape(match.group(1))
        if not path.is_file():
            return match.group(0)
        return f'src="data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()}"'

    body = re.sub(r'src="([^"]+\.png)"', embed, body)
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>spikelab study report</title>"
        f"<style>{STYLE}</style></head><body>{body}</body></html>\n"
    )


def verdicts(findings: list[Finding]) -> dict[str, Any]:
    """metrics/report.json: per finding its verdict and details; counts per verdict."""
    return {
        "findings": {f.key: dataclasses.asdict(f) for f in findings},
        "counts": {
            v: sum(1 for f in findings if f.verdict == v) for v in ("reproduced", "not reproduced", "inconclusive")
        },
    }


def provenance(project: Path, resolved: Path, commit: str | None) -> dict[str, str]:
    return {
        "commit": commit or "unknown (not a git checkout)",
        "config_hash": config_hash(project, resolved),
        "built": time.strftime("%Y-%m-%d %H:%M %Z"),
    }
