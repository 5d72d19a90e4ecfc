"""A stage run before its inputs exist (a fresh clone, before ``dvc repro``) is refused in one line
that names what is missing, the stage that makes it and the command that runs that stage, exit 2,
before any server or engine starts: the inputs are the stage's dvc.yaml deps that other stages make."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from flows.stages import STAGES, inputs, require_inputs
from model.typed_config import UserError
from tests.smoke_study import REPO, VENV_BIN, copy_project

FED = [name for name in STAGES if inputs(REPO, name)]
"""The stages that read another stage's outputs (all but the first)."""


def test_only_the_first_stage_reads_nothing_another_stage_makes():
    assert [name for name in STAGES if name not in FED] == [next(iter(STAGES))]


def test_an_input_inside_another_stages_output_folder_names_that_stage(tmp_path):
    (tmp_path / "dvc.yaml").write_text(
        "stages:\n  ablate:\n    deps:\n      - flows/ablate.py\n      - data/tokens/manifest.json\n"
    )
    assert inputs(tmp_path, "ablate") == {Path("data/tokens/manifest.json"): "tokenize"}


def test_a_stage_whose_inputs_exist_is_not_refused(tmp_path):
    (tmp_path / "dvc.yaml").write_text((REPO / "dvc.yaml").read_text())
    for dep in inputs(tmp_path, "ablate"):
        (tmp_path / dep).mkdir(parents=True)
    require_inputs(tmp_path, "ablate")
    (tmp_path / "data/tokens").rmdir()
    with pytest.raises(
        UserError, match=r"^ablate needs data/tokens, which the tokenize stage makes: run `dvc repro tokenize`"
    ):
        require_inputs(tmp_path, "ablate")


@pytest.mark.parametrize("stage", FED)
def test_a_stage_run_before_its_inputs_exist_names_them_and_their_stage_in_one_line_and_starts_no_server(
    tmp_path, stage
):
    project = copy_project(tmp_path / "project")
    state = tmp_path / "state"
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", "SPIKELAB_STATE": str(state)}
    done = subprocess.run(["spikelab", "run", stage], cwd=project, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"spikelab: error: {stage} needs "), line
    makers = []
    for dep, maker in inputs(project, stage).items():
        assert not (project / dep).exists()
        assert str(dep) in line and f"which the {maker} stage makes" in line, (dep, line)
        makers.append(maker)
    assert f"run `dvc repro {' '.join(dict.fromkeys(m for m in STAGES if m in makers))}`" in line
    started = sorted(p.name for p in state.iterdir()) if state.exists() else []
    assert "prefect" not in started and "mlflow.db" not in started and "mlartifacts" not in started, started
