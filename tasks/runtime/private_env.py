"""``python3 -m tasks.runtime.private_env``: the private environment (model/private.py) as shell
``export`` lines, for scripts/private-env.sh to ``eval`` in make's recipes, scripts/setup.sh and
.ci/run. Every engine's scratch under ``<state>/scratch`` (0700, checked to be this user's alone) and
every engine's telemetry off; Python entry points apply it themselves (flows/__main__.py, the
bare entry points' ``run_private``, tests/conftest.py). docs/results.md lists what a trace of the
documented commands found outside the checkout (scripts/trace_shared_paths.py).

Standard library only: scripts/private-env.sh runs it with the system Python before .venv exists.
"""

from __future__ import annotations

import shlex
import sys

from model.private import ENGINE_FOLDERS, NO_TELEMETRY, UnsafeFolder, private_env, use_private_env

__all__ = ["ENGINE_FOLDERS", "NO_TELEMETRY", "private_env", "use_private_env"]


def main() -> int:
    """Print the variables as shell ``export`` lines (for ``eval``); a refused folder: exit 2, saying why."""
    try:
        env = private_env()
    except UnsafeFolder as e:
        print(f"spikelab: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(f"export {var}={shlex.quote(value)}" for var, value in env.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
