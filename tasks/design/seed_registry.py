"""Clean confirmation (issue #46, item 6): the registry of every seed a design step, sizing probe,
pilot, check or earlier study of this project has used (tasks/design/seed_registry.yaml: its history
by hand, then appended by ``spikelab register``: :func:`with_use`), and the rule that a study trains
on none of them.

Why: a result confirms only what was fixed before its seeds were seen. Version 2 changed the spike
detector (6σ -> 16σ), the poisoned stretch and the skip window after reading give-ups on study seeds
0-7, then confirmed on 4-7; the "unseen" seeds 8-15 of a later check held 10-13, which version 1's
check had used. So the rule reads the record, not the profile's own lists.

The rule:

- **Which seeds.** A study's seeds are ``<section>.seeds`` and ``<section>.confirm_seeds`` of the
  sections that train them (:data:`STUDY_SECTIONS`): the discovery seeds too, since with
  group-sequential rounds the first round decides as the later ones do. Each must be a seed *no*
  entry of the registry lists, under any section: a seed fixes the init and the data order
  (``train.seed``) whatever the stage, so a spike origin run and an ablation arm of one seed share
  both. Sizing seeds and ``train.seed`` are no study seeds: they are recorded, not checked.
- **Which stages.** ``spikelab run ablate|spike|search`` checks the section it trains
  (:data:`TRAINED_BY`) before anything runs (:func:`check_stage`); the other stages train no study
  seed.
- **Which profiles.** Every profile, default, extended and gpu and any added later, unless the
  registry's ``exempt_profiles`` names it with its reason: a new profile is safer checked by default
  than trusted by default. Only ``smoke`` is exempt (the yaml says why).
- The current version's own seeds are not listed until a design decision reads their results, so
  rerunning or resuming the study on them is no reuse.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from model.typed_config import ConfigError, InputError, reject_duplicate_keys
from tasks.config import Config

ROOT = Path(__file__).resolve().parents[2]
REGISTRY = Path(__file__).with_name("seed_registry.yaml")
SHOWN = "tasks/design/seed_registry.yaml"
"""The registry as a refusal names it."""

STUDY_SECTIONS = ("ablation", "spike", "search")
"""The config sections whose ``seeds`` and ``confirm_seeds`` are a study's seeds."""
STUDY_KEYS = ("seeds", "confirm_seeds")
SECTIONS = (*STUDY_SECTIONS, "pretrain")
"""The registry's sections of seed uses: the study sections, and pretrain's ``train.seed``."""
EXEMPT = "exempt_profiles"
"""The registry's one other section: profile -> why its seeds are not checked."""
TRAINED_BY = {"ablate": "ablation", "spike": "spike", "search": "search"}
"""``spikelab run <stage>`` -> the section whose study seeds it trains."""
USES = ("design_step", "sizing_probe", "pilot", "check", "study")
REQUIRED = ("seeds", "used_by", "what", "when", "read_before_design_decision", "source")
OPTIONAL = ("note",)


@dataclass(frozen=True)
class SeedUse:
    """One registry entry: the seeds one step used, and what it was."""

    section: str
    seeds: tuple[int, ...]
    used_by: str
    what: str
    when: str
    read_before_design_decision: bool | None
    source: str
    note: str = ""

    def describe(self) -> str:
        """The use as a refusal names it: the section, the kind of step, what it was, when."""
        return f"the {self.section} {self.used_by.replace('_', ' ')}: {self.what} ({self.when})"


@dataclass(frozen=True)
class Registry:
    """Every recorded seed use per section (oldest first, as the file keeps them), and the profiles
    whose seeds are not checked, each with its reason."""

    uses: dict[str, list[SeedUse]]
    exempt_profiles: dict[str, str] = field(default_factory=dict)

    @property
    def used(self) -> set[int]:
        """Every seed any entry lists."""
        return {seed for uses in self.uses.values() for use in uses for seed in use.seeds}

    def uses_of(self, seed: int, first: str = "") -> list[SeedUse]:
        """The entries that list ``seed``, those under ``first`` before the others."""
        order = sorted(self.uses, key=lambda section: section != first)
        return [use for section in order for use in self.uses[section] if seed in use.seeds]


def load_registry(path: Path | None = None) -> Registry:
    """The registry at ``path`` (default :data:`REGISTRY`), every entry checked: an
    :class:`InputError` names the file and the first bad key, since a malformed record would let a
    used seed through unseen."""
    path = REGISTRY if path is None else path
    where = _shown(path)
    raw = _read_mapping(path, where)
    if unknown := sorted(set(raw) - {*SECTIONS, EXEMPT}):
        raise InputError(f"{where}: {unknown[0]}: not a section; the registry's are {', '.join((*SECTIONS, EXEMPT))}")
    uses = {section: _entries(raw[section], section, where) for section in raw if section != EXEMPT}
    if not uses:
        raise InputError(f"{where}: lists no seed use (sections {', '.join(SECTIONS)})")
    return Registry(uses, _exempt(raw[EXEMPT], where) if EXEMPT in raw else {})


def _shown(path: Path) -> str:
    """``path`` relative to the checkout where it lies inside it, as messages name files."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def _read_mapping(path: Path, where: str) -> dict[str, Any]:
    """The file's top-level mapping. PyYAML keeps the last of two equal keys without a word, and a
    section written twice would drop the first one's seeds, so duplicates are refused first."""
    if not path.is_file():
        raise InputError(f"{where}: the seed registry is missing")
    loader = yaml.SafeLoader(path.read_text(encoding="utf-8"))
    try:
        node = loader.get_single_node()
        if node is not None:
            reject_duplicate_keys(node, where)
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as e:
        raise InputError(f"{where}: not valid YAML: {e}") from None
    except ConfigError as e:  # a key written twice
        raise InputError(f"{where}: {e}") from None
    finally:
        loader.dispose()
    if not isinstance(data, dict) or not data:
        raise InputError(f"{where}: must be a mapping of section to its seed uses ({', '.join(SECTIONS)})")
    return data


def _exempt(raw: Any, where: str) -> dict[str, str]:
    """``exempt_profiles``: each profile with the reason its seeds are not checked."""
    if not isinstance(raw, dict) or not raw:
        raise InputError(f"{where}: {EXEMPT}: must be a non-empty mapping of profile to why it is exempt")
    for profile, why in raw.items():
        if not isinstance(profile, str) or not isinstance(why, str) or not why.strip():
            raise InputError(f"{where}: {EXEMPT}.{profile}: must be a profile's name and why, as text, got {why!r}")
    return dict(raw)


def _entries(raw: Any, section: str, where: str) -> list[SeedUse]:
    """A section's uses: a section left empty is refused, since it would read as "no seed used"."""
    if not isinstance(raw, list) or not raw:
        raise InputError(f"{where}: {section}: must be a non-empty list of seed uses")
    return [_entry(item, section, f"{section}[{index}]", where) for index, item in enumerate(raw)]


def _entry(raw: Any, section: str, key: str, where: str) -> SeedUse:
    """One entry, every field checked: the seeds, the kind of use, and where it is recorded."""
    if not isinstance(raw, dict):
        raise InputError(f"{where}: {key}: must be a mapping ({', '.join(REQUIRED)})")
    if missing := [name for name in REQUIRED if name not in raw]:
        raise InputError(f"{where}: {key}.{missing[0]}: missing; every use says {', '.join(REQUIRED)}")
    if unknown := sorted(set(raw) - set(REQUIRED) - set(OPTIONAL)):
        raise InputError(f"{where}: {key}.{unknown[0]}: not a field of a seed use ({', '.join(REQUIRED + OPTIONAL)})")
    if raw["used_by"] not in USES:
        raise InputError(f"{where}: {key}.used_by: {raw['used_by']!r} is not one of {', '.join(USES)}")
    if raw["read_before_design_decision"] not in (True, False, None):
        raise InputError(
            f"{where}: {key}.read_before_design_decision: must be true, false or null (not recorded), "
            f"got {raw['read_before_design_decision']!r}"
        )
    for name in ("what", "when", "source", *(n for n in OPTIONAL if n in raw)):
        if not isinstance(raw[name], str) or not raw[name].strip():
            raise InputError(f"{where}: {key}.{name}: must be non-empty text, got {raw[name]!r}")
    return SeedUse(
        section=section,
        seeds=_seeds(raw["seeds"], f"{key}.seeds", where),
        used_by=raw["used_by"],
        what=raw["what"],
        when=raw["when"],
        read_before_design_decision=raw["read_before_design_decision"],
        source=raw["source"],
        note=raw.get("note", ""),
    )


def _seeds(raw: Any, key: str, where: str) -> tuple[int, ...]:
    """A non-empty list of distinct seeds, each a non-negative integer (``true`` is no seed)."""
    if not isinstance(raw, list) or not raw:
        raise InputError(f"{where}: {key}: must be a non-empty list of seeds, got {raw!r}")
    for seed in raw:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise InputError(f"{where}: {key}: {seed!r} is not a seed (an integer >= 0)")
    if len(set(raw)) != len(raw):
        raise InputError(f"{where}: {key}: {raw} names a seed twice")
    return tuple(raw)


def check_study_seeds(cfg: Config, sections: Iterable[str] = STUDY_SECTIONS, registry: Registry | None = None) -> None:
    """Refuse ``cfg`` where a study seed of ``sections`` (``seeds``, then ``confirm_seeds``) is one
    the registry lists under any section, naming the key, its lowest such seed and that seed's
    earlier use (:func:`refusal`). A profile the registry exempts passes unchecked."""
    registry = load_registry() if registry is None else registry
    if cfg.profile in registry.exempt_profiles:
        return
    used = registry.used
    for section in sections:
        for key in STUDY_KEYS:
            seeds = study_seeds(cfg, section, key)
            if reused := sorted(set(seeds) & used):
                avoid = {seed for other in STUDY_KEYS if other != key for seed in study_seeds(cfg, section, other)}
                raise ConfigError(refusal(registry, section, key, reused, len(seeds), avoid))


def check_stage(stage: str, cfg: Config) -> None:
    """The check ``spikelab run <stage>`` makes before anything runs: the study seeds of the section
    the stage trains (none for the stages that train no study seed)."""
    if stage in TRAINED_BY:
        check_study_seeds(cfg, [TRAINED_BY[stage]])


def study_seeds(cfg: Config, section: str, key: str) -> list[int]:
    """``<section>.<key>`` of ``cfg`` (a key of :data:`STUDY_KEYS`)."""
    sections = {"ablation": cfg.ablation, "spike": cfg.spike, "search": cfg.search}
    return list(getattr(sections[section], key))


def refusal(registry: Registry, section: str, key: str, reused: list[int], wanted: int, avoid: set[int]) -> str:
    """One line: the key, the lowest reused seed and its use that matters most (under the key's own
    section first, the first whose results were read before a design decision, else the first), the
    other reused seeds, and as many fresh seeds as the key lists, none of ``avoid`` (the section's
    other study seeds)."""
    uses = registry.uses_of(reused[0], first=section)
    named = next((use for use in uses if use.read_before_design_decision), uses[0])
    more = f" (and {len(uses) - 1} other use{'s' if len(uses) > 2 else ''})" if len(uses) > 1 else ""
    others = f"; so {'was' if len(reused) == 2 else 'were'} {', '.join(map(str, reused[1:]))}" if reused[1:] else ""
    return (
        f"{section}.{key}: seed {reused[0]} was used by {named.describe()}{more}{others}; a study trains on "
        f"seeds no earlier step used ({SHOWN}), e.g. {fresh_seeds(registry, wanted, avoid)}"
    )


def fresh_seeds(registry: Registry, count: int, avoid: Iterable[int] = ()) -> list[int]:
    """The ``count`` lowest seeds no entry lists, none of ``avoid``."""
    taken = registry.used | set(avoid)
    fresh: list[int] = []
    seed = 0
    while len(fresh) < count:
        if seed not in taken:
            fresh.append(seed)
        seed += 1
    return fresh


def check_declared_seeds(families: Iterable[Any], registry: Registry | None = None) -> None:
    """Refuse a declared family (studies.yaml) whose own ``seeds`` or ``confirm_seeds`` include a seed
    the registry lists: a declared study is a study (issue #58, item 7). Families that take the
    ablation's seeds are checked with them (:func:`check_study_seeds`)."""
    registry = load_registry() if registry is None else registry
    used = registry.used
    for family in families:
        for key in STUDY_KEYS:
            seeds = list(getattr(family, key))
            if reused := sorted(set(seeds) & used):
                use = registry.uses_of(reused[0], first="ablation")[0]
                raise ConfigError(
                    f"studies.yaml: families.{family.name}.{key}: seed {reused[0]} was used by {use.describe()}; "
                    f"a study trains on seeds no earlier step used ({SHOWN}), e.g. "
                    f"{fresh_seeds(registry, len(seeds), family.all_seeds)}"
                )


def with_use(text: str, use: SeedUse) -> str:
    """The registry's text with ``use`` appended as the last entry of its section (a new section
    at the end where it has none), every comment and entry kept as written."""
    entry = [
        f"  - seeds: [{', '.join(map(str, use.seeds))}]",
        f"    used_by: {use.used_by}",
        *(f"    {name}: {json.dumps(getattr(use, name), ensure_ascii=False)}" for name in ("what", "when")),
        f"    read_before_design_decision: {json.dumps(use.read_before_design_decision)}",
        f"    source: {json.dumps(use.source, ensure_ascii=False)}",
    ]
    lines = text.splitlines()
    header = next((i for i, line in enumerate(lines) if line == f"{use.section}:"), None)
    if header is None:
        return "\n".join([*lines, f"{use.section}:", *entry]) + "\n"
    end = next((i for i in range(header + 1, len(lines)) if lines[i][:1] not in ("", " ", "#")), len(lines))
    while end > header + 1 and not lines[end - 1].strip():
        end -= 1
    return "\n".join([*lines[:end], *entry, *lines[end:]]) + "\n"
