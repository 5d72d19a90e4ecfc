"""The search's findings where its studies are browsed: on the transfer study (the target width
trained at the LR pretrain takes), a markdown note with the optima, slopes and transfer gap, and
the μTransfer figures as Optuna artifacts. optuna-dashboard shows both on the study's page; its
artifacts live under the state directory (``spikelab services up`` serves them, tasks/runtime/services.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import optuna_dashboard
from optuna.artifacts import FileSystemArtifactStore, get_all_artifact_meta, upload_artifact

from tasks.config import Config
from tasks.runtime.paths import state
from tasks.search.findings import Findings
from tasks.search.queue import open_storage, optuna_storage
from tasks.search.spec import StudySpec

ATTACHED = ("mu_transfer.png", "transfer.png")
"""The figures attached to the study (coord_check.png checks the model code, not this search)."""

NAMES = {"sp": "SP", "mup": "μP"}
EXPECTED_SLOPE = {"sp": "−1: η* halves per doubling", "mup": "0: η* stays put"}


def artifact_store() -> FileSystemArtifactStore:
    root = state().optuna_artifacts
    root.mkdir(parents=True, exist_ok=True)
    return FileSystemArtifactStore(root)


def transfer_study(findings: Findings) -> StudySpec:
    return next(spec for spec in findings.points if spec.kind == "transfer")


def annotate(cfg: Config, findings: Findings, figures: list[Path]) -> optuna.Study:
    """Write the note on the transfer study and attach the figures it lacks (a rerun of an
    unchanged search finds the same study and adds nothing twice). Returns the study."""
    storage = open_storage(optuna_storage(cfg))
    study = optuna.load_study(study_name=transfer_study(findings).name, storage=storage)
    optuna_dashboard.save_note(study, note(findings.metrics))
    attached = {meta.filename for meta in get_all_artifact_meta(study, storage=storage)}
    store = artifact_store()
    for path in figures:
        if path.name in ATTACHED and path.name not in attached:
            upload_artifact(
                artifact_store=store, file_path=str(path), study_or_trial=study, storage=storage, mimetype="image/png"
            )
    return study


def note(metrics: dict[str, Any]) -> str:
    """The findings in markdown: optimum per width, slope per parametrization, the transfer."""
    t = metrics["transfer"]
    return "\n".join(
        [
            f"## μTransfer to width {t['target_width']} (LR from widths {', '.join(map(str, t['proxy_widths']))})",
            "",
            *optima_table(metrics),
            "",
            *(slope_line(p, metrics[p]) for p in metrics if p in NAMES),
            "",
            f"**Transferred LR** 2^{t['log2_lr']:.2f} = {t['lr']:.3g} (pretrain trains with it); the direct "
            f"sweep's fitted optimum {_num(t['direct_log2_lr_opt'], '.2f', '2^')} "
            f"(error {_num(t['log2_lr_error'], '+.2f')} octaves).",
            "",
            f"**Transfer gap** {_num(t['loss_gap'], '+.3f')} ± {t['loss_gap_std']:.3f} nats (per seed: loss at the "
            f"transferred LR − the direct sweep's best grid loss; ± over seeds); compute ratio "
            f"{_num(t['compute_ratio'], '.2f')} (proxy FLOPs / direct-sweep FLOPs).",
            "",
            "Figures: the artifacts below (mu_transfer.png, transfer.png); numbers: metrics/search.json.",
        ]
    )


def optima_table(metrics: dict[str, Any]) -> list[str]:
    """log2 η* ± spread over seeds and the loss there, a row per width, a column per parametrization."""
    names = [p for p in metrics if p in NAMES]
    widths = sorted({int(w) for p in names for w in metrics[p]["widths"]})
    rows = [
        "| width | " + " | ".join(f"{NAMES[p]} log2 η* (loss)" for p in names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for w in widths:
        cells = [optimum_cell(metrics[p]["widths"].get(str(w))) for p in names]
        rows.append(f"| {w} | " + " | ".join(cells) + " |")
    return rows


def optimum_cell(summary: dict[str, Any] | None) -> str:
    if not summary or summary["log2_lr_opt"] is None:
        return "no completed trial"
    edge = f", {len(summary['censored'])} censored" if summary.get("censored") else ""
    return f"{summary['log2_lr_opt']:.2f} ± {summary['log2_lr_opt_std']:.2f} ({summary['loss_opt']:.3f}{edge})"


def slope_line(parametrization: str, fit: dict[str, Any]) -> str:
    """The slope of log2 η* on log2 width with the seeds' spread and the standard error of its mean."""
    name = NAMES[parametrization]
    if fit["slope"] is None:
        return f"- {name}: no slope (fewer than two widths with an optimum)"
    return (
        f"- {name}: slope of log2 η* on log2 width **{fit['slope']:+.2f}** ± {fit['slope_std']:.2f} over seeds, "
        f"std. error over seeds {_num(fit['slope_sem'], '.2f')} (expected {EXPECTED_SLOPE[parametrization]})"
    )


def _num(value: float | None, spec: str, prefix: str = "") -> str:
    return "n/a" if value is None else f"{prefix}{value:{spec}}"
