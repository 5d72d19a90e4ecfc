"""The sensitivity stage's section of the study config: the registered data perturbation under which
each finding's estimate is measured again (issue #46, item 7).

The perturbation drops ``drop_share`` of the training split's documents, drawn with ``seed``
(tasks/data/perturb.py); the validation split is left as it is, so the losses stay comparable. The
stage trains the built-in families' arms at the discovery seeds (``ablation.seeds``) on that copy
and sets each claim's estimate beside the one on the full data at the same seeds
(tasks/sensitivity/compare.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from model.typed_config import ConfigError, Section, non_negative


@dataclass(frozen=True)
class SensitivityConfig(Section):
    drop_share: float = 0.1
    """Share of the training split's documents the perturbed copy leaves out, in [0, 1): the number
    dropped is this share of the documents, rounded. 0 keeps every document (the same token stream,
    though the arms' keys still differ from the full data's)."""
    seed: int = 7
    """Seed of the draw of the dropped documents (a keyed hash of each document's place in the
    split, the lowest ``drop_share`` of them dropped); registered, not a training seed."""
    workers: int = 0
    """Perturbed arms trained at once (0: one per available core), as ``ablation.workers``. The
    results do not depend on it, so it is not a DVC param."""

    def check(self) -> None:
        if not 0 <= self.drop_share < 1:
            raise ConfigError(f"sensitivity.drop_share: must be in [0, 1), got {self.drop_share!r}")
        non_negative("sensitivity.seed", self.seed)
        non_negative("sensitivity.workers", self.workers)
