"""The one rule that turns a finding's claims into its verdict (version 3's, with the per-claim
gates, Holm's adjustment and the divergence rate of issue 58, written after version 3's results were
read):

  not tested    a precondition of the finding failed (named by the caller), or every claim's own
                gate failed (``Claim.not_tested``)
  contradicted  a tested claim is shown the other way, by at least its smallest effect of interest
  reproduced    there is at least one tested claim, and every tested claim holds
  negligible    there is at least one tested claim, and every tested claim is shown smaller than
                its smallest effect of interest (version 3)
  inconclusive  anything else: the right direction without significance, an effect significant but
                smaller than the claim's smallest effect of interest, halves that disagree, no
                claims, a claim with no test (p None)

Each claim is judged on its own: a claim whose gate failed is NOT TESTED alone and its siblings
are read without it (version 3 let one claim's failed gate take the whole finding down).

Significance is read on Holm's adjusted p (``p_adjusted``, tasks/design/stats.py: holm) over the
finding's tested claims, set by :func:`adjust`: a claim holds or is contradicted at a family-wise
level α, so a report that lists claims one by one lists none by a chance that grows with their
number. A claim walked in rounds is decided at Holm's share of α instead (tasks/report/declared.py:
holm_walks); its adjusted p is shown beside its raw one.

A family whose seeds came in rounds (version 3) has each claim decided by its group-sequential
outcome instead (``Claim.sequential``; tasks/report/sequential.py): reproduced / contradicted /
negligible where a look's boundary was crossed, inconclusive where none was.

The order is the rule. A failed precondition comes first: the comparison the claim needs was not
made as intended (e.g. the control broke too), so its numbers neither support nor contradict it.
A contradiction then outranks the claims that hold: one result shown against the finding is
evidence against it whatever the others say.

Significant means p < ALPHA, strictly: p equal to ALPHA is not significant (the adjusted p where
there is one).

A claim whose compared variant diverged in more than half of its seeds (``kind`` RATE) is read as a
difference in divergence rate, never as a difference of the capped loss (the cap at ln V minus a
trained loss is no effect size): its estimate is the risk difference, its p the exact McNemar test
paired by seed (tasks/design/stats.py: divergence_rates). It holds when that p is significant with
the predicted sign, and is contradicted when it is significant the other way (an equivalence claim:
either way); it is never negligible.

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

from tasks.design.stats import ALPHA, POWER, holm

REPRODUCED, CONTRADICTED, NOT_TESTED, INCONCLUSIVE = "reproduced", "contradicted", "not tested", "inconclusive"
NEGLIGIBLE = "negligible"
DIRECTION, EQUIVALENCE, RATE = "direction", "equivalence", "divergence rate"
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
    p_adjusted: float | None = None
    """Holm's adjusted p over the finding's tested claims (:func:`adjust`); None before adjustment or
    where the claim has no test."""
    not_tested: str | None = None
    """Why this claim alone is not tested (its gate failed, a compared variant on the plateau); None when it is."""
    fragile: str | None = None
    """Why a claim that holds on the full data did not hold under the registered data perturbation
    (tasks/report/findings.py: mark_fragile); None when it replicated or was not perturbed."""

    def __post_init__(self) -> None:
        allowed = {DIRECTION: (1, -1), EQUIVALENCE: (0,), RATE: (1, -1, 0)}
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

    @property
    def decision_p(self) -> float | None:
        """The p significance is read on: Holm's adjusted p once the finding adjusted it, else the raw one."""
        return self.p if self.p_adjusted is None else self.p_adjusted

    def _rate_shown(self, sign: int) -> bool:
        """A divergence-rate claim: the exact test significant and the risk difference of that sign."""
        return self.estimate is not None and _sign(self.estimate) == sign and significant(self.decision_p)

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
        if self.kind == RATE:
            return self.expected != 0 and self._rate_shown(self.expected)
        if self.sequential is not None:
            return self._ended(NEGLIGIBLE if self.kind == EQUIVALENCE else REPRODUCED)
        if self.kind == EQUIVALENCE:
            inside = all(h is not None and abs(h) < self.sesoi for h in self.halves.values())
            return significant(self.decision_p) and inside
        return (
            self.estimate is not None
            and _sign(self.estimate) == self.expected
            and significant(self.decision_p)
            and self._clears(self.expected)
            and self._halves_point(self.expected)
        )

    @property
    def negligible(self) -> bool:
        if self.kind == RATE:
            return False
        if self.sequential is not None:
            return self._ended(NEGLIGIBLE)
        if self.kind == EQUIVALENCE:
            return self.holds
        inside = all(h is not None and abs(h) < self.sesoi for h in self.halves.values())
        return self.sesoi > 0 and significant(self.tost_p) and inside

    @property
    def contradicted(self) -> bool:
        if self.kind == RATE:
            return any(self._rate_shown(s) for s in ((1, -1) if self.expected == 0 else (-self.expected,)))
        if self.sequential is not None:  # an equivalence claim is walked as expecting +1: beyond either side
            return self._ended(CONTRADICTED, *((REPRODUCED,) if self.kind == EQUIVALENCE else ()))
        if self.kind == EQUIVALENCE:
            return any(self._clears(s) and self._halves_point(s) for s in (1, -1))
        return (
            self.estimate is not None
            and _sign(self.estimate) == -self.expected
            and significant(self.decision_p)
            and self._clears(-self.expected)
            and self._halves_point(-self.expected)
        )


def tested(claims: Sequence[Claim]) -> list[Claim]:
    """The claims whose own gates were met."""
    return [c for c in claims if c.not_tested is None]


def adjust(claims: Sequence[Claim]) -> None:
    """Set each tested claim's Holm-adjusted p over the finding's tested claims that have a test;
    an untested claim (its gate failed, or no test could run) is no hypothesis tested, so it takes
    no share of α."""
    with_p = [c for c in tested(claims) if c.p is not None]
    for c, p in zip(with_p, holm([c.p for c in with_p if c.p is not None]), strict=True):
        c.p_adjusted = p


def verdict(claims: Sequence[Claim], precondition_failed: str | None = None) -> str:
    """The finding's verdict from its tested claims, by the rule in this module's docstring."""
    judged = tested(claims)
    if precondition_failed or (claims and not judged):
        return NOT_TESTED
    if any(c.contradicted for c in judged):
        return CONTRADICTED
    if judged and all(c.holds for c in judged):
        return REPRODUCED
    if judged and all(c.negligible for c in judged):
        return NEGLIGIBLE
    return INCONCLUSIVE
