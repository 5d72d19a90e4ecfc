"""The whole study as a DVC pipeline of Prefect flows tracked in MLflow: outputs, a no-op second
run, a partial re-run after a filter change, and a bad input through the CLI."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from flows.stages import PARAMS_STAGE, STAGES
from tests.smoke_study import (
    REPO,
    SmokeStudy,
    copy_project,
    flow_run_output,
    pipeline_mlflow_runs,
    run,
)


def test_the_stage_registry_names_every_dvc_stage_in_order_and_each_runs_its_registered_flow():
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    assert list(stages) == [PARAMS_STAGE, *STAGES], "dvc.yaml and flows/stages.py: STAGES disagree"
    for name, stage in STAGES.items():
        assert stages[name]["cmd"] == f"spikelab run {name}", name
        assert callable(stage.load_flow()), name


def test_dvc_yaml_declares_exactly_the_outputs_the_code_writes():
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    for name, stage in STAGES.items():
        entries = [e for kind in ("outs", "metrics", "plots") for e in stages[name].get(kind, [])]
        declared = [e if isinstance(e, str) else next(iter(e)) for e in entries]
        assert sorted(declared) == sorted(str(p) for p in stage.outs), name


def test_pretrain_keeps_its_checkpoints_and_curves_across_reruns_so_a_resumed_run_continues_them():
    outs = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["pretrain"]
    declared = {
        next(iter(e)): e[next(iter(e))] for kind in ("outs", "plots") for e in outs.get(kind, []) if isinstance(e, dict)
    }
    assert declared["runs/pretrain/checkpoints"]["persist"] and declared["plots/pretrain"]["persist"]


def test_each_data_stage_depends_on_its_code_and_upstream_outputs_and_reads_only_its_params():
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    assert {"tasks/data/sources.py", "flows/data.py"} <= set(stages["prepare"]["deps"])
    assert {"tasks/data/filters.py", "tasks/data/perplexity.py", "data/raw"} <= set(stages["filter"]["deps"])
    assert {"tasks/data/tokenize.py", "data/clean", "data/poison"} <= set(stages["tokenize"]["deps"])
    reads = {s: stages[s]["params"][0]["params/resolved.yaml"] for s in ("prepare", "filter", "tokenize")}
    assert reads["filter"] == ["filter"]
    assert not any(key.startswith("filter") for key in reads["prepare"] + reads["tokenize"])


def repro(project: Path, env: dict[str, str]) -> str:
    done = run(["dvc", "repro"], project, env)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def ran(output: str) -> set[str]:
    return {s for s in STAGES if f"Running stage '{s}'" in output}


@pytest.mark.e2e
def test_dvc_repro_runs_every_flow_then_is_a_no_op_and_a_filter_change_reruns_only_what_follows(
    smoke_study: SmokeStudy,
):
    import mlflow

    # The shared smoke pipeline (tests/smoke_study.py): `dvc repro` under the pipeline deployment,
    # with a family declared in YAML only; this test goes on in a copy of the project as it left it.
    env, project = smoke_study.env, smoke_study.as_left
    output = flow_run_output(env, smoke_study.flow_run["id"])
    assert ran(output) == set(STAGES)
    assert f"[spikelab] report: {smoke_study.project / 'reports/REPORT.md'}" in output, (
        "the pipeline ends saying where the report is"
    )
    for out in (
        "data/raw/00000-docs.jsonl",
        "data/clean/00000-docs.jsonl",
        "data/poison/generated_space_run.jsonl",
        "metrics/filter.json",
        "data/tokens/manifest.json",
        "data/tokens/train/00000-docs.bin",
        "data/tokens/val/00000-docs.bin",
        "data/tokens/poison.bin",
        "models/pretrain.pt",
        "metrics/pretrain.json",
        "plots/pretrain/train.csv",
        "plots/pretrain/val.csv",
    ):
        assert (project / out).is_file(), out

    client = mlflow.MlflowClient(env["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("spikelab-smoke")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    _, runs = pipeline_mlflow_runs(client, smoke_study.flow_run["id"])
    assert set(runs) == set(STAGES)
    found = [  # the stages' own runs: branches, trials and arms
        r
        for stage_run in runs.values()
        for r in client.search_runs(
            [experiment.experiment_id], f"tags.`mlflow.parentRunId` = '{stage_run.info.run_id}'"
        )
    ]
    for stage in ("prepare", "filter", "tokenize"):
        assert runs[stage].info.status == "FINISHED" and len(runs[stage].data.tags["dataset_digest"]) == 64
        assert runs[stage].info.run_name.startswith(f"{stage} smoke ")
    assert runs["filter"].data.metrics["removed_too_short"] > 0
    assert runs["filter"].data.params["filter.max_char_run"] == "200"
    assert runs["tokenize"].data.metrics["train_tokens"] > 0
    assert [a.path for a in client.list_artifacts(runs["filter"].info.run_id)] == ["filter.json", "removed.md"]
    pretrain = runs["pretrain"]
    identity = pretrain.data.tags["spikelab.run_identity"]
    assert pretrain.info.status == "FINISHED" and pretrain.data.tags["spikelab.profile"] == "smoke"
    assert pretrain.info.run_name == f"pretrain smoke {identity[:8]}"
    assert {"spikelab.dvc_inputs", "spikelab.dvc_stage", "prefect.flow_run_id"} <= pretrain.data.tags.keys()
    loss = [m.value for m in client.get_metric_history(pretrain.info.run_id, "loss/train")]
    assert len(loss) == 30 // 5 and loss[-1] < loss[0], loss  # smoke: 30 steps, logged every 5
    assert pretrain.data.metrics["summary/steps"] == 30
    assert [i.dataset.name for i in pretrain.inputs.dataset_inputs] == ["tokens"]
    figures = sorted(a.path for a in client.list_artifacts(pretrain.info.run_id, "figures"))
    assert figures == ["figures/loss.png", "figures/optimizer.png", "figures/stability.png"]
    assert sorted(p.name for p in (project / "reports/pretrain").iterdir()) == [f.split("/")[1] for f in figures]
    assert [
        m.name
        for m in client.search_logged_models([experiment.experiment_id], f"source_run_id = '{pretrain.info.run_id}'")
    ] == ["model"]
    summary = json.loads((project / "metrics/pretrain.json").read_text())
    assert summary["steps"] == 30 and summary["skipped"] == 0

    search = runs["search"]
    findings = json.loads((project / "metrics/search.json").read_text())
    trials = client.search_runs([experiment.experiment_id], f"tags.`mlflow.parentRunId` = '{search.info.run_id}'")
    assert search.info.status == "FINISHED" and findings["trials"]["run"] == len(trials) == 2 * 2 * 3 + 1
    assert all(
        {"optuna.study", "optuna.trial", "search.width", "search.parametrization"} <= t.data.tags.keys() for t in trials
    )
    transferred = yaml.safe_load((project / "search/lr.yaml").read_text())["optim"]["lr"]
    assert transferred == findings["transfer"]["lr"] == float(pretrain.data.params["optim.lr"]) == trained_lr(project)
    assert_spike_stage(project, runs["spike"], [r for r in found if "spikelab.branch" in r.data.tags], client)
    assert_ablate_and_report(project, runs, found)
    assert_recomputed_from_mlflow(project, env, client, project.parent / "recompute.json")

    assert ran(repro(project, env)) == set()
    assert "up to date" in run(["dvc", "status"], project, env).stdout
    assert_a_declared_value_added_trains_only_its_arms(project, env)

    (project / "search/lr.yaml").write_text("optim:\n  lr: 0.00321\n")  # another search result
    assert "search/lr.yaml" in run(["dvc", "status", "pretrain"], project, env).stdout
    done = run(["dvc", "repro", "--single-item", "pretrain"], project, env)
    assert ran(done.stdout) == {"pretrain"} and trained_lr(project) == 0.00321, done.stdout + done.stderr

    params = project / "params.yaml"
    params.write_text(params.read_text().replace("  min_chars: 64\n", "  min_chars: 100\n", 1))
    # The data stages and pretrain run for real (new data must not resume the old checkpoints); what
    # follows them is left for DVC to name as stale, which is what a full `dvc repro` would rerun.
    done = run(["dvc", "repro", "--single-item", "params", "filter", "tokenize", "pretrain"], project, env)
    output = done.stdout + done.stderr
    assert done.returncode == 0 and ran(output) == {"filter", "tokenize", "pretrain"}, output
    stale = json.loads(run(["dvc", "status", "--json"], project, env).stdout)
    assert set(stale) == {"search", "spike", "ablate", "sensitivity", "report"}, stale  # prepare not among them
    assert "and starting run" in output, "new data must not resume the old run's checkpoints"
    assert json.loads((project / "metrics/pretrain.json").read_text())["start_step"] == 0


def trained_lr(project: Path) -> float:
    """The peak LR of the pretrain run whose checkpoints are in the project (its identity)."""
    return json.loads((project / "runs/pretrain/checkpoints/run.json").read_text())["config"]["optim.lr"]


def assert_recomputed_from_mlflow(project: Path, env: dict[str, str], client, out: Path) -> None:
    """checks/recompute_mlflow.py finds every number of the study in the MLflow runs; one
    arm's logged validation loss moved, it names that arm and the findings that change."""
    command = [sys.executable, str(REPO / "checks/recompute_mlflow.py"), "--project", str(project)]
    command += ["--profile", "smoke", "--out", str(out)]
    done = run(command, project, env)
    assert done.returncode == 0 and "every number equal" in done.stdout, done.stdout + done.stderr
    assert set(json.loads(out.read_text())["stages"]) == {"ablate", "search", "spike"}
    ablate = json.loads((project / "metrics/ablate.json").read_text())
    arm = next(a for a in ablate["arms"] if a["family"] == "xiong" and a["metrics"].get("val_loss") is not None)
    client.log_metric(
        arm["mlflow"].split("/runs/")[1].split("?")[0], "summary/val_loss", arm["metrics"]["val_loss"] + 1
    )
    done = run(command, project, env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"arm {arm['name']}/val_loss: {arm['metrics']['val_loss']!r} vs" in done.stdout, done.stdout
    assert "xiong        " in done.stdout and "DIFFERS" in done.stdout, done.stdout


def assert_spike_stage(project: Path, parent, children, client) -> None:
    """The spike stage through DVC: its outputs, a parent run and a child per branch, tagged."""
    metrics = json.loads((project / "metrics/spike.json").read_text())
    resolved = yaml.safe_load((project / "params/resolved.yaml").read_text())
    kinds, policies = resolved["spike"]["kinds"], resolved["recovery"]["policies"]
    # False alarms on the clean control are a measurement, reported and never hidden; how many the
    # smoke run raises depends on the CPU's bf16 path (0 with AVX512-BF16 autocast, 1 emulated).
    seeds = [*resolved["spike"]["seeds"], *resolved["spike"]["confirm_seeds"]]
    assert list(metrics["seeds"]) == [str(s) for s in seeds]
    assert metrics["false_positives"] == parent.data.metrics["summary/false_positives"]
    for entry in metrics["seeds"].values():
        alarms = entry["false_positive_steps"]
        assert entry["false_positives"] == len(alarms)
        assert all(resolved["spike"]["origin_step"] < step <= entry["end_step"] for step in alarms)  # warm-up, control
        assert all(set(policies) <= entry[kind].keys() for kind in kinds)
    assert {k: sorted(v) for k, v in metrics["matrix"].items()} == dict.fromkeys(kinds, sorted(policies))
    assert (metrics["causes"], metrics["policies"]) == (kinds, policies), "the config's order (the file sorts keys)"
    for number, kind in enumerate(kinds, start=1):  # figures and post-mortems: the first seed's
        assert (project / f"reports/spike/{kind}.png").is_file()
        assert (project / f"reports/postmortems/spike_{number}_{kind}.md").is_file()
    assert parent.info.status == "FINISHED"
    names = sorted(r.info.run_name for r in children)
    assert names == sorted(
        f"s{s}/{b}" for s in seeds for b in ["control", *(f"{k}/{p}" for k in kinds for p in policies)]
    )
    assert all(r.data.tags["mlflow.parentRunId"] == parent.info.run_id for r in children)
    assert all({"spikelab.checkpoint", "spikelab.injection", "spikelab.policy"} <= r.data.tags.keys() for r in children)
    assert any(a.path == "postmortems" for a in client.list_artifacts(parent.info.run_id))


@pytest.mark.e2e
def test_a_bad_input_through_the_cli_exits_2_naming_the_key_and_writes_nothing(live_services, tmp_path):
    project = copy_project(tmp_path)
    params = project / "params.yaml"
    params.write_text(
        params.read_text()
        .replace("  source: stdlib_docs", "  source: jsonl", 1)
        .replace('  path: ""', '  path: "corpus/missing.jsonl"', 1)
    )
    done = run(["spikelab", "run", "prepare"], project, live_services)
    assert done.returncode == 2, done.stderr
    assert "spikelab: error: data.path:" in done.stderr and "corpus/missing.jsonl does not exist" in done.stderr
    assert not (project / "data").exists() or not any((project / "data").iterdir())


@pytest.mark.e2e
def test_the_data_stages_through_the_cli_on_two_worker_processes_in_shards(live_services, tmp_path):
    project = copy_project(tmp_path)
    shards = ["--set", "data.workers=2", "--set", "data.shard_bytes=30000"]
    for stage in ("prepare", "filter", "tokenize"):
        done = run(["spikelab", "run", stage, *shards], project, live_services)
        assert done.returncode == 0, done.stdout + done.stderr
    assert len(list((project / "data" / "raw").glob("*-docs.jsonl"))) > 3
    assert "shard 00000-docs.jsonl" in done.stdout + done.stderr  # a progress line per shard
    manifest = json.loads((project / "data" / "tokens" / "manifest.json").read_text())
    assert len(manifest["splits"]["train"]["shards"]) > 3
    assert "# What the filters removed" in (project / "data" / "poison" / "removed.md").read_text()
    assert not list((project / "data").glob(".*-work-*"))  # scratch removed once a stage succeeded


def test_dvc_plots_are_only_the_top_level_definitions_one_quantity_each_plus_the_stage_figures():
    pipeline = yaml.safe_load((REPO / "dvc.yaml").read_text())
    assert not any("plots" in spec for spec in pipeline["stages"].values()), "stage-level plots draw every column"
    curves = [next(iter(p.values())) for p in pipeline["plots"] if isinstance(p, dict)]
    assert all(c["title"] and len(c["y"]) <= 2 for c in curves)
    assert [p for p in pipeline["plots"] if isinstance(p, str)] == [
        *(f"reports/search/{name}" for name in ("mu_transfer.png", "transfer.png", "coord_check.png")),
        *(f"reports/pretrain/{name}" for name in ("loss.png", "optimizer.png", "stability.png")),
        *(
            f"reports/ablate/{name}.png"
            for name in ("xiong", "depth_probe", "precision", "overflow", "beta2", "wortsman", "trajectories")
        ),
        "reports/report/forest.png",
    ]
    assert "dvc_plots/" in (REPO / ".gitignore").read_text().splitlines()


def assert_ablate_and_report(project: Path, runs: dict, found: list) -> None:
    """The smoke grid's arms and the declared family's, each a child run of the ablate stage's run;
    a verdict per finding, the declared one's included, and the declared family's figure."""
    from tasks.ablate.grid import expand
    from tasks.config import load_config
    from tasks.design.studies import read_studies

    cfg = load_config(project / "params.yaml", "smoke")
    ablate = json.loads((project / "metrics/ablate.json").read_text())
    expected = [arm.name for arm in expand(cfg, read_studies(project, cfg))]
    assert [a["name"] for a in ablate["arms"]] == expected and ablate["counts"]["failed"] == 0
    assert sum(a["family"] == "qk_rescue" for a in ablate["arms"]) == 2 * 2 * 2  # 2 x 2 values, 2 seeds
    children = [r for r in found if r.data.tags.get("mlflow.parentRunId") == runs["ablate"].info.run_id]
    assert sorted(r.data.tags["spikelab.arm"] for r in children) == sorted(a["name"] for a in ablate["arms"])
    declared = next(r for r in children if r.data.tags["spikelab.family"] == "qk_rescue")
    assert {"model.qk_norm", "optim.lr", "seed"} <= declared.data.params.keys()
    assert (project / "reports/ablate/qk_rescue.png").is_file()
    verdicts = json.loads((project / "metrics/report.json").read_text())["findings"]
    assert len(verdicts) == 9 and runs["report"].info.status == "FINISHED"
    assert verdicts["qk_rescue"]["claim"].startswith("Does qk-norm") and verdicts["qk_rescue"]["verdict"]
    assert "qk_rescue" in (project / "reports/REPORT.md").read_text()


def assert_a_declared_value_added_trains_only_its_arms(project: Path, env: dict[str, str]) -> None:
    """A value added to a declared factor reruns the ablate and report stages, and only the new
    value's arms train (the others are found by their run identity)."""
    before = json.loads((project / "metrics/ablate.json").read_text())["arms"]
    studies = project / "studies.yaml"
    studies.write_text(studies.read_text().replace("[0.003, 0.3]", "[0.003, 0.3, 0.03]"))
    assert ran(repro(project, env)) == {"ablate", "sensitivity", "report"}  # sensitivity reads metrics/ablate.json
    after = json.loads((project / "metrics/ablate.json").read_text())
    assert len(after["arms"]) == len(before) + 2 * 2 and after["cached"] == len(before)
    assert (project / "reports/report.html").stat().st_size > 10_000  # figures embedded


def test_stages_run_in_dependency_order_and_a_target_brings_only_its_ancestors():
    from flows.pipeline import dvc_stages, stage_order

    stages = dvc_stages(REPO)
    assert stage_order(stages) == [
        "params",
        "prepare",
        "filter",
        "tokenize",
        "search",
        "pretrain",
        "spike",
        "ablate",
        "sensitivity",
        "report",
    ]
    # the spike stage trains its own origin runs: it needs the tokens, not pretrain's milestones
    assert stage_order(stages, "spike") == ["params", "prepare", "filter", "tokenize", "spike"]
    assert stage_order(stages, "tokenize") == ["params", "prepare", "filter", "tokenize"]
    assert stage_order(stages, "ablate") == ["params", "prepare", "filter", "tokenize", "ablate"]
    assert stage_order(stages, "params") == ["params"]


def test_form_values_are_written_to_params_keeping_its_comments(tmp_path):
    from flows.pipeline import write_params

    copy_project(tmp_path)
    write_params(tmp_path, {"optim.lr": 0.02, "model.block": "post_ln", "profile": "default"})
    text = (tmp_path / "params.yaml").read_text()
    params = yaml.safe_load(text)
    assert params["optim"]["lr"] == 0.02 and params["model"]["block"] == "post_ln" and params["profile"] == "default"
    assert "# pre_ln | post_ln" in text and "# spikelab study parameters" in text


def test_a_failure_puts_params_lock_and_uncached_outputs_back_byte_for_byte(tmp_path):
    from flows.pipeline import restored_on_failure

    project = copy_project(tmp_path)
    (project / "dvc.lock").write_text("schema: '2.0'\n")
    (project / "metrics").mkdir()
    (project / "metrics/pretrain.json").write_text('{"steps": 30}\n')
    before = {
        p: p.read_bytes() for p in (project / "params.yaml", project / "dvc.lock", project / "metrics/pretrain.json")
    }
    with pytest.raises(RuntimeError, match="stage failed"), restored_on_failure(project):
        (project / "params.yaml").write_text("profile: broken\n")
        (project / "metrics/pretrain.json").unlink()
        (project / "reports/pretrain").mkdir(parents=True)  # a half-written output that did not exist
        raise RuntimeError("stage failed")
    assert {p: p.read_bytes() for p in before} == before
    assert not (project / "reports/pretrain").exists()


def test_the_last_lines_that_name_the_error_become_the_failure_message():
    from flows.pipeline import error_lines

    output = [
        "Running stage 'prepare':",
        "Traceback (most recent call last):",
        "InputError: data.path: x does not exist",
        "spikelab: error: data.path: x does not exist",
        "ERROR: failed to reproduce 'prepare'",
    ]
    assert error_lines(output) == output[-2:]
    assert error_lines(["a", "b", "Something failed here"]) == ["Something failed here"]
