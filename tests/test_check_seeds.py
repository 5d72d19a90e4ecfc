"""The held-out seeds of checks/arithmetic.py (--seeds-from): renumbered past the study's
own, each kind's count kept, and refused before anything runs where one is a study or sizing seed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from model.typed_config import ConfigError
from tasks.config import load_config
from tests.test_arithmetic_check import study_project

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from checks.arithmetic import main, unseen_seed_sets  # noqa: E402


def test_unseen_seeds_start_just_past_the_studys_and_keep_each_kinds_count():
    cfg = load_config(REPO / "params.yaml", "default")  # every stage's seeds from 28: to 39, 35 or 31
    assert unseen_seed_sets(cfg, ["ablate", "search", "spike"], 40) == [
        "ablation.seeds=[40, 41, 42, 43]",
        "ablation.confirm_seeds=[44, 45, 46, 47, 48, 49, 50, 51]",
        "search.seeds=[40, 41]",
        "search.confirm_seeds=[42, 43]",
        "spike.seeds=[40, 41, 42, 43]",
        "spike.confirm_seeds=[44, 45, 46, 47]",
    ]


def test_a_start_that_renumbers_onto_a_study_seed_is_refused():
    cfg = load_config(REPO / "params.yaml", "default")
    with pytest.raises(ConfigError, match=r"--seeds-from 39: \[39\] are ablation\.seeds or ablation\.confirm_seeds"):
        unseen_seed_sets(cfg, ["ablate"], 39)
    assert unseen_seed_sets(cfg, ["search"], 32)[0] == "search.seeds=[32, 33]"  # search's seeds end at 31


def test_the_check_refuses_sizing_seeds_as_unseen_ones_before_running_anything(tmp_path, capsys):
    project = study_project(tmp_path / "project")
    work = tmp_path / "work"
    argv = ["--project", str(project), "--stages", "ablate", "--seeds-from", "100", "--work", str(work)]
    assert main(argv) == 2
    assert "ablation.sizing_seeds: [100, 101, 102, 103] are study seeds" in capsys.readouterr().err
    assert not work.exists()
