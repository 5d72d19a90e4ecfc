"""The ablate stage as a Prefect flow: the study's families of arms (tasks/ablate/grid.py: expand)
fanned out as one Prefect task per run onto long-lived worker processes (``ablation.workers`` of a
local cluster, or a running Dask cluster's at ``executor.scheduler``: tasks/runtime/workers.py),
each arm trained there as its own command ``python -m tasks.ablate.arm`` would (from a clean global state), an arm that crashed retried ``ablation.retries`` times, then
reported as failed while the others go on. One progress line per arm (done/total, ETA). An arm whose result
is in ``runs/ablate/arms/<key>/`` (same config, data, spike, probes and code) is not trained again;
two families that ask for the same run share it. Beside the arms, the depth probe (gradient norms
at initialisation against depth, Pre-LN vs Post-LN: tasks/ablate/depth.py).

MLflow: the stage's run with a child per arm (its factors, its command, the figures the study
compares, its per-step loss). Outputs: ``metrics/ablate.json`` (every arm, failed ones
included, per variant the mean, SD and 95 % interval of each figure, the depth probe) and the
per-family figures in ``reports/ablate/``; the findings are the report stage's.
"""

from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import Metric
from prefect import flow, get_run_logger, task
from prefect.futures import as_completed

from flows.forms import Profile
from model.flops import training_flops
from model.typed_config import ConfigError
from tasks.ablate.arm import run_command
from tasks.ablate.conditions import loss_shift_probe
from tasks.ablate.depth import depth_probe
from tasks.ablate.figures import family_figures
from tasks.ablate.grid import (
    Arm,
    arm_config,
    arm_key,
    arm_metrics,
    check_family,
    code_digest,
    data_hashes,
    expand,
    families,
    read_result,
)
from tasks.ablate.natural import FAMILY as NATURAL_FAMILY
from tasks.ablate.natural import natural_arms, natural_record
from tasks.ablate.rounds import Schedule, reachable_rounds
from tasks.config import Config, project_config
from tasks.data.unigram import unigram_baseline
from tasks.design.families import DeclaredFamily
from tasks.design.preregistration import design
from tasks.design.stats import derived, variant_table
from tasks.design.studies import read_studies
from tasks.report.findings import family_finding, family_state
from tasks.report.natural import analyse
from tasks.runtime.artifacts import publish_summary
from tasks.runtime.files import write_json
from tasks.runtime.outputs import ABLATE_ALONE, ABLATE_ARMS, ABLATE_FIGURES, ABLATE_METRICS, MANIFEST, TOKENS_DIR
from tasks.runtime.progress import Progress, pace_record
from tasks.runtime.tracking import (
    child_run,
    log_params,
    log_summary,
    numerics_tags,
    run_url,
    stage_provenance,
    stage_run,
)
from tasks.runtime.workers import Executor, clean_state, executor

ARM_MODULE = ["-m", "tasks.ablate.arm"]


def arm_command(
    arm: Arm,
    cfg: Config,
    project: Path,
    directory: Path,
    stage_overrides: dict[str, Any],
    loss_shift: int,
    family: DeclaredFamily,
    data: Path = TOKENS_DIR,
) -> list[str]:
    """The command that trains ``arm`` by itself (on ``data``): the stage's own overrides, then the arm's."""
    sets = {**stage_overrides, **family.overrides(cfg.ablation, arm.factors, arm.seed, loss_shift)}
    probe = family.range_probe_every
    return [
        sys.executable,
        *ARM_MODULE,
        "--profile",
        cfg.profile,
        "--out",
        str(directory.relative_to(project)),
        *(["--spike", arm.spike] if arm.spike != "none" else []),
        *([f"--range-probe-every={probe}"] if probe else []),
        *(["--data", str(data)] if data != TOKENS_DIR else []),
        *[f"--set={k}={_yaml(v)}" for k, v in sets.items()],
    ]


def shown(command: list[str]) -> str:
    """The command as a user types it in the project directory (shell-quoted)."""
    return shlex.join(["python", *command[1:]])


def _yaml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ",".join(map(_yaml, value)) + "]"
    return str(value)


def _not_a_config_error(task, task_run, state) -> bool:
    """Retry crashes only: a bad config fails the same way every time."""
    try:
        state.result()
    except ConfigError:
        return False
    except Exception:
        return True
    return False


@task(retry_condition_fn=_not_a_config_error)
def train_arm(name: str, command: list[str], project: Path) -> tuple[dict[str, Any], float]:
    """Train one arm in this worker as its command would; its result and the seconds it took here
    (the progress line's ETA), or the exception that stopped it (retried, unless a
    :class:`ConfigError`: a bad config fails the same way again)."""
    clean_state()
    started = time.perf_counter()
    return run_command(command[1 + len(ARM_MODULE) :], project), time.perf_counter() - started


def track_arm(row: dict[str, Any], result: dict[str, Any] | None, parent_id: str) -> str | None:
    """The arm's child run: its family's conditions (``fixed``), factors and seed as params, its
    figures as metrics (every one a claim or gate may read), its per-step loss."""
    tags = {
        "spikelab.arm": row["name"],
        "spikelab.variant": row["variant"],
        "spikelab.family": row["family"],
        "spikelab.run_identity": row["key"],
        "spikelab.command": shown(row["command"]),
        "spikelab.cached": str(row["cached"]).lower(),
        **(
            {"spikelab.policy": row["policy"]} if "policy" in row else {}
        ),  # a natural-spike arm's (tasks/ablate/natural.py)
        **numerics_tags((result or {}).get("provenance")),  # the worker's, not the stage's: another machine's
    }
    with child_run(f"ablate {row['name']}", tags, parent_id=parent_id) as run:
        log_params({**row["fixed"], **row["factors"], "seed": row["seed"]})
        if result is not None:
            log_summary(tracked_figures(row["metrics"]))
            now = int(time.time() * 1000)
            curve = [Metric("loss/train", r["loss"], now, r["step"]) for r in result["rows"] if r["loss"] is not None]
            client = mlflow.MlflowClient()
            for i in range(0, len(curve), 900):  # at most 1000 metrics per batch
                client.log_batch(run.info.run_id, metrics=curve[i : i + 900])
    status = row["status"]
    if status in ("diverged", "failed"):
        mlflow.MlflowClient().set_terminated(run.info.run_id, "FAILED")
    return run_url(run) or f"runs:/{run.info.run_id}"


def tracked_figures(metrics: dict[str, Any]) -> dict[str, Any]:
    """The arm's figures with those read off them (``capped_loss``, ``log_z_drift``: stats.derived),
    a yes/no (``diverged``) as 1/0: a claim or gate reads each, so each is an MLflow metric."""
    return {k: int(v) if isinstance(v, bool) else v for k, v in derived(metrics).items()}


def plan(
    cfg: Config,
    project: Path,
    stage_overrides: dict[str, Any],
    loss_shift: int,
    declared_families: Sequence[DeclaredFamily] = (),
    data_dir: Path = TOKENS_DIR,
    arms_dir: Path = ABLATE_ARMS,
) -> list[dict[str, Any]]:
    """Every arm with its key, directory, command, and its result where one is stored. Arms of two
    families that are the same run (same key) share one directory and train once. ``data_dir``:
    the tokenize output they train on; ``arms_dir``: where their directories are (the sensitivity
    stage's perturbed arms: flows/sensitivity.py)."""
    data, code = data_hashes(project / data_dir / MANIFEST.name), code_digest()
    every = families(cfg, declared_families)
    return [
        plan_row(cfg, project, arm, every[arm.family], (data, code), stage_overrides, loss_shift, data_dir, arms_dir)
        for arm in expand(cfg, declared_families)
    ]


def natural_plan(cfg: Config, project: Path, stage_overrides: dict[str, Any], loss_shift: int) -> list[dict[str, Any]]:
    """The arms of the spike finding's secondary analysis (tasks/ablate/natural.py), one row each as
    :func:`plan` gives them, with its policy: trained after the families, never in their rounds."""
    data, code = data_hashes(project / TOKENS_DIR / MANIFEST.name), code_digest()
    family = families(cfg)[NATURAL_FAMILY]
    return [
        plan_row(cfg, project, arm, family, (data, code), stage_overrides, loss_shift, policy=policy)
        for arm, policy in natural_arms(cfg)
    ]


def plan_row(
    cfg: Config,
    project: Path,
    arm: Arm,
    family: DeclaredFamily,
    hashes: tuple[dict[str, str], str],
    stage_overrides: dict[str, Any],
    loss_shift: int,
    data_dir: Path = TOKENS_DIR,
    arms_dir: Path = ABLATE_ARMS,
    policy: str = "none",
) -> dict[str, Any]:
    """One arm's row: its key (``hashes``: the data's and the code's), directory, command and stored result."""
    arm_cfg = arm_config(cfg, arm, family, loss_shift)
    key = arm_key(arm_cfg, hashes[0], hashes[1], arm.spike, family.range_probe_every, policy)
    directory = project / arms_dir / key
    stored = read_result(directory)
    command = arm_command(arm, cfg, project, directory, stage_overrides, loss_shift, family, data_dir)
    return {
        "name": arm.name if policy == "none" else f"{arm.name}/{policy}",
        "family": arm.family,
        "variant": arm.variant,
        "seed": arm.seed,
        "factors": arm.factors,
        "fixed": family.conditions(loss_shift),
        "key": key,
        "directory": directory,
        "command": command if policy == "none" else [*command, f"--policy={policy}"],
        "config": arm_cfg,
        "cached": stored is not None and stored.get("key") == key,
        "result": stored if stored is not None and stored.get("key") == key else None,
        **({"policy": policy} if policy != "none" else {}),
    }


def underflow_threshold() -> float:
    """The fp16 finding's registered underflow share (the gate of its claim ``unscaled``)."""
    threshold: float = design()["findings"]["fp16"]["claims"]["unscaled"]["gate"]["at_least"]  # registered, any grid
    return threshold


def runs_to_train(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first row of each run (key) with no stored result: two families' shared arm trains once."""
    todo: dict[str, dict[str, Any]] = {}
    for row in rows:
        if not row["cached"]:
            todo.setdefault(row["key"], row)
    return list(todo.values())


@flow(name="ablate")
def ablate_flow(
    profile: Profile | None = None, overrides: dict[str, Any] | None = None, family: str | None = None
) -> None:
    """Train every arm of the study's families (those not stored already) and run the depth probe;
    write metrics/ablate.json and the per-family figures. ``family``: that family's arms alone
    (``spikelab run ablate --family NAME``), the outputs its alone."""
    cfg, project = project_config(profile, overrides)
    declared = read_studies(project, cfg)  # studies.yaml, read once for the plan and the figures
    logger = get_run_logger()
    started = time.perf_counter()
    conditions = {"loss_shift": loss_shift_probe(cfg, project)}
    logger.info(
        "loss shift for the precision family: k = %s (tasks/ablate/conditions.py)", conditions["loss_shift"]["k"]
    )
    rows = plan(cfg, project, overrides or {}, conditions["loss_shift"]["k"] or 0, declared)
    if family is not None:
        check_family(family, cfg, declared)
        rows = [row for row in rows if row["family"] == family]
    metrics_path, figures_dir = outputs_of(family)
    units = executor(cfg, cfg.ablation.workers, len(runs_to_train(rows)))
    logger.info(
        "%d arms (%d runs) at most: %d stored, %d at a time (%s)%s",
        len(rows),
        len({row["key"] for row in rows}),
        sum(row["cached"] for row in rows),
        units.workers,
        units.address or "local workers",
        f"; seeds in rounds of {cfg.ablation.rounds}" if cfg.ablation.rounds else "",
    )
    numerics = stage_provenance(cfg)
    evidence = Evidence(cfg, project, conditions, declared)
    with stage_run(cfg, "ablate", numerics=numerics) as run:
        log_summary({"arms_planned": len(rows), "workers": units.workers})
        if cfg.ablation.rounds:
            rows, sequence = train_in_rounds(cfg, rows, units, run.info.run_id, evidence)
        else:
            fan_out(cfg, project, rows, runs_to_train(rows), units, run.info.run_id)
            sequence = None
        natural = natural_plan(cfg, project, overrides or {}, conditions["loss_shift"]["k"] or 0)
        if natural and family in (None, NATURAL_FAMILY):
            logger.info("natural spikes (the spike finding's secondary analysis): %d policy arms", len(natural))
            fan_out(cfg, project, natural, runs_to_train(natural), units, run.info.run_id)
        else:
            natural = []
        cached = sum(row["cached"] for row in rows)
        for row in rows:
            if row["cached"]:
                row["mlflow"] = track_arm(row, row["result"], run.info.run_id)
        record = natural_record(cfg, rows, natural) if natural else None
        metrics = write_outputs(
            project,
            rows,
            time.perf_counter() - started,
            numerics,
            evidence,
            sequence,
            metrics_path,
            figures_dir,
            record,
        )
        headline = {
            "arms": len(rows),
            "trained now": len(rows) - cached,
            "stored (not rerun)": cached,
            "diverged": metrics["counts"]["diverged"],
            "failed (crashed after retries)": metrics["counts"]["failed"],
            "wall_s": metrics["wall_s"],
        }
        log_summary({k.split(" ")[0]: v for k, v in headline.items()})
        figures = sorted((project / figures_dir).glob("*.png"))
        mlflow.log_artifact(str(project / metrics_path))
        for figure in figures:
            mlflow.log_artifact(str(figure), artifact_path="figures")
        publish_summary("ablate", run, headline, figures)
    if metrics["counts"]["failed"]:
        logger.warning("arms that failed after %d retries: %s", cfg.ablation.retries, metrics["failed"])


class Evidence:
    """What the findings read besides the arms (the probes' conditions, the depth probe, the unigram
    baseline), computed once, and the ablate-like record of any set of finished arms."""

    def __init__(self, cfg: Config, project: Path, conditions: dict[str, Any], declared: Sequence[DeclaredFamily]):
        self.cfg, self.project, self.conditions, self.declared = cfg, project, conditions, declared
        self.depth_probe = depth_probe(cfg)
        self.unigram = unigram_baseline(project / MANIFEST, cfg.ablation.seq_len)["unigram_val_loss"]

    def of(self, arms: list[dict[str, Any]]) -> dict[str, Any]:
        """``arms``: finished arms as arm_records gives them."""
        return {
            "arms": [{k: v for k, v in a.items() if k not in TRACES} for a in arms],
            "variants": variant_table(arms),
            "depth_probe": self.depth_probe,
            "unigram_val_loss": self.unigram,
            "conditions": self.conditions,
        }


def train_in_rounds(
    cfg: Config, rows: list[dict[str, Any]], units: Executor, parent_id: str, evidence: Evidence
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Train the families' seeds round by round (tasks/ablate/rounds.py): after each round every
    family still open is judged as the report will judge it (tasks/report/findings.py:
    family_finding) and stops once decided; returns the rows of the seeds each family trained and
    the schedule's record, look by look."""
    logger = get_run_logger()
    every = families(cfg, evidence.declared)
    index = {(name, s): i for name, f in every.items() for i, s in enumerate(f.all_seeds)}
    per_seed = {name: sum(r["config"].train.steps for r in rows if r["family"] == name) for name in every}
    schedule = Schedule(
        reachable_rounds(cfg.ablation.rounds, cfg.ablation.budget_seeds),
        {n: c // len(every[n].all_seeds) for n, c in per_seed.items()},
        cfg.ablation.budget_seeds,
    )
    going, looks = list(every), []
    for look, seeds in enumerate(schedule.rounds):
        admitted = schedule.admit(look, going)
        chosen = [r for r in rows if r["family"] in admitted and index[r["family"], r["seed"]] < seeds]
        logger.info("round %d (%d seeds): %s", look + 1, seeds, ", ".join(admitted) or "no family")
        fan_out(cfg, evidence.project, chosen, runs_to_train(chosen), units, parent_id)
        used = [r for r in rows if index[r["family"], r["seed"]] < schedule.seeds.get(r["family"], 0)]
        record = evidence.of(arm_records(used))
        found = {f: family_finding(cfg, record, evidence.unigram, every[f]) for f in admitted}
        states = {f: family_state(finding) for f, finding in found.items()}
        going = schedule.close(look, states)
        looks.append(
            {
                "look": look,
                "seeds": seeds,
                "arm_steps": schedule.spent,
                "families": {
                    f: {
                        "state": states[f],
                        "claims": {c.what: (c.sequential or {}).get("outcome") for c in finding.claims},
                    }
                    for f, finding in found.items()
                },
            }
        )
    return used, {**schedule.record(), "looks": looks}


def fan_out(
    cfg: Config, project: Path, rows: list[dict[str, Any]], todo: list[dict[str, Any]], units: Executor, parent_id: str
) -> None:
    """One task per arm to train, on the executor's workers; each arm tracked as it finishes."""
    logger = get_run_logger()
    cost = {row["key"]: training_flops(row["config"]) for row in todo}  # the ETA weighs arms by it
    kept = sum(row["cached"] for row in rows)
    what = f"{sum(cost.values()) / 1e12:.3g} TFLOP by model/flops.py"
    progress = Progress(
        "ablate",
        "arm",
        len(todo),
        logger,
        total_cost=sum(cost.values()),
        workers=units.workers,
        kept=kept,
        what=what,
        record=pace_record("ablate", cfg),
    )
    arm_task = train_arm.with_options(retries=cfg.ablation.retries, retry_delay_seconds=1)
    if todo:
        with units.runner() as runner, units.placement():
            futures = {}
            for row in todo:
                named = arm_task.with_options(task_run_name=f"arm {row['name']}")
                args = {"name": row["name"], "command": row["command"], "project": project}
                futures[runner.submit(named, args)] = row
            for future in as_completed(list(futures)):
                trained = futures[future]
                try:
                    (result, seconds), error = future.result(), None
                except ConfigError:
                    raise
                except Exception as e:  # crashed on every try: reported, the others go on
                    result, seconds, error = None, 0.0, f"{type(e).__name__}: {e}"
                    logger.error("arm %s failed: %s", trained["name"], error)
                for row in rows:
                    if row["key"] == trained["key"]:
                        row["result"], row["error"] = result, error
                        finalize(row)
                        row["mlflow"] = track_arm(row, result, parent_id)
                progress.finished(trained["name"], trained["status"], cost[trained["key"]], seconds)
    progress.close()
    for row in rows:
        if row["cached"]:
            finalize(row)


def finalize(row: dict[str, Any]) -> None:
    result = row["result"]
    row["metrics"] = arm_metrics(result, row["config"]) if result is not None else {}
    row["status"] = row["metrics"]["status"] if result is not None else "failed"
    row["numeric_path"] = ((result or {}).get("provenance") or {}).get("numeric_path")


TRACES = ("rows", "trajectories", "ranges")
"""The per-step and per-layer traces of an arm's result: drawn in the figures, kept out of
metrics/ablate.json (they stay in each arm's result.json and its MLflow run)."""


def arm_numerics(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each numeric path the arms' results record, its arithmetic and how many arms took it."""
    paths: dict[str, dict[str, Any]] = {}
    for row in rows:
        record = (row["result"] or {}).get("provenance")
        if record is not None:
            paths.setdefault(record["numeric_path"], {**record, "arms": 0})["arms"] += 1
    return paths


def arm_records(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each arm as metrics/ablate.json lists it, with its traces (TRACES) for the figures."""
    return [
        {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in row.items()
            if k not in ("result", "directory", "config")
        }
        | {"command": shown(row["command"])}
        | {t: (row["result"] or {}).get(t, []) for t in TRACES}
        for row in rows
    ]


def outputs_of(family: str | None) -> tuple[Path, Path]:
    """Where the stage writes its metrics and figures: the stage's outputs, or for one family run
    alone its own folder (ABLATE_ALONE), so a partial run never replaces the whole study's."""
    if family is None:
        return ABLATE_METRICS, ABLATE_FIGURES
    return ABLATE_ALONE / family / "ablate.json", ABLATE_ALONE / family / "figures"


def write_outputs(
    project: Path,
    rows: list[dict[str, Any]],
    wall_s: float,
    numerics: dict[str, Any],
    evidence: Evidence,
    sequence: dict[str, Any] | None = None,
    metrics_path: Path = ABLATE_METRICS,
    figures_dir: Path = ABLATE_FIGURES,
    natural: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """metrics/ablate.json and the figures (one more per declared family), from every arm
    (failed ones are listed, not dropped); a family run alone's where :func:`outputs_of` says.
    ``provenance``: the stage process's arithmetic (the depth probe's); ``arm_numerics``: the
    arithmetic of each numeric path the arms were trained on (each arm names its own);
    ``conditions``: what the probes measured before the arms (tasks/ablate/conditions.py);
    ``sequential``: the rounds each family trained and why it stopped (tasks/ablate/rounds.py);
    ``natural``: the spike finding's secondary analysis, its runs (tasks/ablate/natural.py) and
    per policy its verdict (tasks/report/natural.py: analyse), where its arms ran."""
    arms = arm_records(rows)
    counts = {s: sum(1 for r in rows if r["status"] == s) for s in ("completed", "diverged", "stopped", "failed")}
    metrics = {
        **evidence.of(arms),
        "counts": counts,
        "failed": [r["name"] for r in rows if r["status"] == "failed"],
        "cached": sum(1 for r in rows if r["cached"]),
        "wall_s": wall_s,
        "provenance": numerics,
        "arm_numerics": arm_numerics(rows),
        "sequential": sequence,
        **({"natural": {**natural, "analysis": analyse(natural)}} if natural else {}),
    }
    write_json(project / metrics_path, metrics)
    family_figures(
        evidence.cfg,
        arms,
        metrics["depth_probe"],
        metrics["unigram_val_loss"],
        project / figures_dir,
        plateau_margin=design()["plateau_margin"],
        underflow_threshold=underflow_threshold(),
        declared=evidence.declared,
    )
    return metrics
