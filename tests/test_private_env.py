"""No shared scratch: every engine's temporary files, caches and locks stay in folders the owner
alone can write, and no engine phones home (tasks/runtime/private_env.py), and what another local user planted first in the
shared folders, where the engines look by default, is never used.

The attacks act as the user ``nobody`` (tests/other_user.py) and plant first; the owner's side
runs as a user's command would: from a shell whose environment names none of the engines'
folders, through make's shell (scripts/private-shell, what ``make repro`` runs ``dvc`` in) or a
``spikelab`` command.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.runtime import paths
from tasks.runtime.paths import UnsafeFolder
from tasks.runtime.private_env import ENGINE_FOLDERS, private_env
from tests.other_user import OTHER, give_to, readable_packages, run_as_other_user, skip_reason

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def users_shell(state: Path) -> dict[str, str]:
    """The environment of a user's shell: none of the engines' folders named (TMPDIR unset, as
    it usually is), the project's tools on PATH, this state directory."""
    env = {k: v for k, v in os.environ.items() if k not in ENGINE_FOLDERS}
    return {**env, "PATH": f"{BIN}:{env['PATH']}", "SPIKELAB_STATE": str(state)}


def in_makes_shell(command: str, state: Path, cwd: Path = ROOT, **kw) -> subprocess.CompletedProcess:
    """``command`` run as a make recipe runs it (Makefile: SHELL), from a user's shell."""
    return subprocess.run(
        [str(ROOT / "scripts" / "private-shell"), "-c", command],
        cwd=cwd,
        env=users_shell(state),
        capture_output=True,
        text=True,
        **kw,
    )


@pytest.fixture
def planted(request):
    """A folder in a shared location that ``nobody`` made first (mode 0777, as DVC makes its own),
    removed afterwards; skips where another user cannot be acted as, or the path is already there
    (another checkout's engine uses it: not ours to remove)."""
    if reason := skip_reason():
        pytest.skip(reason)
    path = Path(request.param)
    if os.path.lexists(path):
        pytest.skip(f"{path} exists already on this machine; the test plants it itself")
    done = run_as_other_user(
        "import os, sys; os.makedirs(sys.argv[1], mode=0o777); os.chmod(sys.argv[1], 0o777)", str(path)
    )
    assert done.returncode == 0, done.stderr
    yield path
    shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# The folders: made private, and refused when another user could have been there first
# --------------------------------------------------------------------------------------------


def test_every_engines_scratch_is_a_folder_of_its_own_only_its_owner_may_enter(tmp_path):
    env = private_env(tmp_path / "scratch")
    folders = {var: env[var] for var in ENGINE_FOLDERS}
    assert len(set(folders.values())) == len(ENGINE_FOLDERS)
    for folder in map(Path, folders.values()):
        assert folder.parent == tmp_path / "scratch" and mode(folder) == 0o700
    assert mode(tmp_path / "scratch") == 0o700


def test_a_scratch_folder_another_user_made_first_is_refused_naming_it_and_left_as_it_was(tmp_path):
    if reason := skip_reason():
        pytest.skip(reason)
    scratch = tmp_path / "scratch"
    scratch.mkdir(mode=0o700)
    (scratch / "tmp").mkdir(mode=0o700)
    os.chown(scratch / "tmp", pwd.getpwnam(OTHER).pw_uid, -1)
    with pytest.raises(UnsafeFolder, match=f"scratch folder {scratch / 'tmp'}: owned by another user"):
        private_env(scratch)
    assert (scratch / "tmp").stat().st_uid == pwd.getpwnam(OTHER).pw_uid and not any((scratch / "tmp").iterdir())


@pytest.mark.parametrize(("folder_mode", "refused"), [(0o755, False), (0o775, True), (0o757, True), (0o1777, True)])
def test_a_scratch_folder_of_ones_own_is_refused_once_others_may_write_it(tmp_path, folder_mode, refused):
    """0755 is the last mode that keeps others out; the sticky bit does not help: what they put
    in it first stays there for the owner's engine to load."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    scratch.chmod(folder_mode)
    if refused:
        with pytest.raises(UnsafeFolder, match=f"scratch folder {scratch}: other users may write it"):
            private_env(scratch)
    else:
        assert private_env(scratch)["TMPDIR"] == str(scratch / "tmp")
        assert scratch.stat().st_mode & 0o777 == folder_mode  # not a secret folder: its owner's mode is kept


def test_a_scratch_folder_that_is_a_link_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "scratch").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafeFolder, match="not a folder"):
        private_env(tmp_path / "scratch")


@pytest.mark.parametrize(
    ("owner", "parent_mode", "refused"),
    [
        (None, 0o1777, False),
        (None, 0o777, True),
        (None, 0o755, False),
        (OTHER, 0o755, True),
        ("root", 0o755, False),
    ],
)
def test_a_state_directory_in_a_folder_others_may_rename_things_in_is_refused(
    tmp_path, monkeypatch, owner, parent_mode, refused
):
    """/tmp's sticky bit keeps others from renaming the owner's entries; without it they could swap
    the whole state directory. A folder another user owns is theirs to rename things in whatever
    its mode (``nobody``'s, 0755); root's (/, /home) is not another user's. ``owner`` None: this user."""
    parent = tmp_path / "shared"
    parent.mkdir()
    uid = give_to(parent, owner)
    parent.chmod(parent_mode)
    monkeypatch.setenv("SPIKELAB_STATE", str(parent / "state"))
    if refused:
        with pytest.raises(
            UnsafeFolder,
            match=rf"{parent} above it is another user's or writable by others \(uid {uid}, mode {parent_mode:04o}\)",
        ):
            paths.state_dir()
        assert not any(parent.iterdir())  # nothing made in it
    else:
        assert paths.state_dir() == parent / "state"


# --------------------------------------------------------------------------------------------
# The entry points: make's shell, scripts/setup.sh, every spikelab command
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("shell_umask", "kept"), [(0o000, 0o022), (0o002, 0o022), (0o077, 0o077)])
def test_makes_recipes_run_with_the_clis_umask_and_every_engines_scratch_private(tmp_path, shell_umask, kept):
    state = tmp_path / "state"
    before = os.umask(shell_umask)
    try:
        done = in_makes_shell("umask; env", state)
    finally:
        os.umask(before)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert int(lines[0], 8) == kept
    env = dict(line.split("=", 1) for line in lines[1:] if "=" in line)
    assert {var: env[var] for var in ENGINE_FOLDERS} == {
        var: str(state / "scratch" / folder) for var, folder in ENGINE_FOLDERS.items()
    }


TELEMETRY_OFF = {
    "DO_NOT_TRACK": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DVC_NO_ANALYTICS": "true",
    "HF_HUB_DISABLE_TELEMETRY": "1",
}
"""Every engine's switch for its usage reports, by value: written out here, not read from
tasks/runtime/private_env.py, so that a switch dropped there fails the test below."""
SPIKELABS_CHILD = """
import contextlib, io, subprocess, sys
from flows.__main__ import main
with contextlib.redirect_stdout(io.StringIO()):
    assert main(["ui"]) == 0
sys.exit(subprocess.run(["env"]).returncode)
"""
"""``spikelab ui`` run as the console script runs it (flows/__main__.py: main), then a child it
starts, which prints the environment it was given."""


@pytest.mark.parametrize("entry", ["make's shell", "a spikelab command"])
def test_makes_shell_and_a_spikelab_command_turn_every_engines_telemetry_off_for_their_children(
    tmp_path, monkeypatch, entry
):
    for var in TELEMETRY_OFF:  # a user's shell sets none of them (this session's does): the entry point must
        monkeypatch.delenv(var, raising=False)
    state = tmp_path / "state"
    if entry == "make's shell":
        done = in_makes_shell("env", state)
    else:
        command = [sys.executable, "-c", SPIKELABS_CHILD]
        done = subprocess.run(command, cwd=ROOT, env=users_shell(state), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    env = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    assert {var: env.get(var) for var in TELEMETRY_OFF} == TELEMETRY_OFF


def test_makes_shell_stops_naming_a_scratch_folder_another_user_made(tmp_path):
    if reason := skip_reason():
        pytest.skip(reason)
    state = tmp_path / "state"
    (state / "scratch").mkdir(parents=True, mode=0o700)
    os.chown(state / "scratch", pwd.getpwnam(OTHER).pw_uid, -1)
    done = in_makes_shell("echo ran", state)
    assert done.returncode == 2 and "ran" not in done.stdout
    assert done.stderr.strip() == (
        f"spikelab: error: scratch folder {state / 'scratch'}: owned by another user "
        f"(uid {pwd.getpwnam(OTHER).pw_uid}); remove it (or choose another SPIKELAB_STATE)"
    )


def test_setup_and_the_ci_script_run_in_the_private_environment():
    """scripts/setup.sh (pip's temporary files; DVC typed in a shell later) and .ci/run (its log)."""
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "source scripts/private-env.sh" in setup
    assert '.venv/bin/dvc config --local core.site_cache_dir "$DVC_SITE_CACHE_DIR"' in setup
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.index("source scripts/private-env.sh") < ci.index("mktemp")
    assert (ROOT / "Makefile").read_text().count("SHELL := $(CURDIR)/scripts/private-shell") == 1


def test_a_spikelab_command_makes_its_scratch_first_and_refuses_an_unsafe_one_without_a_traceback(tmp_path):
    state = tmp_path / "state"
    done = subprocess.run([str(BIN / "spikelab"), "ui"], env=users_shell(state), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (state / "scratch").iterdir()) == sorted(ENGINE_FOLDERS.values())
    (state / "scratch" / "tmp").chmod(0o777)
    done = subprocess.run([str(BIN / "spikelab"), "ui"], env=users_shell(state), capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"scratch folder {state / 'scratch' / 'tmp'}: other users may write it (mode 0777)" in done.stderr


def test_the_gpu_studys_commands_take_the_private_environment_as_spikelab_commands_do(tmp_path):
    """``python -m flows.gpu_study`` plans on this machine, and its loss-shift probe loads torch:
    its caches go to the private scratch, never /tmp/torchinductor_<user>."""
    state = tmp_path / "state"
    command = [sys.executable, "-m", "flows.gpu_study", "--project", str(tmp_path), "status"]
    done = subprocess.run(command, cwd=ROOT, env=users_shell(state), capture_output=True, text=True)
    assert done.returncode == 2 and "gpu_study/plan.json is missing" in done.stderr  # an empty project
    assert sorted(p.name for p in (state / "scratch").iterdir()) == sorted(ENGINE_FOLDERS.values())
    (state / "scratch" / "tmp").chmod(0o777)
    done = subprocess.run(command, cwd=ROOT, env=users_shell(state), capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "other users may write it" in done.stderr


# --------------------------------------------------------------------------------------------
# The attacks: planted first as another user, then the owner's command runs
# --------------------------------------------------------------------------------------------

PICKLED_PAYLOAD = """
import os, sys
sys.path.insert(0, sys.argv[3])
import diskcache

class Payload:  # unpickled by the owner's DVC: runs `id -u` as the owner, into the marker
    def __reduce__(self):
        return (os.system, ("id -u > " + sys.argv[2],))

links = os.path.join(sys.argv[1], "links")
os.makedirs(links, mode=0o777)
with diskcache.Cache(links, disk_pickle_protocol=4) as cache:
    cache[".gitignore"] = Payload()  # a file of the repo that no output uses: checked for removal
for folder, _, files in os.walk(sys.argv[1]):
    os.chmod(folder, 0o777)
    for name in files:
        os.chmod(os.path.join(folder, name), 0o666)
"""
"""DVC's link cache (``links/cache.db``, diskcache) with a pickled value for a file of the repo:
``dvc checkout`` unpickles the entry of each linked file no output uses, to see whether to remove it."""


def dvc_repo(path: Path) -> Path:
    """A git + DVC repository with one tracked file, ``data.txt``."""
    path.mkdir()
    for command in (["git", "init", "-q"], [str(BIN / "dvc"), "init", "-q"]):
        subprocess.run(command, cwd=path, check=True, capture_output=True)
    (path / "data.txt").write_text("data\n")
    subprocess.run([str(BIN / "dvc"), "add", "-q", "data.txt"], cwd=path, check=True, capture_output=True)
    return path


def dvc_repo_cache_name(repo: Path) -> str:
    """The folder DVC keeps this repository's site cache in, under ``<site cache>/repo/``."""
    code = "import sys; from dvc.repo import Repo; print(Repo(sys.argv[1]).site_cache_dir)"
    done = subprocess.run([sys.executable, "-c", code, str(repo)], capture_output=True, text=True, check=True)
    return Path(done.stdout.strip()).name


@pytest.mark.parametrize("planted", ["/var/tmp/dvc"], indirect=True)
def test_a_dvc_site_cache_planted_with_a_pickled_payload_is_never_read_by_the_projects_dvc(tmp_path, planted):
    """DVC's default site cache is /var/tmp/dvc/repo/<hash>, its folders 0777: another user can
    make the owner's folder first. Control: DVC left at that default runs the payload as the owner.
    Through make's shell and with setup's ``core.site_cache_dir`` DVC never opens it."""
    repo = dvc_repo(tmp_path / "repo")
    marker = tmp_path / "ran-as"
    site = planted / "repo" / dvc_repo_cache_name(repo)
    done = run_as_other_user(PICKLED_PAYLOAD, str(site), str(marker), str(readable_packages("diskcache")))
    assert done.returncode == 0, done.stderr
    planted_bytes = (site / "links" / "cache.db").read_bytes()

    state = tmp_path / "state"
    done = in_makes_shell("dvc checkout -q --force && dvc doctor | grep site_cache_dir", state, cwd=repo)
    assert done.returncode == 0, done.stderr
    assert f"Repo.site_cache_dir: {state / 'scratch' / 'dvc' / 'repo'}" in done.stdout
    env = users_shell(state)
    subprocess.run(
        [str(BIN / "dvc"), "config", "--local", "core.site_cache_dir", str(state / "scratch" / "dvc")],
        cwd=repo,
        env=env,
        check=True,
    )
    subprocess.run(
        [str(BIN / "dvc"), "checkout", "-q", "--force"], cwd=repo, env=env, check=True
    )  # as typed in a shell, after setup
    assert not marker.exists() and (site / "links" / "cache.db").read_bytes() == planted_bytes

    subprocess.run(
        [str(BIN / "dvc"), "config", "--local", "--unset", "core.site_cache_dir"], cwd=repo, env=env, check=True
    )
    subprocess.run(
        [str(BIN / "dvc"), "checkout", "-q", "--force"], cwd=repo, env=env, capture_output=True
    )  # the control
    assert marker.read_text().strip() == "0", "the control: DVC at its default should have run the payload"


PLANTED_MODULE = """
import os, sys
open(os.path.join(sys.argv[1], "spikelab_planted.py"), "w").write(
    "import os\\nopen(os.environ['PLANTED_MARKER'], 'w').write(str(os.getuid()))\\n"
)
"""

OWNERS_CLUSTER = """
import json, os, sys
if sys.argv[1] == "private":
    from tasks.runtime.private_env import use_private_env
    use_private_env()  # what every spikelab command does first (flows/__main__.py)
from distributed import Client, LocalCluster
from tasks.runtime.workers import cluster_kwargs, configured_cluster

def probe(dask_worker):
    import torch
    try:
        import spikelab_planted  # noqa: F401
    except ImportError:
        pass
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    compiled = torch.compile(lambda x: x * 2 + 1, backend="inductor")
    compiled(torch.ones(3))
    return {"local_directory": dask_worker.local_directory, "inductor": cache_dir(), "sys_path": sys.path}

with configured_cluster(), LocalCluster(**cluster_kwargs(1)) as cluster, Client(cluster) as client:
    print(json.dumps(list(client.run(probe).values())[0]))
"""
"""A stage's own Dask cluster as the fan-out stages start it, and on its worker what a stage's
unit may do: import a module, compile a function with torch.compile (the ``gpu`` profile's
``train.compile``). ``sys.argv[1]``: ``private`` as spikelab runs it, ``default`` the engines left
to their defaults (the control)."""


@pytest.mark.parametrize("planted", ["/tmp/dask-scratch-space"], indirect=True)
def test_a_dask_scratch_and_an_inductor_cache_planted_first_are_never_adopted(tmp_path, planted):
    """Dask adopted /tmp/dask-scratch-space whoever made it and put it first on the workers'
    sys.path (a planted module ran as the owner); Inductor compiles into and loads from
    /tmp/torchinductor_<user> without looking at its owner."""
    if shutil.which("g++") is None:
        pytest.skip("torch.compile on the CPU needs a C++ compiler (g++)")
    inductor = Path(f"/tmp/torchinductor_{pwd.getpwuid(os.getuid()).pw_name}")
    if os.path.lexists(inductor):
        pytest.skip(f"{inductor} exists already on this machine; the test plants it itself")
    done = run_as_other_user(PLANTED_MODULE, str(planted))
    assert done.returncode == 0, done.stderr
    done = run_as_other_user(
        "import os, sys; os.mkdir(sys.argv[1], 0o777); os.chmod(sys.argv[1], 0o777)", str(inductor)
    )
    assert done.returncode == 0, done.stderr
    try:
        state, marker = tmp_path / "state", tmp_path / "ran-as"
        env = {**users_shell(state), "PLANTED_MARKER": str(marker), "PYTHONPATH": str(ROOT)}

        def owners_cluster(how: str) -> dict:
            done = subprocess.run(
                [sys.executable, "-c", OWNERS_CLUSTER, how],
                env=env,
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert done.returncode == 0, done.stderr[-3000:]
            return json.loads(done.stdout.splitlines()[-1])

        seen, scratch = owners_cluster("private"), state / "scratch"
        assert Path(seen["local_directory"]).is_relative_to(scratch / "tmp")
        assert Path(seen["inductor"]) == scratch / "torchinductor" and any((scratch / "torchinductor").iterdir())
        assert not any(Path(entry).is_relative_to(planted) for entry in seen["sys_path"]) and not marker.exists()
        assert sorted(p.name for p in planted.iterdir()) == ["spikelab_planted.py"] and not any(inductor.iterdir())

        seen = owners_cluster("default")  # the control: both planted folders adopted
        assert Path(seen["local_directory"]).is_relative_to(planted) and marker.read_text() == str(os.getuid())
        assert Path(seen["inductor"]) == inductor and any(inductor.iterdir())
    finally:
        shutil.rmtree(inductor, ignore_errors=True)


def test_mlflows_start_up_lock_is_never_opened_through_a_link_another_user_planted(tmp_path):
    """The MLflow server, starting, takes a lock at /tmp/db_init_lock-<md5 of the store URI> as it
    opens its jobs store, opening it for writing through any symlink there: a planted one truncated
    a root-only file. The URI is on the server's command line, which ``ps`` shows everyone."""
    if reason := skip_reason():
        pytest.skip(reason)
    state = tmp_path / "state"
    precious = tmp_path / "root-only"
    precious.write_text("the owner's\n")
    precious.chmod(0o600)
    uri = f"sqlite:///{state / 'mlflow.db'}"
    lock = Path("/tmp") / f"db_init_lock-{hashlib.md5(uri.encode()).hexdigest()}"
    done = run_as_other_user("import os, sys; os.symlink(sys.argv[1], sys.argv[2])", str(precious), str(lock))
    assert done.returncode == 0, done.stderr
    try:
        code = "import sys; from mlflow.store.jobs.sqlalchemy_store import SqlAlchemyJobStore as S; S(sys.argv[1])"
        done = in_makes_shell(f"python -c {shlex.quote(code)} {shlex.quote(uri)}", state)
        assert done.returncode == 0, done.stderr[-2000:]
        assert precious.read_text() == "the owner's\n"
        assert lock.name in [p.name for p in (state / "scratch" / "tmp").iterdir()]
        (state / "mlflow.db").unlink()  # the control: a fresh store, the lock left to its default
        done = subprocess.run([sys.executable, "-c", code, uri], env=users_shell(state), capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        assert precious.read_text() == "", "the control: MLflow at its default should have truncated it"
    finally:
        lock.unlink(missing_ok=True)


def test_a_stage_on_its_temporary_prefect_server_sends_no_telemetry(tmp_path):
    """Without this checkout's servers a stage starts a temporary Prefect server, whose telemetry
    service tried to phone home from every stage ("Failed to send telemetry" in each log)."""
    from tests.smoke_study import copy_project

    project = copy_project(tmp_path / "project")
    env = {k: v for k, v in users_shell(tmp_path / "state").items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env |= {"SPIKELAB_PREFECT_PORT": "1", "SPIKELAB_MLFLOW_PORT": "1", "PREFECT_LOGGING_LEVEL": "DEBUG"}
    env.pop("DO_NOT_TRACK", None)
    done = subprocess.run(
        [str(BIN / "spikelab"), "run", "prepare"], cwd=project, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "temporary" in done.stderr.lower() and "telemetry" not in (done.stdout + done.stderr).lower()
