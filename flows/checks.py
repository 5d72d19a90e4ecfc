"""``spikelab check NAME [ARGS...]``: the scripts under checks/ that verify a finished study (they
benchmark nothing): each runs as ``python checks/<script>.py ARGS`` would, from the project, its
own ``--help`` saying what it takes."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

CHECKS_DIR = Path(__file__).resolve().parents[1] / "checks"
"""The check scripts, in this code checkout (each takes ``--project``, default this checkout)."""
CHECKS = {
    "arithmetic": ("arithmetic.py", "the verdicts on the other numeric path, unseen seeds or another machine's arms"),
    "mlflow": ("recompute_mlflow.py", "every number of the study read back from its MLflow runs and recomputed"),
    "elsewhere": ("arms_elsewhere.py", "plan the ablate stage's arms here, train them on another machine's CPU"),
    "formats-gpu": ("formats_gpu.py", "the formats' arms on a GPU's real fp16/bf16 against the CPU emulation"),
    "labels": ("label_removals.py", "a blind, labelled judgement of the perplexity filter's removals"),
}
"""Each check: its script under checks/ and what it verifies (``spikelab check --help`` lists them)."""


def listing() -> str:
    width = max(map(len, CHECKS))
    return "\n".join(f"  {name:<{width}}  {what}" for name, (_, what) in CHECKS.items())


def run_check(name: str, arguments: list[str]) -> int:
    """Run check ``name``'s script with ``arguments`` as its command line; its exit status."""
    script = CHECKS_DIR / CHECKS[name][0]
    saved = sys.argv
    sys.argv = [str(script), *arguments]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as stop:  # the script's own exit: its status
        code = stop.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv = saved
    return 0
