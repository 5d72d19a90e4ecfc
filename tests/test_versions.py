"""Version 3 beside version 4, claim by claim (tasks/report/versions.py): an earlier version's
frozen claims matched to this report's by name, each claim it held read as replicated, not
replicated, negligible, contradicted or not tested now, and only this version deciding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.report.method import Finding
from tasks.report.render import report_json
from tasks.report.sections.versions import versions_section
from tasks.report.verdict import Claim
from tasks.report.versions import (
    EARLIER,
    NOT_HERE,
    NOT_REPLICATED,
    REPLICATED,
    beside_earlier,
    comparison,
    freeze,
    replication,
)

HELD = Claim("a higher than b", 0.5, 0.001, sesoi=0.1, ci95=[0.3, 0.7], halves={"discovery": 0.5, "confirmation": 0.5})
NOT_HELD = Claim(
    "c higher than d", 0.05, 0.4, sesoi=0.1, ci95=[-0.1, 0.2], halves={"discovery": 0.1, "confirmation": 0.0}
)
NEGLIGIBLE = Claim(
    "a higher than b",
    0.001,
    1e-6,
    sesoi=0.1,
    ci95=[-0.01, 0.012],
    tost_p=1e-6,
    halves={"discovery": 0.0, "confirmation": 0.0},
)


def finding(*claims: Claim, key: str = "xiong", precondition_failed: str | None = None) -> Finding:
    return Finding(key, "inconclusive", list(claims), precondition_failed, "", [])


def earlier(project: Path, *claims: Claim, profile: str = "default") -> None:
    report = report_json([finding(*claims)], {}, {})
    (project / EARLIER).parent.mkdir(parents=True)
    (project / EARLIER).write_text(json.dumps(freeze(report, 3, profile)))


@pytest.mark.parametrize(
    ("before", "now", "read"),
    [
        ("holds", "holds", REPLICATED),
        ("fragile", "holds", REPLICATED),
        ("holds", "fragile", REPLICATED),
        ("holds", "not shown", NOT_REPLICATED),
        ("holds", "negligible", "negligible now"),
        ("holds", "contradicted", "contradicted now"),
        ("holds", "not tested", "not tested now"),
        ("holds", None, NOT_HERE),
        ("not shown", "holds", ""),  # only a claim the earlier version held asks to be replicated
        ("not tested", None, ""),
    ],
)
def test_a_claim_the_earlier_version_held_reads_as_what_became_of_it(before, now, read):
    assert replication(before, now) == read


def test_the_same_claim_is_matched_by_name_and_each_version_keeps_its_own_numbers(tmp_path):
    earlier(tmp_path, HELD, NOT_HELD)
    compared = beside_earlier(tmp_path, "default", [finding(NEGLIGIBLE)])
    assert compared is not None and compared["held_earlier"] == 1
    by_claim = {r["claim"]: r for r in compared["rows"]}
    row = by_claim["a higher than b"]
    assert (row["earlier"]["estimate"], row["earlier"]["outcome"]) == (0.5, "holds")
    assert (row["now"]["estimate"], row["now"]["outcome"]) == (0.001, "negligible")
    assert row["replication"] == "negligible now"
    assert by_claim["c higher than d"]["now"] is None and by_claim["c higher than d"]["replication"] == ""
    assert compared["counts"] == {"negligible now": 1}


@pytest.mark.parametrize(
    ("earlier_name", "now_name", "paired"),
    [
        ("lr×rollback_lower_lr − continue, scored gap", "lr×rollback_lower_lr − lr×continue, scored gap", True),
        ("data×skip_batch − continue, scored gap", "data×skip_batch − clean control, scored gap", False),
        ("lr×rollback_lower_lr − continue, scored gap", "lr×rollback_lower_lr − data×continue, scored gap", False),
    ],
)
def test_a_reference_policy_named_without_its_cause_is_the_same_comparison_as_with_the_spikes_cause(
    tmp_path, earlier_name, now_name, paired
):
    """Version 3 wrote a comparison's reference policy bare; version 4 names its cause."""
    before = Claim(earlier_name, -0.098, 0.001, ci95=[-0.15, -0.05])
    now = Claim(now_name, 0.031, 0.3, ci95=[-0.025, 0.086])
    earlier(tmp_path, before)
    compared = beside_earlier(tmp_path, "default", [finding(now)])
    assert (compared["rows"][0]["now"] is not None) == paired
    assert len(compared["rows"]) == (1 if paired else 2)
    assert comparison("a higher than b") == "a higher than b"


def test_a_claim_new_in_this_version_is_listed_after_the_earlier_ones_with_a_dash_before_it(tmp_path):
    earlier(tmp_path, HELD)
    new = Claim("e higher than f", 0.2, 0.01, ci95=[0.1, 0.3])
    compared = beside_earlier(tmp_path, "default", [finding(HELD, new)])
    assert [r["claim"] for r in compared["rows"]] == ["a higher than b", "e higher than f"]
    assert compared["rows"][1]["earlier"] is None and compared["counts"] == {REPLICATED: 1}
    table = "\n".join(str(line) for line in versions_section(compared).lines)
    assert "| xiong | e higher than f | - | +0.2 [+0.1 to +0.3]: holds | - |" in table
    assert "Of the 1 claims version 3 held: 1 replicated" in table


def test_a_failed_precondition_makes_every_claim_of_its_finding_not_tested_now(tmp_path):
    earlier(tmp_path, HELD)
    compared = beside_earlier(tmp_path, "default", [finding(HELD, precondition_failed="on the plateau")])
    assert compared["rows"][0]["now"]["outcome"] == "not tested"
    assert compared["rows"][0]["replication"] == "not tested now"


def test_an_earlier_version_of_another_profile_or_none_is_no_comparison_and_no_section(tmp_path):
    assert beside_earlier(tmp_path, "default", [finding(HELD)]) is None
    earlier(tmp_path, HELD, profile="default")
    assert beside_earlier(tmp_path, "smoke", [finding(HELD)]) is None
    assert versions_section(None) is None


def test_the_committed_version_3_is_frozen_from_its_report_with_every_claim():
    frozen = json.loads((Path(__file__).resolve().parents[1] / EARLIER).read_text())
    assert (frozen["version"], frozen["profile"]) == (3, "default")
    assert sum(len(f["claims"]) for f in frozen["findings"].values()) == 22  # version 3's 22 claims
