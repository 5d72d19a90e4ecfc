"""``spikelab register [--profile P] [--stages S ...] [--dry-run]``: freeze the profile's design
into its record, for the stages named (stages.py; default: every stage that trains study seeds).

In order, each refusal one line (a UserError, exit 2):

1. the checkout is a git checkout with no uncommitted change to anything the design covers (the
   design code, params.yaml, the profile, studies.yaml, the records): the registration is
   committable as it is, and its commit names the design exactly;
2. no study seed is exploratory (tasks/design/registration.py: EXPLORATORY_FROM);
3. the seeds of every result that exists now (metrics/{search,spike,ablate}.json) go into the seed
   registry, as read before this design: the tool writes them, not a hand;
4. no study seed of the stages registered, the declared families' own included (ablate), is one the
   registry then lists;
5. no gate of a finding those stages decide is fixed by construction (gates.py);
6. the plan (plan.py): each family's looks and each claim's power, printed.

Then it writes the registry and the record (not with ``--dry-run``) and says what to commit. The
record holds the three design hashes, the profile, the stages it covers, the commit it was made
at, the UTC time, the seeds it registers, the results that existed before it (each with its last
commit) and the plan.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from model.typed_config import PROFILES_DIR, ConfigError
from tasks.ablate.grid import trained
from tasks.config import Config, load_config
from tasks.design.preregistration import DESIGN_CODE
from tasks.design.registration import (
    LABEL_KEY,
    RECORDS,
    STUDIES_FILE,
    design_of,
    git,
    load_records,
    record_path,
    refuse_exploratory_seeds,
    uncommitted,
)
from tasks.design.seed_registry import (
    SHOWN,
    STUDY_KEYS,
    STUDY_SECTIONS,
    TRAINED_BY,
    Registry,
    SeedUse,
    check_declared_seeds,
    check_study_seeds,
    load_registry,
    study_seeds,
    with_use,
)
from tasks.design.studies import read_studies
from tasks.register import gates, stages
from tasks.register.plan import plan, plan_lines
from tasks.runtime.outputs import ABLATE_METRICS, SEARCH_METRICS, SPIKE_METRICS

REGISTRY = Path(SHOWN)
"""The seed registry, relative to the project."""
RESULTS = {"search": SEARCH_METRICS, "spike": SPIKE_METRICS, "ablate": ABLATE_METRICS}
"""The results a registration lists as existing before it, by the stage that writes them."""


def covered(profile: str) -> list[Path]:
    """What a registration freezes, relative to the project: clean before it is made."""
    return [*map(Path, DESIGN_CODE), Path("params.yaml"), Path(PROFILES_DIR) / f"{profile}.yaml", STUDIES_FILE, RECORDS]


def registered_seeds(
    cfg: Config, declared: list[Any], sections: Sequence[str] = STUDY_SECTIONS
) -> dict[str, list[int]]:
    """Every study seed the design trains in ``sections``, by key; a declared family's own seeds
    under its name."""
    seeds = {f"{s}.{k}": study_seeds(cfg, s, k) for s in sections for k in STUDY_KEYS}
    seeds |= {f"studies.yaml:{f.name}.{k}": list(getattr(f, k)) for f in declared for k in STUDY_KEYS}
    return {k: v for k, v in seeds.items() if v}


def result_seeds(stage: str, data: dict[str, Any]) -> list[int]:
    """The study seeds a stage's metrics hold: its registration label's, else read from what the
    stage writes (results from before registrations carry no label)."""
    label = data.get(LABEL_KEY)
    if isinstance(label, dict) and isinstance(label.get("seeds"), dict):
        return sorted({int(s) for seeds in label["seeds"].values() for s in seeds})
    if stage == "ablate":
        return sorted({int(arm["seed"]) for arm in data.get("arms", [])})
    if stage == "spike":
        return sorted({*data.get("discovery_seeds", []), *data.get("confirm_seeds", [])})
    widths = [w for p in ("sp", "mup") for w in (data.get(p) or {}).get("widths", {}).values()]
    return sorted({int(s) for w in widths for s in w.get("per_seed", {})})


def existing_results(project: Path) -> list[dict[str, Any]]:
    """Each stage's result that exists now: its file, the commit that last changed it (None when
    uncommitted), its label's state and the seeds it holds."""
    found = []
    for stage, path in RESULTS.items():
        if not (project / path).is_file():
            continue
        data = json.loads((project / path).read_text(encoding="utf-8"))
        label = data.get(LABEL_KEY) if isinstance(data.get("registration"), dict) else {}
        last = (git(project, "log", "-1", "--format=%H %cI", "--", str(path)) or "").strip()
        commit, _, when = last.partition(" ")
        found.append(
            {
                "path": str(path),
                "stage": stage,
                "commit": commit or None,
                "committed_at": when or None,
                "state": label.get("state", "unlabelled: made before registrations"),
                "seeds": result_seeds(stage, data),
            }
        )
    return found


def new_uses(registry: Registry, results: list[dict[str, Any]], profile: str, now: str) -> list[SeedUse]:
    """The results' seeds the registry does not list yet, one entry per result."""
    uses = []
    for result in results:
        fresh = [s for s in result["seeds"] if s not in registry.used]
        if fresh:
            uses.append(
                SeedUse(
                    section=TRAINED_BY[result["stage"]],
                    seeds=tuple(fresh),
                    used_by="study",
                    what=f"the {result['stage']} results in {result['path']} ({result['state']}), read before "
                    f"profile {profile}'s registration",
                    when=f"{now[:10]}, written by spikelab register",
                    read_before_design_decision=True,
                    source=f"{result['path']} at commit {result['commit'] or 'none (uncommitted)'}",
                )
            )
    return uses


def grown_by(registry: Registry, uses: list[SeedUse]) -> Registry:
    """The registry with ``uses`` appended, as :func:`write_registry` will write it."""
    sections = {*registry.uses, *(u.section for u in uses)}
    grown = {s: [*registry.uses.get(s, []), *(u for u in uses if u.section == s)] for s in sections}
    return Registry(grown, registry.exempt_profiles)


def register(
    project: Path, profile: str | None = None, dry_run: bool = False, only: Sequence[str] | None = None
) -> list[str]:
    """Check, plan and (unless ``dry_run``) write a registration of the stages ``only`` names
    (every stage that trains study seeds by default); the lines to print."""
    covers = stages.chosen(only)
    cfg = load_config(project / "params.yaml", profile)
    registry = load_registry(project / REGISTRY)
    if cfg.profile in registry.exempt_profiles:
        raise ConfigError(f"--profile: {cfg.profile} is exempt from the seed registry (no verdict of it is evidence)")
    commit = (git(project, "rev-parse", "HEAD") or "").strip()
    if not commit:
        raise ConfigError(f"{project}: not a git checkout; a registration names the commit its design is at")
    if dirty := uncommitted(project, covered(cfg.profile)):  # a deleted file too
        raise ConfigError(
            f"{dirty[0]}: uncommitted change to the design; a registration must be committable as it is "
            "(commit or stash first)"
        )
    sections = [TRAINED_BY[stage] for stage in covers]
    families_decided = "ablate" in covers  # the families' findings (studies.yaml's too) are ablate's
    declared = read_studies(project, cfg) if families_decided else []
    seeds = registered_seeds(cfg, declared, sections)
    refuse_exploratory_seeds(seeds)
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    results = existing_results(project)
    uses = new_uses(registry, results, cfg.profile, now)
    grown = grown_by(registry, uses)
    check_study_seeds(cfg, sections, registry=grown)
    check_declared_seeds(declared, grown)
    # a family the profile drops is not registered, nor any family where ablate is not
    every = list(trained(cfg, declared).values()) if families_decided else []
    if refused := gates.refusals(cfg, every, builtin="search" in covers):
        raise ConfigError(f"{refused[0]}{f' (and {len(refused) - 1} more)' if len(refused) > 1 else ''}")
    planned = plan(cfg, every)
    lines = [
        f"register: profile {cfg.profile}, stages {', '.join(covers)}, at {commit[:12]}: "
        f"{sum(map(len, seeds.values()))} study seeds, "
        f"{len(results)} earlier results, {sum(len(u.seeds) for u in uses)} seeds added to the registry",
        *plan_lines(planned),
    ]
    if dry_run:
        return [*lines, "register: --dry-run: nothing written"]
    write_registry(project, uses)
    entry = {
        "profile": cfg.profile,
        "stages": covers,
        "registered_at": now,
        "commit": commit,
        **design_of(cfg, project),
        "seeds": seeds,
        "results_before": results,
        "registry_added": [{"section": u.section, "seeds": list(u.seeds), "source": u.source} for u in uses],
        "plan": planned,
    }
    write_record(project, cfg.profile, [*load_records(project, cfg.profile), entry])
    shown = record_path(cfg.profile)
    return [
        *lines,
        f"register: wrote {shown}{f' and {REGISTRY}' if uses else ''}; commit before any study seed runs: "
        f"git add {RECORDS} {REGISTRY} && git commit",
    ]


def write_registry(project: Path, uses: list[SeedUse]) -> None:
    path = project / REGISTRY
    text = path.read_text(encoding="utf-8")
    for use in uses:
        text = with_use(text, use)
    path.write_text(text, encoding="utf-8")


def write_record(project: Path, profile: str, records: list[dict[str, Any]]) -> None:
    path = project / record_path(profile)
    path.parent.mkdir(parents=True, exist_ok=True)
    head = f"# Registrations of profile {profile}, oldest first: written by `spikelab register`, never by hand.\n"
    path.write_text(
        head + yaml.safe_dump({"registrations": records}, sort_keys=False, allow_unicode=True, default_flow_style=None),
        encoding="utf-8",
    )
