"""Provenance of the arithmetic (model/provenance.py): what changes a run's bits changes its numeric
path and nothing else does; the record reads what the libraries really took, in fresh processes
with the settings set before torch loads; the report warns up front when its runs mix paths or
differ from the committed outputs' (tasks/report/arithmetic.py)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from model.config import PrecisionConfig
from model.precision import native_low_precision, resolve_precision
from model.provenance import MKL_STRICT, numeric_path, provenance
from tasks.pretrain.train import record_arithmetic
from tasks.report.arithmetic import UNRECORDED, numeric_paths, of_the_same_design, warnings
from tasks.runtime.files import read_json, write_json

REPO = Path(__file__).resolve().parents[1]
RECORD = provenance()


def changed(path: str, *candidates) -> dict:
    """The record with ``path`` set to the first of ``candidates`` this machine's record does not
    hold there: a change on any CPU the suite runs on (an Intel one holds ``GenuineIntel``)."""
    record = copy.deepcopy(RECORD)
    *parents, leaf = path.split(".")
    target = record
    for key in parents:
        target = target[key]
    target[leaf] = next(v for v in candidates if v != target[leaf])
    return record


def in_fresh_process(env: dict[str, str]) -> dict:
    """The provenance record of a new interpreter started with ``env`` (read before torch loads)."""
    code = "import json; from model.provenance import provenance; print(json.dumps(provenance()))"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env={**_inherited(), **env}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def _inherited() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k not in ("MKL_CBWR", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}


@pytest.mark.parametrize(
    "field, candidates",
    [
        ("cpu.vendor", ("GenuineIntel", "AuthenticAMD")),
        ("cpu.model", ("143", "17")),
        ("cpu.isa", (["avx2"], ["avx2", "avx512f"])),
        ("torch", ("2.14.0+cpu", "2.13.0+cpu")),
        ("aten_capability", ("DEFAULT", "AVX2")),
        ("mkl.cbwr", (3, 4)),
        ("onednn.max_isa", ("AVX512_CORE_AMX", "AVX2")),
        ("autocast.bf16", ("AMX-BF16", "AVX512-BF16")),
        ("float32_matmul_precision", ("medium", "high")),
        ("env", ({"MKL_CBWR": "AVX2,STRICT"}, {"MKL_CBWR": "AVX512,STRICT"})),
    ],
)
def test_a_field_that_changes_bits_changes_the_numeric_path(field, candidates):
    assert numeric_path(changed(field, *candidates)) != RECORD["numeric_path"]


@pytest.mark.parametrize(
    "field, candidates",
    [
        ("cpu.name", ("Some Other Marketing Name", "Yet Another Name")),
        ("threads.intra_op", (7, 8)),
        ("precision", ("fp32", "bf16")),
    ],
)
def test_the_cpu_name_thread_counts_and_the_runs_own_precision_leave_the_numeric_path_alone(field, candidates):
    assert numeric_path(changed(field, *candidates)) == RECORD["numeric_path"]


def test_the_record_says_which_precision_path_emulate_auto_took_here():
    bf16 = resolve_precision(PrecisionConfig(mode="bf16", emulate="auto"), "cpu")
    record = provenance(bf16)
    assert record["precision"] == bf16.describe()
    assert record["autocast"]["bf16"] == native_low_precision("bf16", "cpu")
    assert record["numeric_path"] == RECORD["numeric_path"]  # the run's mode is its config's, not the machine's


def test_capping_atens_kernels_before_torch_loads_is_recorded_and_moves_the_numeric_path():
    capped = in_fresh_process({"ATEN_CPU_CAPABILITY": "default"})
    assert capped["aten_capability"] == "DEFAULT"
    assert capped["env"]["ATEN_CPU_CAPABILITY"] == "default"
    if RECORD["aten_capability"] != "DEFAULT":
        assert capped["numeric_path"] != RECORD["numeric_path"]


@pytest.mark.parametrize("setting, strict", [("AVX2,STRICT", True), ("COMPATIBLE", False)])
def test_the_cbwr_mode_recorded_is_the_one_mkl_reports_taking(setting, strict):
    record = in_fresh_process({"MKL_CBWR": setting})
    assert record["mkl"]["cbwr"] is not None, "torch's MKL should be reachable on a CPU build"
    assert bool(record["mkl"]["cbwr"] & MKL_STRICT) == strict


def test_an_identity_record_lists_each_numeric_path_that_trained_the_run_once(tmp_path):
    marker = tmp_path / "run.json"
    write_json(marker, {"digest": "0123456789abcdef"})
    record_arithmetic(marker, RECORD)
    record_arithmetic(marker, RECORD)  # a resume on the same machine
    assert [p["numeric_path"] for p in read_json(marker)["provenance"]] == [RECORD["numeric_path"]]
    other = {**changed("aten_capability", "AVX2", "AVX512"), "numeric_path": "000000000000"}
    record_arithmetic(marker, other)  # a resume on another kind of machine
    assert [p["numeric_path"] for p in read_json(marker)["provenance"]] == [RECORD["numeric_path"], "000000000000"]
    assert read_json(marker)["digest"] == "0123456789abcdef"


def outputs(stage_record: dict | None, arm_records: list[dict | None]) -> dict:
    """Stage metrics as the stages write them, the ablate stage's arms on ``arm_records``."""
    arms = [{"name": f"arm{i}", "numeric_path": r["numeric_path"] if r else None} for i, r in enumerate(arm_records)]
    by_path: dict = {}
    for r in arm_records:
        if r:
            by_path.setdefault(r["numeric_path"], {**r, "arms": 0})["arms"] += 1
    ablate = {"arms": arms, "arm_numerics": by_path}
    if stage_record:
        ablate["provenance"] = stage_record
    return {"pretrain": {"provenance": stage_record} if stage_record else {}, "ablate": ablate}


OTHER = {**changed("cpu.vendor", "GenuineIntel", "AuthenticAMD"), "numeric_path": "1234567890ab"}


def test_a_report_on_the_committed_outputs_own_numeric_path_has_no_warning():
    used = numeric_paths(outputs(RECORD, [RECORD, RECORD]))
    assert list(used) == [RECORD["numeric_path"]]
    assert "ablate: 2 arms" in used[RECORD["numeric_path"]]["produced"]
    assert warnings(used, numeric_paths(outputs(RECORD, [RECORD]))) == []


def test_arms_on_two_numeric_paths_are_flagged_as_mixed():
    used = numeric_paths(outputs(RECORD, [RECORD, OTHER]))
    assert set(used) == {RECORD["numeric_path"], OTHER["numeric_path"]}
    assert ["mix 2 numeric paths" in w for w in warnings(used, {})] == [True]


def test_runs_on_another_numeric_path_than_the_committed_outputs_are_flagged():
    used = numeric_paths(outputs(OTHER, [OTHER]))
    found = warnings(used, numeric_paths(outputs(RECORD, [RECORD])))
    assert len(found) == 1 and OTHER["numeric_path"] in found[0] and RECORD["numeric_path"] in found[0]


def registered(metrics: dict, design: str) -> dict:
    return {stage: {**m, "registration": {"hash": design}} for stage, m in metrics.items()}


def test_the_committed_outputs_of_another_registered_design_are_no_reference_for_the_arithmetic():
    """A new version's report is built beside the version it replaces: that version's machine is
    another study's, not a warning; the same design on another machine still warns."""
    inputs = registered(outputs(OTHER, [OTHER]), "f56c6a512dfd7940")
    earlier = registered(outputs(RECORD, [RECORD]), "0d2e7a35c1b94e10")
    used = numeric_paths(inputs)
    assert of_the_same_design(inputs, earlier) == {"pretrain": None, "ablate": None}
    assert warnings(used, numeric_paths(of_the_same_design(inputs, earlier))) == []
    same = registered(outputs(RECORD, [RECORD]), "f56c6a512dfd7940")
    assert len(warnings(used, numeric_paths(of_the_same_design(inputs, same)))) == 1


def test_outputs_written_before_provenance_count_as_an_unrecorded_path():
    committed = numeric_paths(outputs(None, [None, None]))
    assert list(committed) == [UNRECORDED]
    assert "ablate: 2 arms" in committed[UNRECORDED]["produced"]
    assert len(warnings(numeric_paths(outputs(RECORD, [RECORD])), committed)) == 1
