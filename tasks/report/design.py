"""The study's pre-registered design (tasks/report/preregistration.yaml), read in one place: the
findings read it for their tests and thresholds, the ablate stage's figures for the lines they
draw (the plateau margin, the fp16 underflow threshold), the report prints its hash."""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path
from typing import Any

import yaml

DESIGN_FILE = Path(__file__).with_name("preregistration.yaml")


@cache
def design() -> dict[str, Any]:
    """The pre-registered design (read once)."""
    loaded: dict[str, Any] = yaml.safe_load(DESIGN_FILE.read_text(encoding="utf-8"))
    return loaded


def design_hash() -> str:
    """sha256 of the design file, as the report prints it."""
    return hashlib.sha256(DESIGN_FILE.read_bytes()).hexdigest()[:16]
