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
  named factors  a factor whose name is no config key: ``{values: [...], sets: KEY}`` (``times: N``
               multiplies the value first, ``times: steps`` by the family's steps, as a warmup
               fraction is), or ``{values: [...], levels: {name: {KEY: value, ...}}}`` for levels that
               set several keys; ``{values: [none, param], injection: true}`` is the arm's injected
               spike (tasks/ablate/grid.py: injection_spec). Arms name them as ``post_ln·lr=0.001``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from pathlib import Path
from typing import Any

import yaml

from model.typed_config import ConfigError, annotation, flatten
from tasks.ablate.config import AblationConfig
from tasks.config import Config
from tasks.design.preregistration import DESIGN_FILE, design
from tasks.design.stats import FIGURES

STUDIES = Path("studies.yaml")
"""The declared families, beside params.yaml (a DVC params file of the ablate and report stages)."""

KINDS = ("contrast", "equivalence", "interaction", "sensitivity", "slope")
"""What a claim may state (the module doc of tasks/report/declared.py says how each is tested)."""

METRICS = (*FIGURES, "diverged", "update_rms_mean", "wall_s")
"""The figures an arm records that a claim or a gate may name (tasks/ablate/grid.py: arm_metrics,
and ``capped_loss``: the final validation loss with a diverged run counted as ln V)."""

OWNED_KEYS = ("train.seed", "train.steps", "data.", "tokenizer.")
"""Keys a declaration may not set: the seed and length are the family's ``seeds`` and ``steps``,
and every arm reads the study's data and tokenizer."""

FAMILY_KEYS = {"question", "factors", "fixed", "steps", "seeds", "confirm_seeds", "warmup_fraction", "claims"}
FAMILY_KEYS |= {"range_probe_every", "base"}
CLAIM_KEYS = {"kind", "metric", "a", "b", "over", "across", "log", "expected", "sesoi", "justification"}
CLAIM_KEYS |= {"may_fail", "gate", "statement", "unit"}

SPIKES = ("none", "param")
"""An injection factor's values: a clean arm, and the probe-sized weight excursion
(tasks/ablate/conditions.py: OverflowProbeSpike)."""

BUILTIN = DESIGN_FILE
"""Where the built-in families are declared: beside their findings, in the pre-registration."""
REFERENCE = re.compile(r"^\$\{(ablation\.[a-z0-9_]+|probe\.loss_shift)(?:\[(\d+)\])?\}$")
LOSS_SHIFT = "${probe.loss_shift}"
"""Resolved per plan, not per declaration: the precision probe's shift (0 while checking)."""


BOUNDS = {"at_least": "at least", "above": "above", "at_most": "at most", "on_plateau": "on the plateau"}
"""A gate's bounds on the mean of its metric, in words. ``on_plateau: true`` reads "at least the
unigram baseline minus plateau_margin": the variant did not learn past unigram statistics (a
failure to train, e.g. Post-LN without warmup)."""


@dataclasses.dataclass(frozen=True)
class Gate:
    """A mechanism gate: the mean of ``metric`` over ``variant``'s arms must meet every one of
    ``bounds`` (BOUNDS: one, or a band of ``at_least`` and ``at_most``), or the claim's mechanism
    did not occur and it is not tested. With ``at_some`` (a factor the family crosses), the mean is
    taken at each level of that factor and the gate is met where some level meets every bound: the
    mechanism occurs somewhere on the grid (an LR at which Post-LN fails, one at which logits grow).
    With ``trained: true`` only the levels at which the variant trained count (its mean capped loss
    past the plateau): a drift measured in an arm stuck on the unigram plateau is the plateau's."""

    metric: str
    variant: dict[str, Any]
    bounds: tuple[tuple[str, float], ...]
    justification: str
    at_some: str | None = None
    trained: bool = False

    def met(self, mean: float | None, unigram: float | None = None, margin: float = 0.0) -> bool:
        if mean is None:
            return False
        return all(self._meets(bound, value, mean, unigram, margin) for bound, value in self.bounds)

    @staticmethod
    def _meets(bound: str, value: float, mean: float, unigram: float | None, margin: float) -> bool:
        if bound == "on_plateau":
            return unigram is not None and mean >= unigram - margin
        return {"at_least": mean >= value, "above": mean > value, "at_most": mean <= value}[bound]

    @property
    def needs(self) -> str:
        words = " and ".join(BOUNDS[b] if b == "on_plateau" else f"{BOUNDS[b]} {v:g}" for b, v in self.bounds)
        where = f" at some {self.at_some}{' where it trained' if self.trained else ''}"
        return f"{words}{where}" if self.at_some else words


@dataclasses.dataclass(frozen=True)
class DeclaredClaim:
    name: str
    kind: str
    metric: str
    a: dict[str, Any]
    b: dict[str, Any]
    over: str | None
    across: dict[str, list[Any]]
    log: bool
    expected: int
    sesoi: float
    justification: str
    may_fail: list[dict[str, Any]]
    gate: Gate | None
    statement: str
    unit: str = ""


@dataclasses.dataclass(frozen=True)
class DeclaredFamily:
    name: str
    question: str
    factors: dict[str, list[Any]]
    fixed: dict[str, Any]
    steps: int
    seeds: list[int]
    confirm_seeds: list[int]
    warmup_fraction: float
    claims: list[DeclaredClaim]
    named: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """Named factors: how each value becomes config keys (``sets``/``times``, ``levels``, ``injection``)."""
    range_probe_every: int = 0
    """Steps between the fp16 range probe's measurements in each arm (0: none)."""
    base: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The base arm's factor values, the rest at their best grid point (default: each factor's first)."""
    missing: str = ""
    """Why a built-in family's finding cannot be stated in this config's grid ("": it can)."""

    @property
    def all_seeds(self) -> list[int]:
        return [*self.seeds, *self.confirm_seeds]

    def spike(self, factors: dict[str, Any]) -> str:
        """The spike an arm of these factor values takes (``none``: a clean arm)."""
        kind: str = next((factors[k] for k, spec in self.named.items() if spec.get("injection")), "none")
        return kind

    def variants(self, partial: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Every point of the family's grid (those with ``partial``'s values, when given)."""
        grid = [dict(zip(self.factors, values)) for values in itertools.product(*self.factors.values())]
        return [v for v in grid if matches(v, partial or {})]

    def overrides(self, a: AblationConfig, factors: dict[str, Any], seed: int, loss_shift: int = 0) -> dict[str, Any]:
        """The keys that turn the study's config into this arm's: the arm scale at the family's
        length, seed and warmup, then the family's conditions, then its factor values."""
        scale = a.arm_scale(self.steps, seed) | {"schedule.warmup_steps": round(self.warmup_fraction * self.steps)}
        fixed = {k: loss_shift if v == LOSS_SHIFT else v for k, v in self.fixed.items()}
        return scale | fixed | self.factor_keys(factors)

    def factor_keys(self, factors: dict[str, Any]) -> dict[str, Any]:
        """The config keys the factor values set (a named factor's through its ``sets`` or ``levels``)."""
        keys: dict[str, Any] = {}
        for name, value in factors.items():
            spec = self.named.get(name)
            if spec is None:
                keys[name] = value
            elif "levels" in spec:
                keys |= spec["levels"][value]
            elif spec.get("times") == "steps":  # a fraction of the family's steps, e.g. its warmup
                keys[spec["sets"]] = round(value * self.steps)
            elif "sets" in spec:
                keys[spec["sets"]] = value if spec.get("times") is None else value * spec["times"]
        return keys


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
    _only(body, FAMILY_KEYS, where)
    a = cfg.ablation
    claims_unresolved = body.get("claims")
    body = resolve({k: v for k, v in body.items() if k != "claims"}, a, where) | {"claims": claims_unresolved}
    question = _required(body, "question", str, where)
    factors, named = _factors(body.get("factors"), cfg, f"{where}.factors")
    fixed = flatten(body.get("fixed") or {})
    for key in fixed:
        _check_key(key, f"{where}.fixed.{key}")
    _check_value(cfg, "", {k: 0 if v == LOSS_SHIFT else v for k, v in fixed.items()}, f"{where}.fixed")
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
        _check_value(cfg, "", family.overrides(a, variant, seeds[0]), where)
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
    _only(body, CLAIM_KEYS, where)
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


def default_statement(kind: str, metric: str, a: dict, b: dict, over: str | None, across: dict, expected: int) -> str:
    """The claim in words, from its declaration."""
    sign = {1: "higher", -1: "lower", 0: "equal"}[expected]
    a_, b_ = variant_name(a), variant_name(b)
    if kind == "contrast":
        return f"{metric}: {a_} {sign} than {b_}"
    if kind == "equivalence":
        return f"{metric}: {a_} equivalent to {b_}"
    if kind == "interaction":
        ((factor, (v1, v2)),) = across.items()
        return f"{metric}: ({a_} − {b_}) {sign} at {factor}={v1} than at {factor}={v2}"
    if kind == "sensitivity":
        return f"{metric}'s sensitivity to {over}: {a_} {sign} than {b_}"
    return f"{metric} {'rises' if expected > 0 else 'falls'} with {over}" + (f" ({a_})" if a else "")


def matches(variant: dict[str, Any], partial: dict[str, Any]) -> bool:
    """Whether ``variant`` has every factor value ``partial`` names (``{}`` matches every variant)."""
    return all(k in variant and variant[k] == v for k, v in partial.items())


def variant_name(factors: dict[str, Any]) -> str:
    """``model.qk_norm=true·optim.lr=0.003``: the factors as the declaration writes them; a named
    factor's text value alone, e.g. ``post_ln·warmup=0·lr=0.001``."""
    parts = [v if isinstance(v, str) and "." not in k else f"{k}={shown(v)}" for k, v in factors.items()]
    return "·".join(parts) or "every variant"


def shown(value: Any) -> str:
    """A factor value as YAML writes it (``true``, ``0.003``), in names, labels and reports."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _factors(raw: Any, cfg: Config, where: str) -> tuple[dict[str, list[Any]], dict[str, dict[str, Any]]]:
    """Each factor's values, and how each named factor's values set config keys."""
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{where}: declare at least one factor: {{<config key>: [values]}}")
    factors: dict[str, Any] = {}
    named: dict[str, dict[str, Any]] = {}
    for top, value in raw.items():  # {optim.lr: [...]} or {optim: {lr: [...]}}, never both; or a named factor
        if isinstance(value, dict) and "values" in value:
            named[top] = _named(top, value, cfg, f"{where}.{top}")
            factors[top] = value["values"]
            continue
        for key, values in flatten({top: value}).items():
            if key in factors:
                raise ConfigError(f"{where}.{key}: given twice (as a dotted key and nested); keep one")
            _check_key(key, f"{where}.{key}")
            factors[key] = values
    for key, values in factors.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{where}.{key}: must be a non-empty list of values, got {values!r}")
        if len({repr(v) for v in values}) != len(values):
            raise ConfigError(f"{where}.{key}: {values} repeats a value (an arm would run twice)")
        if key not in named:
            for value in values:
                _check_value(cfg, key, value, f"{where}.{key}")
    if len([n for n, spec in named.items() if spec.get("injection")]) > 1:
        raise ConfigError(f"{where}: two injection factors; an arm takes one injected spike")
    setters: dict[str, str] = {}
    for name in factors:
        for key in set_keys(name, named.get(name)):
            if key in setters:
                raise ConfigError(f"{where}.{name}: sets {key}, which {setters[key]} sets too; a key has one factor")
            setters[key] = name
    return factors, named


def set_keys(name: str, spec: dict[str, Any] | None) -> set[str]:
    """The config keys a factor sets: its own name, or a named factor's ``sets`` or levels' keys."""
    if spec is None:
        return {name}
    if "sets" in spec:
        return {spec["sets"]}
    return {key for level in (spec.get("levels") or {}).values() for key in level}


def _named(name: str, spec: dict[str, Any], cfg: Config, where: str) -> dict[str, Any]:
    """A named factor's rule (``sets`` [``times``], ``levels`` or ``injection``), each value checked."""
    if "." in name:
        raise ConfigError(f"{where}: a named factor's name has no dot (a dotted name is a config key)")
    _only(spec, {"values", "sets", "times", "levels", "injection"}, where)
    rules = [k for k in ("sets", "levels", "injection") if k in spec]
    if len(rules) != 1:
        raise ConfigError(f"{where}: give exactly one of sets, levels, injection")
    values = spec["values"] if isinstance(spec["values"], list) else []
    if "sets" in spec:
        if not isinstance(spec["sets"], str):
            raise ConfigError(f"{where}.sets: one config key, got {spec['sets']!r}")
        _check_key(spec["sets"], f"{where}.sets")
        times = spec.get("times")
        if times is not None and times != "steps" and not isinstance(times, (int, float)):
            raise ConfigError(f"{where}.times: a number or steps, got {times!r}")
        if times is not None and not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise ConfigError(f"{where}.values: numbers, to multiply by times ({times}), got {values!r}")
        for value in values:
            scaled = value if times is None else value * (1 if times == "steps" else times)
            if times == "steps" and not (isinstance(value, (int, float)) and 0 <= value < 1):
                raise ConfigError(f"{where}: {value!r} is not a fraction of the steps in [0, 1)")
            if times != "steps":
                _check_value(cfg, spec["sets"], scaled, f"{where}.values")
    elif "levels" in spec:
        levels = spec["levels"]
        if not isinstance(levels, dict) or not levels:
            raise ConfigError(f"{where}.levels: a mapping of level name to the config keys it sets")
        for level, keys in levels.items():
            if not isinstance(keys, dict | None):
                raise ConfigError(f"{where}.levels.{level}: a mapping of the config keys it sets, got {keys!r}")
            flat = flatten(keys or {})
            for key in flat:
                _check_key(key, f"{where}.levels.{level}.{key}")
            _check_value(cfg, "", flat, f"{where}.levels.{level}")
            levels[level] = flat
        if unknown := [v for v in values if not isinstance(v, str) or v not in levels]:
            raise ConfigError(f"{where}.values: {unknown} are not among its levels ({', '.join(levels)})")
    elif spec["injection"] is not True or not set(values) <= set(SPIKES):
        raise ConfigError(f"{where}: an injection factor is `injection: true` with values among {list(SPIKES)}")
    return {k: v for k, v in spec.items() if k != "values"}


def _check_key(key: str, where: str) -> None:
    if annotation(Config, key) is None or "." not in key:
        raise ConfigError(f"{where}: unknown config key {key!r} (params.yaml lists every key)")
    if any(key == owned or (owned.endswith(".") and key.startswith(owned)) for owned in OWNED_KEYS):
        raise ConfigError(f"{where}: {key} is the study's own (seeds, steps, data); it cannot be declared")


def _check_value(cfg: Config, key: str, value: Any, where: str) -> None:
    """The config with ``key`` = ``value`` (or ``value``'s keys) builds and validates."""
    try:
        cfg.replace(**(value if key == "" else {key: value}))
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


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
    _only(raw, {"metric", "variant", *BOUNDS, "at_some", "trained", "justification"}, where)
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
    trained = raw.get("trained", False)
    if not isinstance(trained, bool):
        raise ConfigError(f"{where}.trained: true or false, got {trained!r}")
    if trained and at_some is None:
        raise ConfigError(f"{where}.trained: reads the levels of at_some, and the gate names none")
    return Gate(metric, variant, bounds, justification, at_some, trained)


def _bound(key: str, value: Any, where: str) -> float:
    if key == "on_plateau":
        if value is not True:
            raise ConfigError(f"{where}: must be true (the unigram baseline and plateau_margin give the bound)")
        return 0.0
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(f"{where}: must be a number, got {value!r}")
    return float(value)


def _only(body: dict[str, Any], allowed: set[str], where: str) -> None:
    if unknown := sorted(set(body) - allowed):
        raise ConfigError(f"{where}.{unknown[0]}: unknown key; allowed: {', '.join(sorted(allowed))}")


def _required(body: dict[str, Any], key: str, kind: type, where: str) -> Any:
    value = body.get(key)
    if not isinstance(value, kind) or (isinstance(value, str) and not value.strip()):
        raise ConfigError(f"{where}.{key}: missing or not a {kind.__name__}")
    return value
