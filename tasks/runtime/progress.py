"""How a fan-out stage says how far it is: a line with the work to do (and what an earlier run
left stored), one log line per finished unit (done/total, the outcomes so far, elapsed time and an
ETA), a bar on a terminal, and a Prefect progress artifact
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
    """Counts finished units of one stage. Made, it logs the work to do: ``total`` units to run now
    (``kept`` more were stored by an earlier run and are not rerun), ``what`` they are, ``workers``
    at a time. Then a line per finished unit, with an ETA.

    The ETA (issue #57: it began 3-25x too high) is the finished units' own durations (``seconds``,
    measured where each ran), per unit of ``total_cost`` (e.g. training FLOPs, so the narrow
    trials left after the widest do not inherit its time) or per unit, times the work left,
    divided by the units that run at once. Not the wall time since the stage began: that holds
    the start-up (a Dask cluster, its workers' imports) and counts parallel units' time once, so
    after the first unit it overstated the rest by the start-up share times the workers."""

    def __init__(
        self,
        stage: str,
        unit: str,
        total: int,
        logger: Any,
        plural: str | None = None,
        total_cost: float = 0.0,
        workers: int = 1,
        kept: int = 0,
        what: str = "",
    ) -> None:
        self.stage, self.unit, self.total, self.logger = stage, unit, total, logger
        self.units = plural or f"{unit}s"
        self.total_cost, self.done_cost, self.workers = total_cost, 0.0, max(1, workers)
        self.done, self.seconds, self.started = 0, 0.0, time.perf_counter()
        self.last_finish = self.started
        self.outcomes: Counter[str] = Counter()
        logger.info(self.work(kept, what))
        self.bar = _bar(total, unit) if sys.stderr.isatty() else None
        self.artifact = _artifact(stage, self.line()) if total and _in_flow_run() else None

    def work(self, kept: int, what: str) -> str:
        """``search: 2 of 24 trials kept from the last run; 22 to run (...), 2 at a time``."""
        to_run = f"{self.total} to run" if kept else f"{self.total} {self.units} to run"
        head = f"{kept} of {kept + self.total} {self.units} kept from the last run; " if kept else ""
        detail = f" ({what})" if what else ""
        pace = f", {min(self.workers, self.total)} at a time" if self.total else ""
        return f"{self.stage}: {head}{to_run}{detail}{pace}"

    def eta(self) -> float | None:
        if not self.done:
            return None
        left = self.total - self.done
        if self.total_cost > 0 and self.done_cost > 0:
            work = self.seconds / self.done_cost * max(0.0, self.total_cost - self.done_cost)
        else:
            work = self.seconds / self.done * left
        return work / max(1, min(self.workers, left))

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

    def finished(self, name: str, outcome: str, cost: float = 0.0, seconds: float | None = None) -> None:
        """One unit ended with ``outcome`` (completed, diverged, failed, ...), its ``cost`` in the
        unit of ``total_cost``, its own duration ``seconds`` where it ran (None: the time since the
        unit before it ended, which is its duration when units run one after another here)."""
        now = time.perf_counter()
        self.done += 1
        self.done_cost += cost
        self.seconds += now - self.last_finish if seconds is None else seconds
        self.last_finish = now
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
