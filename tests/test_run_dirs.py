"""A run's files land only in folders the owner alone can write, and a run trusts only files its
owner made (model/private.py: private_run_dir; model/checkpoint.py), and every entry point a user
may type runs in the private environment (model/private.py: run_private).

The attacks act as the user ``nobody`` (tests/other_user.py) and plant first, in a sticky folder
everyone may write (as /tmp is); the owner's side runs the documented command from a user's shell.
Each attack has a control: what the planted files reach when a run follows them as it used to.
"""

from __future__ import annotations

import dataclasses
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from trainer_kit import markov_tokens, tiny_config

from model.callbacks import CSVLogger
from model.checkpoint import CheckpointError, RunLock, list_checkpoints, load_checkpoint, load_latest
from model.private import ENGINE_FOLDERS, UnsafeFolder, private_run_dir
from model.train import train
from tests.other_user import OTHER, SESSION_ENV, give_to, run_as_other_user, skip_reason
from tests.test_private_env import mode, users_shell

ROOT = Path(__file__).resolve().parents[1]
CFG = tiny_config(**{"train.steps": 4, "checkpoint.every_steps": 2, "checkpoint.keep_last": 3})
TOKENS = markov_tokens(4_000)


def as_other_user(code: str, *args: str) -> None:
    done = run_as_other_user(code, *args)
    assert done.returncode == 0, done.stderr


@pytest.fixture
def shared() -> Path:
    """A folder every user may write, sticky as /tmp is, inside the test session's own folder
    (which anyone may pass through): where another user plants first."""
    if reason := skip_reason():
        pytest.skip(reason)
    folder = Path(tempfile.mkdtemp(prefix="shared-", dir=os.environ[SESSION_ENV]))
    folder.chmod(0o1777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """params.yaml (the tiny config), train.bin and val.bin, for ``python -m model.train``."""
    d = tmp_path_factory.mktemp("inputs")
    (d / "params.yaml").write_text(yaml.safe_dump(dataclasses.asdict(CFG)))
    TOKENS[:3_000].tofile(d / "train.bin")
    TOKENS[3_000:].tofile(d / "val.bin")
    return d


def bare_train(inputs: Path, out: Path, state: Path, *sets: str) -> subprocess.CompletedProcess:
    """``python -m model.train`` as docs/pretrain.md shows it, typed in a user's shell."""
    files = ("--params", inputs / "params.yaml", "--train-tokens", inputs / "train.bin", "--val-tokens")
    command = [sys.executable, "-m", "model.train", *map(str, files), str(inputs / "val.bin"), "--out", str(out)]
    command += [f"--set={s}" for s in sets]
    return subprocess.run(command, cwd=ROOT, env=users_shell(state), capture_output=True, text=True, timeout=600)


def owners_secret(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


PLANT_RUN = """
import os, sys
run, lock_target, csv_target = sys.argv[1:]
os.makedirs(os.path.join(run, "plots"))
for folder in (run, os.path.join(run, "plots")):
    os.chmod(folder, 0o777)
os.symlink(lock_target, os.path.join(run, ".lock"))
os.symlink(csv_target, os.path.join(run, "plots", "train.csv.tmp"))
"""
"""Another user's ``--out`` folder, made first, its lock and the CSV writer's temporary file links
to the owner's files (which they cannot read, but can name)."""


def test_an_out_folder_another_user_made_first_is_refused_before_anything_is_written(inputs, shared, tmp_path):
    key, token = owners_secret(tmp_path / "key", "secret\n"), owners_secret(tmp_path / "token", "token\n")
    run = shared / "run"
    as_other_user(PLANT_RUN, str(run), str(key), str(token))
    before = sorted(p.relative_to(run) for p in run.rglob("*"))

    done = bare_train(inputs, run, tmp_path / "state")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == (
        f"spikelab: error: run directory {run}: owned by another user (uid {pwd.getpwnam(OTHER).pw_uid}); "
        "write the run inside the checkout (e.g. --out runs/NAME) or in a folder of your own"
    )
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before  # no checkpoint, no CSV
    assert key.read_text() == "secret\n" and token.read_text() == "token\n"

    # the control: opened as the run lock opened it before, the planted link empties the owner's file
    fd = os.open(run / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    os.ftruncate(fd, 0)
    os.close(fd)
    assert key.read_text() == ""


def test_an_out_folder_reached_through_another_users_link_is_refused_and_ones_own_link_is_followed(shared, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    as_other_user("import os, sys; os.symlink(sys.argv[1], sys.argv[2])", str(mine), str(shared / "run"))
    with pytest.raises(UnsafeFolder, match=rf"{shared / 'run'} is a link made by another user"):
        private_run_dir(shared / "run" / "sub")
    assert not (mine / "sub").exists()

    (tmp_path / "link").symlink_to(mine)  # a link of one's own (a run folder on a bigger disk): taken
    assert private_run_dir(tmp_path / "link" / "sub") == mine / "sub"


@pytest.mark.parametrize("folder_mode, refused", [(0o755, False), (0o775, True), (0o757, True), (0o1777, True)])
def test_an_out_folder_others_may_write_is_refused(tmp_path, folder_mode, refused):
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(folder_mode)
    if refused:
        with pytest.raises(UnsafeFolder, match=rf"run directory {run}: other users may write it"):
            RunLock(run).__enter__()
        assert not (run / ".lock").exists()
    else:
        with RunLock(run):
            assert (run / ".lock").is_file()


def test_an_out_folder_inside_a_folder_another_user_owns_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    give_to(theirs, OTHER)
    with pytest.raises(UnsafeFolder, match=rf"{theirs} above it is another user's"):
        private_run_dir(theirs / "run")
    assert not (theirs / "run").exists()


def test_a_lock_or_a_csv_file_planted_as_a_link_in_ones_own_folder_is_never_written_through(tmp_path):
    key = owners_secret(tmp_path / "key", "secret\n")
    run = tmp_path / "run"
    (run / "plots").mkdir(parents=True)
    (run / ".lock").symlink_to(key)
    with pytest.raises(UnsafeFolder, match=r"run lock .*\.lock: Too many levels of symbolic links"):
        RunLock(run).__enter__()
    (run / "plots" / "train.csv").symlink_to(key)
    CSVLogger(run / "plots").on_log(1, {"train/loss": 1.0})  # rewritten into a new file, put over the link
    assert not (run / "plots" / "train.csv").is_symlink() and key.read_text() == "secret\n"


def trained_run(out: Path) -> list[tuple[int, Path]]:
    """A tiny run with checkpoints at steps 2 and 4; its checkpoint files."""
    train(CFG, TOKENS[:3_000], TOKENS[3_000:], out)
    return list_checkpoints(out / "checkpoints")


def test_a_checkpoint_another_user_owns_is_never_loaded_and_the_run_falls_back_to_its_own(tmp_path, capsys):
    (step2, older), (step4, newest) = trained_run(tmp_path / "run")
    identity = load_checkpoint(newest)["identity"]  # the control: one's own newest loads
    for path in (newest, newest.with_name(newest.name + ".sha256")):
        give_to(path, OTHER)  # as if swapped in by another user
    with pytest.raises(CheckpointError, match=rf"{newest.name} is owned by another user \(uid \d+\): never loaded"):
        load_checkpoint(newest)
    path, state = load_latest(tmp_path / "run" / "checkpoints", identity)
    assert (path, state["step"]) == (older, step2)
    assert "owned by another user" in capsys.readouterr().err


def test_a_checkpoint_reached_through_a_link_is_never_loaded(tmp_path):
    (_, older), (_, newest) = trained_run(tmp_path / "run")
    elsewhere = tmp_path / "elsewhere.pt"
    newest.rename(elsewhere)
    newest.symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match="a link is never followed"):
        load_checkpoint(newest)


# --------------------------------------------------------------------------------------------
# Entry points typed in a shell: the private environment first, as every spikelab command
# --------------------------------------------------------------------------------------------

ENTRY_POINTS = [
    ["-m", "model.train"],
    ["-m", "tasks.ablate.arm"],
    ["-m", "tasks.ablate.sizing"],
    ["-m", "tasks.spike.sizing"],
    ["-m", "flows.gpu_study"],
    ["-m", "tasks.params"],
    ["-m", "tasks.report.versions"],
    *([str(path.relative_to(ROOT))] for path in sorted((ROOT / "checks").glob("*.py"))),
    *([str(path.relative_to(ROOT))] for path in sorted((ROOT / "benchmarks").glob("bench_*.py"))),
    *([f"scripts/{name}.py"] for name in ("search_pruning", "sequential_oc", "screenshots")),
]
"""Every command docs/ shows a user typing with ``python`` (the spikelab CLI and make's recipes
are tested in tests/test_private_env.py)."""


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=lambda e: e[-1])
def test_every_bare_entry_point_makes_its_private_scratch_before_anything_else(tmp_path, entry):
    state = tmp_path / "state"
    done = subprocess.run(
        [sys.executable, *entry, "--help"], cwd=ROOT, env=users_shell(state), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    scratch = state / "scratch"
    assert sorted(p.name for p in scratch.iterdir()) == sorted(ENGINE_FOLDERS.values())
    assert all(mode(p) == 0o700 for p in (scratch, *scratch.iterdir()))


def test_a_bare_entry_point_refuses_a_scratch_folder_others_may_write_in_one_line(tmp_path):
    state = tmp_path / "state"
    (state / "scratch" / "tmp").mkdir(parents=True)
    (state / "scratch" / "tmp").chmod(0o777)
    done = subprocess.run(
        [sys.executable, "-m", "model.train", "--help"],
        cwd=ROOT,
        env=users_shell(state),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == (
        f"spikelab: error: scratch folder {state / 'scratch' / 'tmp'}: other users may write it (mode 0777); "
        "remove it (or choose another SPIKELAB_STATE)"
    )


def test_a_compiled_bare_training_run_never_uses_the_inductor_cache_another_user_made_in_tmp(inputs, tmp_path):
    """``python -m model.train --set train.compile=true``: Inductor's default cache is
    /tmp/torchinductor_<user>, loaded from whoever made it (the control is in
    tests/test_private_env.py: a process outside the private environment adopts it)."""
    if reason := skip_reason():
        pytest.skip(reason)
    if shutil.which("g++") is None:
        pytest.skip("torch.compile on the CPU needs a C++ compiler (g++)")
    inductor = Path(f"/tmp/torchinductor_{pwd.getpwuid(os.getuid()).pw_name}")
    if os.path.lexists(inductor):
        pytest.skip(f"{inductor} exists already on this machine; the test plants it itself")
    as_other_user("import os, sys; os.mkdir(sys.argv[1], 0o777); os.chmod(sys.argv[1], 0o777)", str(inductor))
    try:
        state = tmp_path / "state"
        done = bare_train(inputs, tmp_path / "run", state, "train.compile=true")
        assert done.returncode == 0, done.stderr[-3000:]
        assert not any(inductor.iterdir()) and any((state / "scratch" / "torchinductor").iterdir())
    finally:
        shutil.rmtree(inductor, ignore_errors=True)
