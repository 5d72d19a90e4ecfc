"""A stop loses nothing committed: a stage interrupted under ``dvc repro`` leaves the outputs git
has where they were (DVC keeps them, ``persist: true``; ``spikelab run`` sets them aside while the
flow runs and puts them back), and its MLflow run and the child runs it left RUNNING end KILLED."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from flows.stages import STAGES
from tasks.runtime.outputs import CACHED, KEPT_DIR, RESUMED, KeptOutputs
from tests.smoke_study import REPO, VENV_BIN, copy_project
from tests.trainer_kit import markov_tokens

SMOKE_VOCAB = 512
COMMITTED = {
    "metrics/search.json": '{"committed": "the search before this run"}\n',
    "search/lr.yaml": "optim:\n  lr: 0.00123\n",
}
"""The search stage's versioned outputs as a commit left them."""


def test_every_versioned_output_is_persistent_and_uncached_so_dvc_leaves_it_for_the_stage_to_replace():
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    for name, stage in STAGES.items():
        entries = [e for kind in ("outs", "metrics", "plots") for e in stages[name].get(kind, [])]
        flags = {e: {} for e in entries if isinstance(e, str)}
        flags.update({next(iter(e)): next(iter(e.values())) or {} for e in entries if isinstance(e, dict)})
        for out in stage.versioned:
            assert flags[str(out)].get("cache") is False and flags[str(out)].get("persist") is True, (name, out)
        for out in (p for p in stage.outs if p in CACHED):
            assert flags[str(out)].get("cache", True) and not flags[str(out)].get("persist"), (name, out)
        for out in (p for p in stage.outs if p in RESUMED):
            assert flags[str(out)].get("cache") is False and flags[str(out)].get("persist") is True, (name, out)


def test_outputs_set_aside_come_back_byte_for_byte_and_what_the_run_wrote_in_their_place_goes(tmp_path):
    (tmp_path / "reports/spike").mkdir(parents=True)
    (tmp_path / "reports/spike/data.png").write_bytes(b"committed figure")
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics/spike.json").write_text("{}\n")
    outs = [Path("metrics/spike.json"), Path("reports/spike"), Path("reports/postmortems")]
    kept = KeptOutputs(tmp_path, "spike", outs)
    assert kept.set_aside() == outs[:2]
    assert not (tmp_path / "reports/spike").exists()  # the flow starts from nothing, as DVC's removal did
    (tmp_path / "reports/spike").mkdir()
    (tmp_path / "reports/spike/half.png").write_bytes(b"half")
    (tmp_path / "reports/postmortems").mkdir()
    assert kept.put_back() == outs[:2]
    assert (tmp_path / "reports/spike/data.png").read_bytes() == b"committed figure"
    assert sorted(p.name for p in (tmp_path / "reports/spike").iterdir()) == ["data.png"]
    assert (tmp_path / "metrics/spike.json").read_text() == "{}\n"
    assert not (tmp_path / "reports/postmortems").exists() and not (tmp_path / KEPT_DIR / "spike").exists()


def test_outputs_left_aside_by_a_killed_run_are_put_back_before_the_next_run_sets_them_aside(tmp_path, capsys):
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics/filter.json").write_text('{"kept": 1}\n')
    KeptOutputs(tmp_path, "filter", [Path("metrics/filter.json")]).set_aside()  # then SIGKILL: nothing put back
    (tmp_path / "metrics/filter.json").write_text('{"half": ')
    again = KeptOutputs(tmp_path, "filter", [Path("metrics/filter.json")])
    assert again.set_aside() == [Path("metrics/filter.json")]
    assert "put back metrics/filter.json, set aside by an earlier run" in capsys.readouterr().err
    assert again.put_back() and (tmp_path / "metrics/filter.json").read_text() == '{"kept": 1}\n'


@pytest.mark.parametrize("signal_as", ["TerminationSignal", "KeyboardInterrupt"])
def test_an_interrupted_stage_run_ends_killed_and_so_do_the_child_runs_it_left_running(tmp_path, signal_as):
    import mlflow
    from prefect.exceptions import TerminationSignal

    from tasks.config import Config
    from tasks.runtime.tracking import stage_run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    interrupt = TerminationSignal(signal.SIGTERM) if signal_as == "TerminationSignal" else KeyboardInterrupt()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_TRACKING_URI", uri)
        env.setenv("SPIKELAB_STATE", str(tmp_path / "state"))
        mlflow.set_tracking_uri(uri)
        client = mlflow.MlflowClient(uri)
        try:
            with pytest.raises(type(interrupt)), stage_run(Config(), "search") as run:
                experiment = run.info.experiment_id
                # trials a worker process opened under the stage run: one done, one cut off, one nested deeper
                done = client.create_run(experiment, tags={"mlflow.parentRunId": run.info.run_id})
                client.set_terminated(done.info.run_id, "FINISHED")
                cut = client.create_run(experiment, tags={"mlflow.parentRunId": run.info.run_id})
                deeper = client.create_run(experiment, tags={"mlflow.parentRunId": cut.info.run_id})
                raise interrupt
        finally:
            while mlflow.active_run():
                mlflow.end_run()
            mlflow.set_tracking_uri(None)  # back to MLFLOW_TRACKING_URI: "" would stick as a file store
    status = [client.get_run(r.info.run_id).info.status for r in (run, done, cut, deeper)]
    assert status == ["KILLED", "FINISHED", "KILLED", "KILLED"]


def slow_search_project(root: Path) -> Path:
    """The smoke profile with trials long enough to be caught running, and token shards in place
    of the data stages (what the search reads: tests/test_search.py: tiny_project)."""
    project = copy_project(root)
    profile = project / "profiles/smoke.yaml"
    smoke = yaml.safe_load(profile.read_text())
    smoke["search"].update(steps=100_000, eval_every=50_000, widths=[16, 32])
    profile.write_text(yaml.safe_dump(smoke))
    tokens = project / "data/tokens"
    tokens.mkdir(parents=True)
    splits = {}
    for split, data in (("train", markov_tokens(20_000, SMOKE_VOCAB)), ("val", markov_tokens(4_000, SMOKE_VOCAB, 1))):
        (tokens / f"{split}.bin").write_bytes(data.tobytes())
        splits[split] = {"path": f"{split}.bin", "sha256": hashlib.sha256(data.tobytes()).hexdigest()}
    manifest = {"dtype": "uint16", "vocab_size": SMOKE_VOCAB, "splits": splits}
    (tokens / "manifest.json").write_text(json.dumps(manifest))
    for path, text in COMMITTED.items():
        (project / path).parent.mkdir(parents=True, exist_ok=True)
        (project / path).write_text(text)
    return project


def dvc(args: list[str], project: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    env = {**env, "PATH": f"{VENV_BIN}{os.pathsep}{env['PATH']}"}
    return subprocess.run(["dvc", *args], cwd=project, env=env, capture_output=True, text=True, timeout=300)


def newest_flow_run(env: dict[str, str], flow: str) -> dict:
    import urllib.request

    from tasks.runtime.credentials import basic_auth

    body = {"flows": {"name": {"any_": [flow]}}, "sort": "START_TIME_DESC", "limit": 1}
    request = urllib.request.Request(
        f"{env['PREFECT_API_URL']}/flow_runs/filter",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **basic_auth(env["PREFECT_API_AUTH_STRING"])},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        (flow_run,) = json.load(response)
    return dict(flow_run)


def running_search(client, experiment_name: str, since_ms: int):
    """The search stage's MLflow run once it has a trial RUNNING, else None."""
    experiment = client.get_experiment_by_name(experiment_name)
    if experiment is None:
        return None
    stage = f"tags.`spikelab.stage` = 'search' and attributes.start_time >= {since_ms}"
    for run in client.search_runs([experiment.experiment_id], stage + " and attributes.status = 'RUNNING'"):
        trials = f"tags.`mlflow.parentRunId` = '{run.info.run_id}' and attributes.status = 'RUNNING'"
        if client.search_runs([experiment.experiment_id], trials):
            return run
    return None


@pytest.mark.e2e
def test_sigterm_during_a_stage_under_dvc_repro_keeps_the_committed_outputs_and_ends_its_runs_killed(
    live_services, tmp_path
):
    import mlflow

    project = slow_search_project(tmp_path)
    assert dvc(["init", "--no-scm"], project, live_services).returncode == 0
    done = dvc(["repro", "--single-item", "params"], project, live_services)
    assert done.returncode == 0, done.stdout + done.stderr
    client = mlflow.MlflowClient(live_services["MLFLOW_TRACKING_URI"])
    started = int(time.time() * 1000)
    env = {**live_services, "PATH": f"{VENV_BIN}{os.pathsep}{live_services['PATH']}", "PYTHONUNBUFFERED": "1"}
    repro = subprocess.Popen(
        ["dvc", "repro", "--single-item", "search"],
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: the signal a job scheduler or `kill -- -PGID` sends
    )
    try:
        deadline, run = time.monotonic() + 240, None
        while run is None and repro.poll() is None and time.monotonic() < deadline:
            time.sleep(1)
            run = running_search(client, "spikelab-smoke", started)
        assert run is not None, f"no search trial seen running: {repro.poll()}"
        group = [psutil.Process(repro.pid), *psutil.Process(repro.pid).children(recursive=True)]
        os.killpg(repro.pid, signal.SIGTERM)
        _, alive = psutil.wait_procs(group, timeout=120)
        assert not alive, f"still running 120 s after SIGTERM: {[p.pid for p in alive]}"
    finally:
        if repro.poll() is None:
            os.killpg(repro.pid, signal.SIGKILL)
        output = repro.communicate(timeout=60)[0]

    for path, text in COMMITTED.items():
        assert (project / path).read_text() == text, f"{path}: not as committed\n{output[-3000:]}"
    assert not (project / KEPT_DIR / "search").exists(), "everything set aside was put back"
    assert "spikelab: search stopped by SIGTERM" in output and "run it again to resume" in output, output[-3000:]

    stage = client.get_run(run.info.run_id)
    assert stage.info.status == "KILLED", output[-3000:]
    experiment = stage.info.experiment_id
    trials = client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{run.info.run_id}'")
    assert trials and not [t.info.run_name for t in trials if t.info.status == "RUNNING"]
    assert "KILLED" in {t.info.status for t in trials}

    flow_run = newest_flow_run(live_services, "search")
    assert flow_run["state"]["name"] == "Cancelled" and "stopped by SIGTERM" in flow_run["state"]["message"]

    status = dvc(["status", "search"], project, live_services)  # DVC, killed too, left no lock behind
    assert status.returncode == 0 and "search" in status.stdout, status.stdout + status.stderr


HALF_WRITTEN_STAGE = """
import os
import signal
import sys
import time
from pathlib import Path

import flows.__main__ as cli
from flows.stages import Stage
from prefect import flow

@flow(name="probe-stopped-after-writing")
def stage(profile=None, overrides=None):
    Path("metrics/filter.json").write_text('{"half": ')  # a versioned output, half written
    os.kill(os.getpid(), signal.SIGTERM)  # what a job scheduler sends
    time.sleep(60)

Stage.load_flow = lambda _self: stage
sys.exit(cli.main(["run", "filter", "--profile", "smoke"]))
"""


@pytest.mark.e2e
def test_a_stage_stopped_after_writing_a_versioned_output_puts_the_committed_bytes_back_and_exits_75(
    live_services, tmp_path
):
    project = copy_project(tmp_path)
    (project / "data/raw").mkdir(parents=True)  # filter's input, so the stage starts
    (project / "metrics").mkdir()
    committed = '{"committed": "the filter before this run"}\n'
    (project / "metrics/filter.json").write_text(committed)
    done = subprocess.run(
        [sys.executable, "-c", HALF_WRITTEN_STAGE],
        cwd=project,
        env={**live_services, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 75, done.stderr[-3000:]
    assert (project / "metrics/filter.json").read_text() == committed
    assert not (project / KEPT_DIR).exists()
    said = [line for line in done.stderr.splitlines() if line.startswith("spikelab: ")]
    assert len(said) == 1 and said[0].startswith("spikelab: filter stopped by SIGTERM; "), done.stderr[-3000:]


TWO_STAGES = """\
stages:
  filter:
    cmd: python -c "open('metrics/filter.json', 'w').write('{FILTER}')"
    metrics:
      - metrics/filter.json:
          cache: false
          persist: true
  search:
    cmd: python -c "import time; open('search/lr.yaml', 'w').write('{LR}'); time.sleep({SLEEP})"
    deps:
      - metrics/filter.json
    outs:
      - search/lr.yaml:
          cache: false
          persist: true
"""
"""Two stages writing two of the project's versioned outputs, the second one slow: stand-ins for
the flows (they restore nothing themselves), so what the stop leaves is the recipe's doing."""


def git(project: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=project, capture_output=True, text=True, check=True).stdout


def test_make_repro_stopped_by_ctrl_c_leaves_dvc_lock_and_every_tracked_output_as_committed(tmp_path):
    project = copy_project(tmp_path / "project")
    for name in ("Makefile", "scripts/private-shell", "scripts/private-env.sh"):
        (project / name).parent.mkdir(exist_ok=True)
        shutil.copy2(REPO / name, project / name)
    (project / "metrics").mkdir()
    (project / "search").mkdir()
    # No server of the session's (a test before this one may have pointed os.environ at them): make
    # repro as a user runs it before `spikelab services up`.
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "PREFECT_HOME")}
    env |= {"PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", "SPIKELAB_STATE": str(tmp_path / "s")}
    (project / "dvc.yaml").write_text(TWO_STAGES.format(FILTER="committed", LR="committed", SLEEP=0))
    git(project, "init", "-q")
    assert dvc(["init", "-q"], project, env).returncode == 0
    done = dvc(["repro"], project, env)
    assert done.returncode == 0, done.stdout + done.stderr
    git(project, "add", "-A")
    git(project, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "the committed study")
    committed = {p: (project / p).read_bytes() for p in ("dvc.lock", "metrics/filter.json", "search/lr.yaml")}

    (project / "dvc.yaml").write_text(TWO_STAGES.format(FILTER="new", LR="written", SLEEP=300))
    make = subprocess.Popen(
        ["make", "-o", "setup", "-o", "services", "repro"],  # setup and the servers: not this test's
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: what Ctrl-C in a terminal reaches
    )
    try:
        deadline = time.monotonic() + 120
        while (project / "search/lr.yaml").read_text() != "written" and time.monotonic() < deadline:
            time.sleep(0.2)  # filter finished (dvc.lock and its metrics changed), search wrote its output
        assert (project / "search/lr.yaml").read_text() == "written", make.poll()
        os.killpg(make.pid, signal.SIGINT)
        output = make.communicate(timeout=120)[0]
    except subprocess.TimeoutExpired:
        os.killpg(make.pid, signal.SIGKILL)
        pytest.fail(f"make repro still running 120 s after Ctrl-C; it printed:\n{make.communicate()[0]}")
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGKILL)
    assert make.returncode == -signal.SIGINT, output  # make ends by the signal, as any stopped command (130)
    assert "make repro: stopped; dvc.lock and every output git tracks are as they were" in output, output
    assert {p: (project / p).read_bytes() for p in committed} == committed
    assert git(project, "status", "--porcelain", "--untracked-files=no") == " M dvc.yaml\n"


def test_dvc_repro_exits_255_for_a_bad_declaration_and_prints_the_stages_one_line_error(tmp_path):
    project = copy_project(tmp_path)
    (project / "studies.yaml").write_text("families:\n  mine:\n    factors: {model: {no_such_key: [1, 2]}}\n")
    env = {**os.environ, "SPIKELAB_STATE": str(tmp_path / "state")}
    assert dvc(["init", "--no-scm", "-q"], project, env).returncode == 0
    done = dvc(["repro", "params"], project, env)
    assert done.returncode == 255, done.stdout + done.stderr  # DVC's code for any failed stage
    errors = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("spikelab: error: ")]
    assert len(errors) == 1 and "studies.yaml" in errors[0], done.stdout + done.stderr
    assert "exited with 2" in done.stderr, done.stderr
