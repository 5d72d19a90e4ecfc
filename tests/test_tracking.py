"""MLflow conventions against a real (SQLite) tracking store: each run ends with the status of
how it stopped, a run left RUNNING by a killed process is closed as KILLED when a stage next
starts, child runs nest under their stage run with its lineage, losses sort first."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest

from model.stops import Diverged, Preempted
from tasks.config import Config

REPO = Path(__file__).resolve().parents[1]
CFG = Config().replace(**{"tracking.experiment": "tracking-test"})


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One SQLite store for the module (creating one costs seconds)."""
    import mlflow

    tmp = tmp_path_factory.mktemp("tracking")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_TRACKING_URI", uri)
        env.setenv("SPIKELAB_STATE", str(tmp / "state"))
        mlflow.set_tracking_uri(uri)
        yield mlflow.MlflowClient(uri)
        while mlflow.active_run():
            mlflow.end_run()
        mlflow.set_tracking_uri(None)  # back to MLFLOW_TRACKING_URI: "" would stick as a file store


def stage_run_status(client, exc: BaseException | None) -> str:
    from tasks.runtime.tracking import stage_run

    with pytest.raises(type(exc)) if exc else nullcontext(), stage_run(CFG, "probe") as run:
        if exc:
            raise exc
    return client.get_run(run.info.run_id).info.status


@pytest.mark.parametrize(
    "exc, status",
    [(None, "FINISHED"), (Preempted(7), "KILLED"), (Diverged(7, "nan"), "FAILED"), (ValueError("boom"), "FAILED")],
)
def test_a_stage_run_ends_with_the_status_of_how_it_stopped(store, exc, status):
    assert stage_run_status(store, exc) == status


def test_the_experiment_opens_as_model_training_and_runs_say_what_ran(store):
    from tasks.runtime.tracking import stage_run

    with stage_run(CFG, "pretrain", identity="0123456789abcdef") as run:
        pass
    experiment = store.get_experiment(run.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    finished = store.get_run(run.info.run_id)
    assert finished.info.run_name == "pretrain default 01234567"
    tags = finished.data.tags
    assert tags["spikelab.run_identity"] == "0123456789abcdef" and tags["spikelab.profile"] == "default"
    assert tags["spikelab.dvc_exp"] == "workspace" and len(tags["spikelab.dvc_inputs"]) == 16
    assert len(tags["mlflow.source.git.commit"]) == 40 and not tags["mlflow.source.git.commit"].endswith("-dirty")


def test_the_data_digest_follows_the_resolved_config_not_the_params_file(store):
    from tasks.runtime.tracking import dvc_inputs_digest

    assert dvc_inputs_digest("filter", CFG) != dvc_inputs_digest("filter", CFG.replace(**{"filter.min_chars": 7}))
    assert dvc_inputs_digest("filter", CFG) == dvc_inputs_digest("filter", CFG.replace(**{"optim.lr": 0.5}))


KILLED_MIDWAY = """
import os, signal
from tasks.config import Config
from tasks.runtime.tracking import stage_run
with stage_run(Config().replace(**{"tracking.experiment": "tracking-test"}), "pretrain") as run:
    print(run.info.run_id, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_run_left_running_by_a_killed_process_is_closed_as_killed_when_a_stage_next_starts(store):
    from tasks.runtime.tracking import stage_run

    done = subprocess.run(
        [sys.executable, "-c", KILLED_MIDWAY], cwd=REPO, env=os.environ, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    orphan = done.stdout.split()[0]
    assert store.get_run(orphan).info.status == "RUNNING"
    with stage_run(CFG, "pretrain") as run:
        assert store.get_run(run.info.run_id).info.status == "RUNNING"  # its own run, alive, is left alone
    assert store.get_run(orphan).info.status == "KILLED"


def test_child_runs_nest_under_the_stage_run_with_its_lineage_and_their_own_status(store):
    from tasks.runtime.tracking import child_run, stage_run

    with stage_run(CFG, "ablate") as parent:
        with child_run("arm post_ln seed 0", {"spikelab.arm": "post_ln"}) as ok:
            pass
        with pytest.raises(Diverged), child_run("arm fp16 seed 0") as bad:
            raise Diverged(3, "loss above bound")
    ok, bad = store.get_run(ok.info.run_id), store.get_run(bad.info.run_id)
    assert ok.data.tags["mlflow.parentRunId"] == bad.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert ok.info.experiment_id == parent.info.experiment_id  # not the default experiment
    assert ok.data.tags["spikelab.stage"] == "ablate" and ok.data.tags["spikelab.arm"] == "post_ln"
    assert (ok.info.status, bad.info.status) == ("FINISHED", "FAILED")
    assert store.get_run(parent.info.run_id).info.status == "FINISHED"


def test_a_stage_runs_arithmetic_is_tagged_and_an_in_process_child_inherits_it_unless_it_brings_its_own(store):
    from model.provenance import provenance
    from tasks.runtime.tracking import child_run, numerics_tags, stage_run

    here = provenance()
    elsewhere = {**here, "numeric_path": "1234567890ab"}  # an arm trained on another machine
    with stage_run(CFG, "ablate", numerics=here) as parent:
        with child_run("branch") as inherits:
            pass
        with child_run("arm", numerics_tags(elsewhere)) as own:
            pass
    tags = [store.get_run(r.info.run_id).data.tags for r in (parent, inherits, own)]
    assert [t["spikelab.numerics.numeric_path"] for t in tags] == [here["numeric_path"]] * 2 + ["1234567890ab"]
    assert tags[0]["spikelab.numerics.cpu.isa"] == (",".join(here["cpu"]["isa"]) or "none")
    assert tags[0]["spikelab.numerics.aten_capability"] == here["aten_capability"]


def test_losses_are_named_to_sort_before_the_other_metric_groups():
    from tasks.runtime.tracking import metric_name

    names = sorted(metric_name(n) for n in ["train/loss", "val/loss", "stats/act_l2/block0", "train/grad_norm"])
    assert names[:2] == ["loss/train", "loss/val"]
