"""Whether the study's decisions survive another arithmetic (issue 28): the verdicts of one
project's outputs against another's, computed from the same data and design on another numeric
path (``precision.numerics``: the other ISA branch of MKL, oneDNN and ATen). Per-arm losses move by
1e-3 to 1e-1 nats between paths; a verdict that moves with them was decided by rounding. The
check's driver is checks/arithmetic.py; this module holds what it compares."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tasks.config import Config
from tasks.report.arithmetic import STAGE_METRICS as REPORTED
from tasks.report.findings import evaluate
from tasks.report.method import Finding
from tasks.runtime.files import read_json
from tasks.runtime.outputs import ABLATE_METRICS, SEARCH_METRICS, SPIKE_METRICS

STAGE_METRICS = {stage: path for stage, path in REPORTED.items() if stage != "pretrain"}
"""The outputs whose numbers decide verdicts, by the stage that writes them (pretraining decides none)."""


def findings_of(cfg: Config, project: Path) -> list[Finding]:
    """The findings as the report stage computes them from ``project``'s outputs."""
    ablate = read_json(project / ABLATE_METRICS)
    search, spike = (
        read_json(project / p) if (project / p).is_file() else None for p in (SEARCH_METRICS, SPIKE_METRICS)
    )
    return evaluate(cfg, ablate, search, spike, ablate.get("unigram_val_loss"))


def compare(first: list[Finding], second: list[Finding]) -> dict[str, Any]:
    """Finding by finding, the two verdicts and whether they agree, with each claim's estimate
    under both arithmetics; ``agree`` is True only when every verdict does."""
    rows = {}
    for a, b in zip(first, second, strict=True):
        rows[a.key] = {
            "first": a.verdict,
            "second": b.verdict,
            "agree": a.verdict == b.verdict,
            "claims": [
                {"what": ca.what, "first": ca.estimate, "second": cb.estimate, "sesoi": ca.sesoi}
                for ca, cb in zip(a.claims, b.claims, strict=False)
            ],
            "precondition_failed": [a.precondition_failed, b.precondition_failed],
        }
    return {"findings": rows, "agree": all(r["agree"] for r in rows.values())}
