"""The command line: help answers at once without heavy imports, reads cleanly and shows
examples; --set values are typed by their keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flows.stages import PARAMS_STAGE, STAGES

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "prefect", "mlflow", "dvc", "optuna")


def test_help_answers_without_importing_heavy_libraries():
    """``spikelab --help`` loads the standard library, PyYAML and the project's own modules, and
    nothing else: its speed measured as work (the modules it imports), not as a wall time that a
    loaded machine stretches. Its time is benchmarks/bench_overhead.py's ``help_s``."""
    probe = (
        "import sys, contextlib, io, json\nbefore = set(sys.modules)\nfrom flows.__main__ import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try: main(['--help'])\n    except SystemExit: pass\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
        "print(json.dumps(sorted(m for m in new if m not in sys.stdlib_module_names)))"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and len(done.stdout.splitlines()) == 2, done.stdout + done.stderr
    heavy, third_party = done.stdout.splitlines()
    assert heavy == "[]", done.stdout + done.stderr
    imported = json.loads(third_party)
    loaded = {m for m in imported if not m.startswith(("_cython", "cython_runtime"))}  # PyYAML's C loader
    assert loaded <= {"flows", "model", "tasks", "yaml"}, f"spikelab --help imported {sorted(loaded)}"


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"]])
def test_help_text_has_examples_and_no_raw_markup(argv, capsys):
    from flows.__main__ import main

    with pytest.raises(SystemExit):
        main(argv)
    out = capsys.readouterr().out
    assert "``" not in out and ":func:" not in out
    if argv == ["--help"]:
        assert "examples:" in out and "spikelab run pretrain --set optim.lr=0.02" in out


def test_set_values_are_typed_by_their_key_and_a_malformed_pair_is_a_user_error():
    from model.typed_config import UserError, parse_sets
    from tasks.config import load_config

    sets = parse_sets(
        ["optim.lr=0.02", "model.qk_norm=true", "train.steps=550", "model.block=post_ln", "data.path=007"]
    )
    cfg = load_config(REPO / "params.yaml", overrides=sets)
    assert (cfg.optim.lr, cfg.model.qk_norm, cfg.train.steps, cfg.model.block) == (0.02, True, 550, "post_ln")
    assert cfg.data.path == "007"  # a string-typed key keeps its text, not YAML's 7
    for bad in ("optim.lr", "=3"):
        with pytest.raises(UserError, match="expected key=value"):
            parse_sets([bad])


def test_a_bad_set_value_exits_2_naming_the_key(capsys):
    from flows.__main__ import main

    assert main(["run", "pretrain", "--set", "optim.beta2=1.5"]) == 2
    assert "spikelab: error: optim.beta2" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (
            ["run", "ablate", "--family", "qk_rescu"],
            "spikelab: error: --family: 'qk_rescu' is not a family of the study (xiong,",
        ),
        (["run", "pretrain", "--family", "xiong"], "spikelab: error: --family: only the ablate stage trains"),
    ],
)
def test_a_family_run_alone_must_be_one_the_study_declares_and_on_the_ablate_stage(argv, says, capsys):
    from flows.__main__ import main

    assert main(argv) == 2
    assert capsys.readouterr().err.startswith(says)


@pytest.mark.parametrize(("shell", "kept"), [(0o000, 0o022), (0o002, 0o022), (0o022, 0o022), (0o077, 0o077)])
def test_what_a_command_writes_is_never_writable_by_other_users_whatever_the_shells_umask(shell, kept):
    from flows.__main__ import main

    before = os.umask(shell)
    try:
        assert main(["run", "pretrain", "--set", "optim.beta2=1.5"]) == 2  # any command, even one refused
        assert os.umask(before) == kept
    finally:
        os.umask(before)


@pytest.mark.parametrize("stop, code", [("Preempted", 75), ("Diverged", 3), ("Stopped", 4)])
def test_a_run_that_did_not_complete_exits_with_its_code_and_one_line_saying_what_next(monkeypatch, capsys, stop, code):
    import flows.__main__ as cli
    from model import stops

    def run_stage(*_):
        raise getattr(stops, stop)(12, "why")

    monkeypatch.setattr(cli, "run_stage", run_stage)
    assert cli.main(["run", "pretrain"]) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"spikelab: {getattr(stops, stop).status} at step 12: why (")


def test_status_lists_every_dvc_stage_params_included(monkeypatch):
    import flows.__main__ as cli

    changed = '{"params": [{"changed deps": {"params.yaml": "modified"}}]}'
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, changed, ""))
    monkeypatch.chdir(REPO)
    lines = cli.stage_status()
    assert [line.split()[0] for line in lines][: len(STAGES) + 1] == [PARAMS_STAGE, *STAGES]
    assert lines[0].split(None, 1)[1] == "changed: changed deps (params.yaml)"
    assert all(line.endswith("up to date") for line in lines[1:])


STOPPED_STAGE = """
import sys
import flows.__main__ as cli
from prefect import flow
from flows.stages import Stage
from model import stops

@flow(name="probe-typed-stop")
def stage(profile=None, overrides=None):
    raise getattr(stops, sys.argv[1])(12, "SIGTERM/SIGINT")

Stage.load_flow = lambda _self: stage  # every stage runs the probe
sys.exit(cli.main(["run", "prepare", "--profile", "smoke"]))  # the stage that needs no other's outputs
"""


@pytest.mark.e2e
@pytest.mark.parametrize("stop, code, state", [("Preempted", 75, "Cancelled"), ("Diverged", 3, "Failed")])
def test_a_typed_stop_shows_in_prefect_as_what_it_was_with_what_to_do_next(live_services, stop, code, state, tmp_path):
    from tests.smoke_study import copy_project
    from tests.test_stop_keeps_outputs import newest_flow_run

    done = subprocess.run(
        [sys.executable, "-c", STOPPED_STAGE, stop],
        cwd=copy_project(tmp_path),  # not the checkout: its outputs would be set aside meanwhile
        capture_output=True,
        text=True,
        env={**live_services, "PYTHONPATH": str(REPO)},
        timeout=300,
    )
    assert done.returncode == code, done.stderr[-3000:]
    flow_run = newest_flow_run(live_services, "probe-typed-stop")
    assert flow_run["state"]["name"] == state, flow_run["state"]
    assert flow_run["state"]["message"].startswith(f"{stop.lower()} at step 12") and "(" in flow_run["state"]["message"]


HELPED = [["run"], ["status"], ["ui"], ["serve"], ["services"], ["cluster"], ["check"]] + [
    ["cluster", action] for action in ("up", "join", "down", "status")
]


@pytest.mark.parametrize("command", HELPED, ids=" ".join)
def test_every_commands_help_says_what_it_does_its_options_and_an_example(command, capsys):
    from flows.__main__ import main

    with pytest.raises(SystemExit) as done:
        main([*command, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    usage, _, rest = out.partition("\n\n")
    description = rest.split("\n\n")[0]
    assert usage.startswith(f"usage: spikelab {' '.join(command)}") and len(description.split()) >= 8, out
    assert "options:\n  -h, --help" in out, out
    examples = out.rpartition("example")[2].splitlines()[1:]
    assert examples and all(line.startswith("  ") for line in examples), out
    assert any(line.split()[:2] == ["spikelab", command[0]] for line in examples), out
    assert all(len(line) <= 100 for line in out.splitlines()), "a line wider than a terminal"
    assert "``" not in out and ":func:" not in out


def test_services_help_names_each_action_and_where_the_login_is_never_a_password(capsys):
    from flows.__main__ import main

    with pytest.raises(SystemExit):
        main(["services", "--help"])
    out = capsys.readouterr().out
    for action in ("up", "down", "status", "info"):
        assert f"\n  {action:8}" in out, action
    assert "credentials.json (mode 0600)" in out and "password" in out.split("nothing prints the")[1][:12]


@pytest.mark.parametrize(
    ("argv", "needs"),
    [
        (["run", "search", "--set"], "expected one argument"),
        (["services", "restart"], "invalid choice"),
        (["check", "arithmetics"], "invalid choice"),
    ],
)
def test_a_mistyped_command_says_what_is_wrong_in_one_line_without_a_traceback(argv, needs):
    done = subprocess.run([sys.executable, "-m", "flows", *argv], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert needs in done.stderr.strip().splitlines()[-1], done.stderr


def test_a_check_runs_its_script_with_the_rest_of_the_command_line_and_returns_its_status():
    from flows.checks import CHECKS, CHECKS_DIR

    assert sorted(p.name for p in CHECKS_DIR.glob("*.py")) == sorted(script for script, _ in CHECKS.values())
    helped = subprocess.run(
        [sys.executable, "-m", "flows", "check", "mlflow", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert helped.returncode == 0 and helped.stdout.startswith("usage: spikelab check mlflow [-h]"), helped.stderr
    refused = subprocess.run(
        [sys.executable, "-m", "flows", "check", "mlflow", "--no-such-option"], cwd=REPO, capture_output=True, text=True
    )
    assert refused.returncode == 2 and "unrecognized arguments: --no-such-option" in refused.stderr
