"""Loss curves as the recovery scores read them: numpy only, so the report and the figures that
use it load no torch. One smoothing for the spike study's branches and the ablation arms alike."""

from __future__ import annotations

import numpy as np


def trailing_mean(values: np.ndarray, n: int) -> np.ndarray:
    """Mean of the last ``n`` values at each index (fewer at the start)."""
    sums = np.cumsum(np.insert(values, 0, 0.0))
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(0, idx - n)
    means: np.ndarray = (sums[idx] - sums[lo]) / (idx - lo)
    return means
