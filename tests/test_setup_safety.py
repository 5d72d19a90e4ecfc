"""What ``make setup`` and ``make demo`` leave to files another local user may plant: nothing.

scripts/setup.sh: pip's user agent runs ``rustc --version`` through rustup's proxy, which obeys a
``rust-toolchain.toml`` in any folder above the working directory, and cargo (a dependency built
from Rust source) reads ``.cargo/config.toml`` in every folder above it; pyenv's python3 shim (what
runs before .venv exists) reads ``.python-version`` the same way (scripts/private-env.sh); a
checkout in a folder another user may rename things in could be swapped while pip installs it.
scripts/demo-copy.sh
(``make demo``'s copy): a ``dvc`` typed in the copy later must not use DVC's default site cache,
/var/tmp/dvc, whose folders another user can make first.

The attacks act as the user ``nobody`` (tests/other_user.py) and plant first; the owner's side
runs setup's own environment and pip (scripts/setup.sh, sourced: it returns before installing)
from a copy of the scripts it needs, or a plain ``dvc`` from a shell without make's environment.
Each has a control: the same command without the fix runs what was planted, as the owner.
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests import test_private_env
from tests.other_user import OTHER, SESSION_ENV, give_to, readable_packages, run_as_other_user, skip_reason
from tests.test_private_env import BIN, PICKLED_PAYLOAD, ROOT, dvc_repo_cache_name, users_shell

planted = test_private_env.planted
"""A folder in a shared location that ``nobody`` made first (tests/test_private_env.py)."""

IMPORTED = """
import os, sys, tasks.runtime.private_env
files = (getattr(m, "__file__", None) or "/" for m in list(sys.modules.values()))
ours = sorted(os.path.relpath(f, sys.argv[1]) for f in files if f.startswith(sys.argv[1] + "/") and not f.startswith(sys.prefix))
print("\\n".join(ours))
"""
"""Prints the checkout's own modules (not .venv's) that ``tasks.runtime.private_env`` imports."""


@functools.cache
def setup_needs() -> tuple[str, ...]:
    """What scripts/setup.sh runs before it installs anything: itself, scripts/private-env.sh and
    the project's modules ``python3 -m tasks.runtime.private_env`` imports (found, not listed)."""
    command = ["python3", "-c", IMPORTED, str(ROOT)]
    done = subprocess.run(command, cwd=ROOT, env=users_terminal(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return ("scripts/setup.sh", "scripts/private-env.sh", *done.stdout.split())


RUSTUP = shutil.which("rustup") or shutil.which("rustup", path=str(Path.home() / ".cargo" / "bin"))
NO_SUCH_PACKAGE = "spikelab-no-such-package"


def setup_copy(checkout: Path, venv: bool = True) -> Path:
    """A checkout holding :func:`setup_needs` (and a link to this checkout's .venv, for pip)."""
    for name in setup_needs():
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, checkout / name)
    if venv:
        (checkout / ".venv").symlink_to(ROOT / ".venv")
    return checkout


def users_terminal(**extra: str) -> dict[str, str]:
    """A user's new terminal: no engine's folder, no state directory named (SPIKELAB_STATE
    dropped), no Rust or Python version pinned, the project's tools and rustup's proxies on PATH."""
    env = users_shell(Path("/nonexistent"))
    pinned = ("RUSTUP_TOOLCHAIN", "RUSTUP_AUTO_INSTALL", "CARGO", "SPIKELAB_CARGO_REFUSED", "PYENV_VERSION")
    for var in ("SPIKELAB_STATE", *pinned):
        env.pop(var, None)
    if RUSTUP:
        env["PATH"] = f"{env['PATH']}{os.pathsep}{Path(RUSTUP).parent}"
    return {**env, **extra}


def in_setups_shell(checkout: Path, commands: str, **kw) -> subprocess.CompletedProcess:
    """``commands`` run after sourcing ``checkout``'s scripts/setup.sh: its environment and its
    ``pip``, in the checkout, as setup runs pip (nothing installed: sourced, it stops there)."""
    return subprocess.run(
        ["bash", "-c", f"source scripts/setup.sh\n{commands}"],
        cwd=checkout,
        env=users_terminal(),
        capture_output=True,
        text=True,
        timeout=120,
        **kw,
    )


def rustup_default() -> str:
    done = subprocess.run([RUSTUP, "default"], cwd="/", capture_output=True, text=True, env=users_terminal())
    return done.stdout.split()[0] if done.returncode == 0 and done.stdout.strip() else "none"


@pytest.fixture
def shared():
    """A folder every user may add files to, with the sticky bit, as /tmp is (sticky: nobody may
    rename what is ours, so the state directory's own check lets a checkout live below it), in a
    folder ``nobody`` may pass through; removed afterwards."""
    if reason := skip_reason():
        pytest.skip(reason)
    base = Path(tempfile.mkdtemp(prefix="shared-", dir=os.environ[SESSION_ENV]))
    base.chmod(0o711)
    folder = base / "shared"
    folder.mkdir()
    folder.chmod(0o1777)
    yield folder
    shutil.rmtree(base, ignore_errors=True)


def needs_rustup() -> None:
    if RUSTUP is None:
        pytest.skip("rustup is not installed: no proxy to obey a toolchain file (rustup.rs installs it)")


# --------------------------------------------------------------------------------------------
# rustup and cargo: what they read from the folders above the checkout
# --------------------------------------------------------------------------------------------

PLANT_TOOLCHAIN = """
import os, sys
shared = sys.argv[1]
theirs = os.path.join(shared, "theirs")
os.makedirs(os.path.join(theirs, "bin"))
rustc = os.path.join(theirs, "bin", "rustc")
with open(rustc, "w") as f:  # what pip's user agent would run as the owner: records who ran it
    f.write("#!/bin/sh\\nid -u > " + sys.argv[2] + "\\necho 'rustc 9.9.9 (theirs)'\\n")
os.chmod(rustc, 0o755)
with open(os.path.join(shared, "rust-toolchain.toml"), "w") as f:
    f.write('[toolchain]\\npath = "' + theirs + '"\\n')
"""
"""``nobody``'s toolchain (``sys.argv``: the shared folder, the marker shell-quoted): a
``bin/rustc`` of theirs, named by a rust-toolchain.toml in the shared folder."""


def test_setups_pip_never_runs_a_rustc_another_user_named_in_a_toolchain_file_above_the_checkout(tmp_path, shared):
    """Control: the same pip call without RUSTUP_TOOLCHAIN runs nobody's rustc, as the owner."""
    needs_rustup()
    marker = tmp_path / "ran-as"
    done = run_as_other_user(PLANT_TOOLCHAIN, str(shared), shlex.quote(str(marker)))
    assert done.returncode == 0, done.stderr
    checkout = setup_copy(shared / "checkout")
    pip = f'pip download --no-index --no-deps -d "$TMPDIR/download" {NO_SUCH_PACKAGE} || true'

    done = in_setups_shell(checkout, f'{pip}\necho "pinned: $RUSTUP_TOOLCHAIN $RUSTUP_AUTO_INSTALL"\nrustc --version')
    assert done.returncode == 0, done.stderr
    assert f"No matching distribution found for {NO_SUCH_PACKAGE}" in done.stderr  # pip built its session
    assert not marker.exists()
    lines = done.stdout.splitlines()
    assert lines[0] == f"pinned: {rustup_default()} 0"
    assert lines[1].startswith("rustc ") and "theirs" not in lines[1]  # the user's own toolchain still runs

    done = in_setups_shell(checkout, f"unset RUSTUP_TOOLCHAIN RUSTUP_AUTO_INSTALL\n{pip}")  # the control
    assert f"No matching distribution found for {NO_SUCH_PACKAGE}" in done.stderr
    assert marker.read_text().strip() == str(os.getuid()), "the control: rustup should have run nobody's rustc"


PLANT_CARGO_CONFIG = """
import os, sys
shared = sys.argv[1]
theirs = os.path.join(shared, "theirs")
os.makedirs(os.path.join(theirs, "bin"))
wrapper = os.path.join(theirs, "bin", "wrapper")
with open(wrapper, "w") as f:  # cargo runs it in front of every rustc: records who ran it
    f.write("#!/bin/sh\\nid -u > " + sys.argv[2] + "\\nexec \\"$@\\"\\n")
os.chmod(wrapper, 0o755)
os.makedirs(os.path.join(shared, ".cargo"))
with open(os.path.join(shared, ".cargo", "config.toml"), "w") as f:
    f.write('[build]\\nrustc-wrapper = "' + wrapper + '"\\n')
"""
"""``nobody``'s cargo settings in the shared folder (``sys.argv``: the folder, the marker
shell-quoted): a rustc wrapper of theirs."""


def crate(folder: Path) -> Path:
    """A Rust package with no dependencies: what a dependency built from Rust source hands cargo."""
    (folder / "src").mkdir(parents=True)
    (folder / "Cargo.toml").write_text('[package]\nname = "probe"\nversion = "0.1.0"\nedition = "2021"\n')
    (folder / "src" / "main.rs").write_text("fn main() {}\n")
    return folder


def test_setups_cargo_refuses_below_a_folder_others_may_add_files_to(tmp_path, shared):
    """Cargo's walk up for .cargo/config.toml has no stop: below /tmp (or any folder others may
    add files to) setup's cargo refuses, naming the folder. Control: setup's environment without
    that refusal (rustup pinned) runs nobody's wrapper, as the owner: the pin does not cover cargo."""
    needs_rustup()
    marker = tmp_path / "ran-as"
    done = run_as_other_user(PLANT_CARGO_CONFIG, str(shared), shlex.quote(str(marker)))
    assert done.returncode == 0, done.stderr
    checkout = setup_copy(shared / "checkout")
    crate(checkout / "probe")
    metadata = "cd probe && cargo metadata --format-version 1 --offline >/dev/null"

    done = in_setups_shell(checkout, metadata)
    assert done.returncode == 1 and not marker.exists()
    assert done.stderr.splitlines() == [
        f"setup: cargo refused: other users may add files to {shared}, and cargo would read their "
        f"{shared}/.cargo/config.toml; to build from Rust source, move the checkout (and SPIKELAB_STATE) out of it"
    ]

    unrefused = (
        'unset CARGO\nPATH=${PATH#"$TMPDIR/setup-bin:"}\ntest "$(command -v cargo)" != "$TMPDIR/setup-bin/cargo"\n'
    )
    done = in_setups_shell(checkout, unrefused + metadata)  # the control
    assert done.returncode == 0, done.stderr
    assert marker.read_text().strip() == str(os.getuid()), "the control: cargo should have run nobody's wrapper"


def open_folders(path: Path) -> list[Path]:
    """``path`` and the folders above it that users other than this one and root may add files to."""
    found = []
    for folder in (path, *path.parents):
        info = folder.stat()
        if info.st_uid not in (0, os.getuid()) or info.st_mode & 0o022:
            found.append(folder)
    return found


def test_where_no_folder_above_lets_others_add_files_setups_cargo_is_the_users_own(tmp_path):
    """A legitimate build from Rust source keeps working: rustup pinned to the user's default
    toolchain, cargo left alone."""
    needs_rustup()
    if opened := open_folders(tmp_path):
        pytest.skip(f"{opened[-1]} lets other users add files; SPIKELAB_TEST_TMPDIR in a private folder runs this")
    checkout = setup_copy(tmp_path / "checkout")
    crate(checkout / "probe")
    done = in_setups_shell(
        checkout,
        'echo "${CARGO-unset} $(command -v cargo)"\ncd probe && cargo metadata --format-version 1 --offline >/dev/null',
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["unset", shutil.which("cargo", path=users_terminal()["PATH"])]


PYENV = shutil.which("pyenv") or shutil.which("pyenv", path=str(Path.home() / ".pyenv" / "bin"))


def test_the_python_setup_starts_with_is_never_chosen_by_a_python_version_file_planted_above(tmp_path, shared):
    """pyenv's python3 shim (what setup runs before .venv exists: scripts/private-env.sh, then
    ``python3 -m venv``) takes its version from a .python-version in any folder above. Control:
    without the PYENV_VERSION private-env.sh sets, the version nobody named runs."""
    if PYENV is None:
        pytest.skip("pyenv is not installed: python3 reads no version file")
    bare = users_terminal()
    bare["PATH"] = os.pathsep.join(p for p in bare["PATH"].split(os.pathsep) if Path(p) != BIN)  # no .venv yet
    ask = subprocess.run([PYENV, "which", "python3"], cwd="/", env=bare, capture_output=True, text=True)
    versions = subprocess.run([PYENV, "versions", "--bare"], env=bare, capture_output=True, text=True).stdout.split()
    root = Path(subprocess.run([PYENV, "root"], env=bare, capture_output=True, text=True).stdout.strip())
    others = [
        v for v in versions if "/" not in v and not Path(ask.stdout.strip()).is_relative_to(root / "versions" / v)
    ]
    if ask.returncode or not others:
        pytest.skip(f"pyenv needs a global python3 and another version installed to choose: {versions}")
    theirs = others[-1]
    done = run_as_other_user(
        "import os, sys; open(os.path.join(sys.argv[1], '.python-version'), 'w').write(sys.argv[2] + '\\n')",
        str(shared),
        theirs,
    )
    assert done.returncode == 0, done.stderr
    checkout = setup_copy(shared / "checkout", venv=False)
    which = 'source scripts/private-env.sh\n{}python3 -c "import sys; print(sys.executable)"'

    def python3_after_private_env(unpin: str = "") -> str:
        done = subprocess.run(
            ["bash", "-c", which.format(unpin)], cwd=checkout, env=bare, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert python3_after_private_env() == ask.stdout.strip()  # pyenv's global one
    assert Path(python3_after_private_env("unset PYENV_VERSION\n")).is_relative_to(root / "versions" / theirs)


# --------------------------------------------------------------------------------------------
# A checkout in a folder another user may rename things in: refused before anything is made
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("state", ["default", "elsewhere"])
@pytest.mark.parametrize(("owner", "parent_mode"), [(OTHER, 0o755), (None, 0o777)], ids=["another users", "open"])
def test_setup_refuses_a_checkout_in_a_folder_another_user_may_rename_things_in(tmp_path, owner, parent_mode, state):
    """A folder another user owns (whatever its mode), or one others may write without the sticky
    bit: they could swap the checkout (or its .spikelab) for theirs while pip installs it. With
    SPIKELAB_STATE left at its default the state directory's check (tasks/runtime/paths.py) saw it
    already; with SPIKELAB_STATE elsewhere only setup's own check of the checkout does."""
    parent = tmp_path / "parent"
    checkout = setup_copy(parent / "checkout", venv=False)
    uid = give_to(parent, owner)
    parent.chmod(parent_mode)
    env = users_terminal(**({"SPIKELAB_STATE": str(tmp_path / "state")} if state == "elsewhere" else {}))
    done = subprocess.run(
        [str(checkout / "scripts" / "setup.sh")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.splitlines() == [
        f"setup: error: checkout {checkout}: {parent} is another user's or writable by others "
        f"(uid {uid}, mode {parent_mode:04o}), who could swap it; move the checkout"
    ]
    assert not {".venv", ".spikelab"} & {p.name for p in checkout.iterdir()}
    assert [p.name for p in parent.iterdir()] == ["checkout"] and not (tmp_path / "state").exists()
    assert stat.S_IMODE(parent.stat().st_mode) == parent_mode


# --------------------------------------------------------------------------------------------
# The demo's copy: a dvc typed there never uses /var/tmp/dvc
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("planted", ["/var/tmp/dvc"], indirect=True)
def test_a_dvc_typed_in_the_demos_copy_never_reads_a_site_cache_planted_in_var_tmp(tmp_path, planted):
    """The demo's copy (scripts/demo-copy.sh, as scripts/demo.sh makes it) lacked the checkout's
    .dvc/config.local (git ignores it), so a ``dvc checkout`` typed there in a new terminal
    unpickled nobody's link cache at /var/tmp/dvc/repo/<hash>. Control: the copy as demo.sh made
    it before (``core.no_scm`` alone in its config.local) runs the payload as the owner."""
    state = tmp_path / "state"
    project = state / "demo" / "project"
    done = subprocess.run(
        [str(ROOT / "scripts" / "demo-copy.sh"), str(project)],
        cwd=ROOT,
        env=users_shell(state),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert (project / ".gitignore").is_file()  # the payload's entry: a file of the copy no output uses
    marker = tmp_path / "ran-as"
    site = planted / "repo" / dvc_repo_cache_name(project)
    done = run_as_other_user(PICKLED_PAYLOAD, str(site), str(marker), str(readable_packages("diskcache")))
    assert done.returncode == 0, done.stderr
    planted_bytes = (site / "links" / "cache.db").read_bytes()

    terminal = users_terminal()  # no DVC_SITE_CACHE_DIR, no TMPDIR: a dvc typed in a new terminal
    dvc = [str(BIN / "dvc")]
    done = subprocess.run([*dvc, "doctor"], cwd=project, env=terminal, capture_output=True, text=True)
    assert f"Repo.site_cache_dir: {state / 'scratch' / 'dvc' / 'repo'}" in done.stdout, done.stderr
    subprocess.run([*dvc, "checkout", "--force"], cwd=project, env=terminal, capture_output=True, timeout=300)
    assert not marker.exists() and (site / "links" / "cache.db").read_bytes() == planted_bytes

    config = [*dvc, "config", "--local"]
    subprocess.run([*config, "--unset", "core.site_cache_dir"], cwd=project, env=terminal, check=True)
    assert (project / ".dvc" / "config.local").read_text().split() == ["[core]", "no_scm", "=", "true"]
    subprocess.run([*dvc, "checkout", "--force"], cwd=project, env=terminal, capture_output=True, timeout=300)
    assert marker.read_text().strip() == str(os.getuid()), "the control: DVC at its default should have run it"
