"""What a declared family is (tasks/design/studies.py reads one from ``studies.yaml`` or the
pre-registration): its factors, crossed into a grid of variants, each trained as one arm per seed
with the config keys :meth:`DeclaredFamily.overrides` gives; its claims and their gates; and the
names its variants go by in arms, labels and reports.

A factor is a config key with its values, or a named factor, whose name is no config key:
``{values: [...], sets: KEY}`` (``times: N`` multiplies the value first, ``times: steps`` by the
family's steps, as a warmup fraction is), or ``{values: [...], levels: {name: {KEY: value, ...}}}``
for levels that set several keys; ``{values: [none, param], injection: true}`` is the arm's
injected spike (tasks/ablate/grid.py: injection_spec). Arms name them as ``post_ln·lr=0.001``.
:func:`parse_factors` checks a family's factors against the config before any arm trains.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from model.typed_config import ConfigError, annotation, flatten
from tasks.ablate.config import AblationConfig
from tasks.config import Config

FIGURES = (
    "final_loss",
    "val_loss",
    "capped_loss",
    "natural_spikes",
    "spikes_per_1k",
    "update_rms_max",
    "nonfinite_steps",
    "skipped",
    "overflows",
    "attn_logit_max",
    "logits_max",
    "log_z_max",
    "log_z_min",
    "log_z_drift",
    "attn_entropy_min",
    "grad_underflow_share",
    "act_overflow_share",
)
"""Per-arm figures summarised per variant (tasks/ablate/grid.py: arm_metrics, plus the derived ones)."""

OWNED_KEYS = ("train.seed", "train.steps", "data.", "tokenizer.")
"""Keys a declaration may not set: the seed and length are the family's ``seeds`` and ``steps``,
and every arm reads the study's data and tokenizer."""

SPIKES = ("none", "param")
"""An injection factor's values: a clean arm, and the probe-sized weight excursion
(tasks/ablate/conditions.py: OverflowProbeSpike)."""

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
    Every gate is read at its claim's own conditions, at the levels where the claim's compared
    variants trained (tasks/report/declared.py: gate_value): a drift measured in an arm stuck on the
    unigram plateau is the plateau's."""

    metric: str
    variant: dict[str, Any]
    bounds: tuple[tuple[str, float], ...]
    justification: str
    at_some: str | None = None

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
    def on_plateau(self) -> bool:
        """The gate reads a failure to train (the variant on the unigram plateau)."""
        return any(b == "on_plateau" for b, _ in self.bounds)

    @property
    def needs(self) -> str:
        words = " and ".join(BOUNDS[b] if b == "on_plateau" else f"{BOUNDS[b]} {v:g}" for b, v in self.bounds)
        where = f" at some {self.at_some} where the compared variants trained"
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
        return scale | self.conditions(loss_shift) | self.factor_keys(factors)

    def conditions(self, loss_shift: int = 0) -> dict[str, Any]:
        """The family's ``fixed`` keys as its arms take them: the precision probe's shift resolved."""
        return {k: loss_shift if v == LOSS_SHIFT else v for k, v in self.fixed.items()}

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


def parse_factors(raw: Any, cfg: Config, where: str) -> tuple[dict[str, list[Any]], dict[str, dict[str, Any]]]:
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
            check_key(key, f"{where}.{key}")
            factors[key] = values
    for key, values in factors.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{where}.{key}: must be a non-empty list of values, got {values!r}")
        if len({repr(v) for v in values}) != len(values):
            raise ConfigError(f"{where}.{key}: {values} repeats a value (an arm would run twice)")
        if key not in named:
            for value in values:
                check_value(cfg, key, value, f"{where}.{key}")
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
    only_keys(spec, {"values", "sets", "times", "levels", "injection"}, where)
    rules = [k for k in ("sets", "levels", "injection") if k in spec]
    if len(rules) != 1:
        raise ConfigError(f"{where}: give exactly one of sets, levels, injection")
    values = spec["values"] if isinstance(spec["values"], list) else []
    if "sets" in spec:
        if not isinstance(spec["sets"], str):
            raise ConfigError(f"{where}.sets: one config key, got {spec['sets']!r}")
        check_key(spec["sets"], f"{where}.sets")
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
                check_value(cfg, spec["sets"], scaled, f"{where}.values")
    elif "levels" in spec:
        levels = spec["levels"]
        if not isinstance(levels, dict) or not levels:
            raise ConfigError(f"{where}.levels: a mapping of level name to the config keys it sets")
        for level, keys in levels.items():
            if not isinstance(keys, dict | None):
                raise ConfigError(f"{where}.levels.{level}: a mapping of the config keys it sets, got {keys!r}")
            flat = flatten(keys or {})
            for key in flat:
                check_key(key, f"{where}.levels.{level}.{key}")
            check_value(cfg, "", flat, f"{where}.levels.{level}")
            levels[level] = flat
        if unknown := [v for v in values if not isinstance(v, str) or v not in levels]:
            raise ConfigError(f"{where}.values: {unknown} are not among its levels ({', '.join(levels)})")
    elif spec["injection"] is not True or not set(values) <= set(SPIKES):
        raise ConfigError(f"{where}: an injection factor is `injection: true` with values among {list(SPIKES)}")
    return {k: v for k, v in spec.items() if k != "values"}


def check_key(key: str, where: str) -> None:
    """``key`` is a dotted config key a declaration may set (none of :data:`OWNED_KEYS`)."""
    if annotation(Config, key) is None or "." not in key:
        raise ConfigError(f"{where}: unknown config key {key!r} (params.yaml lists every key)")
    if any(key == owned or (owned.endswith(".") and key.startswith(owned)) for owned in OWNED_KEYS):
        raise ConfigError(f"{where}: {key} is the study's own (seeds, steps, data); it cannot be declared")


def check_value(cfg: Config, key: str, value: Any, where: str) -> None:
    """The config with ``key`` = ``value`` (or ``value``'s keys) builds and validates."""
    try:
        cfg.replace(**(value if key == "" else {key: value}))
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def only_keys(body: dict[str, Any], allowed: set[str], where: str) -> None:
    """``body`` holds no key outside ``allowed``; else a ConfigError naming the first unknown one."""
    if unknown := sorted(set(body) - allowed):
        raise ConfigError(f"{where}.{unknown[0]}: unknown key; allowed: {', '.join(sorted(allowed))}")
