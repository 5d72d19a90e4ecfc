"""The arithmetic-robustness check (benchmarks/check_arithmetic.py) at smoke scale, as a user runs
it: the ablate stage on a tiny project under the portable and the native numeric path, against the
test servers, and every finding's verdict compared; its JSON names both paths and each verdict."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_search import tiny_project

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]


def test_the_verdicts_are_recomputed_under_the_other_arithmetic_and_compared(live_services, tmp_path):
    project = tiny_project(tmp_path / "project")
    manifest = project / "data" / "tokens" / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "eot_id": 0}))
    shutil.copy(REPO / "params.yaml", project / "params.yaml")
    shutil.copytree(REPO / "profiles", project / "profiles")
    # The smoke profile's whole grid (every family, a discovery and a confirmation seed), so each
    # finding's verdict is computed; two workers a side.
    sets = ["--set=ablation.workers=2", "--set=tracking.experiment=arithmetic-test"]
    out = tmp_path / "arithmetic.json"
    env = {**live_services, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{live_services['PATH']}"}
    command = [sys.executable, str(REPO / "benchmarks/check_arithmetic.py"), "--project", str(project)]
    command += ["--profile", "smoke", "--stages", "ablate", "--rerun-first", "--work", str(tmp_path / "work")]
    done = subprocess.run([*command, "--out", str(out), *sets], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode in (0, 1), done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["numerics"] == ["portable", "native"] and result["stages"] == ["ablate"]
    assert set(result["findings"]) >= {"xiong", "beta2", "wortsman", "fp16", "overflow"}
    assert result["agree"] == all(row["agree"] for row in result["findings"].values())
    assert (done.returncode == 0) == result["agree"]
    for side in ("portable", "native"):
        arms = json.loads((tmp_path / "work" / side / "metrics" / "ablate.json").read_text())["arms"]
        paths = {a["numeric_path"] for a in arms if a.get("numeric_path")}
        assert len(paths) == 1, f"{side}: every arm on one numeric path"
    first, second = (
        json.loads((tmp_path / "work" / side / "metrics" / "ablate.json").read_text())["provenance"]["env"]
        for side in ("portable", "native")
    )
    assert first != second, "the two sides ran on different library settings"
