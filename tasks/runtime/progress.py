"""How a fan-out stage says how far it is: one log line per finished unit (done/total, the
outcomes so far, elapsed time and an ETA), a bar on a terminal, and a Prefect progress artifact
whose description carries the same counts, on the flow run's page in the UI."""

from __future__ import annotations

import logging
import sys
import time
from collections import Counter
from typing import Any


def run_logger() -> logging.Logger | logging.LoggerAdapter:
    """The Prefect run's logger inside a flow or task run (its lines reach the UI), else this
    module's (a unit run from a test, a shell or a benchmark)."""
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(__name__)


def clock(seconds: float) -> str:
    """``1:02:03`` / ``2:03``: what a person reads at a glance."""
    m, s = divmod(round(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """Counts finished units of one stage. ``total`` counts the units to run now (stored ones are
    not). The ETA assumes the work left goes at the rate of the work done: with ``total_cost`` (the
    units' summed cost, e.g. their training FLOPs, each finished unit passing its own), by cost, so
    a stage that runs its widest trials first does not promise hours for the narrow ones left;
    without, by the units' mean duration."""

    def __init__(
        self, stage: str, unit: str, total: int, logger: Any, plural: str | None = None, total_cost: float = 0.0
    ) -> None:
        self.stage, self.unit, self.total, self.logger = stage, unit, total, logger
        self.units = plural or f"{unit}s"
        self.total_cost, self.done_cost = total_cost, 0.0
        self.done, self.started = 0, time.perf_counter()
        self.outcomes: Counter[str] = Counter()
        self.bar = _bar(total, unit) if sys.stderr.isatty() else None
        self.artifact = _artifact(stage, self.line()) if total and _in_flow_run() else None

    def eta(self) -> float | None:
        if not self.done:
            return None
        elapsed = time.perf_counter() - self.started
        if self.total_cost > 0 and self.done_cost > 0:
            return elapsed / self.done_cost * max(0.0, self.total_cost - self.done_cost)
        return elapsed / self.done * (self.total - self.done)

    def line(self, name: str = "", outcome: str = "") -> str:
        counts = ", ".join(f"{n} {k}" for k, n in sorted(self.outcomes.items()))
        eta = self.eta()
        parts = [
            f"{self.stage}: {self.done}/{self.total} {self.units} done" + (f" ({counts})" if counts else ""),
            f"elapsed {clock(time.perf_counter() - self.started)}",
            f"ETA {clock(eta)}" if eta is not None else "ETA unknown",
        ]
        if name:
            parts.insert(0, f"{self.unit} {name}: {outcome}")
        return " · ".join(parts)

    def finished(self, name: str, outcome: str, cost: float = 0.0) -> None:
        """One unit ended with ``outcome`` (completed, diverged, failed, ...), its ``cost`` in the
        unit of ``total_cost``."""
        self.done += 1
        self.done_cost += cost
        self.outcomes[outcome] += 1
        line = self.line(name, outcome)
        self.logger.info(line)
        if self.bar is not None:
            self.bar.set_postfix_str(", ".join(f"{n} {k}" for k, n in sorted(self.outcomes.items())))
            self.bar.update(1)
        if self.artifact is not None:
            from prefect.artifacts import update_progress_artifact

            update_progress_artifact(self.artifact, 100.0 * self.done / self.total, description=line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _bar(total: int, unit: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, dynamic_ncols=True, file=sys.stderr)


def _in_flow_run() -> bool:
    from prefect.context import FlowRunContext

    return FlowRunContext.get() is not None


def _artifact(stage: str, description: str) -> Any:
    from prefect.artifacts import create_progress_artifact

    return create_progress_artifact(0.0, key=f"{stage}-progress", description=description)
