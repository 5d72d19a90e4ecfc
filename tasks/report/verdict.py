"""The one rule that turns a finding's claims into its verdict, written down before any result was seen:

  not tested    a precondition of the finding failed (named by the caller)
  contradicted  a claim is shown the other way, by at least its smallest effect of interest
  reproduced    there is at least one claim, and every claim holds
  negligible    there is at least one claim, and every claim is shown smaller than its smallest
                effect of interest (version 3)
  inconclusive  anything else: the right direction without significance, an effect significant but
                smaller than the claim's smallest effect of interest, halves that disagree, no
                claims, a claim with no test (p None)

A family whose seeds came in rounds (version 3) has each claim decided by its group-sequential
outcome instead (``Claim.sequential``; tasks/report/sequential.py): reproduced / contradicted /
negligible where a look's boundary was crossed, inconclusive where none was.

The order is the rule. A failed precondition comes first: the comparison the claim needs was not
made as intended (e.g. the control broke too), so its numbers neither support nor contradict it.
A contradiction then outranks the claims that hold: one result shown against the finding is
evidence against it whatever the others say.

Significant means p < ALPHA, strictly: p equal to ALPHA is not significant.

A direction claim predicts the sign of its estimate (``expected`` +1 or -1). It **holds** when
  - the pooled test over every seed is significant with the estimate of that sign,
  - its 95 % interval clears the claim's smallest effect of interest (``sesoi``, registered from the
    claim's source): the whole interval lies beyond +sesoi (or below -sesoi for -1), so float
    rounding on another CPU, which moves per-arm losses by 1e-3 to 1e-1 nats, cannot make or unmake
    an effect that matters, and
  - every half of the seeds (discovery, confirmation: ``halves``, each half's own estimate) points
    the predicted way: a pooled result carried by one half's seeds is not a replication.
It is **contradicted** by the mirror image: significant, the interval beyond the SESOI on the other
side, and every half pointing the other way.

An equivalence claim predicts no effect beyond a margin fixed beforehand (``expected`` 0; the
margin is its ``sesoi``): ``p`` is its TOST p (tasks/design/stats.py: tost_paired) and it
holds when that is significant and every half's estimate lies inside the margin; it is contradicted
when the 95 % interval of the difference (``ci95``) lies wholly outside the margin, on one side,
with every half on that side (a difference too small to matter is what the claim allows).

A claim is **negligible** (version 3; Lakens 2017) when the data rule out an effect as large as its
SESOI either way: two one-sided t-tests against ±SESOI, each significant (``tost_p`` < ALPHA, the 90 %
interval inside ±SESOI), and every half's estimate inside ±SESOI. For an equivalence claim that is
what it predicts, so it is negligible exactly when it holds. A finding every claim of which is
negligible is NEGLIGIBLE: an informative result (the effect the source predicts is absent at this
scale, or too small to act on), not a failure to decide. A direction claim with SESOI 0 cannot be
negligible.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from tasks.design.stats import ALPHA, POWER

REPRODUCED, CONTRADICTED, NOT_TESTED, INCONCLUSIVE = "reproduced", "contradicted", "not tested", "inconclusive"
NEGLIGIBLE = "negligible"
DIRECTION, EQUIVALENCE = "direction", "equivalence"
POWERED_RATIO = 0.5
"""A claim is adequately powered when its MDE (80 % power, the test used) is at most this share of
its SESOI: then a true effect of 1.5 x SESOI clears the SESOI with about 80 % probability."""


def significant(p: float | None) -> bool:
    """p < ALPHA, strictly; an untested comparison (p None) is not significant."""
    return p is not None and p < ALPHA


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


@dataclasses.dataclass
class Claim:
    """One comparison a finding rests on, pooled over every seed, with its registered smallest
    effect of interest and each half's estimate; ``mde`` rides along for the report."""

    what: str
    estimate: float | None
    p: float | None
    expected: int = 1
    kind: str = DIRECTION
    sesoi: float = 0.0
    ci95: list[float] | None = None
    halves: dict[str, float | None] = dataclasses.field(default_factory=dict)
    mde: float | None = None
    unit: str = ""
    tost_p: float | None = None
    """A direction claim's TOST p against ±SESOI (an equivalence claim's is ``p``)."""
    power: float | None = None
    """An equivalence claim's TOST power at no true difference, at its seeds and measured SD."""
    seeds_needed: int | None = None
    """An equivalence claim's seeds for 80 % TOST power at the measured SD (None: beyond the search)."""
    sequential: dict[str, Any] | None = None
    """Version 3's group-sequential outcome (tasks/report/sequential.py: Outcome, as a dict) of a
    claim whose family trained in rounds: when set it decides the claim in place of the fixed rule
    below (the boundaries keep its error rates), and the halves are shown, not required."""

    def __post_init__(self) -> None:
        allowed = {DIRECTION: (1, -1), EQUIVALENCE: (0,)}
        if self.expected not in allowed.get(self.kind, ()):
            raise ValueError(f"{self.what}: a {self.kind!r} claim cannot expect {self.expected}")
        if not (self.sesoi >= 0 and math.isfinite(self.sesoi)) or (self.kind == EQUIVALENCE and self.sesoi == 0):
            raise ValueError(f"{self.what}: smallest effect of interest {self.sesoi!r} (an equivalence margin is > 0)")

    @property
    def powered(self) -> bool | None:
        """An equivalence claim: its TOST power at least POWER. A direction claim: MDE at most
        POWERED_RATIO x SESOI (None: no MDE, or no SESOI to compare it with)."""
        if self.kind == EQUIVALENCE:
            return None if self.power is None else self.power >= POWER
        if self.mde is None or self.sesoi == 0:
            return None
        return self.mde <= POWERED_RATIO * self.sesoi

    def _halves_point(self, sign: int) -> bool:
        return all(h is not None and _sign(h) == sign for h in self.halves.values())

    def _clears(self, sign: int) -> bool:
        """The 95 % interval lies wholly beyond ``sign`` x SESOI (strictly)."""
        if self.ci95 is None:
            return False
        near = min(self.ci95) if sign > 0 else max(self.ci95)
        return sign * near > self.sesoi

    def _ended(self, *outcomes: str) -> bool:
        return self.sequential is not None and self.sequential["outcome"] in outcomes

    @property
    def holds(self) -> bool:
        if self.sequential is not None:
            return self._ended(NEGLIGIBLE if self.kind == EQUIVALENCE else REPRODUCED)
        if self.kind == EQUIVALENCE:
            inside = all(h is not None and abs(h) < self.sesoi for h in self.halves.values())
            return significant(self.p) and inside
        return (
            self.estimate is not None
            and _sign(self.estimate) == self.expected
            and significant(self.p)
            and self._clears(self.expected)
            and self._halves_point(self.expected)
        )

    @property
    def negligible(self) -> bool:
        if self.sequential is not None:
            return self._ended(NEGLIGIBLE)
        if self.kind == EQUIVALENCE:
            return self.holds
        inside = all(h is not None and abs(h) < self.sesoi for h in self.halves.values())
        return self.sesoi > 0 and significant(self.tost_p) and inside

    @property
    def contradicted(self) -> bool:
        if self.sequential is not None:  # an equivalence claim is walked as expecting +1: beyond either side
            return self._ended(CONTRADICTED, *((REPRODUCED,) if self.kind == EQUIVALENCE else ()))
        if self.kind == EQUIVALENCE:
            return any(self._clears(s) and self._halves_point(s) for s in (1, -1))
        return (
            self.estimate is not None
            and _sign(self.estimate) == -self.expected
            and significant(self.p)
            and self._clears(-self.expected)
            and self._halves_point(-self.expected)
        )


def verdict(claims: Sequence[Claim], precondition_failed: str | None = None) -> str:
    """The finding's verdict from its claims, by the rule in this module's docstring."""
    if precondition_failed:
        return NOT_TESTED
    if any(c.contradicted for c in claims):
        return CONTRADICTED
    if claims and all(c.holds for c in claims):
        return REPRODUCED
    if claims and all(c.negligible for c in claims):
        return NEGLIGIBLE
    return INCONCLUSIVE
