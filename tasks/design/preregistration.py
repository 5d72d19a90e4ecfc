"""The study's pre-registered design (tasks/design/preregistration.yaml), read in one place: the
findings read it for their tests and thresholds, the ablate stage's figures for the lines they
draw (the plateau margin, the fp16 underflow threshold), the report prints its hash.

The hash covers the YAML and the code that turns results into verdicts (DESIGN_CODE): the pairing
unit, the tests, the verdict rule, what each arm's figures mean, how a spike is classified and an
optimum fitted. Changing any of them changes the design as much as editing a threshold does."""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DESIGN_FILE = Path(__file__).with_name("preregistration.yaml")
DESIGN_CODE = (
    "tasks/design/preregistration.yaml",
    "tasks/report/verdict.py",
    "tasks/report/findings.py",
    "tasks/report/recovery.py",
    "tasks/report/natural.py",
    "tasks/ablate/natural.py",
    "tasks/report/method.py",
    "tasks/report/declared.py",
    "tasks/design/studies.py",
    "tasks/design/families.py",
    "tasks/design/stats.py",
    "tasks/ablate/grid.py",
    "tasks/ablate/conditions.py",
    "tasks/search/fit.py",
    "tasks/spike/study.py",
    "tasks/spike/scores.py",
    "tasks/spike/summary.py",
    "tasks/spike/sizing.py",
    "tasks/ablate/sizing.py",
    "tasks/report/sequential.py",
    "tasks/ablate/rounds.py",
    "tasks/design/seed_registry.py",
    "tasks/design/seed_registry.yaml",
    "tasks/design/registration.py",
)
"""The files whose content decides a verdict, relative to the checkout (the design hash's input:
the method, the declared claims' tests and the declared families' arms among them);
tasks/spike/sizing.py and tasks/ablate/sizing.py hold the rules that size the spike and xiong
findings' conditions, as tasks/ablate/conditions.py does the other ablation families'; the seed
registry and its rule decide which seeds a study may train on (clean confirmation), the registration
which runs are confirmatory; under rounds,
tasks/report/sequential.py draws the boundaries a look is tested against and tasks/ablate/rounds.py
decides which seeds each family is given."""


@cache
def design() -> dict[str, Any]:
    """The pre-registered design (read once)."""
    loaded: dict[str, Any] = yaml.safe_load(DESIGN_FILE.read_text(encoding="utf-8"))
    return loaded


def design_hash(root: Path | None = None) -> str:
    """sha256 over DESIGN_CODE under ``root`` (a checkout; this one by default), file by file (path
    and bytes), as the report prints it."""
    root = ROOT if root is None else root
    h = hashlib.sha256()
    for name in DESIGN_CODE:
        h.update(name.encode() + b"\0" + (root / name).read_bytes())
    return h.hexdigest()[:16]
