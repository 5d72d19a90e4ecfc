"""Each finding's estimate under the registered data perturbation, beside its estimate on the full
data at the same seeds: plain functions over ablate-like records (metrics/ablate.json's form), no
orchestration (flows/sensitivity.py trains the perturbed arms and calls them).

The findings compared are the built-in ones the report reads through its declared engine
(tasks/report/findings.py: builtin_finding), the checks of the machinery aside (their registered
``check``: overflow). Each side's estimate is that engine's, on a record holding only the arms of
the discovery seeds (``ablation.seeds``): on the full data, metrics/ablate.json's arms at those
seeds; on the perturbed data, the arms trained on it. The difference is taken seed by seed
(perturbed − full, each seed's value of the claim as the engine computes it), with its mean and
t-interval (tasks/design/stats.py: paired): the seed is the unit, as everywhere in the study.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tasks.config import Config
from tasks.design.families import DeclaredFamily
from tasks.design.preregistration import design
from tasks.design.stats import paired
from tasks.design.studies import builtin_families
from tasks.report.findings import FAMILY_OF, builtin_finding
from tasks.report.method import Finding
from tasks.report.verdict import Claim

RECORD_KEYS = ("conditions",)
"""What an ablate-like record carries besides its arms and baseline: the probes' conditions (the
precision family's loss shift, which the fp16 finding's notes read)."""


def compared_findings(cfg: Config) -> dict[str, DeclaredFamily]:
    """Finding key -> its family of arms: every built-in finding read through the declared engine,
    in the pre-registration's order, the checks of the machinery left out."""
    families = {f.name: f for f in builtin_families(cfg)}
    registered = design()["findings"]
    return {
        key: families[FAMILY_OF[key]] for key in registered if key in FAMILY_OF and not registered[key].get("check")
    }


def trained(families: dict[str, DeclaredFamily]) -> set[str]:
    """The families whose arms the stage trains: those with a claim this config's grid can state."""
    return {f.name for f in families.values() if f.claims}


def record(arms: list[dict[str, Any]], unigram: float | None, ablate: dict[str, Any]) -> dict[str, Any]:
    """An ablate-like record of ``arms`` (metrics/ablate.json's ``arms`` entries), with
    ``ablate``'s conditions and the baseline ``unigram``."""
    return {"arms": arms, "unigram_val_loss": unigram, **{k: ablate.get(k) for k in RECORD_KEYS}}


def at_seeds(ablate: dict[str, Any], families: set[str], seeds: Sequence[int]) -> dict[str, Any]:
    """metrics/ablate.json restricted to the arms of ``families`` at ``seeds``."""
    arms = [a for a in ablate["arms"] if a["family"] in families and a["seed"] in seeds]
    return record(arms, ablate.get("unigram_val_loss"), ablate)


def unmatched(planned: list[dict[str, Any]], ablate: dict[str, Any]) -> list[str]:
    """The planned full-data arms that metrics/ablate.json lacks, or lists under another key (its
    arms were trained with another config or code): the pairs would not be twins."""
    recorded = {a["name"]: a.get("key") for a in ablate["arms"]}
    return [row["name"] for row in planned if recorded.get(row["name"]) != row["key"]]


def per_seed(finding: Finding, statement: str) -> dict[tuple, float]:
    """A claim's value per seed, as the engine computed it (its test against 0: tasks/report/method.py)."""
    tested = finding.details.get(statement) or {}
    return {tuple(u): float(v) for u, v in zip(tested.get("seeds") or [], tested.get("diffs") or [])}


def side(claim: Claim, values: dict[tuple, float]) -> dict[str, Any]:
    return {
        "estimate": claim.estimate,
        "ci95": claim.ci95,
        "n": len(values),
        "per_seed": {str(u[0]): v for u, v in values.items()},
    }


def difference(perturbed: dict[tuple, float], main: dict[tuple, float]) -> dict[str, Any]:
    """Per seed perturbed − full over the seeds both have: mean, 95 % t-interval, the paired test."""
    d = paired(perturbed, main)
    return {
        "estimate": d["estimate"],
        "ci95": d["ci95"],
        "n": d["n"],
        "sd": d["sd_diff"],
        "p": d["p"],
        "test": d["test"],
        "per_seed": {str(u[0]): x for u, x in zip(d["seeds"], d["diffs"])},
    }


def compare(
    cfg: Config, families: dict[str, DeclaredFamily], main: dict[str, Any], perturbed: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """Per finding (``families``: :func:`compared_findings`), per claim: its estimate on ``main``
    and on ``perturbed`` (ablate-like records of the same seeds) and their per-seed difference."""
    out: dict[str, dict[str, Any]] = {}
    for key, family in families.items():
        if not family.claims:
            out[key] = {"family": family.name, "missing": family.missing or "no claim in this grid", "claims": []}
            continue
        on = {
            name: builtin_finding(key, family, cfg, data, data.get("unigram_val_loss"))
            for name, data in (("main", main), ("perturbed", perturbed))
        }
        names = {c.statement: c.name for c in family.claims}
        claims = []
        for full, moved in zip(on["main"].claims, on["perturbed"].claims):
            a, b = per_seed(on["perturbed"], moved.what), per_seed(on["main"], full.what)
            claims.append(
                {
                    "claim": names.get(full.what, full.what),
                    "statement": full.what,
                    "kind": full.kind,
                    "unit": full.unit,
                    "sesoi": full.sesoi,
                    "main": side(full, b),
                    "perturbed": side(moved, a),
                    "difference": difference(a, b),
                }
            )
        out[key] = {
            "family": family.name,
            "verdict": {name: f.verdict for name, f in on.items()},
            "precondition_failed": {name: f.precondition_failed for name, f in on.items()},
            "claims": claims,
        }
    return out
