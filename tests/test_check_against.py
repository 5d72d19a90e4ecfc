"""checks/arithmetic.py --against: a whole study finished elsewhere (``make repro`` on
another CPU) compared verdict by verdict with this one, rerunning nothing; on the committed
study's own metrics, so no stage runs here."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from checks.arithmetic import main  # noqa: E402


def finished_study(dest: Path, metrics: bool = True) -> Path:
    """The committed study's params and profiles, and (with ``metrics``) its stages' metrics in
    ``dest``."""
    dest.mkdir(parents=True)
    shutil.copytree(REPO / "profiles", dest / "profiles")
    shutil.copy(REPO / "params.yaml", dest / "params.yaml")
    if metrics:
        shutil.copytree(REPO / "metrics", dest / "metrics")
    return dest


def check(here: Path, there: Path, out: Path) -> int:
    return main(["--project", str(here), "--against", str(there), "--out", str(out)])


def test_a_study_against_its_copy_agrees_on_every_verdict_and_names_the_cpu_of_each_side(tmp_path, capsys):
    out = tmp_path / "against.json"
    assert check(finished_study(tmp_path / "here"), finished_study(tmp_path / "there"), out) == 0
    result = json.loads(out.read_text())
    committed = json.loads((REPO / "metrics/report.json").read_text())["findings"]
    assert all(r["agree"] for r in result["findings"].values()) and set(result["findings"]) == set(committed)
    assert {k: r["first"] for k, r in result["findings"].items()} == {k: f["verdict"] for k, f in committed.items()}
    cpu = json.loads((REPO / "metrics/ablate.json").read_text())["provenance"]["cpu"]
    assert result["cpu"] == [f"{cpu['name']} {cpu['family']}/{cpu['model']}"] * 2
    assert "verdicts all agree" in capsys.readouterr().out


def test_a_study_whose_beta2_arms_never_left_the_plateau_differs_on_beta2_alone_and_exits_1(tmp_path, capsys):
    there = finished_study(tmp_path / "there")
    ablate = json.loads((there / "metrics/ablate.json").read_text())
    for arm in ablate["arms"]:
        if arm["family"] == "beta2" and arm.get("metrics"):
            # on the unigram plateau there, so the finding's precondition fails: beta2 is not tested
            arm["metrics"] |= {"val_loss": 10.0, "capped_loss": 10.0}
    (there / "metrics/ablate.json").write_text(json.dumps(ablate))
    out = tmp_path / "against.json"
    assert check(finished_study(tmp_path / "here"), there, out) == 1
    rows = json.loads(out.read_text())["findings"]
    assert rows["beta2"]["second"] == "not tested" != rows["beta2"]["first"]
    assert [k for k, r in rows.items() if not r["agree"]] == ["beta2"]
    differ = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.endswith(" DIFFER")]
    assert differ == ["beta2"]


def test_a_folder_without_a_finished_study_exits_2_naming_the_file_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "against.json"
    there = finished_study(tmp_path / "there", metrics=False)
    assert check(finished_study(tmp_path / "here"), there, out) == 2
    assert str(there / "metrics/ablate.json") in capsys.readouterr().err
    assert not out.exists()
