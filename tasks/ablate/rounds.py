"""Which families train the next round of seeds (issue #47; preregistration.yaml, ``sequential``).

The ablate stage trains every family's first ``ablation.rounds[0]`` seeds, then looks: each family's
claims are walked through the registered boundaries (tasks/report/declared.py: walk). A family stops
when every claim is decided (reproduced, contradicted, negligible) or a gate fails (its mechanism
did not occur: more seeds estimate the same mean more precisely, they do not make it occur). The
families still open are admitted to the next round cheapest first (the round's arm-steps, the
registration order on a tie) while the study's arm-steps stay within its cap, ``budget_seeds`` x
every family's arm-steps per seed. A family left out stops there, its undecided claims inconclusive.
Everything counts seeds and steps, never wall time, so the same study decides the same way on a
slower CPU.

Budget-honest (issue #58, item 4): the cap reserves every family ``budget_seeds`` seeds up front,
and a family's looks are those rounds the reservation reaches (:func:`reachable_rounds`), decided
before any run. Its alpha is spent over those looks only (tasks/report/declared.py: looks), so a
cap that stops every family at 8 of 12 seeds spends all of alpha by the look at 8; version 3
spent it over 4-8-12 and tested at 8 with 0.006 of its 0.025.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

DECIDED, GATED, OUT_OF_BUDGET, LAST_ROUND = "decided", "a gate failed", "out of budget", "last round"
"""Why a family stopped."""


def reachable_rounds(rounds: Sequence[int], budget_seeds: int) -> tuple[int, ...]:
    """The looks a family's reserved budget reaches: the rounds at or below ``budget_seeds`` (every
    round when 0, no cap). The first round is always reached (AblationConfig.check)."""
    return tuple(n for n in rounds if not budget_seeds or n <= budget_seeds)


@dataclasses.dataclass
class Schedule:
    """The rounds, each family's arm-steps per seed, the cap, and what has been spent and decided."""

    rounds: tuple[int, ...]
    per_seed: dict[str, int]
    budget_seeds: int = 0
    spent: int = 0
    seeds: dict[str, int] = dataclasses.field(default_factory=dict)
    stopped: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    @property
    def cap(self) -> int:
        """The study's arm-steps at most: every family at ``budget_seeds`` (the last round's when 0)."""
        return (self.budget_seeds or self.rounds[-1]) * sum(self.per_seed.values())

    def admit(self, look: int, open_families: Sequence[str]) -> list[str]:
        """The families that train round ``look`` (0-based), charged to the budget; the first round
        admits every family (a cap is at least the first round: AblationConfig.check)."""
        grow = self.rounds[look] - (self.rounds[look - 1] if look else 0)
        order = sorted(open_families, key=lambda f: (grow * self.per_seed[f], list(self.per_seed).index(f)))
        admitted = []
        for family in order:
            cost = grow * self.per_seed[family]
            if look and self.spent + cost > self.cap:
                self.stopped[family] = {"look": look - 1, "seeds": self.seeds[family], "why": OUT_OF_BUDGET}
                continue
            self.spent += cost
            self.seeds[family] = self.rounds[look]
            admitted.append(family)
        return [f for f in open_families if f in admitted]

    def close(self, look: int, outcomes: Mapping[str, str | None]) -> list[str]:
        """After look ``look``: each admitted family's state (DECIDED, GATED or None while a claim is
        open); returns those that go on (none after the last round)."""
        going = []
        for family, state in outcomes.items():
            if state is None and look + 1 < len(self.rounds):
                going.append(family)
                continue
            self.stopped[family] = {"look": look, "seeds": self.seeds[family], "why": state or LAST_ROUND}
        return going

    def record(self) -> dict[str, Any]:
        return {
            "rounds": list(self.rounds),
            "budget_seeds": self.budget_seeds,
            "cap_arm_steps": self.cap,
            "arm_steps": self.spent,
            "families": {f: self.stopped.get(f, {"seeds": self.seeds.get(f, 0)}) for f in self.per_seed},
        }
