"""The verdict rule on constructed claims: each of the four verdicts, their order, p exactly at
alpha (not significant), and equivalence claims."""

from __future__ import annotations

import pytest

from tasks.ablate.stats import ALPHA
from tasks.report.verdict import CONTRADICTED, INCONCLUSIVE, NOT_TESTED, REPRODUCED, Claim, verdict


def equivalence(p_tost, p_difference=None):
    return Claim(
        "no effect within ±0.01 nats", 0.002, p_tost, expected=0, kind="equivalence", p_difference=p_difference
    )


@pytest.mark.parametrize(
    ("claims", "expected"),
    [
        ([Claim("a", 1.0, 0.01), Claim("b", 2.0, 0.001)], REPRODUCED),
        ([Claim("a", -1.0, 0.01, expected=-1)], REPRODUCED),
        ([Claim("a", 1.0, 0.01), Claim("b", 2.0, 0.2)], INCONCLUSIVE),  # one claim not significant
        ([Claim("a", -1.0, 0.3), Claim("b", -2.0, 0.2)], INCONCLUSIVE),  # the wrong way, but not significantly
        ([Claim("a", 1.0, None)], INCONCLUSIVE),  # untested
        ([], INCONCLUSIVE),
        ([Claim("a", 1.0, 0.01), Claim("b", -2.0, 0.01)], CONTRADICTED),  # one holds, one significantly opposite
        ([Claim("a", 1.0, 0.001, expected=-1)], CONTRADICTED),
    ],
)
def test_the_verdict_rule(claims, expected):
    assert verdict(claims) == expected


def test_a_failed_precondition_is_not_tested_even_against_a_contradiction():
    assert verdict([Claim("a", 1.0, 0.001)], precondition_failed="the bf16 control broke too") == NOT_TESTED
    assert verdict([Claim("a", -1.0, 0.001)], precondition_failed="the bf16 control broke too") == NOT_TESTED


def test_p_exactly_at_alpha_is_not_significant_either_way():
    assert verdict([Claim("a", 1.0, ALPHA)]) == INCONCLUSIVE
    assert verdict([Claim("a", -1.0, ALPHA)]) == INCONCLUSIVE
    assert verdict([equivalence(ALPHA)]) == INCONCLUSIVE
    assert verdict([Claim("a", 1.0, 0.0499)]) == REPRODUCED


def test_an_equivalence_claim_holds_on_its_tost_p_and_is_contradicted_by_a_difference_outside_the_margin():
    assert verdict([equivalence(0.01, p_difference=0.6)]) == REPRODUCED
    assert verdict([equivalence(0.3, p_difference=0.6)]) == INCONCLUSIVE  # absence of evidence is not evidence
    assert verdict([equivalence(0.3, p_difference=0.01)]) == CONTRADICTED
    assert verdict([equivalence(0.3)]) == INCONCLUSIVE  # no difference test given: nothing contradicts it


def test_a_significant_difference_inside_the_margin_does_not_contradict_equivalence():
    # With small paired SDs a 0.002-nat difference can be significant and still lie within ±0.01.
    assert verdict([equivalence(0.01, p_difference=0.01)]) == REPRODUCED


def test_an_equivalence_claim_and_a_direction_claim_combine_under_the_same_rule():
    assert verdict([Claim("a", 1.0, 0.01), equivalence(0.01)]) == REPRODUCED
    assert verdict([Claim("a", 1.0, 0.01), equivalence(0.2, p_difference=0.001)]) == CONTRADICTED


@pytest.mark.parametrize(("kind", "expected"), [("direction", 0), ("equivalence", 1), ("sign", 1)])
def test_a_claim_whose_expectation_does_not_fit_its_kind_is_refused(kind, expected):
    with pytest.raises(ValueError):
        Claim("a", 1.0, 0.01, expected=expected, kind=kind)
