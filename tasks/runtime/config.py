"""The ``tracking`` section of the study config: where every stage records its runs."""

from __future__ import annotations

from dataclasses import dataclass

from model.typed_config import Section


@dataclass(frozen=True)
class TrackingConfig(Section):
    experiment: str = "spikelab"
    """MLflow experiment (one per study)."""
    async_logging: bool = True
    """Log metrics to MLflow from a background thread so the training loop never waits on it."""
