"""The gpu study's windows (tasks/gpu_study/): a slice planned here, trained "elsewhere" by a CPU
process exactly as a GPU window trains it, brought back and accumulated; a file from another plan
refused; an arm brought back twice compared, not replaced; a slice that cannot fit refused."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from model.typed_config import UserError
from tasks.config import load_config
from tasks.gpu_study.carry import CARRY, CarryError, pack, unpack
from tasks.gpu_study.plan import MARGIN, next_slice
from tasks.gpu_study.report import findings, render
from tasks.gpu_study.state import accept, accumulated, duplicates, read_results
from tests.test_arithmetic_check import study_project

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from project_gpu_plan import (  # noqa: E402
    GOAL_MINUTES,
    plan_arms,
    profile_arms,
    project,
    unmeasured_precisions,
    windows,
)

ROWS = [json.loads(line) for line in (REPO / "gpu_study/packing/h200-2026-11-27.jsonl").read_text().splitlines()]


def study(project: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "flows.gpu_study", "--project", str(project), *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)


def window(project: Path, slice_file: Path, out: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "tasks.gpu_study.window", str(slice_file), "--out", str(out)]
    command += ["--workers", "2", "--window-s", "300", "--project", str(project)]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)


def write_results(path: Path, records: list[dict]) -> Path:
    with open(path, "wb") as sink:
        for record in records:
            sink.write(gzip.compress(json.dumps(record).encode() + b"\n"))
    return path


def a_plan(families: dict[str, int]) -> dict:
    """A plan of ``n`` arms per family, each training 1000 steps."""
    arms = [
        {"key": f"{family}{i}", "name": f"{family}/{i}", "family": family, "arguments": ["--set=train.steps=1000"]}
        for family, n in families.items()
        for i in range(n)
    ]
    return {"plan": "p1", "arms": arms}


@pytest.mark.e2e
def test_a_slice_trained_elsewhere_comes_back_whole_and_accumulates(tmp_path):
    project = study_project(tmp_path / "project")
    manifest = project / "data" / "tokens" / "manifest.json"  # the tiny tokens, declared as smoke's data
    vocab = load_config(project / "params.yaml", "smoke").tokenizer.vocab_size
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "vocab_size": vocab}))
    assert study(project, "plan", "--profile", "smoke").returncode == 0
    made = study(project, "slice", "--window-s", "300", "--workers", "2", "--family", "wortsman")
    assert made.returncode == 0, made.stderr
    assert "calibration slice" in made.stdout  # nothing of the family measured yet
    slice_file = project / "gpu_study" / "slices" / "01.json"
    planned = json.loads(slice_file.read_text())["arms"]
    out = tmp_path / "elsewhere" / "01.jsonl.gz"
    out.parent.mkdir()
    trained = window(project, slice_file, out)
    assert trained.returncode == 0, trained.stdout + trained.stderr
    header, records, footer = read_results(out)
    assert header["machine"]["torch"] and header["machine"]["host"]["cpus"]
    assert footer and footer["finished"] == len(planned)
    assert {r["key"] for r in records} == {arm["key"] for arm in planned}
    assert all(r["result"]["provenance"]["numeric_path"] for r in records)
    fused = [r for r in records if r["fused"] > 1]  # the wortsman arms of one shape train as fused groups
    assert fused and all(r["result"]["provenance"]["trainer"] == f"model/fused.py, {r['fused']} arms" for r in fused)
    assert {r["status"] for r in records} <= {"completed", "diverged"}  # each its planned key: no "other run"

    accepted = study(project, "accept", str(out))
    assert accepted.returncode == 0, accepted.stderr
    status = study(project, "status")
    assert f"{len(planned)}/" in status.stdout
    reported = study(project, "report")
    assert reported.returncode == 0, reported.stderr
    report = (project / "gpu_study" / "REPORT.md").read_text()
    total = len(json.loads((project / "gpu_study" / "plan.json").read_text())["arms"])
    assert f"**{len(planned)} of {total} arms in**" in report
    assert "## wortsman — `" in report and f"(partial: {len(planned)} of " not in report  # the family is whole
    assert "## xiong — `NOT TESTED` (partial: 0 of" in report  # judged on no arm: not tested, saying so
    assert all(f"| {arm['name']} |" in report for arm in planned)
    again = study(project, "slice", "--window-s", "300", "--workers", "2", "--family", "wortsman")
    assert "every arm" in again.stderr and again.returncode == 2  # the family is in: nothing left of it

    # The data changes here: the plan's arms are no longer the runs a window would train.
    old = json.loads((project / "gpu_study" / "plan.json").read_text())["plan"]
    manifest = project / "data" / "tokens" / "manifest.json"
    changed = json.loads(manifest.read_text())
    changed["splits"]["train"]["sha256"] = "0" * 64
    manifest.write_text(json.dumps(changed))
    stale = study(project, "slice", "--window-s", "300", "--workers", "2")
    assert stale.returncode == 2 and f"is plan {old}" in stale.stderr and "make the plan again" in stale.stderr
    assert not (project / "gpu_study" / "slices" / "02.json").exists()
    other = study(project, "plan", "--profile", "gpu")  # this checkout's tokens are smoke's, not gpu's
    assert other.returncode == 2 and "the gpu profile's tokenizer.vocab_size is 8192" in other.stderr
    assert json.loads((project / "gpu_study" / "plan.json").read_text())["plan"] == old  # nothing moved aside
    replanned = study(project, "plan", "--profile", "smoke")
    assert f"moved to gpu_study/superseded/{old}" in replanned.stdout, replanned.stderr
    assert (project / "gpu_study" / "superseded" / old / "results" / "01.jsonl.gz").is_file()
    assert "0/" in study(project, "status").stdout  # the new plan starts empty


def test_a_results_file_from_another_plan_is_refused_and_nothing_is_added(tmp_path):
    plan = a_plan({"wortsman": 2})
    path = write_results(tmp_path / "01.jsonl.gz", [{"header": {"plan": "another", "slice": 1, "workers": 2}}])
    with pytest.raises(UserError, match="trained plan 'another', not this plan 'p1'"):
        accept(path, plan, tmp_path)
    assert not (tmp_path / "gpu_study").exists()


def test_an_arm_not_in_the_plan_is_refused(tmp_path):
    plan = a_plan({"wortsman": 2})
    records = [{"header": {"plan": "p1", "slice": 1, "workers": 2}}, {"arm": {"key": "stray", "status": "completed"}}]
    with pytest.raises(UserError, match="arms not in plan p1"):
        accept(write_results(tmp_path / "01.jsonl.gz", records), plan, tmp_path)


def finished_arm(key: str, gpu: str, loss: float, digest: str) -> dict:
    result = {"summary": {"status": "completed", "steps": 1000, "final_loss": loss}, "weights_sha256": digest}
    result["provenance"] = {"gpu": {"name": gpu}}
    return {"key": key, "name": key, "wall_s": 100.0, "sharing": 2, "status": "completed", "result": result}


def test_an_arm_back_from_two_gpus_is_kept_twice_and_compared_not_replaced(tmp_path):
    plan = a_plan({"wortsman": 1})
    for n, (gpu, loss, digest) in enumerate((("NVIDIA H200", 3.1, "aa"), ("NVIDIA H100", 3.2, "bb")), 1):
        records = [
            {"header": {"plan": "p1", "slice": 1, "workers": 2}},
            {"arm": finished_arm("wortsman0", gpu, loss, digest)},
        ]
        accept(write_results(tmp_path / f"{n}.jsonl.gz", records), plan, tmp_path)
    state = accumulated(plan, tmp_path)
    kept = state["arms"]["wortsman0"]["records"]
    assert [r["gpu"] for r in kept] == ["NVIDIA H200", "NVIDIA H100"]  # the first to arrive is judged
    (compared,) = duplicates(state)
    assert not compared["bitwise_equal"]
    assert [c["final_loss"] for c in compared["copies"]] == [3.1, 3.2]
    assert sorted(p.name for p in (tmp_path / "gpu_study" / "results").iterdir()) == ["01-2.jsonl.gz", "01.jsonl.gz"]


def measure(family: str, wall_s: float, done: int, sharing: int = 2) -> dict:
    return {"family": family, "wall_s": wall_s, "sharing": sharing, "steps_done": done, "steps_total": 1000}


def test_a_slice_that_cannot_fit_the_window_is_refused():
    plan = a_plan({"wortsman": 3})
    too_long = [measure("wortsman", wall_s=100.0, done=100)]  # 1000 s an arm, x MARGIN
    with pytest.raises(UserError, match="no arm fits a 1299 s window .the quickest left needs 1300 s at 2 at once"):
        next_slice(plan, set(), too_long, window_s=1000 * MARGIN - 1, workers=2, number=1)


def test_an_arm_whose_estimate_is_exactly_the_window_fits():
    plan = a_plan({"wortsman": 3})
    slice_ = next_slice(plan, set(), [measure("wortsman", 100.0, 100)], window_s=1000 * MARGIN, workers=2, number=1)
    assert len(slice_["arms"]) == 2 and not slice_["calibration"]  # one per lane: the third would not fit


def test_a_cut_arms_reached_step_scales_to_its_whole_run_and_to_the_packing():
    plan = a_plan({"wortsman": 1})
    # 250 s for 500 of 1000 steps at 2 at once: 500 s whole, 1000 s at 4 at once
    slice_ = next_slice(plan, set(), [measure("wortsman", 250.0, 500)], window_s=2000, workers=4, number=1)
    assert slice_["arms"][0]["estimate_s"] == pytest.approx(1000 * MARGIN)


def test_an_unmeasured_family_makes_a_calibration_slice():
    plan = a_plan({"wortsman": 1, "xiong": 2})
    slice_ = next_slice(plan, set(), [measure("wortsman", 10.0, 1000)], window_s=100, workers=2, number=3)
    assert slice_["calibration"] and [a["estimate_s"] for a in slice_["arms"]] == [13.0, None, None]


def fusing_plan(fuse: list[str | None]) -> dict:
    """A wortsman plan whose arms carry these fuse keys (None: trains alone)."""
    plan = a_plan({"wortsman": len(fuse)})
    return plan | {"arms": [arm | {"fuse": key} for arm, key in zip(plan["arms"], fuse, strict=True)]}


def groups(slice_: dict) -> list[list[str]]:
    found: dict[int, list[str]] = {}
    for arm in slice_["arms"]:
        found.setdefault(arm["group"], []).append(arm["key"])
    return list(found.values())


def test_arms_of_one_fuse_key_form_groups_of_at_most_the_group_size_in_plan_order():
    plan = fusing_plan(["a", "b", "a", None, "a", "b"])
    slice_ = next_slice(plan, set(), [], window_s=100, workers=2, number=1, group_size=2)
    assert groups(slice_) == [["wortsman0", "wortsman2"], ["wortsman1", "wortsman5"], ["wortsman3"], ["wortsman4"]]
    alone = next_slice(plan, set(), [], window_s=100, workers=2, number=1, group_size=1)
    assert all(len(group) == 1 for group in groups(alone))


def test_a_window_holds_whole_groups_each_estimated_at_the_arms_sharing_the_gpu():
    plan = fusing_plan(["a", "a", "a", "a", "b"])
    # 100 s an arm at 2 at once: 200 s a group of 2 with 2 groups at once (4 arms share), 100 s one arm alone
    measured = [measure("wortsman", 100.0, 1000, sharing=2)]
    slice_ = next_slice(plan, set(), measured, window_s=200 * MARGIN, workers=2, number=1, group_size=2)
    assert groups(slice_) == [["wortsman0", "wortsman1"], ["wortsman2", "wortsman3"]]  # the third group: no lane left
    assert [arm["estimate_s"] for arm in slice_["arms"]] == [pytest.approx(200 * MARGIN)] * 4
    with pytest.raises(UserError, match="the quickest left needs 260 s"):
        next_slice(
            fusing_plan(["a", "a"]), set(), measured, window_s=200 * MARGIN - 1, workers=2, number=1, group_size=2
        )


def test_the_gpu_registration_trains_the_families_the_cpu_cannot_test_on_fresh_seeds():
    arms = profile_arms(load_config(REPO / "params.yaml", "gpu"))
    assert {arm["family"] for arm in arms} == {"wortsman", "xiong", "beta2"}  # no precision, no overflow
    assert {arm["seed"] for arm in arms} == {40, 41, 42, 43, 44}
    assert all(arm["fuse"] for arm in arms), "every arm of the gpu registration trains in a fused group"


def test_the_gpu_registration_fits_sixty_gpu_minutes_and_one_more_seed_would_not():
    cfg = load_config(REPO / "params.yaml", "gpu")
    fused = project(profile_arms(cfg), ROWS)[-1]  # the registered vocabulary, fused groups
    assert fused["minutes_ceiling"] <= GOAL_MINUTES
    wider = cfg.replace(**{"ablation.confirm_seeds": [*cfg.ablation.confirm_seeds, 45]})
    assert project(profile_arms(wider), ROWS)[-1]["minutes_ceiling"] > GOAL_MINUTES


def test_the_gpu_registrations_bf16_arms_are_costed_at_the_fp32_rows_saying_so():
    arms = profile_arms(load_config(REPO / "params.yaml", "gpu"))
    note = unmeasured_precisions(arms)
    assert note is not None and note.startswith(f"{len(arms)} arms train bf16: no packing row of that precision")
    assert note.endswith("costed at the fp32 rows, the conservative estimate")
    assert unmeasured_precisions([arm | {"precision": "fp32"} for arm in arms]) is None  # measured: nothing to say


def test_the_committed_plan_is_the_gpu_registrations_and_projects_as_docs_say():
    plan = json.loads((REPO / "gpu_study/plan.json").read_text())
    assert plan["registration"]["state"] == "confirmatory" and len(plan["arms"]) == 145
    fused = project(plan_arms(plan), ROWS)[-1]
    assert (fused["minutes_floor"], fused["minutes_ceiling"]) == (49, 54)  # under 60: the goal


def test_the_gpu_registrations_windows_each_hold_whole_groups_within_the_window():
    arms = profile_arms(load_config(REPO / "params.yaml", "gpu"))
    cut = windows(arms, ROWS, window_s=780, workers=1, launch_bound=False)
    assert len(cut) == 4 and all(w["busy_s"] <= 780 for w in cut)
    assert sum(len(w["groups"]) for w in cut) == 29  # wortsman 3 x 7, xiong 2 x 2, beta2 4: groups of 5


def test_the_gpu_report_judges_only_the_families_its_profile_trains():
    plan = json.loads((REPO / "gpu_study/plan.json").read_text())
    judged = [finding.key for finding, _, _ in findings(REPO, plan | {"profile": "gpu"}, [])]
    assert judged == ["xiong", "beta2", "wortsman"]  # fp16 and overflow: left out of the gpu registration
    every = [finding.key for finding, _, _ in findings(REPO, plan | {"profile": "default"}, [])]
    assert every == ["xiong", "fp16", "overflow", "beta2", "wortsman"]


def test_a_fused_arms_cost_counts_every_arm_that_shared_the_gpu(tmp_path):
    plan = a_plan({"wortsman": 1})
    record = finished_arm("wortsman0", "NVIDIA H200", 3.1, "aa") | {"fused": 5}
    accept(
        write_results(
            tmp_path / "01.jsonl.gz", [{"header": {"plan": "p1", "slice": 1, "workers": 2}}, {"arm": record}]
        ),
        plan,
        tmp_path,
    )
    (measured,) = accumulated(plan, tmp_path)["measures"]
    assert measured["sharing"] == 10  # 2 processes of 5 fused arms each


def test_a_windows_mfu_is_its_finished_arms_model_flops_over_its_wall_time_at_the_cards_bf16_peak(tmp_path):
    plan = a_plan({"wortsman": 3})
    arms = [finished_arm(f"wortsman{i}", "NVIDIA H200", 3.1, "aa") | {"fused": 3} for i in range(3)]
    for arm, mfu in zip(arms, (0.2, 0.2, None), strict=True):  # the third: its GPU's peak unknown to it
        arm["result"]["summary"] |= {"mfu": mfu, "wall_s": 100.0, "eval_s": 10.0}
    cut = {"key": "wortsman2", "name": "wortsman2", "status": "cut", "wall_s": 120.0}
    header = {"plan": "p1", "slice": 1, "workers": 1, "window_s": 480, "machine": {"gpus": ["NVIDIA H200"]}}
    records = [{"header": header}, *({"arm": a} for a in arms[:2]), {"arm": cut}]
    accept(
        write_results(tmp_path / "01.jsonl.gz", [*records, {"footer": {"wall_s": 120.0, "finished": 2}}]),
        plan,
        tmp_path,
    )
    state = accumulated(plan, tmp_path)
    assert state["windows"][0]["peak_s"] == pytest.approx(2 * 0.2 * 90)  # the cut arm counts no FLOPs
    row = next(line for line in render(plan | {"profile": "gpu"}, state, [], []).splitlines() if "01.jsonl.gz" in line)
    assert row.endswith("| 1.00 | 30.0% | 297 |")  # 36 s at peak in 120 s; 0.3 x 989 TFLOP/s


def test_a_fused_group_that_fails_comes_back_as_each_of_its_arms_failed_with_the_reason(tmp_path):
    bad = ["--profile", "smoke", "--out", "x", "--set=no.such_key=1"]
    arms = [
        {"key": f"k{i}", "name": f"wortsman/{i}", "family": "wortsman", "arguments": bad, "group": 0} for i in range(2)
    ]
    slice_file, out = tmp_path / "01.json", tmp_path / "01.jsonl.gz"
    slice_file.write_text(json.dumps({"plan": "p1", "slice": 1, "arms": arms}))
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    shutil.copytree(REPO / "profiles", tmp_path / "profiles")
    assert window(tmp_path, slice_file, out).returncode == 1
    _, records, footer = read_results(out)
    assert [(r["key"], r["status"], r["fused"], r["exit"]) for r in records] == [
        ("k0", "crashed", 2, 2),
        ("k1", "crashed", 2, 2),
    ]
    assert all("unknown key" in r["stderr"][-1] for r in records) and footer and footer["finished"] == 0


def tokens_dir(project: Path, payload: bytes) -> Path:
    tokens = project / "data" / "tokens"
    (tokens / "train").mkdir(parents=True)
    (tokens / "manifest.json").write_text('{"vocab_size": 50304}')
    (tokens / "train" / "00000.bin").write_bytes(payload)
    return tokens


def test_the_carried_tokens_unpack_on_the_gpu_box_byte_for_byte(tmp_path):
    here, there = tmp_path / "here", tmp_path / "there"
    tokens_dir(here, bytes(range(256)) * 64)
    done = study(here, "pack")
    assert done.returncode == 0, done.stderr
    assert "gpu_study/carry/tokens.tar.xz" in done.stdout
    (there / CARRY).parent.mkdir(parents=True)
    (there / CARRY).write_bytes((here / CARRY).read_bytes())
    unpacked = subprocess.run(
        [sys.executable, "-m", "tasks.gpu_study.carry", "unpack", "--project", str(there)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert unpacked.returncode == 0, unpacked.stderr
    for path in (here / "data" / "tokens").rglob("*"):
        twin = there / path.relative_to(here)
        assert twin.is_dir() if path.is_dir() else twin.read_bytes() == path.read_bytes()
    assert unpack_refused(there, "exists already")  # never unpacked over data a window has


def unpack_refused(project: Path, why: str) -> bool:
    with pytest.raises(CarryError, match=why):
        unpack(project)
    return True


def test_a_carry_larger_than_a_window_takes_is_refused_naming_both_sizes_and_nothing_is_left(tmp_path):
    tokens_dir(tmp_path, os.urandom(1 << 16))  # random bytes do not compress
    with pytest.raises(CarryError, match=r"compress to 0\.1 MiB, more than a window carries \(0 MiB\)"):
        pack(tmp_path, limit=1 << 16)
    assert not list((tmp_path / CARRY).parent.iterdir())
    assert pack(tmp_path, limit=1 << 20).is_file()  # the same data under a limit it fits


def test_a_window_without_its_carry_or_tokens_is_refused_naming_the_command_that_makes_it(tmp_path):
    assert unpack_refused(tmp_path, "python -m flows.gpu_study pack makes it")
    done = study(tmp_path, "pack")
    assert done.returncode == 2 and "dvc repro tokenize" in done.stderr and "Traceback" not in done.stderr
