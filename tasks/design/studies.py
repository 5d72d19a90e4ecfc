"""Families of arms and their claims declared in ``studies.yaml``, not in code: a researcher's own
ablation, trained, tracked and judged by the same machinery as the built-in families.

    families:
      wd_sensitivity:
        question: Does independent weight decay lower LR sensitivity?
        factors:                         # run-config keys, nested (as `dvc exp run -S` sets them)
          optim:
            weight_decay_mode: [coupled, independent]
            lr: [0.001, 0.003, 0.01, 0.03]
        fixed: {optim.weight_decay: 0.1} # the family's conditions, on top of the arm scale
        steps: 300                       # optional: ablation.steps
        claims:
          lower_sensitivity:
            kind: sensitivity            # contrast | equivalence | interaction | sensitivity | slope
            metric: capped_loss          # any figure an arm records (METRICS)
            over: optim.lr
            a: {optim.weight_decay_mode: independent}
            b: {optim.weight_decay_mode: coupled}
            expected: -1                 # the sign of a − b
            sesoi: 0.05
            justification: why 0.05 nats is the least effect worth acting on

Every arm starts from the ablation's arm scale (``ablation.d_model`` ... ``batch_size``, μP at
the base width, fp32; DeclaredFamily.overrides), then takes the family's ``fixed`` keys,
then its factor values. Seeds default to ``ablation.seeds`` and ``ablation.confirm_seeds``, so a
profile scales a declared family as it scales the built-in ones. A declaration is checked in
full before any arm trains; each error names the file and the key.

The built-in families are declared in the same form, each beside its finding in
tasks/design/preregistration.yaml (``family``, and its claims' ``kind``, ``metric``, ...), with two
things a profile needs:

  references   ``"${ablation.xiong_lrs}"`` (a list for a factor's values, a number elsewhere) and
               ``"${ablation.xiong_warmups[0]}"`` read the study config, so a profile scales them;
               ``"${probe.loss_shift}"`` is the precision probe's shift (tasks/ablate/conditions.py).
  named factors  a factor whose name is no config key (``sets``, ``levels`` or ``injection``: how
               each sets the arm's keys is in tasks/design/families.py, with what a family is).
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import yaml

from model.typed_config import ConfigError, flatten
from tasks.ablate.config import AblationConfig
from tasks.config import Config
from tasks.design.families import (
    BOUNDS,
    FIGURES,
    LOSS_SHIFT,
    DeclaredClaim,
    DeclaredFamily,
    Gate,
    check_key,
    check_value,
    default_statement,
    only_keys,
    parse_factors,
    set_keys,
)
from tasks.design.preregistration import DESIGN_FILE, design

STUDIES = Path("studies.yaml")
"""The declared families, beside params.yaml (a DVC params file of the ablate and report stages)."""

KINDS = ("contrast", "equivalence", "interaction", "sensitivity", "slope")
"""What a claim may state (the module doc of tasks/report/declared.py says how each is tested)."""

METRICS = (*FIGURES, "diverged", "update_rms_mean", "wall_s")
"""The figures an arm records that a claim or a gate may name (tasks/ablate/grid.py: arm_metrics,
and ``capped_loss``: the final validation loss with a diverged run counted as ln V)."""

FAMILY_KEYS = {"question", "factors", "fixed", "steps", "seeds", "confirm_seeds", "warmup_fraction", "claims"}
FAMILY_KEYS |= {"range_probe_every", "base"}
CLAIM_KEYS = {"kind", "metric", "a", "b", "over", "across", "log", "expected", "sesoi", "justification"}
CLAIM_KEYS |= {"may_fail", "gate", "statement", "unit"}
GATE_KEYS = {"metric", "variant", *BOUNDS, "at_some", "justification"}
"""What a claim's ``gate`` may say (:class:`tasks.design.families.Gate`); docs/ablate-reference.md
lists each, with FAMILY_KEYS, CLAIM_KEYS, KINDS and METRICS (tests/test_docs.py holds it to them)."""

BUILTIN = DESIGN_FILE
"""Where the built-in families are declared: beside their findings, in the pre-registration."""
REFERENCE = re.compile(r"^\$\{(ablation\.[a-z0-9_]+|probe\.loss_shift)(?:\[(\d+)\])?\}$")


def read_studies(project: Path, cfg: Config) -> list[DeclaredFamily]:
    """The families ``studies.yaml`` declares (none when the file is absent), each checked in full
    against ``cfg``'s schema, none named as a built-in family: a :class:`ConfigError` names the file
    and the first bad key."""
    path = project / STUDIES
    if not path.is_file():
        return []
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{STUDIES}: not valid YAML: {e}") from None
    if not isinstance(raw, dict) or set(raw) - {"families"}:
        raise ConfigError(f"{STUDIES}: must be a mapping with one key, families (got {sorted(raw)!r})")
    families = raw.get("families") or {}
    if not isinstance(families, dict):
        raise ConfigError(f"{STUDIES}: families: must be a mapping of family name to declaration")
    for name in families:
        if name in builtin_names():
            raise ConfigError(f"{STUDIES}: families.{name}: {name!r} is a built-in family; choose another name")
    return [parse_family(name, body, cfg, f"{STUDIES}: families.{name}") for name, body in families.items()]


def builtin_names() -> dict[str, str]:
    """Each built-in family's name and the finding that declares it (finding ``fp16``: ``precision``)."""
    return {f["family"]["name"]: key for key, f in design()["findings"].items() if "family" in f}


def builtin_families(cfg: Config) -> list[DeclaredFamily]:
    """The built-in families as preregistration.yaml declares them (each finding's ``family`` and
    its claims), resolved against ``cfg``: its profile's values. A profile may shrink a grid: a claim
    the grid cannot state (a variant it names, its gate's or its ``over`` grid not crossed) is left
    out where it says ``if_crossed`` (a profile without z-loss), and otherwise leaves the family no
    claims, with the reason in ``missing`` (its finding reads "not in this grid")."""
    families = []
    for key, finding in design()["findings"].items():
        if "family" not in finding:
            continue
        declared = dict(finding["family"])
        name = declared.pop("name")
        claims = {
            claim: {k: v for k, v in entry.items() if k != "sesoi_justification"}
            | {"justification": entry["sesoi_justification"], "may_fail": finding.get("may_fail") or []}
            for claim, entry in finding["claims"].items()
        }
        body = declared | {"question": finding["claim"], "claims": claims}
        families.append(parse_family(name, body, cfg, f"{BUILTIN.name}: findings.{key}.family", builtin=True))
    return families


def parse_family(name: str, body: Any, cfg: Config, where: str, builtin: bool = False) -> DeclaredFamily:
    if not isinstance(body, dict):
        raise ConfigError(f"{where}: must be a mapping (question, factors, claims, ...)")
    only_keys(body, FAMILY_KEYS, where)
    a = cfg.ablation
    claims_unresolved = body.get("claims")
    body = resolve({k: v for k, v in body.items() if k != "claims"}, a, where) | {"claims": claims_unresolved}
    question = _required(body, "question", str, where)
    factors, named = parse_factors(body.get("factors"), cfg, f"{where}.factors")
    fixed = flatten(body.get("fixed") or {})
    for key in fixed:
        check_key(key, f"{where}.fixed.{key}")
    check_value(cfg, "", {k: 0 if v == LOSS_SHIFT else v for k, v in fixed.items()}, f"{where}.fixed")
    crossed = {key for name in factors for key in set_keys(name, named.get(name))}
    if overlap := sorted(set(fixed) & crossed):
        raise ConfigError(f"{where}.fixed: {overlap} also set by a factor; a key is either fixed or crossed")
    steps = body.get("steps", a.steps)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ConfigError(f"{where}.steps: must be a positive integer, got {steps!r}")
    seeds = _seeds(body.get("seeds", a.seeds), f"{where}.seeds")
    confirm = _seeds(body.get("confirm_seeds", a.confirm_seeds), f"{where}.confirm_seeds")
    if twice := sorted(set(seeds) & set(confirm)):
        raise ConfigError(
            f"{where}.confirm_seeds: seed {twice[0]} is also a discovery seed (seeds); a seed is used once"
        )
    if a.rounds and len(seeds) + len(confirm) != a.rounds[-1]:
        raise ConfigError(
            f"{where}.seeds: {len(seeds) + len(confirm)} seeds with confirm_seeds, but the study trains in rounds "
            f"up to {a.rounds[-1]} (ablation.rounds): a family's seeds fill the last round"
        )
    warmup = body.get("warmup_fraction", a.warmup_fraction)
    if not isinstance(warmup, (int, float)) or isinstance(warmup, bool) or not 0 <= warmup < 1:
        raise ConfigError(f"{where}.warmup_fraction: must be in [0, 1), got {warmup!r}")
    probe = body.get("range_probe_every", 0)
    if not isinstance(probe, int) or isinstance(probe, bool) or probe < 0:
        raise ConfigError(f"{where}.range_probe_every: must be an integer >= 0, got {probe!r}")
    claims_raw = body.get("claims")
    if not isinstance(claims_raw, dict) or not claims_raw:
        raise ConfigError(f"{where}.claims: declare at least one claim (a mapping of claim name to claim)")
    family = DeclaredFamily(name, question, factors, fixed, steps, seeds, confirm, float(warmup), [], named, probe)
    base = body.get("base") or {}
    if builtin and isinstance(base, dict) and not _crossed({"a": base}, family):
        base = {}  # a profile's grid without the base's values: each factor's first value instead
    family = dataclasses.replace(family, base=_variant(base, family, f"{where}.base"))
    for variant in family.variants():  # every arm's config builds: a bad combination fails here
        check_value(cfg, "", family.overrides(a, variant, seeds[0]), where)
    if not builtin:
        claims = [
            parse_claim(c, resolve(body, a, f"{where}.claims.{c}"), family, f"{where}.claims.{c}")
            for c, body in claims_raw.items()
        ]
        return dataclasses.replace(family, claims=claims)
    return _builtin_claims(family, claims_raw, a, where)


def _builtin_claims(
    family: DeclaredFamily, claims_raw: dict[str, Any], a: AblationConfig, where: str
) -> DeclaredFamily:
    """A built-in family's claims in this config's grid: a claim it cannot state (a value the grid
    does not cross, or a reference to an item the profile's list lacks) is dropped where it says
    ``if_crossed``; any other leaves the family none, saying why (``missing``)."""
    claims = []
    for name, raw in claims_raw.items():
        body = dict(raw)
        optional = bool(body.pop("if_crossed", False))
        try:
            body = resolve(body, a, f"{where}.claims.{name}")
            body["may_fail"] = [v for v in body.get("may_fail") or [] if _crossed({"a": v}, family)]
            claims.append(parse_claim(name, body, family, f"{where}.claims.{name}"))
        except ConfigError as e:
            if not optional:
                return dataclasses.replace(family, missing=str(e))
    return dataclasses.replace(family, claims=claims)


def resolve(value: Any, a: AblationConfig, where: str) -> Any:
    """``value`` with every ``${ablation.KEY}`` (``[i]``: its i-th item) read from ``a``;
    ``${probe.loss_shift}`` is kept (DeclaredFamily.overrides takes it per plan)."""
    if isinstance(value, dict):
        return {k: resolve(v, a, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [resolve(v, a, where) for v in value]
    if not isinstance(value, str) or not value.startswith("${"):
        return value
    if value == LOSS_SHIFT:
        return value
    match = REFERENCE.match(value)
    if match is None or match.group(1).removeprefix("ablation.") not in {f.name for f in dataclasses.fields(a)}:
        raise ConfigError(f"{where}: {value!r} is no reference to a key of ablation (e.g. ${{ablation.lrs}})")
    found = getattr(a, match.group(1).removeprefix("ablation."))
    if match.group(2) is None:
        return list(found) if isinstance(found, list) else found
    index = int(match.group(2))
    if not isinstance(found, list) or index >= len(found):
        raise ConfigError(f"{where}: {value!r}: {match.group(1)} has no item {index}")
    return found[index]


def _crossed(claim: dict[str, Any], family: DeclaredFamily) -> bool:
    """Whether every factor value a built-in claim names (a, b, its gate's variant) is in the grid."""
    gate = claim.get("gate") or {}
    named = [kv for side in (claim.get("a"), claim.get("b"), gate.get("variant")) for kv in flatten(side or {}).items()]
    return all(v in family.factors.get(k, ()) for k, v in named)


def parse_claim(name: str, body: Any, family: DeclaredFamily, where: str) -> DeclaredClaim:
    if not isinstance(body, dict):
        raise ConfigError(f"{where}: must be a mapping (kind, metric, a, b, expected, sesoi, justification)")
    only_keys(body, CLAIM_KEYS, where)
    kind = _required(body, "kind", str, where)
    if kind not in KINDS:
        raise ConfigError(f"{where}.kind: {kind!r} is not one of {', '.join(KINDS)}")
    metric = _metric(_required(body, "metric", str, where), f"{where}.metric")
    if "sesoi" not in body:
        raise ConfigError(f"{where}.sesoi: missing; every claim registers its smallest effect of interest")
    sesoi = body["sesoi"]
    if not isinstance(sesoi, (int, float)) or isinstance(sesoi, bool) or not math.isfinite(sesoi) or sesoi < 0:
        raise ConfigError(f"{where}.sesoi: must be a number >= 0, got {sesoi!r}")
    if kind == "equivalence" and sesoi == 0:
        raise ConfigError(f"{where}.sesoi: an equivalence claim's margin must be > 0")
    justification = body.get("justification")
    if not isinstance(justification, str) or not justification.strip():
        raise ConfigError(f"{where}.justification: missing; say why the SESOI is the least effect worth acting on")
    a = _variant(body.get("a") or {}, family, f"{where}.a")
    b = _variant(body.get("b") or {}, family, f"{where}.b")
    expected = body.get("expected", 0 if kind == "equivalence" else None)
    if kind == "equivalence":
        if expected != 0:
            raise ConfigError(f"{where}.expected: an equivalence claim expects 0, got {expected!r}")
    elif expected not in (1, -1):
        raise ConfigError(f"{where}.expected: the predicted sign, 1 or -1, got {expected!r}")
    over = body.get("over")
    across = body.get("across") or {}
    if kind in ("sensitivity", "slope"):
        if over not in family.factors:
            raise ConfigError(f"{where}.over: {over!r} is not a factor of the family ({', '.join(family.factors)})")
        if over in a or over in b:
            raise ConfigError(f"{where}.over: {over} is also fixed by a or b; the claim reads across it")
        if len(family.factors[over]) < (2 if kind == "sensitivity" else 3):
            raise ConfigError(f"{where}.over: {over} has {len(family.factors[over])} values; a {kind} needs more")
    elif over is not None:
        raise ConfigError(f"{where}.over: only a sensitivity or a slope reads across a factor")
    if kind == "interaction":
        if not isinstance(across, dict) or len(across) != 1:
            raise ConfigError(f"{where}.across: an interaction names one factor and two of its values")
        ((factor, values),) = across.items()
        if factor not in family.factors or not isinstance(values, list) or len(values) != 2:
            raise ConfigError(f"{where}.across: {factor!r} with two of its values, e.g. {{{factor}: [v1, v2]}}")
        for value in values:
            _variant({factor: value}, family, f"{where}.across")
        if factor in a or factor in b:
            raise ConfigError(f"{where}.across: {factor} is also fixed by a or b")
    elif across:
        raise ConfigError(f"{where}.across: only an interaction compares across a factor")
    if kind in ("contrast", "equivalence", "interaction", "sensitivity") and not (a and b):
        raise ConfigError(f"{where}.a, b: a {kind} compares two variants; name each by its factor values")
    if a and b and a == b:
        raise ConfigError(f"{where}.b: the same variant as a")
    if kind != "slope" and a and b and set(a) != set(b):
        raise ConfigError(f"{where}.b: must fix the same factors as a ({sorted(a)}), so arms pair one to one")
    may_fail_raw = body.get("may_fail") or []
    if not isinstance(may_fail_raw, list):
        raise ConfigError(f"{where}.may_fail: a list of variants, e.g. [{{{next(iter(family.factors))}: ...}}]")
    may_fail = [_variant(v, family, f"{where}.may_fail") for v in may_fail_raw]
    gate = _gate(body.get("gate"), family, f"{where}.gate")
    log = body.get("log", False)
    if not isinstance(log, bool):
        raise ConfigError(f"{where}.log: true or false, got {log!r}")
    statement = body.get("statement") or default_statement(kind, metric, a, b, over, across, expected)
    unit = body.get("unit", "")
    if not isinstance(unit, str):
        raise ConfigError(f"{where}.unit: a label such as nats, got {unit!r}")
    return DeclaredClaim(
        name,
        kind,
        metric,
        a,
        b,
        over,
        dict(across),
        log,
        expected,
        float(sesoi),
        justification,
        may_fail,
        gate,
        statement,
        unit,
    )


def _seeds(raw: Any, where: str) -> list[int]:
    if not isinstance(raw, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in raw):
        raise ConfigError(f"{where}: must be a list of non-negative integers, got {raw!r}")
    if len(set(raw)) != len(raw):
        twice = next(s for s in raw if raw.count(s) > 1)
        raise ConfigError(f"{where}: seed {twice} is listed twice; a seed is used once")
    return list(raw)


def _variant(raw: Any, family: DeclaredFamily, where: str) -> dict[str, Any]:
    """Factor values naming (part of) a variant of the family, checked against what it crosses."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must map factors to values, e.g. {{{next(iter(family.factors))}: ...}}")
    variant = flatten(raw)
    for key, value in variant.items():
        if key not in family.factors:
            raise ConfigError(f"{where}: {key} is not a factor of family {family.name} ({', '.join(family.factors)})")
        if value not in family.factors[key]:
            raise ConfigError(
                f"{where}: {key}={value!r} is not among the values the family crosses {family.factors[key]}"
            )
    return variant


def _metric(name: str, where: str) -> str:
    if name not in METRICS:
        raise ConfigError(f"{where}: unknown metric {name!r}; an arm records {', '.join(METRICS)}")
    return name


def _gate(raw: Any, family: DeclaredFamily, where: str) -> Gate | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must be a mapping (metric, variant, a bound, at_some, justification)")
    only_keys(raw, GATE_KEYS, where)
    metric = _metric(_required(raw, "metric", str, where), f"{where}.metric")
    bounds = tuple((k, _bound(k, raw[k], f"{where}.{k}")) for k in BOUNDS if raw.get(k) is not None)
    if {k for k, _ in bounds} not in ({"at_least"}, {"above"}, {"at_most"}, {"on_plateau"}, {"at_least", "at_most"}):
        raise ConfigError(f"{where}: give one of {', '.join(BOUNDS)}, or a band of at_least and at_most")
    if dict(bounds).get("at_least", -math.inf) > dict(bounds).get("at_most", math.inf):
        raise ConfigError(f"{where}: the band's at_least is above its at_most (nothing could meet it)")
    at_some = raw.get("at_some")
    if at_some is not None and at_some not in family.factors:
        raise ConfigError(f"{where}.at_some: {at_some!r} is not a factor of family {family.name}")
    justification = _required(raw, "justification", str, where)
    variant = _variant(raw.get("variant") or {}, family, f"{where}.variant")
    if at_some in variant:
        raise ConfigError(f"{where}.at_some: {at_some} is fixed by the gate's variant")
    return Gate(metric, variant, bounds, justification, at_some)


def _bound(key: str, value: Any, where: str) -> float:
    if key == "on_plateau":
        if value is not True:
            raise ConfigError(f"{where}: must be true (the unigram baseline and plateau_margin give the bound)")
        return 0.0
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(f"{where}: must be a number, got {value!r}")
    return float(value)


def _required(body: dict[str, Any], key: str, kind: type, where: str) -> Any:
    value = body.get(key)
    if not isinstance(value, kind) or (isinstance(value, str) and not value.strip()):
        raise ConfigError(f"{where}.{key}: missing or not a {kind.__name__}")
    return value
