"""The arithmetic-robustness check (checks/arithmetic.py) at smoke scale, as a user runs
it: the ablate stage on a tiny project under the native and the portable numeric path, against the
test servers, and every finding's verdict compared; its JSON names both paths and each verdict. And
the cross-machine path: arms trained apart (checks/arms_elsewhere.py), lent to a copy whose
ablate stage decides on them without training one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.test_search import tiny_project

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]


def study_project(path: Path) -> Path:
    """A tiny project with the repository's params and profiles."""
    project = tiny_project(path)
    manifest = project / "data" / "tokens" / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "eot_id": 0}))
    shutil.copy(REPO / "params.yaml", project / "params.yaml")
    shutil.copytree(REPO / "profiles", project / "profiles")
    return project


def with_this_python(env: dict[str, str]) -> dict[str, str]:
    """``env`` with this interpreter's folder first on PATH (the scripts call ``spikelab``)."""
    return {**env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"}


@dataclass
class Check:
    """One run of the check: its folder (``work/native`` is the first side it reran), its
    completed process and its JSON."""

    path: Path
    done: subprocess.CompletedProcess
    result: dict[str, Any]

    @property
    def first_side(self) -> Path:
        """The rerun first side: a finished smoke ablate stage, with its arms, on the native path."""
        return self.path / "work" / "native"


@pytest.fixture(scope="module")
def other_arithmetic(live_services, tmp_path_factory) -> Check:
    """The check with ``--rerun-first`` under the other numeric path, run once: its first side is
    also the finished study the unseen-seeds and arms-elsewhere checks start from."""
    path = tmp_path_factory.mktemp("arithmetic")
    project = study_project(path / "project")
    # The smoke profile's whole grid (every family, a discovery and a confirmation seed), so each
    # finding's verdict is computed; two workers a side.
    out = path / "arithmetic.json"
    done = check(
        live_services, project, "--stages", "ablate", "--rerun-first", "--work", str(path / "work"), "--out", str(out)
    )
    assert done.returncode in (0, 1), done.stdout + done.stderr
    return Check(path, done, json.loads(out.read_text()))


def check(
    env: dict[str, str], project: Path, *options: str, study: str = "arithmetic-test"
) -> subprocess.CompletedProcess:
    """``checks/arithmetic.py`` on ``project`` at the smoke profile, two workers a side, its stages
    logging to ``<study>-check``."""
    command = [sys.executable, str(REPO / "checks/arithmetic.py"), "--project", str(project), "--profile", "smoke"]
    command += [*options, "--set=ablation.workers=2", f"--set=tracking.experiment={study}"]
    return subprocess.run(command, env=with_this_python(env), capture_output=True, text=True, timeout=900)


def test_the_verdicts_are_recomputed_under_the_other_arithmetic_and_compared(live_services, other_arithmetic):
    done, result, work = other_arithmetic.done, other_arithmetic.result, other_arithmetic.path / "work"
    assert result["numerics"] == ["native", "portable"] and result["stages"] == ["ablate"]
    assert set(result["findings"]) >= {"xiong", "beta2", "wortsman", "fp16", "overflow"}
    assert result["agree"] == all(row["agree"] for row in result["findings"].values())
    assert (done.returncode == 0) == result["agree"]
    for side in ("portable", "native"):
        arms = json.loads((work / side / "metrics" / "ablate.json").read_text())["arms"]
        paths = {a["numeric_path"] for a in arms if a.get("numeric_path")}
        assert len(paths) == 1, f"{side}: every arm on one numeric path"
    first, second = (
        json.loads((work / side / "metrics" / "ablate.json").read_text())["provenance"]["env"]
        for side in ("portable", "native")
    )
    assert first != second, "the two sides ran on different library settings"
    assert_logged_apart(live_services, study="arithmetic-test", runs=2)


def assert_logged_apart(env: dict[str, str], study: str, runs: int) -> None:
    """The check's stage runs are in ``<study>-check`` (``runs`` ablate stage runs), none in the
    study's own experiment."""
    import mlflow

    client = mlflow.MlflowClient(env["MLFLOW_TRACKING_URI"])
    check = client.get_experiment_by_name(f"{study}-check")
    assert check is not None, f"no MLflow experiment {study}-check"
    stage_runs = [
        r
        for r in client.search_runs([check.experiment_id], "attributes.run_name LIKE 'ablate %'")
        if "mlflow.parentRunId" not in r.data.tags  # an arm's run is a child named "ablate <arm>"
    ]
    assert len(stage_runs) == runs, [r.info.run_name for r in stage_runs]
    own = client.get_experiment_by_name(study)
    assert own is None or not client.search_runs([own.experiment_id]), (
        f"a check's run in the study's experiment {study}"
    )


def test_arms_trained_elsewhere_decide_the_copys_findings_and_none_is_trained_again(
    live_services, other_arithmetic, tmp_path
):
    env = with_this_python(live_services)
    elsewhere = [sys.executable, str(REPO / "checks/arms_elsewhere.py")]
    plan, results = tmp_path / "plan.json", tmp_path / "arms.jsonl.gz"
    run = {"env": env, "capture_output": True, "text": True, "timeout": 900}
    unfinished = study_project(tmp_path / "unfinished")  # no study of its own to compare with
    options = ["--arms-from", str(results), "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out.json")]
    refused = check(live_services, unfinished, *options, study="elsewhere-test")
    assert refused.returncode == 2 and "metrics/ablate.json: missing" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "out.json").exists()

    project = other_arithmetic.first_side  # a finished smoke study
    done = subprocess.run(
        [*elsewhere, "plan", "--project", str(project), "--profile", "smoke", "--out", str(plan)], **run
    )
    assert done.returncode == 0, done.stderr
    arms = json.loads(plan.read_text())
    train = [*elsewhere, "train", str(plan), "--project", str(project), "--out", str(results), "--workers", "2"]
    done = subprocess.run(train, **run)
    assert done.returncode == 0, done.stdout + done.stderr
    done = check(live_services, project, *options, study="elsewhere-test")
    assert done.returncode in (0, 1), done.stdout + done.stderr
    assert f"{len(arms)} arms' results lent" in done.stdout
    metrics = json.loads((tmp_path / "work" / "elsewhere" / "metrics" / "ablate.json").read_text())
    assert all(arm["cached"] for arm in metrics["arms"]), "an arm lent from elsewhere was trained again"
    lent = json.loads((tmp_path / "out.json").read_text())["lent_arms"]
    # Trained apart on this very CPU and numeric path, each arm is the study's own, bit for bit.
    assert lent["lent"] == lent["bitwise_equal"] == len(arms) and lent["status_differs"] == 0, lent


def test_the_verdicts_are_recomputed_on_unseen_seeds_and_compared(live_services, other_arithmetic, tmp_path):
    project = other_arithmetic.first_side  # a finished smoke study on seeds 0 and 1
    out, work = tmp_path / "seeds.json", tmp_path / "work"
    options = ["--stages", "ablate", "--seeds-from", "2", "--work", str(work), "--out", str(out)]
    done = check(live_services, project, *options, study="seeds-test")
    assert done.returncode in (0, 1), done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["seeds"] == {"first": {"ablation": [0, 1]}, "second": {"ablation": [2, 3]}}
    assert result["numerics"] == ["native", "native"]
    assert (done.returncode == 0) == result["agree"]
    trained = json.loads((work / "seeds-from-2" / "metrics" / "ablate.json").read_text())["arms"]
    assert {a["seed"] for a in trained} == {2, 3}, "the second side trained only the unseen seeds"
