"""The ``params`` stage validates the whole config first and writes the values every stage runs
with; dvc.yaml makes every other stage read its keys from that file, so a bad value stops
``dvc repro`` before any output is deleted and ``dvc params diff`` shows the values that ran."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from params_kit import dvc_set
from ruamel.yaml import YAML

from tasks.config import load_config
from tasks.params import RESOLVED

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
PIPELINE = yaml.safe_load((REPO / "dvc.yaml").read_text(encoding="utf-8"))["stages"]
LATER_STAGES = [name for name in PIPELINE if name != "params"]


def project(tmp_path: Path, *extra: str) -> Path:
    """The project's params, profiles and the stage's code in ``tmp_path`` (plus ``extra`` paths)."""
    for name in ("model", "tasks", "profiles", "params.yaml", *extra):
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, tmp_path / name)
    return tmp_path


def run_stage(project: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tasks.params"],
        cwd=project,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(project)},
    )


# --------------------------------------------------------------------------------------------
# The stage
# --------------------------------------------------------------------------------------------


def test_the_stage_writes_the_config_the_stages_load_in_a_form_dvc_reads_back(tmp_path):
    root = project(tmp_path)
    dvc_set(root / "params.yaml", profile="smoke", **{"train.steps": 100, "optim.eps": "1e-9"})
    done = run_stage(root)
    assert done.returncode == 0, done.stderr
    written = YAML(typ="safe").load((root / RESOLVED).read_text(encoding="utf-8"))  # DVC's parser
    assert written == dataclasses.asdict(load_config(root / "params.yaml"))
    assert written["train"]["steps"] == 100 and written["model"]["d_model"] == 32
    assert written["optim"]["eps"] == 1e-9


def test_under_a_profile_the_stage_names_the_keys_the_profile_set(tmp_path):
    root = project(tmp_path)
    dvc_set(root / "params.yaml", profile="smoke")
    done = run_stage(root)
    assert "spikelab: profile 'smoke' set" in done.stderr and "train.steps=30" in done.stderr


@pytest.mark.parametrize(
    ("dotted", "key"), [({"optim.eps": 1e-50}, "optim.eps"), ({"train.device": "cuda"}, "train.device")]
)
def test_a_bad_value_exits_2_naming_the_key_and_keeps_the_previous_resolved_file(tmp_path, dotted, key):
    if key == "train.device":
        import torch

        if torch.cuda.is_available():
            pytest.skip("CUDA is available here")
    root = project(tmp_path)
    assert run_stage(root).returncode == 0
    before = (root / RESOLVED).read_bytes()
    dvc_set(root / "params.yaml", **dotted)
    done = run_stage(root)
    assert done.returncode == 2
    assert done.stderr.startswith(f"spikelab: error: {key}:")
    assert (root / RESOLVED).read_bytes() == before
    assert [p.name for p in (root / RESOLVED).parent.iterdir()] == [RESOLVED.name]  # no temp files


def test_a_bad_declaration_in_studies_yaml_exits_2_naming_its_key_and_keeps_the_resolved_file(tmp_path):
    root = project(tmp_path, "studies.yaml")
    assert run_stage(root).returncode == 0
    before = (root / RESOLVED).read_bytes()
    bad = "families:\n  mine:\n    question: q?\n    factors: {optim: {lrr: [0.1]}}\n    claims: {}\n"
    (root / "studies.yaml").write_text(bad)
    done = run_stage(root)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("spikelab: error: studies.yaml: families.mine.factors.optim.lrr: unknown config key")
    assert (root / RESOLVED).read_bytes() == before


# --------------------------------------------------------------------------------------------
# The pipeline around it
# --------------------------------------------------------------------------------------------


def test_the_params_stage_depends_on_every_config_file_and_keeps_its_output_when_it_fails():
    stage = PIPELINE["params"]
    assert {"params.yaml", "profiles/", "studies.yaml", "model/config.py", "tasks/params.py"} <= set(stage["deps"])
    (out,) = stage["outs"]
    assert out == {str(RESOLVED): {"cache": False, "persist": True}}


STUDY_READERS = {"ablate", "report"}
"""The stages that also read studies.yaml whole: the declared families, which no config key holds."""


@pytest.mark.parametrize("stage", LATER_STAGES)
def test_every_later_stage_reads_its_params_only_from_the_resolved_file(stage):
    declared = PIPELINE[stage]["params"]
    studies = [{"studies.yaml": None}] if stage in STUDY_READERS else []
    assert [next(iter(entry)) for entry in declared] == [str(RESOLVED)] + [next(iter(e)) for e in studies]
    assert declared[1:] == studies  # the whole file: every declared key
    assert not {"params.yaml", "profiles/", "profiles"} & set(PIPELINE[stage]["deps"])
    flat = load_config(REPO / "params.yaml").to_flat_dict()
    for key in declared[0][str(RESOLVED)]:
        assert key in flat or any(k.startswith(f"{key}.") for k in flat), f"{stage}: no key {key}"


def test_the_committed_resolved_file_is_the_shipped_config():
    written = yaml.safe_load((REPO / RESOLVED).read_text(encoding="utf-8"))
    assert written == dataclasses.asdict(load_config(REPO / "params.yaml")), "stale: run `dvc repro params`"


STUB = textwrap.dedent("""\
    # Stands in for a stage's flow: writes each output path given, stamped with the stage name.
    import pathlib, sys
    stage, *outs = sys.argv[1:]
    for out in map(pathlib.Path, outs):
        target = out if out.suffix else out / "part"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(stage)
    with open("ran.log", "a") as log:
        log.write(stage + "\\n")
    """)


def stub_pipeline(root: Path) -> None:
    """The real dvc.yaml with every later stage's command replaced by STUB writing its outputs."""
    dvc_yaml = yaml.safe_load((REPO / "dvc.yaml").read_text(encoding="utf-8"))
    for name in LATER_STAGES:
        stage = dvc_yaml["stages"][name]
        outs = [
            next(iter(e)) if isinstance(e, dict) else e
            for kind in ("outs", "metrics", "plots")
            for e in stage.get(kind, [])
        ]
        stage["cmd"] = f"python stub.py {name} {' '.join(outs)}"
    (root / "dvc.yaml").write_text(yaml.safe_dump(dvc_yaml, sort_keys=False), encoding="utf-8")
    (root / "stub.py").write_text(STUB, encoding="utf-8")


def dvc(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(root)}
    return subprocess.run(["dvc", *args], cwd=root, capture_output=True, text=True, env=env, timeout=120)


def repro(root: Path) -> list[str]:
    """Run ``dvc repro``; return the later stages that ran, in order."""
    (root / "ran.log").unlink(missing_ok=True)
    done = dvc(root, "repro")
    assert done.returncode == 0, done.stdout + done.stderr
    return (root / "ran.log").read_text().split() if (root / "ran.log").exists() else []


@pytest.mark.e2e
def test_dvc_repro_shows_resolved_values_reruns_only_readers_and_stops_at_a_bad_value(tmp_path):
    root = project(tmp_path, "flows", "studies.yaml")
    stub_pipeline(root)
    dvc_set(root / "params.yaml", profile="smoke")
    for args in (["init", "-q"], ["config", "user.email", "t@t"], ["config", "user.name", "t"]):
        subprocess.run(["git", *args], cwd=root, check=True)
    assert dvc(root, "init", "-q").returncode == 0
    assert repro(root) == LATER_STAGES
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    subprocess.run(["git", "commit", "-qm", "smoke"], cwd=root, check=True)

    # An explicit value under a profile: only the stages that read it rerun, and DVC shows
    # the value it ran with (the profile alone would have run 30 steps).
    dvc_set(root / "params.yaml", **{"train.steps": 100})
    assert repro(root) == ["pretrain"]  # the spike stage's origin runs have their own train.steps
    diff = json.loads(dvc(root, "params", "diff", "--json").stdout)
    assert diff[str(RESOLVED)]["train.steps"] == {"old": 30, "new": 100, "diff": 70}

    # A bad value fails in the params stage: no later stage ran, nothing was deleted.
    outputs = {
        p: p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and p.parts[len(root.parts)] in {"data", "models", "metrics", "plots", "runs", "params"}
    }
    dvc_set(root / "params.yaml", **{"optim.eps": 1e-50})
    (root / "ran.log").unlink()
    done = dvc(root, "repro")
    assert done.returncode != 0 and "spikelab: error: optim.eps:" in done.stdout + done.stderr
    assert not (root / "ran.log").exists()
    assert {p: p.read_bytes() for p in outputs if p.is_file()} == outputs
