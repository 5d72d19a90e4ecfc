"""Where a process keeps what only its owner may touch, and the environment every command runs in.

Another local user is an attacker: whatever they can plant where the project writes or reads
(a folder made first, a link, a pickled cache entry) runs or is trusted as the owner. So:

  state     ``<repo>/.spikelab`` (or ``$SPIKELAB_STATE``), 0700: the login, the stores, and under
            ``scratch/`` every engine's temporary and cache folder (:func:`private_env`).
  run dirs  a run's ``--out`` and the checkpoints and plots in it (:func:`private_run_dir`): made
            or adopted only as this user's, never through another user's folder or link.
  __main__  :func:`run_private`: every entry point a user may type (``python -m model.train``,
            ``python -m tasks.ablate.arm``, checks/, benchmarks/) runs as the ``spikelab`` CLI does,
            with the umask and engine folders below, before it starts anything.

By default the engines keep scratch under predictable names in /tmp and /var/tmp, and each was
a way in: DVC's site cache /var/tmp/dvc/repo/<hash> (0777 folders, pickled link caches), Dask's
/tmp/dask-scratch-space (adopted whoever made it, first on the workers' sys.path), Inductor's
/tmp/torchinductor_<user> (compiled modules and pickled FX graphs loaded from it), MLflow's start-up
lock /tmp/db_init_lock-<hash>, and ``tempfile`` itself (pip, gunicorn, Chromium, the servers).

Standard library only: scripts/private-env.sh runs it (through tasks/runtime/private_env.py) with
the system Python before .venv exists, and model/ runs on a GPU box with only torch.
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

STATE_ENV = "SPIKELAB_STATE"
EXPS_MARKER = (".dvc", "tmp", "exps")
USER_ERROR_EXIT = 2

ENGINE_FOLDERS = {
    "TMPDIR": "tmp",  # Dask's scratch too: its temporary-directory is unset, so it follows tempfile
    "DVC_SITE_CACHE_DIR": "dvc",
    "TORCHINDUCTOR_CACHE_DIR": "torchinductor",
    "TRITON_CACHE_DIR": "triton",
}
"""Each engine's variable for where it keeps scratch, and its folder under ``<state>/scratch``.
DVC reads ``DVC_SITE_CACHE_DIR`` before ``core.site_cache_dir``, which scripts/setup.sh also sets
for a plain ``dvc`` typed in a shell. Not ``DASK_TEMPORARY_DIRECTORY``: Dask parses its variables
as Python literals, and a path warns (``SyntaxWarning``) where a part reads as a bad number."""

NO_TELEMETRY = {
    "DO_NOT_TRACK": "true",  # Prefect's and MLflow's clients
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",  # every Prefect server, a stage's temporary one too
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DVC_NO_ANALYTICS": "true",  # and core.analytics = false in .dvc/config
    "HF_HUB_DISABLE_TELEMETRY": "1",
}
"""Every engine's switch for its usage reports."""


class UnsafeFolder(PermissionError):
    """A folder spikelab would write into, or a file it would trust, that another local user owns or
    can write: the message names it and what to do. Every command prints it as one line, exit 2."""


def project_dir() -> Path:
    """The nearest directory at or above the working directory holding ``params.yaml``."""
    cwd = Path.cwd().resolve()
    for d in (cwd, *cwd.parents):
        if (d / "params.yaml").is_file():
            return d
    return cwd


def repo_root(project: Path | None = None) -> Path:
    """The original repository, also from inside a DVC experiment copy (``<repo>/.dvc/tmp/exps/...``)."""
    project = (project or project_dir()).resolve()
    parts = project.parts
    for i in range(len(parts) - len(EXPS_MARKER)):
        if parts[i : i + len(EXPS_MARKER)] == EXPS_MARKER:
            return Path(*parts[:i])
    return project


def state_dir() -> Path:
    """Created 0700, and made so when another mode let other users in: it holds the login, the
    cluster's keys, every store and every engine's scratch. One another user owns (made before us,
    say under /tmp), or inside a folder another user may rename things in, is refused, root's own
    runs included: its owner could read the stores and swap the records, the keys, the servers'
    settings and the scratch that this process then trusts."""
    path = Path(os.environ.get(STATE_ENV) or repo_root() / ".spikelab").resolve()
    refuse_unsafe_parents(path, "state directory", f"choose another {STATE_ENV}")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    refuse_unless_owned(path, "state directory", f"choose another {STATE_ENV}")
    if path.stat().st_mode & 0o077:
        path.chmod(0o700)
    return path


def private_folder(
    path: Path, what: str, remedy: str = f"remove it (or choose another {STATE_ENV})", *, secret: bool = False
) -> Path:
    """``path`` made (0700) or adopted as a folder its owner alone can write: one another user owns,
    or that others may write, is refused (whatever they left in it may be planted). A ``secret``
    folder (keys) is made 0700 even where it was there open to others' reads (a half-made one, a
    copy): the rest (run folders, scratch) keeps the mode its owner gave it."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    mode = refuse_unless_owned(path, what, remedy)
    if mode & 0o022:
        raise UnsafeFolder(f"{what} {path}: other users may write it (mode {mode:04o}); {remedy}")
    if secret and mode != 0o700:
        path.chmod(0o700)
    return path


def private_run_dir(path: Path, what: str = "run directory") -> Path:
    """A run's output folder (``--out``, its checkpoints/ and plots/), made or adopted before
    anything is written in it: refused when another user owns it or may write it, when it or a
    folder above it is a link another user made, or when a folder above it lets another user
    rename things (they could swap the run out from under us). The documented runs write inside
    the checkout (``runs/``); a folder in /tmp is accepted only when it is this user's alone."""
    remedy = "write the run inside the checkout (e.g. --out runs/NAME) or in a folder of your own"
    absolute = Path(os.path.abspath(path))
    refuse_others_links(absolute, what, remedy)
    real = Path(os.path.realpath(absolute))
    refuse_unsafe_parents(real, what, remedy)
    return private_folder(real, what, remedy)


def refuse_unless_owned(path: Path, what: str, remedy: str) -> int:
    """``path``'s mode, when it is a folder (not a link to one) this user owns; else UnsafeFolder."""
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeFolder(f"{what} {path}: not a folder (a link?); {remedy}")
    if info.st_uid != os.getuid():
        raise UnsafeFolder(f"{what} {path}: owned by another user (uid {info.st_uid}); {remedy}")
    return stat.S_IMODE(info.st_mode)


def refuse_unsafe_parents(path: Path, what: str, remedy: str) -> None:
    """Every existing folder above ``path`` is root's or this user's, and lets no one else rename
    things in it unless it is sticky (as /tmp is): otherwise ``path`` could be swapped."""
    for parent in (p for p in path.parents if p.exists()):
        info = parent.stat()
        open_to_others = info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX
        if info.st_uid not in (0, os.getuid()) or open_to_others:
            raise UnsafeFolder(
                f"{what} {path}: {parent} above it is another user's or writable by others "
                f"(uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o}), who could swap it; {remedy}"
            )


def refuse_others_links(path: Path, what: str, remedy: str) -> None:
    """No part of ``path`` is a symbolic link made by a user other than this one or root: through
    it the run's files would land where that user chose."""
    current = Path(path.anchor)
    for part in path.parts[1:]:
        current = current / part
        if not current.is_symlink():
            continue
        owner = current.lstat().st_uid
        if owner not in (0, os.getuid()):
            raise UnsafeFolder(f"{what} {path}: {current} is a link made by another user (uid {owner}); {remedy}")
        current = Path(os.path.realpath(current))


def create_exclusive(path: Path) -> int:
    """A new file's descriptor, opened to write: never through a link, never over a file already
    there (a stale one of ours is removed first; the folder is ours, so no one else can put one
    back between the two calls)."""
    path.unlink(missing_ok=True)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)


def private_env(scratch: Path | None = None) -> dict[str, str]:
    """:data:`NO_TELEMETRY`, and each engine's variable and its folder under ``scratch`` (default
    ``<state>/scratch``), made (or adopted) as this user's alone."""
    root = private_folder(scratch or state_dir() / "scratch", "scratch folder")
    folders = {var: str(private_folder(root / name, "scratch folder")) for var, name in ENGINE_FOLDERS.items()}
    return {**NO_TELEMETRY, **folders}


def use_private_env(scratch: Path | None = None) -> dict[str, str]:
    """Give this process and every process it starts :func:`private_env`."""
    env = private_env(scratch)
    os.environ.update(env)
    tempfile.tempdir = None  # ``tempfile`` keeps the folder it chose first: choose again from TMPDIR
    return env


def keep_others_from_writing() -> None:
    """Nothing this process or its children create (data, runs/, checkpoints, stores, logs) is
    writable by other users, whatever umask the user's shell had (002 and 000 are common on shared
    machines): the files are read back as the project's owner."""
    os.umask(os.umask(0) | 0o022)


def run_private(main: Callable[[], int | None]) -> int:
    """Run an entry point typed in a shell (``if __name__ == "__main__": sys.exit(run_private(main))``)
    as every ``spikelab`` command runs: the umask above, the engines' scratch private and their
    telemetry off, before anything is imported lazily or started. An unsafe folder, here or anywhere
    the entry point writes (a run directory): one line, exit 2."""
    keep_others_from_writing()
    try:
        use_private_env()
        return main() or 0
    except UnsafeFolder as e:
        print(f"spikelab: error: {e}", file=sys.stderr)
        return USER_ERROR_EXIT
