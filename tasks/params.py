"""The ``params`` DVC stage: validate the whole config, then write the values every stage runs with.

It runs first (every other stage reads its params from its output), takes a fraction of a second
(no Prefect, no torch unless ``train.device: cuda`` asks for it), and so:

- a bad key or value in params.yaml, a profile or studies.yaml (the declared families) fails
  here, before DVC deletes any other stage's outputs to rerun it;
- ``params/resolved.yaml`` holds the config after the profile overlay and the precedence rule of
  ``model.typed_config.resolve``: what ``dvc params diff`` and ``dvc exp show`` show, and the values
  DVC compares to decide which stages rerun (each stage lists the keys it reads in dvc.yaml).

The file is replaced only when the config is valid (DVC keeps it across runs: ``persist``), so a
failed run leaves the previous one in place. Run it as ``python -m tasks.params``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import yaml

from model.private import run_private
from model.typed_config import UserError
from tasks.config import check_runtime, resolve_study
from tasks.design.studies import builtin_families, read_studies
from tasks.runtime.paths import project_dir

RESOLVED = Path("params/resolved.yaml")
"""The resolved config, relative to the project (dvc.yaml names the same path)."""

HEADER = (
    "# Written by the `params` stage (tasks/params.py): the values every stage runs with.\n"
    "# Do not edit; change params.yaml or profiles/, then `dvc repro`.\n"
)


def write_resolved(project: Path) -> str:
    """Resolve and check the project's config, write it to RESOLVED; return the profile's notice."""
    resolved = resolve_study(project / "params.yaml")
    check_runtime(resolved.config)
    builtin_families(resolved.config)  # a profile's values that break a built-in family fail here,
    read_studies(project, resolved.config)  # and a bad declaration, before any stage runs
    text = HEADER + yaml.safe_dump(
        dataclasses.asdict(resolved.config), sort_keys=False, default_flow_style=False, allow_unicode=True
    )
    out = project / RESOLVED
    out.parent.mkdir(parents=True, exist_ok=True)
    temp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    temp.write_text(text, encoding="utf-8")
    os.replace(temp, out)
    return resolved.notice()


def main() -> int:
    try:
        notice = write_resolved(project_dir())
    except UserError as e:
        print(f"spikelab: error: {e}", file=sys.stderr)
        return 2
    if notice:
        print(f"spikelab: {notice}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_private(main))
