"""The stage launcher (tasks/launcher.py): a stage forked from the warm process behaves as the
same command run in-process would (argv, cwd, environment, streams, exit code, signals, the code
on disk), and a client whose settings differ is not served by it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks import launcher

ROOT = Path(__file__).resolve().parents[1]
NOT_SERVED = 99

CLIENT = f"""
import sys
from tasks.launcher import run_in_launcher
code = run_in_launcher(sys.argv[2:], code=sys.argv[1])
sys.exit({NOT_SERVED} if code is None else code)
"""
"""A client process: runs ``python -c argv[1]`` in the launcher with the rest as its argv."""

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the launcher forks and uses abstract sockets")


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    """A launcher of its own: a temporary state directory, no servers (ports nothing answers on)."""
    state = tmp_path_factory.mktemp("launcher-state")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PREFECT_", "MLFLOW_")) and k != launcher.SWITCH_ENV}
    env.update(SPIKELAB_STATE=str(state), SPIKELAB_PREFECT_PORT="9", SPIKELAB_MLFLOW_PORT="9",
               SPIKELAB_DASHBOARD_PORT="9", PYTHONPATH=str(ROOT))
    python(env, "from tasks import launcher; launcher.start()")
    yield env
    python(env, "from tasks import launcher; launcher.stop()")


def python(env: dict[str, str], code: str) -> None:
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=180)


def launcher_pid(env: dict[str, str]) -> int:
    return json.loads((Path(env["SPIKELAB_STATE"]) / "services/launcher.json").read_text())["pid"]


def client(env: dict[str, str], code: str, *argv: str, cwd: Path = ROOT, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CLIENT, code, *argv], cwd=cwd, env=env, text=True, **popen)


ECHO = """
import json, os, sys
line = sys.stdin.readline()
print("to stderr", file=sys.stderr)
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "mark": os.environ.get("MARK"), "stdin": line,
                  "parent": os.getppid(),
                  "project_modules": sorted(m for m in sys.modules if m.split(".")[0] in ("flows", "tasks", "model"))}))
sys.exit(7)
"""


def test_a_forked_stage_has_the_clients_argv_cwd_environment_streams_and_exit_code(env, tmp_path):
    proc = client({**env, "MARK": "from the client"}, ECHO, "a", "--b=c", cwd=tmp_path,
                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate("hello\n", timeout=60)
    assert proc.returncode == 7, err
    seen = json.loads(out)
    assert seen["argv"] == ["a", "--b=c"] and seen["cwd"] == str(tmp_path) and seen["mark"] == "from the client"
    assert seen["stdin"] == "hello\n" and "to stderr" in err
    assert seen["parent"] == launcher_pid(env)  # forked by the launcher, not run by the client


def test_a_forked_stage_imports_the_project_code_afresh_not_the_launchers_copy(env):
    proc = client(env, ECHO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 7
    assert json.loads(out)["project_modules"] == []  # the launcher had loaded tasks.paths, tasks.launcher


WAIT_FOR_SIGNAL = """
import signal, sys, time
def note(signum, _frame):
    open(sys.argv[1], "w").write(signal.Signals(signum).name)
    sys.exit(128 + signum)
signal.signal(signal.SIGTERM, note)
signal.signal(signal.SIGINT, note)
print("ready", flush=True)
time.sleep(60)
"""


def wait_for(path: Path, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} was never written"
        time.sleep(0.1)
    return path.read_text()


def test_a_signal_to_the_client_reaches_the_stage_and_its_exit_code_comes_back(env, tmp_path):
    noted = tmp_path / "signal"
    proc = client(env, WAIT_FOR_SIGNAL, str(noted), stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C or DVC sends
    assert proc.wait(timeout=30) == 128 + signal.SIGINT
    assert noted.read_text() == "SIGINT"


def test_a_client_killed_outright_gives_its_stage_sigterm(env, tmp_path):
    noted = tmp_path / "signal"
    proc = client(env, WAIT_FOR_SIGNAL, str(noted), stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == "ready"
    proc.kill()  # no chance to forward anything: the stage hears the connection close
    proc.wait(timeout=30)
    assert wait_for(noted) == "SIGTERM"  # a training stage checkpoints on it, as when preempted


def test_a_client_with_other_prefect_settings_is_not_served(env):
    other = {**env, "PREFECT_API_URL": "http://127.0.0.1:9/api"}  # Prefect read its settings at import
    assert client(other, "import sys; sys.exit(0)").wait(timeout=60) == NOT_SERVED
    assert client(env, "import sys; sys.exit(0)").wait(timeout=60) == 0


def test_the_switch_turns_the_launcher_off(env):
    assert client({**env, launcher.SWITCH_ENV: "0"}, "import sys; sys.exit(0)").wait(timeout=60) == NOT_SERVED


def test_the_services_start_a_launcher_that_this_checkouts_stage_commands_reach(live_services):
    assert launcher.status().startswith("up")
    proc = client({**live_services, "PYTHONPATH": str(ROOT)}, ECHO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 7 and json.loads(out)["parent"] == launcher_pid(live_services)
