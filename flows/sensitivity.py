"""The sensitivity stage as a Prefect flow (issue #46, item 7: data sensitivity): each finding's
estimate under a registered data perturbation, beside its estimate on the full data at the same
seeds.

It builds data/perturbed (tasks/data/perturb.py: the training split less ``sensitivity.drop_share``
of its documents, drawn with ``sensitivity.seed``; validation unchanged), then trains, for every
built-in finding the report reads through its declared engine (the checks of the machinery aside),
its family's arms at the discovery seeds (``ablation.seeds``) on that copy, with the ablate stage's
own planning and fan-out (flows/ablate.py: plan, runs_to_train, fan_out), each arm's key carrying
the perturbation (tasks/ablate/grid.py: data_hashes) and its directory under runs/sensitivity/arms.
The full-data twins are metrics/ablate.json's arms at those seeds: each must be listed there under
the key this config and code give it, or the stage stops (run the ablate stage first).

Outputs: ``metrics/sensitivity.json`` (the perturbation, the arms, and per finding and claim the
estimate on each side and their per-seed difference: tasks/sensitivity/compare.py); MLflow: the
stage's run with a child per perturbed arm. The report shows it (tasks/report/sections/stages.py:
sensitivity_section).
"""

from __future__ import annotations

import time
from typing import Any

import mlflow
from prefect import flow, get_run_logger

from flows.ablate import arm_numerics, fan_out, plan, runs_to_train, shown, track_arm
from flows.forms import Profile
from model.typed_config import InputError
from tasks.config import project_config
from tasks.data.perturb import MANIFEST_NAME, drop_documents
from tasks.data.unigram import unigram_baseline
from tasks.runtime.artifacts import publish_summary
from tasks.runtime.files import read_json, write_json
from tasks.runtime.outputs import ABLATE_METRICS, PERTURBED_DIR, SENSITIVITY_ARMS, SENSITIVITY_METRICS, TOKENS_DIR
from tasks.runtime.tracking import log_summary, stage_provenance, stage_run
from tasks.runtime.workers import executor
from tasks.sensitivity.compare import at_seeds, compare, compared_findings, record, trained, unmatched

ARM_FIELDS = ("name", "family", "variant", "seed", "factors", "key", "cached", "status", "metrics", "numeric_path")
"""What metrics/sensitivity.json lists of each perturbed arm (as metrics/ablate.json does)."""


@flow(name="sensitivity")
def sensitivity_flow(profile: Profile | None = None, overrides: dict[str, Any] | None = None) -> None:
    """Train the discovery seeds' arms of the built-in findings on the perturbed data (those not
    stored already) and write metrics/sensitivity.json."""
    cfg, project = project_config(profile, overrides)
    if not (project / ABLATE_METRICS).is_file():
        raise InputError(f"{project / ABLATE_METRICS}: missing; run the ablate stage first (dvc repro ablate)")
    ablate = read_json(project / ABLATE_METRICS)
    logger = get_run_logger()
    started = time.perf_counter()
    s, seeds = cfg.sensitivity, list(cfg.ablation.seeds)
    perturbation = drop_documents(project / TOKENS_DIR, project / PERTURBED_DIR, s.drop_share, s.seed)
    logger.info(
        "%s: %d of %d training documents dropped (share %g, seed %d); validation unchanged",
        PERTURBED_DIR,
        perturbation["dropped"],
        perturbation["documents"],
        s.drop_share,
        s.seed,
    )
    findings = compared_findings(cfg)
    names = trained(findings)
    shift = ((ablate.get("conditions") or {}).get("loss_shift") or {}).get("k") or 0  # the full data's arms' shift

    def chosen(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [r for r in rows if r["family"] in names and r["seed"] in seeds]

    stale = unmatched(chosen(plan(cfg, project, overrides or {}, shift)), ablate)
    if stale:
        raise InputError(
            f"{project / ABLATE_METRICS}: {len(stale)} arm(s) it should pair with are missing or were trained "
            f"with another config or code (e.g. {stale[0]}); run the ablate stage first (dvc repro ablate)"
        )
    rows = chosen(plan(cfg, project, overrides or {}, shift, data_dir=PERTURBED_DIR, arms_dir=SENSITIVITY_ARMS))
    todo = runs_to_train(rows)
    units = executor(cfg, s.workers, len(todo))
    cached = sum(row["cached"] for row in rows)
    logger.info(
        "%d arms of %s at seeds %s on %s: %d stored, %d to train, %d at a time (%s)",
        len(rows),
        ", ".join(sorted(names)) or "no family",
        seeds,
        PERTURBED_DIR,
        cached,
        len(todo),
        units.workers,
        units.address or "local workers",
    )
    numerics = stage_provenance(cfg)
    with stage_run(cfg, "sensitivity", numerics=numerics) as run:
        log_summary({"arms": len(rows), "arms_cached": cached, "workers": units.workers})
        fan_out(cfg, project, rows, todo, units, run.info.run_id)
        for row in rows:
            if row["cached"]:
                row["mlflow"] = track_arm(row, row["result"], run.info.run_id)
        arms = [
            {k: row.get(k) for k in ARM_FIELDS}
            | {"error": row.get("error"), "mlflow": row.get("mlflow"), "command": shown(row["command"])}
            for row in rows
        ]
        unigram = unigram_baseline(project / PERTURBED_DIR / MANIFEST_NAME, cfg.ablation.seq_len)["unigram_val_loss"]
        compared = compare(cfg, findings, at_seeds(ablate, names, seeds), record(arms, unigram, ablate))
        counts = {k: sum(1 for r in rows if r["status"] == k) for k in ("completed", "diverged", "stopped", "failed")}
        metrics = {
            "perturbation": {**perturbation, "data": str(PERTURBED_DIR)},
            "seeds": seeds,
            "families": sorted(names),
            "findings": compared,
            "arms": arms,
            "counts": counts,
            "cached": cached,
            "unigram_val_loss": {"main": ablate.get("unigram_val_loss"), "perturbed": unigram},
            "wall_s": time.perf_counter() - started,
            "provenance": numerics,
            "arm_numerics": arm_numerics(rows),
        }
        write_json(project / SENSITIVITY_METRICS, metrics)
        headline = {
            "arms": len(rows),
            "trained now": len(todo),
            "stored (not rerun)": cached,
            "documents dropped": perturbation["dropped"],
            "failed (crashed after retries)": counts["failed"],
            "wall_s": metrics["wall_s"],
        }
        log_summary({k.split(" ")[0]: v for k, v in headline.items()})
        mlflow.log_artifact(str(project / SENSITIVITY_METRICS))
        publish_summary("sensitivity", run, headline)
    if counts["failed"]:
        failed = [r["name"] for r in rows if r["status"] == "failed"]
        logger.warning("perturbed arms that failed after %d retries: %s", cfg.ablation.retries, failed)
