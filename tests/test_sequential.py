"""Group-sequential seeds (tasks/report/sequential.py): the Lan-DeMets boundaries against the joint
normal distribution and a published table, the per-look rule at its edges and against verdict.py's,
the walk over rounds, the simulator against exact fixed-design rates, the error rates and power by
simulation (the registered combination, spending increments as Bonferroni levels, and the joint
reading of z boundaries), and the settings a registration may not make.

Rates are asserted with a fixed generator and a tolerance of 3 Monte Carlo SE. The spending
designs' small-sample excess over the level (the t adaptation of z boundaries) is pinned by strict
xfails, so that a fix shows up as an XPASS rather than passing unnoticed."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from tasks.design.stats import ALPHA, paired, tost_paired, tost_power
from tasks.report.declared import holm_walks
from tasks.report.sequential import (
    CONTINUE,
    JOINT,
    NOMINAL,
    OBRIEN_FLEMING,
    POCOCK,
    SequentialDesign,
    boundaries,
    equivalence_boundaries,
    fixed_decision,
    look_correlation,
    run_sequential,
    shared,
    simulate,
)
from tasks.report.verdict import CONTRADICTED, INCONCLUSIVE, NEGLIGIBLE, REPRODUCED, Claim

ROUNDS = (4, 6, 8, 10, 12)
SMALL = (3, 4, 5)
SESOI = 0.5  # in SDs of the per-seed values
BONFERRONI = (0.001, 0.003, 0.006, 0.01, 0.03)  # per-look two-sided levels over ROUNDS, summing to ALPHA
N_SIMS = 200_000  # SE 0.00035 at a rate of 0.025, 0.0005 at 0.05
N_POWER = 50_000  # SE at most 0.0022 (rate 0.5)


def mc_tolerance(rate: float, n_sims: int) -> float:
    return 3 * math.sqrt(max(rate * (1 - rate), 1e-4) / n_sims)


def spent(levels: list[float], rounds: tuple[int, ...]) -> float:
    """P(some look crosses) for standard normal looks, from the joint distribution."""
    cs = stats.norm.isf(levels)
    corr = look_correlation(rounds)
    return float(1 - stats.multivariate_normal.cdf(cs, cov=corr, abseps=1e-8, rng=np.random.default_rng(7)))


def unit_sample(mean: float, n: int = 4) -> list[float]:
    """n values with exactly this mean and sample SD 1 (up to rounding)."""
    z = np.arange(n) - (n - 1) / 2
    return list(mean + z / z.std(ddof=1))


# ----------------------------------------------------------------------------------------------
# Boundaries
# ----------------------------------------------------------------------------------------------


def test_obrien_fleming_spends_less_early_than_pocock_and_keeps_more_for_the_last_look():
    obf = boundaries(SequentialDesign(ROUNDS, OBRIEN_FLEMING, combine=JOINT))
    pocock = boundaries(SequentialDesign(ROUNDS, POCOCK, combine=JOINT))
    for k in range(1, len(ROUNDS)):  # spent by look k, before the last
        assert spent(obf[:k], ROUNDS[:k]) < spent(pocock[:k], ROUNDS[:k])
    assert obf[-1] > 2 * pocock[-1]
    assert obf == sorted(obf)  # O'Brien-Fleming's nominal levels grow look by look


@pytest.mark.parametrize("rounds", [ROUNDS, SMALL, (3, 30)])
@pytest.mark.parametrize("spending", [OBRIEN_FLEMING, POCOCK])
def test_the_boundaries_spend_alpha_over_two_per_direction_tail_and_alpha_per_equivalence_tail(rounds, spending):
    design = SequentialDesign(rounds, spending, combine=JOINT)
    assert spent(boundaries(design), rounds) == pytest.approx(ALPHA / 2, abs=1e-4)
    assert spent(equivalence_boundaries(design), rounds) == pytest.approx(ALPHA, abs=1e-4)


def test_lan_demets_obrien_fleming_matches_the_published_five_look_boundaries():
    # gsDesign's sfLDOF, k = 5 equally spaced looks, one-sided 0.025: z = 4.8769 3.3569 2.6803 2.2898 2.0310
    levels = boundaries(SequentialDesign((3, 6, 9, 12, 15), OBRIEN_FLEMING, combine=JOINT))
    assert list(stats.norm.isf(levels)) == pytest.approx([4.8769, 3.3569, 2.6803, 2.2898, 2.0310], abs=1e-3)


@pytest.mark.parametrize("spending", [OBRIEN_FLEMING, POCOCK])
def test_a_one_look_design_tests_at_the_fixed_level_exactly(spending):
    design = SequentialDesign((8,), spending, combine=JOINT)
    assert boundaries(design) == [ALPHA / 2]
    assert equivalence_boundaries(design) == [ALPHA]
    assert boundaries(SequentialDesign((8,), NOMINAL, nominal=(ALPHA,))) == [ALPHA / 2]


def test_nominal_levels_split_into_half_per_direction_tail_and_the_whole_per_equivalence_tail():
    design = SequentialDesign(ROUNDS, NOMINAL, nominal=BONFERRONI)
    assert boundaries(design) == pytest.approx([x / 2 for x in BONFERRONI])
    assert equivalence_boundaries(design) == pytest.approx(list(BONFERRONI))


# ----------------------------------------------------------------------------------------------
# One look's rule
# ----------------------------------------------------------------------------------------------


def test_reproduced_needs_the_interval_strictly_beyond_the_sesoi():
    reach = stats.t.isf(ALPHA / 2, 3) / 2  # n 4, SD 1: the 95 % interval's half-width
    assert fixed_decision(unit_sample(SESOI + reach + 1e-9), SESOI, 1).outcome == REPRODUCED
    assert fixed_decision(unit_sample(SESOI + reach - 1e-9), SESOI, 1).outcome == INCONCLUSIVE


def test_contradicted_needs_the_interval_strictly_beyond_the_sesoi_the_other_way():
    reach = stats.t.isf(ALPHA / 2, 3) / 2
    assert fixed_decision(unit_sample(SESOI + reach + 1e-9), SESOI, -1).outcome == CONTRADICTED
    assert fixed_decision(unit_sample(-SESOI - reach - 1e-9), SESOI, 1).outcome == CONTRADICTED
    assert fixed_decision(unit_sample(-SESOI - reach + 1e-9), SESOI, 1).outcome == INCONCLUSIVE


def test_negligible_needs_the_tost_interval_strictly_inside_the_sesoi():
    margin = stats.t.isf(ALPHA, 3) / 2  # the 90 % interval's half-width
    sesoi = 2.0
    inside = fixed_decision(unit_sample(sesoi - margin - 1e-9), sesoi, 1)
    assert (inside.outcome, inside.boundary) == (NEGLIGIBLE, ALPHA)
    assert fixed_decision(unit_sample(sesoi - margin + 1e-9), sesoi, 1).outcome == INCONCLUSIVE


def test_values_without_spread_decide_nothing():
    assert fixed_decision([3.0, 3.0, 3.0, 3.0], SESOI, 1).outcome == INCONCLUSIVE


def test_the_fixed_decision_is_verdicts_rule_for_one_claim():
    rng = np.random.default_rng(3)
    for _ in range(200):
        diffs = list(rng.normal(rng.uniform(-1.5, 1.5), 1.0, size=int(rng.integers(3, 13))))
        test, tost = paired(dict(enumerate(diffs)), dict.fromkeys(range(len(diffs)), 0.0)), tost_paired(diffs, SESOI)
        for expected in (1, -1):
            claim = Claim("c", test["estimate"], test["p"], expected, sesoi=SESOI, ci95=test["ci95"], tost_p=tost["p"])
            outcome = fixed_decision(diffs, SESOI, expected).outcome
            assert (outcome == REPRODUCED) == claim.holds
            assert (outcome == CONTRADICTED) == claim.contradicted
            assert (outcome == NEGLIGIBLE) == claim.negligible


# ----------------------------------------------------------------------------------------------
# The walk over rounds
# ----------------------------------------------------------------------------------------------


def test_the_walk_stops_at_the_first_look_that_decides_and_reads_no_later_seed():
    design = SequentialDesign(ROUNDS, OBRIEN_FLEMING, combine=JOINT)
    values = [10.0, 10.1, 9.9, 10.05] + [-50.0] * 8
    out = run_sequential(values, design, SESOI, 1)
    assert (out.outcome, out.look, out.seeds, out.boundary) == (REPRODUCED, 0, 4, boundaries(design)[0])


def test_an_undecided_claim_is_inconclusive_only_at_the_last_look():
    design = SequentialDesign(ROUNDS, POCOCK, combine=JOINT)
    noise = list(np.random.default_rng(0).normal(0.0, 5.0, size=12))
    assert run_sequential(noise, design, SESOI, 1).outcome == INCONCLUSIVE
    assert run_sequential(noise, design, SESOI, 1).seeds == 12
    partway = run_sequential(noise[:9], design, SESOI, 1)  # looks at 4, 6 and 8 seeds; the 9th waits
    assert (partway.outcome, partway.look, partway.seeds, partway.boundary) == (CONTINUE, 2, 8, None)


def test_before_the_first_round_is_complete_nothing_is_tested():
    out = run_sequential([1.0, 2.0, 3.0], SequentialDesign(ROUNDS), SESOI, 1)
    assert (out.outcome, out.look, out.seeds) == (CONTINUE, None, 0)


def test_more_values_than_the_last_round_are_refused():
    with pytest.raises(ValueError, match="more than the design's last round"):
        run_sequential([0.0] * 13, SequentialDesign(ROUNDS), SESOI, 1)


def test_a_one_look_design_decides_as_the_fixed_design():
    rng = np.random.default_rng(4)
    design = SequentialDesign((8,), POCOCK, combine=JOINT)
    for _ in range(100):
        values = list(rng.normal(rng.uniform(-1.5, 1.5), 1.0, size=8))
        assert run_sequential(values, design, SESOI, 1) == fixed_decision(values, SESOI, 1)


# ----------------------------------------------------------------------------------------------
# Simulation
# ----------------------------------------------------------------------------------------------


def test_simulate_counts_what_run_sequential_decides_on_the_same_draws():
    design = SequentialDesign(SMALL, POCOCK, combine=JOINT)
    draws = np.random.default_rng(9).standard_normal((400, 5)) + 1.0
    outcomes = [run_sequential(list(row), design, SESOI, 1) for row in draws]
    rates = simulate(design, 1.0, SESOI, 1, 400, np.random.default_rng(9))
    for name in (REPRODUCED, CONTRADICTED, NEGLIGIBLE, INCONCLUSIVE):
        assert rates[name] == sum(o.outcome == name for o in outcomes) / 400
    assert rates["mean_seeds"] == pytest.approx(np.mean([o.seeds for o in outcomes]))


@pytest.mark.parametrize("effect", [SESOI, 1.0, 0.0])
def test_the_simulated_fixed_design_matches_its_exact_rates(effect):
    # P(reproduced) = noncentral t tail; P(negligible) = tasks/design/stats.py: tost_power (Owen).
    rates = simulate(SequentialDesign((8,)), effect, SESOI, 1, N_SIMS, np.random.default_rng(5))
    reproduced = stats.nct.sf(stats.t.isf(ALPHA / 2, 7), 7, (effect - SESOI) * math.sqrt(8))
    negligible = tost_power(8, 1.0, SESOI, delta=effect)
    assert negligible is not None
    assert abs(rates[REPRODUCED] - reproduced) <= mc_tolerance(reproduced, N_SIMS)
    assert abs(rates[NEGLIGIBLE] - negligible) <= mc_tolerance(negligible, N_SIMS)


# ----------------------------------------------------------------------------------------------
# Error rates
# ----------------------------------------------------------------------------------------------

SPENDING_DESIGNS = [
    pytest.param(SequentialDesign(rounds, spending, combine=JOINT), id=f"{spending}-{'-'.join(map(str, rounds))}")
    for rounds in (ROUNDS, SMALL)
    for spending in (OBRIEN_FLEMING, POCOCK)
]
SMALL_SAMPLE_EXCESS = pytest.mark.xfail(
    strict=True,
    reason="z boundaries read as nominal levels of t-tests overshoot at a few seeds per look: measured "
    "0.026-0.028 for alpha/2 = 0.025, 0.053-0.057 for alpha = 0.05 (issue #47's report)",
)


@pytest.mark.parametrize("effect", [SESOI, -SESOI])
def test_reproduced_or_contradicted_at_the_sesoi_stays_at_alpha_over_2_under_bonferroni_levels(effect):
    rates = simulate(
        SequentialDesign(ROUNDS, NOMINAL, nominal=BONFERRONI), effect, SESOI, 1, N_SIMS, np.random.default_rng(1)
    )
    wrong = rates[REPRODUCED] if effect > 0 else rates[CONTRADICTED]
    assert wrong <= ALPHA / 2 + mc_tolerance(ALPHA / 2, N_SIMS)


def test_negligible_at_the_sesoi_stays_at_alpha_under_bonferroni_levels():
    # SESOI 2 SD: the far side's test rejects almost always, so the near side's error is all there is.
    rates = simulate(
        SequentialDesign(ROUNDS, NOMINAL, nominal=BONFERRONI), 2.0, 2.0, 1, N_SIMS, np.random.default_rng(2)
    )
    assert rates[NEGLIGIBLE] <= ALPHA + mc_tolerance(ALPHA, N_SIMS)


@SMALL_SAMPLE_EXCESS
@pytest.mark.parametrize("design", SPENDING_DESIGNS)
def test_reproduced_at_the_sesoi_stays_at_alpha_over_2_under_spending(design):
    rates = simulate(design, SESOI, SESOI, 1, N_SIMS, np.random.default_rng(1))
    assert rates[REPRODUCED] <= ALPHA / 2 + mc_tolerance(ALPHA / 2, N_SIMS)


@pytest.mark.parametrize("design", SPENDING_DESIGNS)
def test_negligible_at_a_half_sd_sesoi_stays_at_alpha_under_spending(design):
    rates = simulate(design, SESOI, SESOI, 1, N_SIMS, np.random.default_rng(2))
    assert rates[NEGLIGIBLE] <= ALPHA + mc_tolerance(ALPHA, N_SIMS)


@SMALL_SAMPLE_EXCESS
@pytest.mark.parametrize("design", SPENDING_DESIGNS)
def test_negligible_at_a_two_sd_sesoi_stays_at_alpha_under_spending(design):
    rates = simulate(design, 2.0, 2.0, 1, N_SIMS, np.random.default_rng(2))
    assert rates[NEGLIGIBLE] <= ALPHA + mc_tolerance(ALPHA, N_SIMS)


@pytest.mark.parametrize("spending", [OBRIEN_FLEMING, POCOCK])
def test_the_spending_designs_keep_alpha_over_2_once_each_look_has_tens_of_seeds(spending):
    n_sims = 100_000
    design = SequentialDesign((20, 40, 60, 80, 100), spending, combine=JOINT)
    rates = simulate(design, SESOI, SESOI, 1, n_sims, np.random.default_rng(1))
    assert rates[REPRODUCED] <= ALPHA / 2 + mc_tolerance(ALPHA / 2, n_sims)


REGISTERED_ROUNDS = (4, 8, 12)


@pytest.mark.parametrize("rounds", [REGISTERED_ROUNDS, ROUNDS, SMALL])
@pytest.mark.parametrize("spending", [OBRIEN_FLEMING, POCOCK])
def test_spending_increments_as_bonferroni_levels_keep_alpha_over_2_at_a_few_seeds_per_look(rounds, spending):
    design = SequentialDesign(rounds, spending)  # combine: bonferroni, the default
    assert math.fsum(boundaries(design)) == pytest.approx(ALPHA / 2, abs=1e-15)
    assert math.fsum(equivalence_boundaries(design)) == pytest.approx(ALPHA, abs=1e-15)
    rates = simulate(design, SESOI, SESOI, 1, N_SIMS, np.random.default_rng(1))
    assert rates[REPRODUCED] <= ALPHA / 2 + mc_tolerance(ALPHA / 2, N_SIMS)
    wide = simulate(design, 2.0, 2.0, 1, N_SIMS, np.random.default_rng(2))  # the equivalence's near side
    assert wide[NEGLIGIBLE] <= ALPHA + mc_tolerance(ALPHA, N_SIMS)


def test_the_registered_design_decides_an_overwhelming_effect_at_its_first_look():
    design = SequentialDesign(REGISTERED_ROUNDS, OBRIEN_FLEMING)
    rates = simulate(design, 6 * SESOI, SESOI, 1, 20_000, np.random.default_rng(3))
    assert rates[REPRODUCED] > 0.99 and rates["mean_seeds"] < 8


# ----------------------------------------------------------------------------------------------
# Power against the fixed 8-seed design
# ----------------------------------------------------------------------------------------------


def compare_with_fixed_8(design: SequentialDesign, effect: float, outcome: str) -> tuple[float, float, float]:
    rates = simulate(design, effect, SESOI, 1, N_POWER, np.random.default_rng(6))
    fixed = simulate(SequentialDesign((8,)), effect, SESOI, 1, N_POWER, np.random.default_rng(8))
    tolerance = math.hypot(mc_tolerance(rates[outcome], N_POWER), mc_tolerance(fixed[outcome], N_POWER))
    print(
        f"{design.spending} {design.rounds}: P({outcome}) {rates[outcome]:.4f} over {rates['mean_seeds']:.2f} seeds; fixed 8: {fixed[outcome]:.4f}"
    )
    return rates[outcome], fixed[outcome], tolerance


POWER_DESIGNS = [
    pytest.param(SequentialDesign(REGISTERED_ROUNDS, OBRIEN_FLEMING), id="registered-bonferroni-obf-4-8-12"),
    pytest.param(SequentialDesign(ROUNDS, OBRIEN_FLEMING, combine=JOINT), id="obrien_fleming-4-to-12"),
    pytest.param(SequentialDesign(ROUNDS, POCOCK, combine=JOINT), id="pocock-4-to-12"),
    pytest.param(SequentialDesign(ROUNDS, NOMINAL, nominal=BONFERRONI), id="bonferroni-4-to-12"),
]


@pytest.mark.parametrize("design", POWER_DESIGNS)
def test_reproduced_at_twice_the_sesoi_is_at_least_as_likely_as_with_a_fixed_8(design):
    sequential, fixed, tolerance = compare_with_fixed_8(design, 2 * SESOI, REPRODUCED)
    assert sequential >= fixed - tolerance


@pytest.mark.parametrize(
    "design",
    [
        pytest.param(SequentialDesign(REGISTERED_ROUNDS, OBRIEN_FLEMING), id="registered-bonferroni-obf-4-8-12"),
        pytest.param(SequentialDesign(ROUNDS, OBRIEN_FLEMING, combine=JOINT), id="obrien_fleming-4-to-12"),
        pytest.param(SequentialDesign(ROUNDS + (14,), POCOCK, combine=JOINT), id="pocock-4-to-14"),
        pytest.param(SequentialDesign(ROUNDS, NOMINAL, nominal=BONFERRONI), id="bonferroni-4-to-12"),
        pytest.param(
            SequentialDesign(ROUNDS, POCOCK, combine=JOINT),
            id="pocock-4-to-12",
            marks=pytest.mark.xfail(strict=True, reason="measured 0.036 against the fixed 8's 0.039"),
        ),
    ],
)
def test_negligible_at_no_effect_is_at_least_as_likely_as_with_a_fixed_8(design):
    sequential, fixed, tolerance = compare_with_fixed_8(design, 0.0, NEGLIGIBLE)
    assert sequential >= fixed - tolerance


# ----------------------------------------------------------------------------------------------
# Settings refused
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mapping", "key"),
    [
        ({"rounds": [4, 8, 8]}, "sequential.rounds"),
        ({"rounds": [8, 4]}, "sequential.rounds"),  # the maximum below the first round
        ({"rounds": [2, 4]}, "sequential.rounds"),  # df 1 at the first look
        ({"rounds": []}, "sequential.rounds"),
        ({"rounds": 8}, "sequential.rounds"),
        ({"spending": POCOCK}, "sequential.rounds"),
        ({"rounds": [4, 8], "spending": "haybittle_peto"}, "sequential.spending"),
        ({"rounds": [4, 8], "nominal": [0.03, 0.0201]}, "sequential.nominal"),  # spends more than alpha
        ({"rounds": [4, 8], "nominal": [0.05]}, "sequential.nominal"),  # one level for two looks
        ({"rounds": [4, 8], "spending": POCOCK, "nominal": [0.02, 0.03]}, "sequential.nominal"),
        ({"rounds": [4, 8], "alpha": 1.0}, "sequential.alpha"),
        ({"rounds": [4, 8], "looks": 2}, "sequential.looks"),
        ({"rounds": [4, 8], "combine": "holm"}, "sequential.combine"),
    ],
)
def test_a_bad_setting_is_refused_naming_its_key(mapping, key):
    with pytest.raises(ValueError, match=f"^{key}: "):
        SequentialDesign.from_mapping(mapping)


def test_the_edges_of_the_settings_are_accepted():
    assert SequentialDesign.from_mapping({"rounds": [3]}).rounds == (3,)
    at_alpha = SequentialDesign.from_mapping({"rounds": [4, 8], "nominal": [0.02, 0.03]})
    assert (at_alpha.spending, at_alpha.nominal) == (NOMINAL, (0.02, 0.03))


# ----------------------------------------------------------------------------------------------
# Holm's shares (issue 58)
# ----------------------------------------------------------------------------------------------

ONE_LOOK = SequentialDesign(rounds=(4,), spending=NOMINAL, nominal=(ALPHA,))


def test_a_share_of_one_is_the_unadjusted_design():
    design = SequentialDesign(rounds=(4, 8, 12))
    assert shared(design, 1.0) is design
    x = unit_sample(1.5, 12)
    assert run_sequential(x, design, SESOI, 1, share=1.0) == run_sequential(x, design, SESOI, 1)


def test_a_share_scales_nominal_levels_and_redraws_a_spending_function_at_that_alpha():
    nominal = SequentialDesign(rounds=(4, 8), spending=NOMINAL, nominal=(0.02, 0.03))
    assert boundaries(shared(nominal, 0.5)) == pytest.approx([0.005, 0.0075])
    spending = SequentialDesign(rounds=(4, 8, 12))
    assert sum(boundaries(shared(spending, 0.25))) == pytest.approx(ALPHA / 8)


@pytest.mark.parametrize("share", [0.0, 1.5])
def test_a_share_outside_zero_to_one_is_refused(share):
    with pytest.raises(ValueError, match="share of alpha"):
        shared(ONE_LOOK, share)


def test_a_claim_is_reproduced_at_its_share_only_strictly_beyond_the_shared_boundary():
    reach = stats.t.isf(ALPHA / 4, 3) / 2  # one look at share 1/2: alpha / 4 per tail; n 4, SD 1
    assert run_sequential(unit_sample(SESOI + reach + 1e-9), ONE_LOOK, SESOI, 1, share=0.5).outcome == REPRODUCED
    assert run_sequential(unit_sample(SESOI + reach - 1e-9), ONE_LOOK, SESOI, 1, share=0.5).outcome == INCONCLUSIVE
    assert run_sequential(unit_sample(SESOI + reach - 1e-9), ONE_LOOK, SESOI, 1).outcome == REPRODUCED


def test_holm_walks_hands_a_decided_claims_share_to_the_rest():
    """B clears the whole-alpha boundary but not half of it: walked at 1/2 beside A it stays open,
    and once A crosses at 1/2, B is walked again at the whole alpha and crosses."""
    reach = stats.t.isf(ALPHA / 2, 3) / 2
    strong, edge = unit_sample(SESOI + 3 * reach), unit_sample(SESOI + reach + 1e-6)

    def walker(x):
        return lambda share: run_sequential(x, ONE_LOOK, SESOI, 1, share=share)

    claims = [Claim("A", 1.0, 0.01), Claim("B", 1.0, 0.01)]
    holm_walks(claims, [walker(strong), walker(edge)])
    assert [(c.sequential or {}).get("outcome") for c in claims] == [REPRODUCED, REPRODUCED]
    assert [(c.sequential or {}).get("share") for c in claims] == [0.5, 1.0]
    alone = [Claim("A", 1.0, 0.01), Claim("B", 1.0, 0.01)]
    holm_walks(alone, [walker(unit_sample(0.0)), walker(edge)])  # A crosses nothing: B keeps its half
    assert [(c.sequential or {}).get("outcome") for c in alone] == [INCONCLUSIVE, INCONCLUSIVE]
    assert alone[1].sequential == {"outcome": INCONCLUSIVE, "look": 0, "seeds": 4, "boundary": None, "share": 0.5}
