"""What the search stage reports from finished studies: points per study, optima per width, the
slopes, the transfer check, the counts and which trials the pruner stopped where
(metrics/search.json), the transferred LR (search/lr.yaml) and the figures."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import optuna
import yaml
from optuna.trial import TrialState

from tasks.config import Config
from tasks.runtime.files import staged, write_json
from tasks.runtime.outputs import SEARCH_LR, SEARCH_METRICS, SEARCH_REPORTS
from tasks.search.fit import GRID_TOL, Point, counts, slope, transfer_check, width_summary
from tasks.search.groups import grid_point
from tasks.search.queue import open_storage, optuna_storage, pruner
from tasks.search.spec import StudySpec, lr_grid, proxy_widths, swept_widths, uniform_loss


def points_of(storage: optuna.storages.BaseStorage, spec: StudySpec) -> tuple[list[Point], int]:
    """The study's finished trials as points, and how many trials were interrupted and retried."""
    trials = optuna.load_study(study_name=spec.name, storage=storage).get_trials(deepcopy=False)
    points = [
        Point(
            *grid_point(t),
            t.value,
            t.user_attrs.get("status", "completed"),
            t.user_attrs.get("flops", 0.0),
        )
        for t in trials
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
    ]
    return points, sum(t.state == TrialState.FAIL for t in trials)


@dataclasses.dataclass
class Findings:
    """Everything the stage reports: per study its points, and the summary (metrics/search.json)."""

    points: dict[StudySpec, list[Point]]
    metrics: dict[str, Any]

    def of(self, kind: str, parametrization: str | None = None, width: int | None = None) -> dict[int, list[Point]]:
        """Points by width of the studies of one kind (and parametrization)."""
        return {
            spec.width: pts
            for spec, pts in self.points.items()
            if spec.kind == kind and parametrization in (None, spec.parametrization) and width in (None, spec.width)
        }


def sweep_optima(cfg: Config, sweeps: list[StudySpec]) -> dict[int, dict]:
    """The fitted optimum per width of the transferred parametrization's finished sweeps."""
    storage = open_storage(optuna_storage(cfg))
    return {
        spec.width: width_summary(points_of(storage, spec)[0])
        for spec in sweeps
        if spec.parametrization == cfg.mup.parametrization
    }


def sweep_summary(points: list[Point], grid: list[float]) -> dict[str, Any]:
    """One width's summary (tasks/search/fit.py: width_summary) and ``grid_loss_opt``, the loss at
    the optimum fitted from the grid's points alone: what the μ-transfer gate compares, so SP and
    μP meet on the same grid when the second stage refined one of them (search.refine_points)."""
    on_grid = [p for p in points if any(abs(p.log2_lr - g) <= GRID_TOL for g in grid)]
    return width_summary(points) | {"grid_loss_opt": width_summary(on_grid)["loss_opt"]}


def pruned_trials(cfg: Config, storage: optuna.storages.BaseStorage, specs: list[StudySpec]) -> dict[str, Any]:
    """Which finished trials the pruner stopped, at which step and by which rule, per group
    (parametrization, width, seed) in LR order, and the steps that saved: a stopped trial did
    not train its last ``search.steps`` minus the step it stopped at."""
    steps = cfg.search.steps
    groups, trials, ran = [], 0, 0
    for spec in specs:
        finished = optuna.load_study(study_name=spec.name, storage=storage).get_trials(
            deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)
        )
        for seed in sorted({grid_point(t)[1] for t in finished}):
            group = sorted((t for t in finished if grid_point(t)[1] == seed), key=lambda t: grid_point(t)[0])
            stopped = [
                {
                    "log2_lr": grid_point(t)[0],
                    "step": int(t.user_attrs.get("pruned_at", t.last_step or 0)),
                    "by": t.user_attrs.get("pruned_by", "threshold"),
                }
                for t in group
                if t.state == TrialState.PRUNED
            ]
            groups.append(
                {
                    "kind": spec.kind,
                    "parametrization": spec.parametrization,
                    "width": spec.width,
                    "seed": seed,
                    "trials": len(group),
                    "pruned": stopped,
                    "steps_saved": sum(steps - p["step"] for p in stopped),
                }
            )
            trials += len(group)
            ran += sum(int(t.user_attrs.get("steps", steps)) for t in group)
    saved = sum(g["steps_saved"] for g in groups)
    return {
        "rule": pruner(cfg).settings(),
        "trials": trials,
        "pruned": sum(len(g["pruned"]) for g in groups),
        "steps": trials * steps,
        "steps_trained": ran,
        "steps_saved": saved,
        "steps_saved_share": saved / (trials * steps) if trials else 0.0,
        "groups": groups,
    }


def summarize(cfg: Config, sweeps: list[StudySpec], transfer: StudySpec) -> Findings:
    """The findings of finished studies: optima per width, slopes, the transfer check, counts."""
    storage = open_storage(optuna_storage(cfg))
    collected = {spec: points_of(storage, spec) for spec in [*sweeps, transfer]}
    points = {spec: pts for spec, (pts, _) in collected.items()}
    by_width = {  # censored against each seed's own LRs, the pruned ones and the second stage's included
        p: {
            s.width: sweep_summary(pts, lr_grid(cfg))
            for s, pts in points.items()
            if s.kind == "sweep" and s.parametrization == p
        }
        for p in cfg.search.parametrizations
    }
    sweep_of = {(s.parametrization, s.width): pts for s, pts in points.items() if s.kind == "sweep"}
    proxies, log2_lr = proxy_widths(cfg), transfer.points[0][0]
    proxy_flops = sum(p.flops for w in proxies for p in sweep_of[(transfer.parametrization, w)])
    check = transfer_check(sweep_of[(transfer.parametrization, transfer.width)], points[transfer], proxy_flops, log2_lr)
    metrics: dict[str, Any] = {
        **{
            p: {"widths": {str(w): summary for w, summary in sorted(by_width[p].items())}, **slope(by_width[p])}
            for p in cfg.search.parametrizations
        },
        "transfer": {
            "parametrization": transfer.parametrization,
            "target_width": transfer.width,
            "proxy_widths": proxies,
            **check,
        },
        "trials": counts([p for pts in points.values() for p in pts], sum(r for _, r in collected.values())),
        "pruning": pruned_trials(cfg, storage, [*sweeps, transfer]),
        "studies": sorted(spec.name for spec in points),
        "storage": optuna_storage(cfg),
    }
    return Findings(points, metrics)


def publish(cfg: Config, project: Path, findings: Findings) -> list[Path]:
    """metrics/search.json, search/lr.yaml and the figures, all or none; returns the figures."""
    from model.coord_check import coord_check
    from tasks.search import figures

    m = findings.metrics
    transfer = m["transfer"]
    with staged(project / SEARCH_METRICS, project / SEARCH_LR, project / SEARCH_REPORTS) as (metrics, lr, reports):
        write_json(metrics, m)
        lr.write_text(LR_FILE_HEADER + yaml.safe_dump({"optim": {"lr": transfer["lr"]}}), encoding="utf-8")
        reports.mkdir()
        sweeps = {p: findings.of("sweep", p) for p in cfg.search.parametrizations}
        figures.mu_transfer(sweeps, reports / "mu_transfer.png", uniform_loss(cfg))
        widths = swept_widths(cfg)
        coords = {
            p: coord_check(p, widths, steps=5, lr=transfer["lr"], base_width=cfg.mup.base_width)
            for p in cfg.search.parametrizations
        }
        figures.coord_check_figure(coords, widths, transfer["lr"], reports / "coord_check.png")
        direct = findings.of("sweep", transfer["parametrization"], transfer["target_width"])
        figures.transfer_figure(
            direct[transfer["target_width"]],
            findings.of("transfer")[transfer["target_width"]],
            transfer,
            transfer["target_width"],
            reports / "transfer.png",
        )
    return sorted((project / SEARCH_REPORTS).glob("*.png"))


LR_FILE_HEADER = """\
# The learning rate the search stage transferred from the proxy widths to the target width
# (tasks/search/study.py; how it was found: metrics/search.json). pretrain trains with it when
# search.transfer_lr is true (tasks/pretrain/train.py: pretrain_config).
"""
