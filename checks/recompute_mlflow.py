"""The study's numbers read back from its MLflow runs and recomputed (issue 28: "every number
recomputed from the MLflow runs"), so a reader can check the report against what MLflow recorded
rather than against the stages' own JSON.

- ablate: each arm's child run (metrics/ablate.json links it) gives the arm's figures: its
  ``summary/*`` metrics, its status from how the run ended (FAILED with a divergence step:
  diverged), its precision path from its ``spikelab.numerics.precision`` tag; the stage's other
  numbers (conditions, depth probe, unigram loss) come from the stage run's artifact.
- search and spike: the stage run with this project's DVC inputs (its ``spikelab.dvc_inputs``
  tag) gives the stage's metrics (its artifact); each spike branch's scores are checked against
  the branch's own child run (the control's final loss recomputed from its logged curve). The
  μ-transfer's optima are read from the artifact, not refitted from the trials' runs.

Each number is compared with the project's metrics/*.json; then every finding is recomputed by the
report's own code from the MLflow numbers alone and compared, field by field, with
metrics/report.json (verdict, estimates, p, intervals, MDEs, halves).

    python checks/recompute_mlflow.py [--profile default] [--out checks/out/recompute.json]

Needs the project's MLflow server (``spikelab services up``). Prints one line per finding and per
stage; exits 1 when a number differs, 2 when a run is missing or an input is.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from model.private import run_private  # noqa: E402
from model.typed_config import ConfigError, parse_sets  # noqa: E402
from tasks.config import Config, load_config  # noqa: E402
from tasks.design.registration import LABEL_KEY  # noqa: E402
from tasks.report.findings import evaluate, mark_fragile  # noqa: E402
from tasks.runtime.files import read_json  # noqa: E402
from tasks.runtime.outputs import (  # noqa: E402
    ABLATE_METRICS,
    REPORT_METRICS,
    SEARCH_METRICS,
    SENSITIVITY_METRICS,
    SPIKE_METRICS,
)
from tasks.spike.study import branch_name  # noqa: E402

SUMMARY = "summary/"
"""The prefix of a run's summary figures (tasks/runtime/tracking.py: log_summary)."""


class Missing(Exception):
    """A run or an input the recomputation needs is not there."""


def run_id(link: str) -> str:
    """The run id in a UI link (``.../runs/<id>?...``) or a ``runs:/<id>`` URI."""
    tail = link.split("runs:/", 1)[1] if link.startswith("runs:/") else link.split("/runs/", 1)[1]
    return tail.split("?", 1)[0].split("/", 1)[0]


def summary_of(run: Any) -> dict[str, float]:
    return {k.removeprefix(SUMMARY): v for k, v in run.data.metrics.items() if k.startswith(SUMMARY)}


def arm_figures(run: Any, keys: list[str]) -> dict[str, Any]:
    """An arm's figures as its MLflow run holds them; ``keys`` the JSON's (a None figure is not
    logged, so a key MLflow lacks is None; the figures read off them, tasks/design/stats.py:
    derived, are logged for the UI and are no figure of the file's). A failed arm (no result)
    logged none."""
    logged = summary_of(run)
    if run.info.status == "FAILED" and "diverged_at" not in logged:
        return {}
    status = "diverged" if run.info.status == "FAILED" else "completed"
    return {
        **{k: logged.get(k) for k in keys},
        "status": status,
        "diverged": status == "diverged",
        "precision_path": run.data.tags.get("spikelab.numerics.precision"),
    }


def is_number(v: Any) -> bool:
    """An int or a float, not a bool (a JSON true is no figure)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two JSON-like values differ; numbers compare exactly (MLflow stores doubles), NaN
    equal to NaN, an int equal to the same float."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(a.keys() | b.keys()) for d in differences(a.get(k), b.get(k), f"{path}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{path}[{i}]")]
    if is_number(a) and is_number(b) and (a == b or (math.isnan(a) and math.isnan(b))):
        return []
    return [] if a == b and type(a) is type(b) else [f"{path}: {a!r} vs {b!r}"]


def unlabelled(data: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if k != LABEL_KEY}


def label_differences(client: Any, run: str, data: dict[str, Any]) -> list[str]:
    """The file's registration state against its stage run's tag (both absent: equal): the label is
    written into a stage's metrics after its run logged them (tasks/design/registration.py:
    label_results), so MLflow holds only its state, as the ``spikelab.registration`` tag."""
    state = (data.get(LABEL_KEY) or {}).get("state")
    tag = client.get_run(run).data.tags.get("spikelab.registration")
    return [] if state == tag else [f"/{LABEL_KEY}/state: {state!r} vs the run's spikelab.registration tag {tag!r}"]


def without_words(finding: dict[str, Any] | None) -> dict[str, Any] | None:
    """A reported finding without its claims' ``words`` (the report's phrasing for a reader, no number)."""
    if not finding:
        return finding
    return {**finding, "claims": [{k: v for k, v in c.items() if k != "words"} for c in finding.get("claims") or []]}


def stage_artifact(client: Any, run: str, name: str) -> dict[str, Any]:
    """The stage's metrics JSON as its MLflow run stored it (an artifact)."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            return json.loads(Path(client.download_artifacts(run, name, tmp)).read_text())
        except Exception as e:  # MLflow raises its own kinds for a missing artifact
            raise Missing(f"MLflow run {run}: no artifact {name} ({type(e).__name__})") from None


def ablate_from_mlflow(project: Path, client: Any) -> tuple[dict[str, Any], list[str]]:
    """metrics/ablate.json rebuilt from MLflow: each arm's figures from its child run, the rest
    (conditions, depth probe, unigram loss) from the stage run's artifact; and where each part
    differs from the project's file."""
    ablate = read_json(project / ABLATE_METRICS)
    arms, parents, rows = [], set(), []
    for arm in ablate["arms"]:
        if not arm.get("mlflow"):
            raise Missing(f"{ABLATE_METRICS}: arm {arm['name']} links no MLflow run")
        run = client.get_run(run_id(arm["mlflow"]))
        parents.add(run.data.tags.get("mlflow.parentRunId"))
        figures = arm_figures(run, list(arm["metrics"]))
        rows += [f"arm {arm['name']}{d}" for d in differences(arm["metrics"], figures)]
        arms.append({**arm, "metrics": figures, "status": figures.get("status", "failed")})
    if len(parents) != 1 or None in parents:
        raise Missing(f"{ABLATE_METRICS}: the arms' runs are not the children of one stage run ({parents})")
    parent = parents.pop()
    stored = stage_artifact(client, parent, ABLATE_METRICS.name)
    rows += differences({**unlabelled(ablate), "arms": None}, {**unlabelled(stored), "arms": None})
    rows += label_differences(client, parent, ablate)
    return {**stored, "arms": arms}, rows


def stage_from_mlflow(cfg: Config, client: Any, stage: str, path: Path) -> tuple[dict[str, Any], str]:
    """A stage's metrics JSON from the newest finished run of ``stage`` with this project's DVC
    inputs (its ``spikelab.dvc_inputs`` tag: the same deps and params), and that run's id."""
    from tasks.runtime.tracking import dvc_inputs_digest

    digest = dvc_inputs_digest(stage, cfg)
    experiment = client.get_experiment_by_name(cfg.tracking.experiment)
    runs = (
        client.search_runs(
            [experiment.experiment_id],
            f"attributes.run_name LIKE '{stage} {cfg.profile} %' and tags.`spikelab.stage` = '{stage}' "
            f"and tags.`spikelab.dvc_inputs` = '{digest}' and attributes.status = 'FINISHED'",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        if experiment
        else []
    )
    if not runs:
        raise Missing(f"no finished {stage} stage run with DVC inputs {digest} in experiment {cfg.tracking.experiment}")
    return stage_artifact(client, runs[0].info.run_id, path.name), runs[0].info.run_id


def curve_tail_mean(client: Any, run: Any, steps: int) -> float:
    """The mean training loss of a run's last ``steps`` steps, from its logged curve (how the
    spike study computes a branch's final loss: tasks/spike/study.py)."""
    history = sorted(client.get_metric_history(run.info.run_id, "loss/train"), key=lambda m: m.step)
    return float(np.mean([m.value for m in history[-steps:]]))


def branch_differences(cfg: Config, spike: dict[str, Any], stage_run: str, client: Any) -> tuple[int, list[str]]:
    """Each branch's scores in ``spike`` against its own child run's ``summary/*`` metrics (the
    control logs only its validation loss: its final loss is recomputed from its curve)."""
    experiment = client.get_run(stage_run).info.experiment_id
    children = client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{stage_run}'", max_results=5000)
    runs = {r.data.tags.get("spikelab.branch"): r for r in children}
    rows, found = [], 0
    for seed, entry in spike["seeds"].items():
        listed = {branch_name(int(seed), None, "continue"): entry["control"]} | {
            branch_name(int(seed), cause, policy): entry[cause][policy]
            for cause in spike["causes"]
            for policy in spike["policies"]
        }
        for name, scores in listed.items():
            if name not in runs:
                rows.append(f"branch {name}: no child run")
                continue
            found += 1
            logged = summary_of(runs[name])
            if "final_loss" in scores and "final_loss" not in logged:
                logged["final_loss"] = curve_tail_mean(client, runs[name], cfg.recovery.smooth_steps)
            numeric = {k: v for k, v in scores.items() if is_number(v)}
            rows += [f"branch {name}{d}" for d in differences(numeric, {k: logged.get(k) for k in numeric})]
    return found, rows


def recompute(cfg: Config, project: Path, client: Any) -> dict[str, Any]:
    """Every stage's numbers from MLflow against the project's files, and every finding
    recomputed from them by the report's own code against metrics/report.json."""
    ablate, ablate_rows = ablate_from_mlflow(project, client)
    stages: dict[str, Any] = {"ablate": {"arms": len(ablate["arms"]), "differences": ablate_rows}}
    held: dict[str, dict[str, Any] | None] = {"search": None, "spike": None}
    for stage, path in (("search", SEARCH_METRICS), ("spike", SPIKE_METRICS)):
        if not (project / path).is_file():
            continue
        held[stage], run = stage_from_mlflow(cfg, client, stage, path)
        own = read_json(project / path)
        rows = differences(unlabelled(own), unlabelled(held[stage])) + label_differences(client, run, own)
        stages[stage] = {"stage_run": run, "differences": rows}
    if held["spike"] is not None:
        found, rows = branch_differences(cfg, held["spike"], stages["spike"]["stage_run"], client)
        stages["spike"] |= {"branches": found}
        stages["spike"]["differences"] += rows
    reported = read_json(project / REPORT_METRICS)["findings"]
    evaluated = evaluate(cfg, ablate, held["search"], held["spike"], ablate.get("unigram_val_loss"))
    sensitivity = project / SENSITIVITY_METRICS  # its perturbed arms are read from the file, not MLflow
    mark_fragile(evaluated, cfg, read_json(sensitivity) if sensitivity.is_file() else None)
    findings = {}
    for finding in evaluated:
        recomputed = json.loads(json.dumps(finding.to_json()))
        findings[finding.key] = {
            "verdict": finding.verdict,
            "differences": differences(without_words(reported.get(finding.key)), recomputed),
        }
    return {"stages": stages, "findings": findings}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spikelab check mlflow",
        description="Read the study's numbers back from its MLflow runs (each arm's child run, the stage\n"
        "runs' artifacts), compare each with the project's metrics/*.json, then recompute every finding\n"
        "by the report's own code from the MLflow numbers alone and compare it with metrics/report.json.\n"
        "Needs the project's MLflow server (`spikelab services up`); exits 1 when a number differs,\n"
        "2 when a run or an input is missing.",
        epilog="examples:\n"
        "  spikelab check mlflow                                   after make repro\n"
        "  spikelab check mlflow --profile smoke --out checks/out/recompute-smoke.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--project", type=Path, default=ROOT, help="the project whose study is recomputed")
    p.add_argument("--profile", default="default", help="the profile the stages ran (default: %(default)s)")
    p.add_argument("--set", dest="sets", action="append", default=[], help="KEY=VALUE, as the stages ran")
    p.add_argument("--out", type=Path, default=ROOT / "checks/out/recompute.json", help="every comparison, as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    project = args.project.resolve()
    os.chdir(project)  # the DVC inputs digest and the servers are the project's, as its stages saw them
    try:
        cfg = load_config(project / "params.yaml", args.profile, parse_sets(args.sets))
    except ConfigError as e:
        print(f"recompute_mlflow: {e}", file=sys.stderr)
        return 2
    for path in (ABLATE_METRICS, REPORT_METRICS):
        if not (project / path).is_file():
            print(f"recompute_mlflow: {project / path}: missing; run the pipeline first", file=sys.stderr)
            return 2
    import mlflow

    from tasks.runtime.services import configure_environment

    configure_environment()
    client = mlflow.MlflowClient()
    try:
        result = recompute(cfg, project, client)
    except Missing as e:
        print(f"recompute_mlflow: {e}", file=sys.stderr)
        return 2
    for key, row in result["findings"].items():
        print(f"{key:12s} {row['verdict']:13s} {'equal' if not row['differences'] else 'DIFFERS'}")
        for d in row["differences"][:5]:
            print(f"  {d}")
    for stage, row in result["stages"].items():
        count = f"{row['arms']} arms" if "arms" in row else f"run {row['stage_run']}"
        branches = f", {row['branches']} branches" if "branches" in row else ""
        print(f"{stage}: {count}{branches}, {len(row['differences'])} numbers differ from the project's file")
        for d in row["differences"][:10]:
            print(f"  {d}")
    result["equal"] = not any(r["differences"] for part in ("stages", "findings") for r in result[part].values())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{'every number equal' if result['equal'] else 'numbers DIFFER'} ({args.out})")
    return 0 if result["equal"] else 1


if __name__ == "__main__":
    sys.exit(run_private(main))
