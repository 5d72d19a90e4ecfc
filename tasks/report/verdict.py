"""The one rule that turns a finding's claims into its verdict, written down before any result was seen:

  not tested    a precondition of the finding failed (named by the caller)
  contradicted  a claim is significant the other way
  reproduced    there is at least one claim, and every claim holds
  inconclusive  anything else: the right direction without significance, a wrong direction without
                significance, no claims, a claim with no test (p None)

The order is the rule. A failed precondition comes first: the comparison the claim needs was not
made as intended (e.g. the control broke too), so its numbers neither support nor contradict it.
A contradiction then outranks the claims that hold: one significant result against the finding is
evidence against it whatever the others say.

Significant means p < ALPHA, strictly: p equal to ALPHA is not significant.

A direction claim predicts the sign of its estimate (``expected`` +1 or -1) and holds when the
estimate has that sign and is significant. An equivalence claim predicts no effect beyond a margin
fixed beforehand (``expected`` 0): ``p`` is its TOST p (tasks/ablate/stats.py: tost_paired,
tost_slope) and it holds when that is significant; ``p_difference`` is the ordinary two-sided test of
a difference, and a significant one contradicts the claim unless the TOST also placed the effect
inside the margin (a difference too small to matter is what the claim allows).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tasks.ablate.stats import ALPHA

REPRODUCED, CONTRADICTED, NOT_TESTED, INCONCLUSIVE = "reproduced", "contradicted", "not tested", "inconclusive"
DIRECTION, EQUIVALENCE = "direction", "equivalence"


def significant(p: float | None) -> bool:
    """p < ALPHA, strictly; an untested comparison (p None) is not significant."""
    return p is not None and p < ALPHA


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


@dataclasses.dataclass
class Claim:
    """One comparison a finding rests on; ``ci95`` and ``mde`` ride along for the report's forest plot."""

    what: str
    estimate: float | None
    p: float | None
    expected: int = 1
    kind: str = DIRECTION
    p_difference: float | None = None
    ci95: list[float] | None = None
    mde: float | None = None
    unit: str = ""

    def __post_init__(self) -> None:
        allowed = {DIRECTION: (1, -1), EQUIVALENCE: (0,)}
        if self.expected not in allowed.get(self.kind, ()):
            raise ValueError(f"{self.what}: a {self.kind!r} claim cannot expect {self.expected}")

    @property
    def holds(self) -> bool:
        if self.kind == EQUIVALENCE:
            return significant(self.p)
        return self.estimate is not None and _sign(self.estimate) == self.expected and significant(self.p)

    @property
    def contradicted(self) -> bool:
        if self.kind == EQUIVALENCE:
            return significant(self.p_difference) and not self.holds
        return self.estimate is not None and _sign(self.estimate) == -self.expected and significant(self.p)


def verdict(claims: Sequence[Claim], precondition_failed: str | None = None) -> str:
    """The finding's verdict from its claims, by the rule in this module's docstring."""
    if precondition_failed:
        return NOT_TESTED
    if any(c.contradicted for c in claims):
        return CONTRADICTED
    if claims and all(c.holds for c in claims):
        return REPRODUCED
    return INCONCLUSIVE
