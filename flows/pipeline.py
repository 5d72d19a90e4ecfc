"""The whole study as one Prefect flow that drives DVC, so a run triggered from the Prefect UI is
cached, versioned and reproducible exactly like ``dvc repro`` from a shell."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task

from tasks.paths import project_dir


def dvc_command(overrides: dict[str, Any], profile: str | None) -> list[str]:
    """``dvc repro`` for the workspace as it is; ``dvc exp run -S key=value ...`` when the form
    sets parameters, so each variation becomes a named DVC experiment instead of editing files."""
    dvc = str(Path(sys.executable).with_name("dvc"))
    sets = {**({"profile": profile} if profile else {}), **overrides}
    if not sets:
        return [dvc, "repro"]
    return [dvc, "exp", "run", *[arg for k, v in sets.items() for arg in ("-S", f"{k}={v}")]]


@task
def run_dvc(command: list[str]) -> None:
    logger = get_run_logger()
    logger.info("running %s", " ".join(command))
    proc = subprocess.run(command, cwd=project_dir(), capture_output=True, text=True)
    for line in (proc.stdout + proc.stderr).splitlines():
        logger.info(line)
    if proc.returncode:
        raise RuntimeError(f"{command[1:3]} failed with exit code {proc.returncode}")


@flow(name="pipeline")
def pipeline_flow(profile: str | None = None, overrides: dict[str, Any] | None = None) -> None:
    """Run every stage through DVC. ``overrides`` maps dotted params keys to values, e.g.
    ``{"model.block": "post_ln", "optim.beta2": 0.999}``."""
    run_dvc(dvc_command(overrides or {}, profile))
