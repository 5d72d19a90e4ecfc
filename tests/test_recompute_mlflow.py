"""checks/recompute_mlflow.py's rules, apart from the servers (its run against a real MLflow
server is in tests/test_pipeline.py): how a run link names its run, how an arm's figures are read
off its run, and when two numbers count as different."""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from checks.recompute_mlflow import arm_figures, differences, main, run_id  # noqa: E402


def a_run(status: str, metrics: dict[str, float], precision: str = "fp32") -> SimpleNamespace:
    """What MlflowClient.get_run returns, as far as arm_figures reads it."""
    return SimpleNamespace(
        info=SimpleNamespace(status=status),
        data=SimpleNamespace(metrics=metrics, tags={"spikelab.numerics.precision": precision}),
    )


def test_a_run_is_named_by_a_ui_link_or_a_runs_uri():
    link = "http://127.0.0.1:5000/#/experiments/1/runs/31f44c43603c4d3286e8d7108d18f34d?workflowType=machine_learning"
    assert run_id(link) == "31f44c43603c4d3286e8d7108d18f34d"
    assert run_id("http://h/#/experiments/1/runs/abc/artifacts/figures/loss.png") == "abc"
    assert run_id("runs:/abc") == "abc"


def test_a_finished_arm_is_completed_and_a_figure_it_did_not_log_is_none():
    run = a_run("FINISHED", {"summary/val_loss": 4.5, "summary/natural_spikes": 1.0, "loss/train": 4.4})
    figures = arm_figures(run, ["val_loss", "grad_underflow_share", "natural_spikes"])
    assert figures == {
        "val_loss": 4.5,
        "grad_underflow_share": None,
        "natural_spikes": 1.0,
        "status": "completed",
        "diverged": False,
        "precision_path": "fp32",
    }


def test_a_failed_arm_with_a_divergence_step_diverged_and_one_without_has_no_result():
    diverged = arm_figures(a_run("FAILED", {"summary/diverged_at": 219.0}), ["val_loss"])
    assert (diverged["status"], diverged["diverged"], diverged["val_loss"]) == ("diverged", True, None)
    assert arm_figures(a_run("FAILED", {}), ["val_loss"]) == {}  # crashed: the stage stored no figures


def test_numbers_equal_exactly_across_int_and_float_and_nan_equals_nan():
    assert differences({"n": 1, "x": 0.1, "y": math.nan}, {"n": 1.0, "x": 0.1, "y": math.nan}) == []
    assert differences({"x": 0.1}, {"x": math.nextafter(0.1, 1)}) == [f"/x: 0.1 vs {math.nextafter(0.1, 1)!r}"]


def test_a_difference_is_named_by_its_path_and_a_type_change_counts():
    a = {"arms": [{"m": {"val_loss": 4.0, "status": "completed"}}], "ok": True}
    b = {"arms": [{"m": {"val_loss": 4.0, "status": "diverged"}}], "ok": 1}
    assert differences(a, b) == ["/arms[0]/m/status: 'completed' vs 'diverged'", "/ok: True vs 1"]


def test_a_missing_key_or_a_shorter_list_is_a_difference():
    assert differences({"a": 1.0}, {}) == ["/a: 1.0 vs None"]
    assert differences([1, 2], [1]) == [": 2 items vs 1"]
    assert differences({"a": None}, {}) == []  # not logged: None on both sides


def test_a_project_without_the_studys_outputs_exits_2_naming_the_file(tmp_path, monkeypatch, capsys):
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    shutil.copytree(REPO / "profiles", tmp_path / "profiles")
    monkeypatch.chdir(tmp_path)  # main moves into the project; put the working directory back after
    assert main(["--project", str(tmp_path), "--out", str(tmp_path / "out.json")]) == 2
    assert f"{tmp_path / 'metrics/ablate.json'}: missing" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()
