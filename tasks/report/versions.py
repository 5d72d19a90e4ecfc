"""An earlier version's claims beside this one's (issue 59, item 1): version 3's claims, frozen
before version 4's rerun (:data:`EARLIER`), matched claim by claim to this report's by the claim's
declared name (``what``, read as :func:`comparison`). Version 3 is exploratory (its conditions were chosen with pilots and
earlier results in view); only this version decides a verdict, and a claim version 3 held is read
here as replicated, not replicated, negligible now, contradicted now or not tested now.

``python -m tasks.report.versions freeze`` writes the file from the committed metrics/report.json,
once, before the next version reruns (the rerun overwrites that file)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, get_args

from model.private import run_private
from tasks.report.method import Finding
from tasks.report.sections.words import FRAGILE, HOLDS, outcome
from tasks.report.verdict import CONTRADICTED, NEGLIGIBLE, NOT_TESTED, Claim
from tasks.runtime.files import write_json
from tasks.spike.config import RecoveryPolicy

EARLIER = Path("tasks/design/versions/3.json")
"""Version 3's claims as its report left them (metrics/report.json at the registration of version 4)."""
CLAIM_FIELDS = tuple(f.name for f in dataclasses.fields(Claim))

REPLICATED, NOT_REPLICATED, NOT_HERE = "replicated", "did not replicate", "not in this version"
"""How a claim the earlier version held reads now, beside the now-outcomes negligible,
contradicted and not tested (:func:`replication`)."""


def freeze(report: dict[str, Any], version: int, profile: str) -> dict[str, Any]:
    """An earlier report's claims, each with every field of :class:`Claim` and its reader's name."""
    return {
        "version": version,
        "profile": profile,
        "design_hash": report["design_hash"],
        "findings": {
            key: {
                "verdict": f["verdict"],
                "precondition_failed": f.get("precondition_failed"),
                "claims": [{k: c.get(k) for k in (*CLAIM_FIELDS, "words")} for c in f["claims"]],
            }
            for key, f in report["findings"].items()
        },
    }


def earlier_claims(project: Path, profile: str) -> dict[str, Any] | None:
    """The frozen earlier version of this profile's study, if there is one."""
    path = project / EARLIER
    if not path.is_file():
        return None
    frozen: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return frozen if frozen["profile"] == profile else None


def beside_earlier(project: Path, profile: str, findings: list[Finding]) -> dict[str, Any] | None:
    """This report's claims beside the earlier version's (:func:`compare`); None without one."""
    earlier = earlier_claims(project, profile)
    return None if earlier is None else compare(earlier, findings)


def replication(before: str, now: str | None) -> str:
    """What became of a claim the earlier version held (an empty string for one it did not hold:
    not a replication question)."""
    if before not in (HOLDS, FRAGILE):
        return ""
    if now is None:
        return NOT_HERE
    if now in (HOLDS, FRAGILE):
        return REPLICATED
    if now in (NEGLIGIBLE, CONTRADICTED, NOT_TESTED):
        return f"{now} now"
    return NOT_REPLICATED


def comparison(what: str) -> str:
    """A claim's name with a bare reference policy given its spike's cause: version 3 named
    ``lr×rollback_lower_lr − continue`` what version 4 names ``lr×rollback_lower_lr − lr×continue``,
    the same comparison. Any other name is itself."""
    left, minus, rest = what.partition(" − ")
    reference, comma, tail = rest.partition(",")
    if "×" in left and reference in get_args(RecoveryPolicy):
        reference = f"{left.split('×')[0]}×{reference}"
    return left + minus + reference + comma + tail


def compare(earlier: dict[str, Any], findings: list[Finding]) -> dict[str, Any]:
    """Every claim of either version, in this version's order then the earlier's left over: each
    side's estimate, interval and outcome, and what became of a claim the earlier version held."""
    now = {(f.key, comparison(c.what)): (c, outcome(c, f.precondition_failed)) for f in findings for c in f.claims}
    rows = []
    for key, was in earlier["findings"].items():
        for raw in was["claims"]:
            before = Claim(**{k: raw[k] for k in CLAIM_FIELDS})
            said = outcome(before, was["precondition_failed"])
            claim, now_said = now.pop((key, comparison(before.what)), (None, None))
            rows.append(row(key, raw.get("words") or before.what, (before, said), (claim, now_said)))
    rows += [row(key, c.what, (None, None), (c, said)) for (key, _), (c, said) in now.items()]
    held = [r for r in rows if r["replication"]]
    counts = {
        label: sum(r["replication"] == label for r in held) for label in dict.fromkeys(r["replication"] for r in held)
    }
    return {"earlier": earlier["version"], "held_earlier": len(held), "counts": counts, "rows": rows}


def row(
    finding: str, words: str, before: tuple[Claim | None, str | None], now: tuple[Claim | None, str | None]
) -> dict[str, Any]:
    """One claim of the comparison, as metrics/report.json keeps it."""

    def side(claim: Claim | None, said: str | None) -> dict[str, Any] | None:
        return (
            None
            if claim is None
            else {"estimate": claim.estimate, "ci95": claim.ci95, "unit": claim.unit, "outcome": said}
        )

    return {
        "finding": finding,
        "claim": words,
        "earlier": side(*before),
        "now": side(*now),
        "replication": replication(before[1] or "", now[1]),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="freeze a finished report's claims before the next version reruns")
    parser.add_argument("command", choices=["freeze"])
    parser.add_argument("--report", type=Path, default=Path("metrics/report.json"))
    parser.add_argument("--version", type=int, required=True, help="the version that report is")
    parser.add_argument("--profile", default="default")
    args = parser.parse_args(argv)
    write_json(EARLIER, freeze(json.loads(args.report.read_text(encoding="utf-8")), args.version, args.profile))
    print(f"versions: wrote {EARLIER} (version {args.version}, profile {args.profile})")


if __name__ == "__main__":
    sys.exit(run_private(main))
