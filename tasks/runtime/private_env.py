"""The environment every process the project starts inherits: each engine's scratch in a folder
its owner alone can write, under the state directory, and no engine phoning home.

By default the engines keep scratch under predictable names in /tmp and /var/tmp, where another
local user can plant it first, and each such folder was a way in:
  DVC     its site cache /var/tmp/dvc/repo/<hash> (folders made 0777; link caches of pickled keys)
  Dask    /tmp/dask-scratch-space, adopted whoever made it, first on the stage's and workers' sys.path
  torch   Inductor's /tmp/torchinductor_<user> (compiled modules loaded from it), Triton's below it
  MLflow  the server's start-up lock /tmp/db_init_lock-<md5 of the store URI>, opened through links
  Python  ``tempfile`` (TMPDIR): pip, gunicorn, Chromium, the servers, everything else
:func:`use_private_env` points each at its own folder under ``<state>/scratch``, made 0700 and
checked to be this user's alone (tasks/runtime/paths.py), and turns every engine's usage
telemetry off (a stage's temporary Prefect server tried to send it). It runs first in every
``spikelab`` command (flows/__main__.py), in make's recipes and scripts/setup.sh
(scripts/private-env.sh evaluates ``python3 -m tasks.runtime.private_env``), and in the test
session (tests/conftest.py). docs/services.md lists what a trace of ``make repro`` and ``make test``
found outside the checkout (scripts/trace_shared_paths.py).

Standard library only: scripts/private-env.sh runs it with the system Python before .venv exists.
"""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
from pathlib import Path

from tasks.runtime import paths

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


def private_env(scratch: Path | None = None) -> dict[str, str]:
    """:data:`NO_TELEMETRY`, and each engine's variable and its folder under ``scratch`` (default
    ``<state>/scratch``), made (or adopted) as this user's alone."""
    root = paths.private_folder(scratch or paths.state_dir() / "scratch", "scratch folder")
    folders = {var: str(paths.private_folder(root / name, "scratch folder")) for var, name in ENGINE_FOLDERS.items()}
    return {**NO_TELEMETRY, **folders}


def use_private_env(scratch: Path | None = None) -> dict[str, str]:
    """Give this process and every process it starts :func:`private_env`."""
    env = private_env(scratch)
    os.environ.update(env)
    tempfile.tempdir = None  # ``tempfile`` keeps the folder it chose first: choose again from TMPDIR
    return env


def main() -> int:
    """Print the variables as shell ``export`` lines (for ``eval``); a refused folder: exit 2, saying why."""
    try:
        env = private_env()
    except paths.UnsafeFolder as e:
        print(f"spikelab: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(f"export {var}={shlex.quote(value)}" for var, value in env.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
