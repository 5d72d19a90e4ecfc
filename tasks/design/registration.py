"""A registration the tool enforces (issue #58, item 1): the record ``spikelab register`` writes
when it freezes a design, and the one question every training stage asks of it before it trains a
study seed: is this run confirmatory (its design is the registered one, the record committed) or
exploratory?

A design is three hashes, each of what decides a verdict: the design code and pre-registration
(tasks/design/preregistration.py: design_hash, the seed registry among its files), the profile's
resolved config (every section but where things run and are tracked: :data:`NOT_DESIGN`), and
``studies.yaml`` (the declared families). A one-byte change to any of them is another design.

Records live in ``tasks/design/registrations/<profile>.yaml``, a list, oldest first; the last one
is the profile's registration. Exploratory work trains on seeds no registration may use: a study
seed the seed registry does not list moves to ``EXPLORATORY_FROM + seed`` (a registration refuses
any seed at or past it), so exploring never spends a fresh seed; a seed already listed is spent
and stays. A profile the registry exempts (smoke) keeps its seeds: nothing it trains is evidence.
Exploratory results are labelled where the report reads them (``registration`` in each stage's
metrics JSON: :func:`label_results`) and never counted as verdicts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from model.typed_config import ConfigError, InputError, flatten
from tasks.config import Config
from tasks.design.preregistration import DESIGN_CODE, design_hash
from tasks.design.seed_registry import STUDY_KEYS, STUDY_SECTIONS, TRAINED_BY, Registry, study_seeds
from tasks.runtime.files import write_json

RECORDS = Path("tasks/design/registrations")
"""The records, relative to the project: one file per profile."""
STUDIES_FILE = Path("studies.yaml")
EXPLORATORY_FROM = 1_000_000
"""Seeds at or past this are exploratory: no registration may list one."""
NOT_DESIGN = ("tracking.", "executor.", "data.workers")
"""Config keys that say where a run happens and is tracked, not what it is (no part of a design)."""
CONFIRMATORY, EXPLORATORY = "confirmatory", "exploratory"


def record_path(profile: str) -> Path:
    """A profile's records, relative to the project."""
    return RECORDS / f"{profile}.yaml"


def config_hash(cfg: Config) -> str:
    """sha256 of the resolved config, every key but :data:`NOT_DESIGN`, in a canonical form."""
    keys = {k: v for k, v in flatten(dataclasses.asdict(cfg)).items() if not k.startswith(NOT_DESIGN)}
    text = json.dumps(keys, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def studies_hash(project: Path) -> str:
    """sha256 of studies.yaml's bytes ("none" without one)."""
    path = project / STUDIES_FILE
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.is_file() else "none"


def design_of(cfg: Config, project: Path) -> dict[str, str]:
    """The three hashes a registration freezes. The design code is hashed in the project where it
    holds a copy of its own (a checkout), else where it runs from (a folder of params and data
    driven by the installed code)."""
    code = project if all((project / name).is_file() for name in DESIGN_CODE) else None
    return {"design_hash": design_hash(code), "config_hash": config_hash(cfg), "studies_hash": studies_hash(project)}


def load_records(project: Path, profile: str) -> list[dict[str, Any]]:
    """A profile's registrations, oldest first (none without a record file)."""
    path = project / record_path(profile)
    if not path.is_file():
        return []
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise InputError(f"{record_path(profile)}: not valid YAML: {e}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("registrations"), list):
        raise InputError(f"{record_path(profile)}: registrations: must be a list of registrations")
    records: list[dict[str, Any]] = raw["registrations"]
    return records


def git(project: Path, *args: str) -> str | None:
    """``git ARGS`` in the project, its stdout as it is; None outside a git checkout or on failure."""
    try:
        done = subprocess.run(["git", "-C", str(project), *args], capture_output=True, text=True, check=False)
    except OSError:
        return None
    return done.stdout if done.returncode == 0 else None


def uncommitted(project: Path, paths: Iterable[Path | str]) -> list[str]:
    """Those of ``paths`` git reports changed, staged or untracked (all of them outside git)."""
    names = [str(p) for p in paths]
    out = git(project, "status", "--porcelain", "--untracked-files=all", "--", *names)
    if out is None:
        return names
    return [line[3:] for line in out.splitlines() if line.strip()]  # "XY path": X may be a space


@dataclasses.dataclass(frozen=True)
class State:
    """Whether a stage's run is confirmatory, and if not, why; the record it was read against."""

    state: str
    record: str
    hashes: dict[str, str]
    why: str = ""

    def label(self, seeds: dict[str, list[int]]) -> dict[str, Any]:
        """What each metrics file says of the run (``registration``): the report reads ``state``."""
        return {"state": self.state, "record": self.record, "hash": self.hashes["design_hash"]} | {
            "hashes": self.hashes,
            "why": self.why,
            "seeds": seeds,
        }


def state_of(cfg: Config, project: Path) -> State:
    """Confirmatory when the profile's last registration holds this design's three hashes and its
    record is committed; exploratory otherwise, saying why in words a user acts on."""
    shown = str(record_path(cfg.profile))
    now = design_of(cfg, project)
    records = load_records(project, cfg.profile)
    if not records:
        return State(EXPLORATORY, shown, now, f"profile {cfg.profile} has no registration ({shown})")
    last = records[-1]
    if changed := [k for k in now if last.get(k) != now[k]]:
        what = ", ".join(f"{k} {last.get(k)} -> {now[k]}" for k in changed)
        return State(EXPLORATORY, shown, now, f"the design differs from its registration in {shown} ({what})")
    if uncommitted(project, [shown]):
        return State(EXPLORATORY, shown, now, f"{shown} is not committed")
    return State(CONFIRMATORY, shown, now)


def exploratory_seeds(
    cfg: Config, registry: Registry, sections: Iterable[str] = STUDY_SECTIONS
) -> dict[str, list[int]]:
    """Overrides that move each study seed of ``sections`` the registry does not list into the
    exploratory range, so exploring spends no seed a registration could use (none for an exempt
    profile)."""
    if cfg.profile in registry.exempt_profiles:
        return {}
    used = registry.used
    moved = {}
    for section in sections:
        for key in STUDY_KEYS:
            seeds = study_seeds(cfg, section, key)
            fresh = [s if s in used or s >= EXPLORATORY_FROM else EXPLORATORY_FROM + s for s in seeds]
            if fresh != seeds:
                moved[f"{section}.{key}"] = fresh
    return moved


def stage_seeds(stage: str, cfg: Config) -> dict[str, list[int]]:
    """The study seeds ``spikelab run <stage>`` trains, by key."""
    section = TRAINED_BY[stage]
    return {f"{section}.{key}": study_seeds(cfg, section, key) for key in STUDY_KEYS}


def refuse_exploratory_seeds(seeds: Mapping[str, Sequence[int]]) -> None:
    """A registration lists no exploratory seed: such a seed's results may already exist unlabelled."""
    for key, listed in seeds.items():
        if bad := [s for s in listed if s >= EXPLORATORY_FROM]:
            raise ConfigError(
                f"{key}: seed {bad[0]} is in the exploratory range (>= {EXPLORATORY_FROM:,}); "
                "a registration trains on seeds exploratory work never uses"
            )


LABEL_KEY = "registration"
"""The key of a stage's metrics JSON that holds its registration label (:func:`label_results`)."""


def label_results(project: Path, paths: Iterable[Path], label: dict[str, Any]) -> None:
    """Write ``registration`` into each metrics JSON a stage wrote, where the report reads it."""
    for path in paths:
        full = project / path
        if full.suffix == ".json" and full.is_file():
            data = json.loads(full.read_text(encoding="utf-8"))
            write_json(full, {**data, LABEL_KEY: label})


def refuse_fresh_declared_seeds(families: Iterable[Any], registry: Registry) -> None:
    """An exploratory run moves the config's fresh seeds (:func:`exploratory_seeds`), but a declared
    family's own ``seeds`` are studies.yaml's: one the registry does not list would be spent by
    exploring, so it is refused, naming the family and the seed."""
    used = registry.used
    for family in families:
        if fresh := [s for s in family.all_seeds if s not in used and s < EXPLORATORY_FROM]:
            raise ConfigError(
                f"studies.yaml: families.{family.name}.seeds: seed {fresh[0]} is fresh and this run is exploratory, "
                f"so it would spend it: register the design (spikelab register) or give the family seeds "
                f">= {EXPLORATORY_FROM:,}"
            )
