"""A gate that cannot fail is refused at registration (issue #58, item 2): the tool evaluates each
gate against the design, before any arm trains, and refuses one whose value is fixed by construction.

Two ways a gate's value is fixed without a run:

- **by its metric's range.** Some figures are bounded by construction (a diverged share in [0, 1],
  a capped loss in [0, ln V], counts and norms >= 0): a bound every value in the range meets is met
  by every run, one no value meets by none.
- **by the arms it reads.** A gate is read where the claim it gates is decided; when the claim's two
  sides are the same model there (same config, or configs that differ only in switches that change
  nothing at that point, e.g. μP and SP at the base width, where every μP multiplier is 1), the
  comparison the gate stands for is a value compared with itself. Two configs are the same model
  when they differ only under ``mup.`` and build bitwise-equal weights, optimizer groups and logits
  from one seed (:func:`same_by_construction`); any other difference counts as a difference.

μ-transfer's gate lives in code (tasks/report/findings.py: mup_trains, μP against SP at the target
width since version 4; version 3's, at the base width, was refused here), so its gated point is
named here (:func:`builtin_points`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any

from model.typed_config import ConfigError, flatten
from tasks.ablate.grid import arm_config, family_arm
from tasks.config import Config
from tasks.design.families import DeclaredClaim, DeclaredFamily, Gate, matches
from tasks.search.spec import target_width

NON_NEGATIVE = (
    "val_loss",
    "final_loss",
    "natural_spikes",
    "spikes_per_1k",
    "update_rms_max",
    "update_rms_mean",
    "nonfinite_steps",
    "skipped",
    "overflows",
    "attn_logit_max",
    "attn_entropy_min",
    "wall_s",
)
SHARES = ("diverged", "grad_underflow_share", "act_overflow_share")
"""Figures in [0, 1] by construction; capped_loss is in [0, ln V] (tasks/design/stats.py: capped_loss)."""
MODEL_ONLY = ("mup.",)
"""Keys whose effect :func:`same_by_construction` measures by building the model, not by their value."""


def metric_range(metric: str, cfg: Config) -> tuple[float, float] | None:
    """The values ``metric`` can take by construction; None where it is not bounded that way."""
    if metric in SHARES:
        return 0.0, 1.0
    if metric == "capped_loss":
        return 0.0, math.log(cfg.tokenizer.vocab_size)
    if metric in NON_NEGATIVE:
        return 0.0, math.inf
    return None


def fixed_by_range(gate: Gate, cfg: Config) -> str | None:
    """ "always met" or "never met" when the metric's range decides every bound; else None."""
    span = metric_range(gate.metric, cfg)
    if span is None or any(bound == "on_plateau" for bound, _ in gate.bounds):
        return None
    lo, hi = span
    always = {"at_least": lambda v: lo >= v, "above": lambda v: lo > v, "at_most": lambda v: hi <= v}
    never = {"at_least": lambda v: hi < v, "above": lambda v: hi <= v, "at_most": lambda v: lo > v}
    if all(always[b](v) for b, v in gate.bounds):
        return "always met"
    if any(never[b](v) for b, v in gate.bounds):
        return "never met"
    return None


def same_by_construction(x: Config, y: Config) -> bool:
    """Whether two arm configs train the same model: equal, or different only under MODEL_ONLY and
    building, from one seed, bitwise-equal weights, optimizer groups and logits on one batch."""
    fx, fy = flatten(dataclasses.asdict(x)), flatten(dataclasses.asdict(y))
    differ = {k for k in fx.keys() | fy.keys() if fx.get(k) != fy.get(k)}
    if not differ:
        return True
    if not all(k.startswith(MODEL_ONLY) for k in differ):
        return False
    return _built(x) == _built(y)


def _built(cfg: Config) -> tuple[Any, ...]:
    """What a config builds from seed 0: weights, optimizer groups (LR multiplier, decay, shapes) and
    the logits of one fixed batch, as bytes."""
    import torch

    from model.gpt import GPT
    from model.optim import param_groups

    torch.manual_seed(0)
    model = GPT(cfg.model, cfg.mup, cfg.tokenizer.vocab_size).eval()
    weights = tuple((k, v.detach().numpy().tobytes()) for k, v in model.state_dict().items())
    groups = tuple(
        (g["name"], g["lr"], g["weight_decay"], g["independent_decay"], tuple(tuple(p.shape) for p in g["params"]))
        for g in param_groups(model, cfg.optim)
    )
    tokens = torch.arange(2 * cfg.model.seq_len).reshape(2, -1) % cfg.tokenizer.vocab_size
    with torch.no_grad():
        logits = model(tokens)[0]
    return weights, groups, logits.numpy().tobytes()


def same_at(cfg: Config, family: DeclaredFamily, a: dict[str, Any], b: dict[str, Any], point: dict[str, Any]) -> bool:
    """Whether the claim's sides ``a`` and ``b`` are the same model at every arm of the grid that
    ``point`` fixes (a side that ``point`` contradicts has no arm there: not the same)."""
    free = [k for k in family.factors if k not in point]
    pairs = 0
    for values in itertools.product(*(family.factors[k] for k in free)):
        rest = dict(zip(free, values)) | point
        x, y = {**rest, **a}, {**rest, **b}
        if not (matches(x, point) and matches(y, point)) or x == y:
            continue
        seed = family.seeds[0]
        cx = arm_config(cfg, family_arm(family, seed, **x), family)
        cy = arm_config(cfg, family_arm(family, seed, **y), family)
        if not same_by_construction(cx, cy):
            return False
        pairs += 1
    return pairs > 0


def claim_refusals(cfg: Config, family: DeclaredFamily, claim: DeclaredClaim, where: str) -> list[str]:
    """Why the claim's gate (or the claim itself) is fixed by construction, one line each."""
    found = []
    sides = claim.kind in ("contrast", "equivalence") and claim.a != claim.b
    if sides and same_at(cfg, family, claim.a, claim.b, {}):
        found.append(f"{where}: compares {claim.a} with {claim.b}, the same model by construction at every arm")
    gate = claim.gate
    if gate is None:
        return found
    if (fixed := fixed_by_range(gate, cfg)) is not None:
        found.append(f"{where}.gate: {gate.metric} {gate.needs} is {fixed} by construction (its range)")
    elif sides and gate.variant and same_at(cfg, family, claim.a, claim.b, gate.variant):
        found.append(
            f"{where}.gate: reads {gate.variant}, where {claim.a} and {claim.b} are the same model by "
            "construction; gate the claim where its sides differ"
        )
    return found


def builtin_points(cfg: Config) -> dict[str, tuple[Config, Config]]:
    """The built-in gates that live in code, each as the two configs it compares at its gated point:
    μ-transfer's reads μP against SP at the target width (tasks/report/findings.py: mup_trains)."""
    at = {"model.d_model": target_width(cfg)}
    return {
        "findings.mu_transfer (tasks/report/findings.py: mup_trains, μP within MUP_TOLERANCE of SP at the target width)": (
            cfg.replace(**at, **{"mup.parametrization": "sp"}),
            cfg.replace(**at, **{"mup.parametrization": "mup"}),
        )
    }


def family_refusals(cfg: Config, families: Sequence[DeclaredFamily]) -> list[str]:
    """Every gate (and claim) of the families whose value is fixed by construction, one line each."""
    found = []
    for family in families:
        for claim in family.claims:
            found += claim_refusals(cfg, family, claim, f"{family.name}.claims.{claim.name}")
    return found


def builtin_refusals(cfg: Config) -> list[str]:
    """The gates in code (:func:`builtin_points`) that compare a model with itself, or whose point
    the profile cannot build (the gpu profile ties its embedding, which μP cannot)."""
    try:
        points = builtin_points(cfg)
    except ConfigError as e:
        return [f"findings.mu_transfer: its gate's μP point cannot be built under profile {cfg.profile} ({e})"]
    return [
        f"{where}: μP and SP are the same model there by construction; gate where they differ"
        for where, (sp, mup) in points.items()
        if same_by_construction(sp, mup)
    ]


def refusals(cfg: Config, families: Sequence[DeclaredFamily], builtin: bool = True) -> list[str]:
    """Every gate of the design whose value is fixed by construction: the families', then the code's
    (μ-transfer's, which the search stage decides: ``builtin`` False where it is not registered)."""
    return [*family_refusals(cfg, families), *(builtin_refusals(cfg) if builtin else [])]
