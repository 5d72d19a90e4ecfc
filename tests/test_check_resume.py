"""checks/arithmetic.py --resume: a cut-short check's copy is rebuilt from the project, but
the arms it already trained stay where the ablate stage looks for them; without --resume nothing of
the old copy survives."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from checks.arithmetic import copy_project  # noqa: E402
from tasks.runtime.outputs import ABLATE_ARMS  # noqa: E402


def a_cut_short_copy(tmp_path: Path) -> tuple[Path, Path]:
    project = tmp_path / "project"
    (project / "data" / "tokens").mkdir(parents=True)
    (project / "params.yaml").write_text("new: params\n")
    copy = tmp_path / "work" / "portable"
    (copy / ABLATE_ARMS / "k1").mkdir(parents=True)
    (copy / ABLATE_ARMS / "k1" / "result.json").write_text('{"key": "k1"}')
    (copy / "params.yaml").write_text("old: params\n")
    (copy / "metrics").mkdir()
    (copy / "metrics" / "ablation.json").write_text("{}")
    return project, copy


def test_resume_keeps_the_trained_arms_and_replaces_everything_else(tmp_path):
    project, copy = a_cut_short_copy(tmp_path)
    copy_project(project, copy, resume=True)
    assert (copy / ABLATE_ARMS / "k1" / "result.json").read_text() == '{"key": "k1"}'
    assert (copy / "params.yaml").read_text() == "new: params\n"
    assert not (copy / "metrics").exists()  # the old decision is not kept
    assert sorted(p.name for p in copy.parent.iterdir()) == ["portable"]  # no parking folder left


def test_without_resume_the_old_copy_and_its_arms_are_gone(tmp_path):
    project, copy = a_cut_short_copy(tmp_path)
    copy_project(project, copy)
    assert not (copy / ABLATE_ARMS).exists()
    assert (copy / "params.yaml").read_text() == "new: params\n"


def test_resume_on_a_first_run_makes_a_plain_copy(tmp_path):
    project, copy = a_cut_short_copy(tmp_path)
    fresh = copy_project(project, tmp_path / "work" / "native", resume=True)
    assert (fresh / "params.yaml").is_file() and not (fresh / ABLATE_ARMS).exists()
