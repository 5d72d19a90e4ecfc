"""Start-up of a stage process (``spikelab run``) or a worker: its heavy imports (prefect,
mlflow and what they pull in: pydantic models, pandas, fastapi; torch, optuna) create about a
million long-lived objects, and the cyclic garbage collector, triggered by allocation counts,
walks them again and again while they load, and once more when the process exits: about a
third of the CPU a data stage spends before its own work (benchmarks/bench_overhead.py).

:func:`imports_without_gc` loads them with the collector paused, then freezes what was loaded
(``gc.freeze``: a permanent generation that later collections, the one at exit included, skip;
reference counting still frees everything as usual). Garbage cycles made while importing are
kept, not collected: a few kilobytes.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def imports_without_gc() -> Iterator[None]:
    """Run the block (the heavy imports) without cyclic collections; freeze what it loaded."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
