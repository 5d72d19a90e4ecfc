"""Outputs in step with code: `dvc status` on this checkout (real DVC, read-only) finds no stage
whose committed outputs are older than its code or params, except the reruns the ledger owes
(stale_outputs.yaml), and every rerun the ledger owes is still owed.

DVC writes only its lock files under .dvc/tmp (git-ignored, made here under umask 077) and its
state under the site cache dir, sent to this test's private folder (else /var/tmp/dvc, 0777)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from model.typed_config import UserError
from tasks.runtime.staleness import LEDGER, committed_outs, dvc_stages, read_ledger, stale_stages

REPO = Path(__file__).resolve().parents[1]
OUTS = {"tokenize": ["data/tokens"], "ablate": ["runs/ablate/arms", "metrics/ablate.json"], "prepare": ["data/raw"]}
"""A pipeline in small: a data stage git holds nothing of, a stage that reads its output."""
COMMITTED = {"metrics/ablate.json"}


def git_status() -> str:
    return subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout


@pytest.fixture(scope="module")
def dvc_status(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """`dvc status --json` of this checkout, with the checkout's git status before and after."""
    site = tmp_path_factory.mktemp("dvc-site")
    env = {**os.environ, "DVC_SITE_CACHE_DIR": str(site), "DVC_NO_ANALYTICS": "1"}
    before = git_status()
    done = subprocess.run(
        [sys.executable, "-m", "dvc", "status", "--json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        umask=0o077,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr
    return {"status": json.loads(done.stdout), "before": before, "after": git_status(), "site": site}


@pytest.fixture(scope="module")
def stale(dvc_status: dict[str, Any]) -> dict[str, list[str]]:
    outs = dvc_stages(REPO)
    return stale_stages(dvc_status["status"], outs, committed_outs(REPO, outs))


def test_every_stage_whose_committed_outputs_are_older_than_its_code_is_owed_a_rerun(
    stale: dict[str, list[str]],
) -> None:
    owed = read_ledger(REPO)
    unowed = {stage: changed for stage, changed in stale.items() if stage not in owed}
    assert not unowed, (
        f"committed outputs older than their code, owed no rerun in {LEDGER}: {unowed}; rerun the stage "
        f"(dvc repro <stage>) and commit its outputs, or add it to {LEDGER} with its reason and rerun"
    )


def test_every_rerun_the_ledger_owes_is_still_owed(stale: dict[str, list[str]]) -> None:
    in_step = sorted(set(read_ledger(REPO)) - set(stale))
    assert not in_step, f"{LEDGER} owes a rerun to stages in step with their code: {in_step}; remove them"


def test_dvc_status_leaves_the_checkout_as_it_was_and_its_state_in_a_private_folder(
    dvc_status: dict[str, Any],
) -> None:
    assert dvc_status["after"] == dvc_status["before"]
    assert any(dvc_status["site"].iterdir())  # DVC's state went to the folder it was given


def test_a_changed_code_dep_or_command_makes_a_stage_git_holds_outputs_of_stale() -> None:
    status = {
        "ablate": [{"changed deps": {"flows/ablate.py": "modified", "data/tokens": "deleted"}}],
        "tokenize": ["changed command"],
    }
    assert stale_stages(status, OUTS, COMMITTED | {"data/tokens"}) == {
        "ablate": ["flows/ablate.py"],
        "tokenize": ["cmd"],
    }


def test_a_changed_param_the_stage_reads_is_staleness() -> None:
    status = {"ablate": [{"changed deps": {"params/resolved.yaml": {"ablation.lr": "modified"}}}]}
    assert stale_stages(status, OUTS, COMMITTED) == {"ablate": ["params/resolved.yaml:ablation.lr"]}


def test_what_a_fresh_clone_lacks_is_not_staleness() -> None:
    """An upstream output absent (not pulled, not made), an output absent from DVC's cache."""
    status = {
        "ablate": [
            {"changed deps": {"data/tokens": "deleted", "data/tokens/train.bin": "modified"}},
            {"changed outs": {"runs/ablate/arms": "not in cache", "metrics/ablate.json": "modified"}},
        ]
    }
    assert stale_stages(status, OUTS, COMMITTED) == {}


def test_a_stage_git_holds_no_output_of_is_never_stale() -> None:
    status = {"prepare": [{"changed deps": {"tasks/data/sources.py": "modified"}}]}
    assert stale_stages(status, OUTS, COMMITTED) == {}


def test_the_committed_outputs_are_the_outs_git_tracks_a_file_at() -> None:
    outs = {"report": ["reports/REPORT.md", "reports/report"], "tokenize": ["data/tokens"]}
    assert committed_outs(REPO, outs) == {"reports/REPORT.md", "reports/report"}


@pytest.mark.parametrize(
    ("ledger", "refused"),
    [
        ("nosuch: {reason: r, rerun: x}\n", "stale_outputs.yaml: nosuch: no such stage"),
        ("ablate: {reason: r}\n", "stale_outputs.yaml: ablate: needs exactly reason and rerun"),
        ("ablate: {reason: r, rerun: ' '}\n", "stale_outputs.yaml: ablate.rerun: must be text, not empty"),
        ("- ablate\n", "stale_outputs.yaml: must map each stale stage to its reason and rerun"),
    ],
)
def test_a_bad_ledger_entry_is_refused_by_its_key(tmp_path: Path, ledger: str, refused: str) -> None:
    (tmp_path / "dvc.yaml").write_text("stages:\n  ablate:\n    cmd: spikelab run ablate\n")
    (tmp_path / LEDGER).write_text(ledger)
    with pytest.raises(UserError, match=refused):
        read_ledger(tmp_path)


def test_no_ledger_owes_nothing(tmp_path: Path) -> None:
    assert read_ledger(tmp_path) == {}
