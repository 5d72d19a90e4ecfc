"""The report names the commit each stage ran at beside its build stamp, says "unrecorded" where
the outputs predate that record (never a guessed commit), and names the stages whose outputs are
older than their code: by their recorded commit, or by the ledger of reruns owed."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tasks.config import project_config
from tasks.report.lineage import commits_line, stale, trained_at
from tasks.report.render import code_json
from tasks.report.sections.method import provenance_section
from tasks.report.sections.summary import summary_section
from tasks.runtime.staleness import LEDGER, read_ledger
from tasks.runtime.tracking import code_commit, numerics_tags, stage_provenance

REPO = Path(__file__).resolve().parents[1]
BUILT = "1c5351be4ab9a5d8dd66222ca75ed29dc1305029"


def git(project: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=project, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A git checkout with a one-stage pipeline: ablate, its code flows/ablate.py."""
    (tmp_path / "flows").mkdir()
    (tmp_path / "flows/ablate.py").write_text("ARMS = 1\n")
    (tmp_path / "dvc.yaml").write_text(
        "stages:\n  ablate:\n    cmd: spikelab run ablate\n    deps: [flows/ablate.py, data/tokens]\n"
        "    metrics: [metrics/ablate.json]\n  tokenize:\n    cmd: spikelab run tokenize\n    outs: [data/tokens]\n"
    )
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "pipeline")
    return tmp_path


def ran_at(commit: str | None, changed: list[str] | None = None) -> dict:
    return {"provenance": {"numeric_path": "p", "code": {"commit": commit, "changed": changed or []}}}


def committed_outputs() -> dict[str, dict]:
    read = lambda name: json.loads((REPO / "metrics" / f"{name}.json").read_text())  # noqa: E731
    return {stage: read(stage) for stage in ("search", "spike", "ablate", "sensitivity")}


def test_the_committed_study_names_the_commit_its_stages_ran_at_apart_from_the_build_stamp():
    lineage = trained_at(REPO, committed_outputs())
    (commit,) = {entry["commit"] for entry in lineage.values()}
    assert commit == json.loads((REPO / "metrics/ablate.json").read_text())["provenance"]["code"]["commit"]
    assert commits_line(lineage, BUILT) == (
        f"arms trained at `{commit[:7]}` (search, spike, ablate, sensitivity); report built at `1c5351b`"
    )


def test_the_committed_study_s_stages_older_than_their_code_are_the_ones_the_ledger_owes():
    lineage = trained_at(REPO, committed_outputs())
    assert set(stale(lineage)) == set(read_ledger(REPO)) & set(lineage)


def test_a_stage_that_ran_at_this_commit_is_named_by_it_and_in_step(project: Path):
    head = git(project, "rev-parse", "HEAD")
    lineage = trained_at(project, {"ablate": ran_at(head), "search": None})
    assert commits_line(lineage, head) == f"arms trained at `{head[:7]}` (ablate); report built at `{head[:7]}`"
    assert stale(lineage) == []


def test_a_stage_whose_code_changed_since_its_commit_is_older_than_its_code(project: Path):
    head = git(project, "rev-parse", "HEAD")
    (project / "flows/ablate.py").write_text("ARMS = 2\n")
    (project / "data").mkdir()  # an upstream output changing is data, not code
    lineage = trained_at(project, {"ablate": ran_at(head)})
    assert lineage["ablate"]["changed_since"] == ["flows/ablate.py"]
    assert stale(lineage) == ["ablate"]


def test_uncommitted_code_when_it_ran_unrecorded_outputs_and_no_git_are_each_said(project: Path):
    head = git(project, "rev-parse", "HEAD")
    outputs = {"ablate": ran_at(head, ["flows/ablate.py"]), "search": {"provenance": {}}, "spike": ran_at(None)}
    said = commits_line(trained_at(project, outputs), head)
    assert said == (
        f"arms trained at `{head[:7]}` with uncommitted changes (ablate), unrecorded (search), "
        f"unknown (not a git checkout) (spike); report built at `{head[:7]}`"
    )


def test_a_project_without_a_pipeline_names_the_commit_and_cannot_tell_what_changed(project: Path):
    head = git(project, "rev-parse", "HEAD")
    (project / "dvc.yaml").unlink()
    lineage = trained_at(project, {"ablate": ran_at(head)})
    assert lineage["ablate"]["commit"] == head and lineage["ablate"]["changed_since"] is None
    assert stale(lineage) == []


def test_the_first_screen_names_the_commits_and_the_stages_older_than_their_code(project: Path):
    head = git(project, "rev-parse", "HEAD")
    (project / "flows/ablate.py").write_text("ARMS = 2\n")
    origin = {"commit": head, "trained": trained_at(project, {"ablate": ran_at(head)})}
    lines = summary_section(project_config()[0], [], {"warnings": []}, origin).lines
    code = next(line for line in lines if line.startswith("Code: "))
    assert code.startswith(f"Code: arms trained at `{head[:7]}` (ablate)")
    assert "**Outputs older than their code:** ablate" in code


def test_where_the_numbers_come_from_gives_an_unrecorded_stale_stage_the_ledgers_reason_and_rerun(project: Path):
    (project / LEDGER).write_text("ablate: {reason: trained before stages recorded their commit, rerun: make repro}\n")
    origin = {"commit": BUILT, "config_hash": "h", "built": "today", "trained": trained_at(project, {"ablate": {}})}
    lines = provenance_section(project_config()[0], origin, {"inputs": {}}, {}).lines
    ablate = next(line for line in lines if line.startswith("  - ablate: "))
    assert ablate == "  - ablate: trained before stages recorded their commit; owed: make repro"


def test_report_json_keeps_the_build_stamp_each_stage_s_commit_and_the_stale_stages(project: Path):
    head = git(project, "rev-parse", "HEAD")
    code = code_json({"commit": BUILT, "trained": trained_at(project, {"ablate": ran_at(head)})})
    assert code["built"] == BUILT
    assert code["trained"]["ablate"]["commit"] == head
    assert code["stale"] == []


def test_a_stage_records_the_commit_it_ran_at_beside_its_arithmetic_and_not_as_a_numerics_tag(monkeypatch):
    record = stage_provenance(project_config()[0])
    assert record["code"]["commit"] == git(REPO, "rev-parse", "HEAD")
    assert record["numeric_path"] and isinstance(record["code"]["changed"], list)
    assert not [tag for tag in numerics_tags(record) if "code" in tag]
    monkeypatch.setenv("DVC_EXP_BASELINE_REV", "b" * 40)  # inside `dvc exp run`: the experiment's baseline
    assert code_commit()["commit"] == "b" * 40
