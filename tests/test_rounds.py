"""The ablate stage's rounds (issue #47): which families train the next round, the cap on arm-steps,
the config that declares them, and a sequential outcome deciding a claim in place of the fixed rule."""

from __future__ import annotations

import dataclasses

import pytest

from model.typed_config import ConfigError
from tasks.ablate.config import AblationConfig
from tasks.ablate.rounds import DECIDED, GATED, LAST_ROUND, OUT_OF_BUDGET, Schedule
from tasks.report.sequential import CONTINUE
from tasks.report.verdict import CONTRADICTED, EQUIVALENCE, NEGLIGIBLE, REPRODUCED, Claim, verdict

SEEDS = {"seeds": [16, 17, 18, 19], "confirm_seeds": [20, 21, 22, 23, 24, 25, 26, 27]}


def schedule(budget_seeds: int = 8) -> Schedule:
    # arm-steps per seed: cheap 100, mid 300, dear 1000 -> cap 8 x 1400 = 11200
    return Schedule((4, 8, 12), {"dear": 1000, "cheap": 100, "mid": 300}, budget_seeds)


def test_the_first_round_admits_every_family_and_charges_its_seeds():
    s = schedule()
    assert s.admit(0, ["dear", "cheap", "mid"]) == ["dear", "cheap", "mid"]
    assert s.spent == 4 * 1400
    assert s.seeds == {"dear": 4, "cheap": 4, "mid": 4}


def test_a_decided_family_stops_and_an_open_one_goes_on():
    s = schedule()
    s.admit(0, ["dear", "cheap", "mid"])
    going = s.close(0, {"dear": None, "cheap": DECIDED, "mid": GATED})
    assert going == ["dear"]
    assert s.stopped["cheap"] == {"look": 0, "seeds": 4, "why": DECIDED}
    assert s.stopped["mid"]["why"] == GATED


def test_the_seeds_a_decided_family_leaves_go_to_the_undecided_up_to_the_cap():
    s = schedule()  # cap 11200; after round 1: 5600
    s.admit(0, ["dear", "cheap", "mid"])
    s.close(0, {"dear": None, "cheap": None, "mid": DECIDED})
    assert s.admit(1, ["dear", "cheap"]) == ["dear", "cheap"]  # +400 cheap, +4000 dear: 10000
    s.close(1, {"dear": None, "cheap": None})
    # round 3: cheap first (+400 -> 10400), then dear (+4000 -> 14400 > 11200): out of budget
    assert s.admit(2, ["dear", "cheap"]) == ["cheap"]
    assert s.stopped["dear"] == {"look": 1, "seeds": 8, "why": OUT_OF_BUDGET}
    assert s.seeds == {"dear": 8, "cheap": 12, "mid": 4}
    assert s.spent == 10400 <= s.cap


def test_a_round_that_spends_the_cap_exactly_is_admitted_and_one_step_more_is_not():
    exact = Schedule((4, 8), {"a": 10, "b": 10}, budget_seeds=6)  # cap 120: round 1 80, +40 for a
    exact.admit(0, ["a", "b"])
    assert exact.admit(1, ["a"]) == ["a"] and exact.spent == exact.cap == 120
    over = Schedule((4, 8), {"a": 10, "b": 10}, budget_seeds=6)
    over.admit(0, ["a", "b"])
    over.spent += 1  # one arm-step already beyond
    assert over.admit(1, ["a"]) == []


def test_every_family_still_open_after_the_last_round_stops_there():
    s = Schedule((4,), {"a": 10})
    s.admit(0, ["a"])
    assert s.close(0, {"a": None}) == []
    assert s.stopped["a"]["why"] == LAST_ROUND


def test_no_cap_means_the_last_round_for_every_family():
    assert schedule(budget_seeds=0).cap == 12 * 1400


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"rounds": [4, 8, 11]}, "ablation.rounds"),  # the last look is not every seed
        ({"rounds": [2, 12]}, "ablation.rounds"),  # a first look with a t-test of 1 df
        ({"rounds": [4, 4, 12]}, "ablation.rounds"),
        ({"rounds": [4, 8, 12], "budget_seeds": 3}, "ablation.budget_seeds"),  # a maximum below the first round
        ({"rounds": [4, 8, 12], "budget_seeds": 13}, "ablation.budget_seeds"),
        ({"budget_seeds": 8}, "ablation.budget_seeds"),  # a cap with no rounds
    ],
)
def test_bad_rounds_are_refused_naming_the_key(changes, key):
    with pytest.raises(ConfigError, match=key):
        AblationConfig(**SEEDS, **changes).check()


@pytest.mark.parametrize("budget", [4, 12])
def test_a_cap_at_either_end_of_the_rounds_is_accepted(budget):
    AblationConfig(**SEEDS, rounds=[4, 8, 12], budget_seeds=budget).check()


def claim(kind: str = "direction", outcome: str = REPRODUCED) -> Claim:
    # the fixed rule would say nothing holds: no p, no interval, halves disagreeing
    return Claim(
        "c",
        None,
        None,
        0 if kind == EQUIVALENCE else 1,
        kind=kind,
        sesoi=0.1,
        halves={"discovery": 1.0, "confirmation": -1.0},
        sequential={"outcome": outcome, "look": 0, "seeds": 4, "boundary": 1e-3},
    )


def test_a_sequential_outcome_decides_the_claim_in_place_of_the_fixed_rule():
    assert claim(outcome=REPRODUCED).holds and verdict([claim(outcome=REPRODUCED)]) == "reproduced"
    assert claim(outcome=CONTRADICTED).contradicted
    assert claim(outcome=NEGLIGIBLE).negligible and not claim(outcome=NEGLIGIBLE).holds
    assert verdict([claim(outcome=CONTINUE)]) == "inconclusive"


def test_an_equivalence_claim_walked_as_expecting_plus_one_is_contradicted_beyond_either_margin():
    assert claim(EQUIVALENCE, NEGLIGIBLE).holds
    assert claim(EQUIVALENCE, REPRODUCED).contradicted and claim(EQUIVALENCE, CONTRADICTED).contradicted
    assert not claim(EQUIVALENCE, REPRODUCED).holds


def test_without_a_sequential_outcome_the_fixed_rule_still_needs_both_halves():
    fixed = dataclasses.replace(claim(), sequential=None, estimate=0.5, p=1e-6, ci95=[0.3, 0.7])
    assert not fixed.holds  # the confirmation half points the other way


def test_a_family_whose_claim_ended_inconclusive_is_not_called_decided():
    """After the last look an inconclusive claim crossed no boundary: the family stops because the
    rounds ran out (LAST_ROUND), not because it was decided."""
    from tasks.report.findings import family_state
    from tasks.report.method import decide

    found = lambda *outcomes: decide("f", [claim(outcome=o) for o in outcomes], "", [])  # noqa: E731
    assert family_state(found(REPRODUCED, NEGLIGIBLE)) == DECIDED
    assert family_state(found(REPRODUCED, "inconclusive")) is None
    assert family_state(found(REPRODUCED, CONTINUE)) is None
    s = Schedule((4, 8), {"a": 10})
    s.admit(0, ["a"])
    s.admit(1, s.close(0, {"a": None}))
    assert s.close(1, {"a": family_state(found(REPRODUCED, "inconclusive"))}) == []
    assert s.stopped["a"]["why"] == LAST_ROUND
