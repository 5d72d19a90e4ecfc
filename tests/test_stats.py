"""The study's paired statistics against values computed by hand: the paired t-test and its interval,
the per-seed means, the minimum detectable difference, the paired equivalence test, divergence as a
paired rate (exact McNemar), the equivalence test's own power (checked by simulation), and every
case where no test can run."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from tasks.design.stats import (
    ALPHA,
    divergence_rates,
    holm,
    mde_paired,
    paired,
    seed_means,
    seeds_for_tost_power,
    tost_paired,
    tost_power,
)

T975_DF2 = 4.302652729911275  # t(0.975, df=2)
T95_DF2 = 2.919985580353726  # t(0.95, df=2)


def t2_sf(t: float) -> float:
    """P(T > t) for Student's t with 2 df, which has a closed form: 1/2 - t / (2 sqrt(t^2 + 2))."""
    return 0.5 - t / (2 * math.sqrt(t * t + 2))


def test_paired_t_test_on_three_seeds_matches_the_hand_computation():
    # diffs [1, 2, 3]: mean 2, sd 1, t = 2 / (1 / sqrt 3) = 3.4641, df 2, p = 2 * t2_sf(3.4641) = 0.0742
    a = {0: 3.0, 1: 4.0, 2: 5.0, 3: 9.0}
    b = {0: 2.0, 1: 2.0, 2: 2.0, 7: 1.0}
    r = paired(a, b)
    assert r["test"] == "paired t-test"
    assert (r["n"], r["seeds"], r["missing"]) == (3, [0, 1, 2], {"a": [7], "b": [3]})
    assert r["diffs"] == [1.0, 2.0, 3.0]
    assert r["mean_diff"] == r["estimate"] == 2.0
    assert (r["sd_diff"], r["dz"]) == (pytest.approx(1.0), pytest.approx(2.0))
    assert r["p"] == pytest.approx(2 * t2_sf(2 * math.sqrt(3)), abs=1e-12)
    assert r["p"] == pytest.approx(0.0742, abs=1e-4)
    half = T975_DF2 / math.sqrt(3)  # 2.4841
    assert r["ci95"] == pytest.approx([2 - half, 2 + half]) and "t-interval" in r["ci95_method"]
    assert r["mde"] == pytest.approx(3.2640, abs=1e-3)  # mde_paired(3, sd 1)


def test_a_group_without_spread_against_one_with_spread_is_tested_because_the_differences_vary():
    # Every seed of a diverged to the cap (6.9); b varies by seed, so the differences vary too.
    r = paired({0: 6.9, 1: 6.9, 2: 6.9}, {0: 5.0, 1: 5.1, 2: 5.3})  # diffs 1.9, 1.8, 1.6
    mean, sd = 5.3 / 3, math.sqrt((0.4**2 + 0.1**2 + 0.5**2) / 9 / 2)  # deviations 0.4/3, 0.1/3, -0.5/3
    assert r["test"] == "paired t-test"
    assert r["sd_diff"] == pytest.approx(sd) and r["p"] == pytest.approx(2 * t2_sf(mean / (sd / math.sqrt(3))))
    assert r["p"] < 0.01


def test_the_paired_t_test_is_the_test_at_every_number_of_seeds_so_its_mde_is_the_one_printed():
    # Eight seeds: version 1 switched to the signed-rank test from 6 pairs and kept the t-test's MDE.
    diffs = [1.0, 2.0, 3.0, 4.0, 5.0, 20.0, 0.5, 1.5]
    r = paired({s: 10.0 + d for s, d in enumerate(diffs)}, {s: 10.0 for s in range(8)})
    assert r["test"] == "paired t-test"
    assert r["p"] == pytest.approx(stats.ttest_1samp(diffs, 0.0).pvalue)
    assert r["mde"] == pytest.approx(mde_paired(8, r["sd_diff"]))
    assert "hodges_lehmann" not in r


def test_seed_means_average_a_seeds_units_over_the_other_factors_before_any_test():
    # (seed, lr) units: two LRs of one seed share its init and data order, so they are one unit.
    values = {(0, 0.01): 1.0, (0, 0.04): 3.0, (1, 0.01): 2.0, (1, 0.04): 2.0, (2, 0.01): 5.0}
    assert seed_means(values) == {(0,): 2.0, (1,): 2.0, (2,): 5.0}
    assert seed_means({3: 1.5}) == {(3,): 1.5}  # plain seed keys too


def test_equal_differences_in_every_seed_are_untested_but_keep_their_estimate():
    flat = paired({0: 6.9, 1: 6.9, 2: 6.9}, {0: 5.0, 1: 5.0, 2: 5.0})
    assert flat["p"] is None and flat["test"] == "untested: no spread in the per-seed differences"
    assert flat["estimate"] == pytest.approx(1.9) and flat["sd_diff"] == 0.0
    same = paired({0: 1.0, 1: 2.0}, {0: 1.0, 1: 2.0})
    assert same["p"] is None and same["test"] == "untested: no difference in any seed" and same["estimate"] == 0.0


def test_differences_equal_up_to_rounding_are_no_spread_not_p_1e_minus_47():
    # 1.3 - 1.0 and 2.3 - 2.0 differ in the last bits; a t-test on them gives t ~ 5e15.
    r = paired({0: 1.3, 1: 2.3, 2: 0.7}, {0: 1.0, 1: 2.0, 2: 0.4})
    assert len(set(r["diffs"])) > 1
    assert r["p"] is None and "no spread" in r["test"] and r["estimate"] == pytest.approx(0.3)


def test_a_non_finite_value_names_its_arm_and_seed_and_keeps_the_sign():
    r = paired({0: math.inf, 1: 1.0, 2: 2.0}, {0: 1.0, 1: 1.1, 2: 0.9})
    assert r["test"] == "untested: a non-finite value (a at seed 0)"
    assert r["p"] is None and r["estimate"] == math.inf
    both = paired({0: math.inf, 1: 1.0}, {0: math.inf, 1: 2.0})
    assert both["test"] == "untested: a non-finite value (a at seed 0, b at seed 0)" and both["estimate"] is None


def test_fewer_than_two_shared_seeds_are_untested():
    r = paired({0: 1.0, 5: 3.0}, {0: 2.0, 1: 3.0})
    assert (r["n"], r["p"], r["estimate"]) == (1, None, -1.0)
    assert r["test"] == "untested: fewer than 2 seeds in both arms" and r["missing"] == {"a": [1], "b": [5]}


def test_mde_paired_solves_the_noncentral_t_power_for_the_noncentrality():
    # n = 3, sd 1: crit = t(0.975, 2) = 4.3027. With noncentrality 5.6535,
    # P(T > 4.3027) + P(T < -4.3027) under nct(df 2, 5.6535) = 0.800 + ~0, so MDE = 5.6535 / sqrt 3 = 3.2640.
    assert stats.nct.sf(T975_DF2, 2, 5.6535) == pytest.approx(0.8, abs=1e-4)
    assert mde_paired(3, 1.0) == pytest.approx(5.6535 / math.sqrt(3), abs=1e-3)
    assert mde_paired(3, 0.5) == pytest.approx(mde_paired(3, 1.0) / 2)
    # Large n: the normal limit (z_0.975 + z_0.8) sd / sqrt n = (1.95996 + 0.84162) / 100.
    assert mde_paired(10_000, 1.0) * 100 == pytest.approx(1.95996 + 0.84162, abs=1e-3)
    assert mde_paired(1, 1.0) is None


def test_tost_paired_is_equivalent_when_the_90_percent_interval_lies_inside_the_margin():
    # diffs [1, 2, 3]: mean 2, se 1/sqrt 3, df 2. Margin 5: t = (2 + 5) sqrt 3 and (2 - 5) sqrt 3.
    r = tost_paired([1.0, 2.0, 3.0], margin=5.0)
    assert r["p_lower"] == pytest.approx(t2_sf(7 * math.sqrt(3)))
    assert r["p_upper"] == pytest.approx(1 - t2_sf(-3 * math.sqrt(3)))  # 0.01755
    assert r["p"] == pytest.approx(0.01755, abs=1e-4) and r["equivalent"]
    half = T95_DF2 / math.sqrt(3)
    assert r["ci90"] == pytest.approx([2 - half, 2 + half])  # [0.314, 3.686], inside ±5
    narrow = tost_paired([1.0, 2.0, 3.0], margin=3.0)  # t_upper = -sqrt 3: p = 1/2 - sqrt3 / (2 sqrt 5) = 0.1127
    assert narrow["p"] == pytest.approx(0.1127, abs=1e-4) and not narrow["equivalent"]


def test_tost_paired_without_spread_or_pairs_is_untested_and_a_margin_must_be_positive():
    assert tost_paired([0.1, 0.1, 0.1], margin=1.0)["test"] == "untested: no spread in the per-seed differences"
    assert tost_paired([0.1], margin=1.0)["p"] is None
    assert not tost_paired([math.inf, 0.1], margin=1.0)["equivalent"]
    with pytest.raises(ValueError, match="positive"):
        tost_paired([1.0, 2.0], margin=0.0)


def test_divergence_rates_pair_the_seeds_and_test_the_discordant_ones():
    a = {0: True, 1: True, 2: True, 3: False}
    b = {0: False, 1: False, 2: True, 3: False, 4: True}
    r = divergence_rates(a, b)
    assert (r["n"], r["events"], r["rates"], r["risk_difference"]) == (4, [3, 1], [0.75, 0.25], 0.5)
    assert r["discordant"] == [2, 0] and r["missing"] == {"a": [4], "b": []}
    assert r["p"] == pytest.approx(2 * 0.5**2)  # both discordant pairs one way: 1/4, twice
    six = divergence_rates({s: True for s in range(6)}, {s: False for s in range(6)})
    assert six["p"] == pytest.approx(2 / 2**6) and six["risk_difference"] == 1.0


def test_divergence_with_no_discordant_pair_is_untested():
    r = divergence_rates({0: True, 1: False}, {0: True, 1: False})
    assert r["p"] is None and "no discordant pairs" in r["test"] and r["risk_difference"] == 0.0


@pytest.mark.parametrize(("n", "margin", "delta"), [(12, 0.8, 0.0), (5, 1.5, 0.3), (30, 0.5, 0.2), (3, 3.0, 0.0)])
def test_tost_power_equals_the_share_of_simulated_studies_whose_tost_is_significant(n, margin, delta):
    rng = np.random.default_rng(n)
    sims = 40_000  # Monte Carlo SE at most 0.0025
    x = rng.normal(delta, 1.0, (sims, n))
    pvalues = [tost_paired(row, margin)["p"] for row in x[:4000]]  # the test itself, on a tenth of them
    mean, se = x.mean(1), x.std(1, ddof=1) / math.sqrt(n)
    crit = stats.t.ppf(0.95, n - 1)
    inside = (mean - crit * se > -margin) & (mean + crit * se < margin)
    assert np.mean(np.array(pvalues) < 0.05) == pytest.approx(inside[:4000].mean(), abs=1e-9)
    assert tost_power(n, 1.0, margin, delta) == pytest.approx(inside.mean(), abs=0.0075)


def test_seeds_for_tost_power_is_the_first_n_at_which_the_power_reaches_80_percent():
    n = seeds_for_tost_power(1.0, 0.5)
    assert tost_power(n - 1, 1.0, 0.5) < 0.8 <= tost_power(n, 1.0, 0.5)
    assert n == 36
    # not the direction rule's MDE <= SESOI / 2, which at SD 1 and SESOI 0.5 asks for 128 seeds
    assert mde_paired(127, 1.0) > 0.25 >= mde_paired(128, 1.0)
    assert seeds_for_tost_power(1.0, 0.001, most=1000) is None
    assert tost_power(1, 1.0, 0.5) is None
    assert tost_power(5, 0.0, 0.5) == 1.0 and tost_power(5, 0.0, 0.5, delta=0.5) == 0.0


def test_holm_of_one_p_is_that_p():
    assert holm([0.03]) == [0.03]


def test_holm_multiplies_the_ith_smallest_p_by_m_minus_i_plus_1_in_the_order_given():
    assert holm([0.04, 0.01, 0.03]) == pytest.approx([0.06, 0.03, 0.06])


def test_holm_is_monotone_in_p_and_capped_at_one():
    adjusted = holm([0.02, 0.021, 0.6, 0.9])
    assert adjusted == pytest.approx(
        [0.08, 0.08, 1.0, 1.0]
    )  # 0.021 x 3 = 0.063 raised to 0.08: never below a smaller p's
    assert max(holm([0.5, 0.6])) == 1.0


def test_a_p_exactly_at_its_holm_level_is_not_significant():
    """Two claims: the smaller p is tested at alpha / 2, so p = alpha / 2 adjusts to exactly alpha (not < alpha)."""
    assert holm([ALPHA / 2, 0.04])[0] == ALPHA
    assert holm([ALPHA / 2 - 1e-9, 0.04])[0] < ALPHA
