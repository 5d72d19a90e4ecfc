"""The verdict rule on constructed claims: each of the four verdicts, their order, p exactly at
alpha (not significant), the interval clearing the smallest effect of interest (and exactly at it:
not cleared), the halves' sign rule, and equivalence claims against their margin."""

from __future__ import annotations

import pytest

from tasks.design.stats import ALPHA
from tasks.report.method import decide
from tasks.report.verdict import (
    CONTRADICTED,
    INCONCLUSIVE,
    NEGLIGIBLE,
    NOT_TESTED,
    RATE,
    REPRODUCED,
    Claim,
    adjust,
    verdict,
)

AGREE = {"discovery": 1.0, "confirmation": 1.2}


def claim(estimate=1.0, p=0.01, ci=(0.5, 1.5), sesoi=0.2, expected=1, halves=None):
    return Claim("a", estimate, p, expected, sesoi=sesoi, ci95=list(ci), halves=AGREE if halves is None else halves)


def equivalence(p_tost, ci=(-0.004, 0.008), halves=None):
    halves = {"discovery": 0.001, "confirmation": 0.003} if halves is None else halves
    return Claim(
        "no effect within ±0.01 nats", 0.002, p_tost, 0, kind="equivalence", sesoi=0.01, ci95=list(ci), halves=halves
    )


@pytest.mark.parametrize(
    ("claims", "expected"),
    [
        ([claim(), claim(2.0, 0.001, (1.0, 3.0))], REPRODUCED),
        ([claim(-1.0, ci=(-1.5, -0.5), expected=-1, halves={"discovery": -1.0})], REPRODUCED),
        ([claim(), claim(2.0, 0.2, (-1.0, 5.0))], INCONCLUSIVE),  # one claim not significant
        ([claim(-1.0, 0.3, (-3.0, 1.0)), claim(-2.0, 0.2, (-5.0, 1.0))], INCONCLUSIVE),  # wrong way, not significant
        ([claim(p=None)], INCONCLUSIVE),  # untested
        ([], INCONCLUSIVE),
        (
            [claim(), claim(-2.0, 0.01, (-3.0, -1.0), halves={"discovery": -2.0, "confirmation": -1.5})],
            CONTRADICTED,
        ),  # one holds, one shown the other way
        ([claim(1.0, 0.001, (0.5, 1.5), expected=-1, halves=AGREE)], CONTRADICTED),
    ],
)
def test_the_verdict_rule(claims, expected):
    assert verdict(claims) == expected


def test_a_failed_precondition_is_not_tested_even_against_a_contradiction():
    against = claim(-1.0, 0.001, (-1.5, -0.5), halves={"discovery": -1.0})
    assert verdict([claim()], precondition_failed="the bf16 control broke too") == NOT_TESTED
    assert verdict([against], precondition_failed="the bf16 control broke too") == NOT_TESTED


def test_p_exactly_at_alpha_is_not_significant_either_way():
    assert verdict([claim(p=ALPHA)]) == INCONCLUSIVE
    assert verdict([claim(-1.0, ALPHA, (-1.5, -0.5), halves={"discovery": -1.0})]) == INCONCLUSIVE
    assert verdict([equivalence(ALPHA)]) == INCONCLUSIVE
    assert verdict([claim(p=0.0499)]) == REPRODUCED


def test_a_significant_effect_whose_interval_does_not_clear_the_sesoi_is_inconclusive():
    # Significant (the interval excludes 0) but it reaches below the SESOI: float rounding on another
    # CPU could move it across; exactly at the SESOI is not clearing it either.
    assert verdict([claim(ci=(0.1, 1.9), sesoi=0.2)]) == INCONCLUSIVE
    assert verdict([claim(ci=(0.2, 1.8), sesoi=0.2)]) == INCONCLUSIVE
    assert verdict([claim(ci=(0.2000001, 1.8), sesoi=0.2)]) == REPRODUCED
    # ... and the same standard the other way: a small significant effect opposite is no contradiction.
    small_against = claim(-0.3, 0.01, (-0.35, -0.1), sesoi=0.2, halves={"discovery": -0.3})
    assert verdict([small_against]) == INCONCLUSIVE


def test_a_pooled_result_one_half_does_not_share_is_not_reproduced():
    assert verdict([claim(halves={"discovery": 1.4, "confirmation": -0.1})]) == INCONCLUSIVE
    assert verdict([claim(halves={"discovery": 1.4, "confirmation": 0.0})]) == INCONCLUSIVE  # no sign
    assert verdict([claim(halves={"discovery": 1.4, "confirmation": None})]) == INCONCLUSIVE  # untested half
    assert verdict([claim(halves={"discovery": 1.4})]) == REPRODUCED  # a profile with one half
    # a contradiction needs both halves the other way too
    split = claim(-1.0, 0.001, (-1.5, -0.5), halves={"discovery": -2.0, "confirmation": 0.1})
    assert verdict([split]) == INCONCLUSIVE


def test_an_equivalence_claim_holds_on_its_tost_p_and_is_contradicted_by_an_interval_outside_the_margin():
    assert verdict([equivalence(0.01)]) == REPRODUCED
    assert verdict([equivalence(0.3, ci=(-0.02, 0.03))]) == INCONCLUSIVE  # absence of evidence is not evidence
    assert verdict([equivalence(0.3, ci=(0.011, 0.05), halves={"discovery": 0.02, "confirmation": 0.03})]) == (
        CONTRADICTED
    )
    assert verdict([equivalence(0.3, ci=(0.01, 0.05), halves={"discovery": 0.02, "confirmation": 0.03})]) == (
        INCONCLUSIVE  # the interval touches the margin: not wholly outside it
    )
    assert verdict([equivalence(0.01, halves={"discovery": 0.001, "confirmation": 0.012})]) == INCONCLUSIVE


def test_a_significant_difference_inside_the_margin_does_not_contradict_equivalence():
    # With small paired SDs a 0.002-nat difference can be significant and still lie within ±0.01.
    assert verdict([equivalence(0.01, ci=(0.001, 0.003))]) == REPRODUCED


def test_an_equivalence_claim_and_a_direction_claim_combine_under_the_same_rule():
    assert verdict([claim(), equivalence(0.01)]) == REPRODUCED
    outside = equivalence(0.2, ci=(0.02, 0.05), halves={"discovery": 0.03, "confirmation": 0.04})
    assert verdict([claim(), outside]) == CONTRADICTED


@pytest.mark.parametrize(("kind", "expected"), [("direction", 0), ("equivalence", 1), ("sign", 1)])
def test_a_claim_whose_expectation_does_not_fit_its_kind_is_refused(kind, expected):
    with pytest.raises(ValueError):
        Claim("a", 1.0, 0.01, expected=expected, kind=kind, sesoi=0.1)


@pytest.mark.parametrize("sesoi", [-0.1, float("nan"), float("inf")])
def test_a_smallest_effect_of_interest_must_be_a_finite_non_negative_number(sesoi):
    with pytest.raises(ValueError, match="smallest effect of interest"):
        Claim("a", 1.0, 0.01, sesoi=sesoi)


def test_an_equivalence_claim_needs_a_positive_margin():
    with pytest.raises(ValueError, match="margin"):
        Claim("a", 0.0, 0.01, 0, kind="equivalence", sesoi=0.0)


@pytest.mark.parametrize(("mde", "powered"), [(0.1, True), (0.1000001, False), (None, None)])
def test_a_claim_is_powered_when_its_mde_is_at_most_half_its_sesoi(mde, powered):
    assert Claim("a", 1.0, 0.01, sesoi=0.2, mde=mde).powered is powered


def small(tost_p=0.01, halves=None, sesoi=0.2):
    """A direction claim whose effect is small: not significant against 0, TOST p ``tost_p`` against ±SESOI."""
    halves = {"discovery": 0.01, "confirmation": -0.02} if halves is None else halves
    return Claim("a", 0.0, 0.8, 1, sesoi=sesoi, ci95=[-0.05, 0.05], halves=halves, tost_p=tost_p)


def test_every_claim_shown_smaller_than_its_sesoi_is_negligible_and_one_undecided_claim_keeps_it_inconclusive():
    assert verdict([small(), small(0.001)]) == NEGLIGIBLE
    assert verdict([small(), claim(2.0, 0.2, (-1.0, 5.0))]) == INCONCLUSIVE
    assert verdict([small(), claim()]) == INCONCLUSIVE  # one holds, one negligible: neither verdict
    assert verdict([small()], precondition_failed="the mechanism did not occur") == NOT_TESTED


def test_negligible_needs_the_tost_p_below_alpha_strictly_and_each_half_strictly_inside_the_sesoi():
    assert not small(tost_p=ALPHA).negligible
    assert small(tost_p=0.0499).negligible
    assert not small(halves={"discovery": 0.2, "confirmation": 0.0}).negligible  # a half exactly at the SESOI
    assert small(halves={"discovery": 0.1999, "confirmation": 0.0}).negligible
    assert not small(tost_p=None).negligible


def test_a_claim_with_no_sesoi_is_never_negligible_and_an_equivalence_is_negligible_exactly_when_it_holds():
    assert not small(sesoi=0.0, tost_p=1e-9, halves={}).negligible
    assert equivalence(0.01).negligible and equivalence(0.01).holds
    assert not equivalence(ALPHA).negligible
    assert verdict([equivalence(0.01), small()]) == NEGLIGIBLE


def gated(c: Claim, why: str = "its mechanism did not occur") -> Claim:
    c.not_tested = why
    return c


def test_a_claim_whose_own_gate_failed_leaves_its_sibling_tested_and_the_finding_read_from_it():
    assert verdict([claim(), gated(claim(-1.0, 0.001, (-1.5, -0.5)))]) == REPRODUCED  # the gated one would contradict
    assert verdict([claim(0.1, 0.5, (-0.5, 0.7)), gated(claim())]) == INCONCLUSIVE


def test_a_finding_is_not_tested_only_when_every_claim_is():
    assert verdict([gated(claim()), gated(claim())]) == NOT_TESTED
    finding = decide("beta2", [gated(claim(), "spikes_1x: gate"), gated(claim(), "spikes_4x: gate")], "", [])
    assert finding.verdict == NOT_TESTED and finding.precondition_failed == "spikes_1x: gate; spikes_4x: gate"


def test_holm_adjusts_over_the_tested_claims_only():
    claims = [claim(p=0.02), claim(p=0.001), gated(claim(p=0.0001))]
    adjust(claims)
    assert [c.p_adjusted for c in claims] == pytest.approx([0.02, 0.002, None])


@pytest.mark.parametrize(("p", "holds"), [(ALPHA / 2, False), (ALPHA / 2 - 1e-9, True)])
def test_a_claim_holds_on_its_holm_adjusted_p_strictly_below_alpha(p, holds):
    """Two claims: the larger p is Holm's last step (x1), the smaller p's step is x2: p = alpha / 2 adjusts to alpha."""
    finding = decide("beta2", [claim(p=p), claim(p=ALPHA / 2 + 0.001)], "", [])
    assert finding.claims[0].p_adjusted == pytest.approx(2 * p)
    assert finding.claims[0].holds is holds


def test_one_claim_is_adjusted_to_itself():
    (only,) = decide("beta2", [claim(p=0.049)], "", []).claims
    assert only.p_adjusted == 0.049 and only.holds


def rate(estimate: float, p: float | None, expected: int = 1) -> Claim:
    return Claim("diverged share", estimate, p, expected, kind=RATE)


@pytest.mark.parametrize(
    ("c", "holds", "contradicted"),
    [
        (rate(1.0, 0.0005), True, False),
        (rate(1.0, ALPHA), False, False),  # p at alpha: not significant
        (rate(-1.0, 0.0005), False, True),
        (rate(1.0, 0.0005, expected=0), False, True),  # an equivalence claim read as a rate: any difference
        (rate(0.0, None), False, False),
    ],
)
def test_a_divergence_rate_claim_is_decided_by_its_exact_test_and_sign_never_negligible(c, holds, contradicted):
    assert (c.holds, c.contradicted, c.negligible) == (holds, contradicted, False)
