"""How a fan-out stage says how far it is: a line with the work to do (and what an earlier run
left stored) and the minutes it should take, one log line per finished unit (done/total, the
outcomes so far, elapsed time and an ETA), a bar on a terminal, and a Prefect progress artifact
whose description carries the same counts, on the flow run's page in the UI."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import platform
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from tasks.runtime.files import read_json, write_json


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


class Pace(NamedTuple):
    """What a unit takes: ``per_unit`` seconds whatever its size plus ``per_cost`` seconds per unit
    of its cost (a training FLOP). Small models are the first kind (Python, the optimizer, evals
    and logging per step: on the recorded search a trial of a third of the FLOPs took as long),
    large ones the second (the matmuls)."""

    per_unit: float
    per_cost: float

    def seconds(self, units: float, cost: float) -> float:
        return self.per_unit * units + self.per_cost * cost

    def words(self, unit: str) -> str:
        """``2.1 s a trial + 0.3 s per TFLOP``, either part left out when it is zero."""
        parts = [f"{self.per_unit:.3g} s a {unit}"] if self.per_unit else []
        return " + ".join([*parts, f"{self.per_cost * 1e12:.3g} s per TFLOP"] if self.per_cost else parts)


def fit_pace(units: Sequence[tuple[float, float]]) -> Pace:
    """The pace of ended ``units`` ((cost, seconds) each): least squares of seconds on a constant
    and the cost, neither part negative. Until two costs differ the parts cannot be told apart and
    the cost model (model/flops.py) takes it all, or the unit count where units carry no cost."""
    n = len(units)
    sc = sum(c for c, _ in units)
    ss = sum(s for _, s in units)
    scc = sum(c * c for c, _ in units)
    scs = sum(c * s for c, s in units)
    by_cost = Pace(0.0, ss / sc) if sc > 0 else Pace(ss / n, 0.0)
    if one_cost(units):
        return by_cost
    spread = n * scc - sc * sc
    per_cost = (n * scs - sc * ss) / spread
    per_unit = (ss - per_cost * sc) / n
    if per_cost < 0:  # the costlier units were not the slower ones: cost tells nothing yet
        return Pace(ss / n, 0.0)
    return by_cost if per_unit < 0 else Pace(per_unit, per_cost)


def one_cost(units: Sequence[tuple[float, float]]) -> bool:
    """Whether the ``units`` ((cost, seconds) each) all had one cost (floating-point noise aside)."""
    costs = [c for c, _ in units]
    return max(costs) - min(costs) <= 1e-9 * max(costs)


def work_left(ended: Sequence[tuple[float, float]], units: int, cost: float) -> float:
    """Seconds of work in ``units`` more units of ``cost`` in all at the pace of the ``ended`` ones
    (:func:`fit_pace`). While they all had one cost, how much of a unit's time is fixed and how
    much goes with its cost is unknown, and the truth lies between the two extremes: all fixed
    (their mean seconds a unit) and all with the cost (their seconds per cost). Their geometric
    mean is off by at most the square root of the extremes' ratio either way, the least any
    choice can promise (on a recorded search the FLOPs alone read 0.3-0.6x of the truth there)."""
    if cost <= 0 or not one_cost(ended):
        return fit_pace(ended).seconds(units, cost)
    per_unit = sum(s for _, s in ended) / len(ended)
    return math.sqrt(per_unit * units * fit_pace(ended).seconds(0, cost))


def pace_record(stage: str, config: Any) -> Path:
    """Where a stage keeps the pace its last run with this ``config`` (a dataclass) measured on this
    machine: keyed by the config's digest, as a smoke run's pace says nothing of the default
    size's; in the state directory, the machine's, never the checkout's tracked files."""
    from model.private import state_dir

    text = json.dumps(dataclasses.asdict(config), sort_keys=True, default=str)
    return state_dir() / "pace" / f"{stage}-{hashlib.sha256(text.encode()).hexdigest()[:12]}.json"


def this_machine() -> str:
    """What a recorded pace is valid for: this host and its cores (another machine's is not used)."""
    return f"{platform.node()} ({os.cpu_count()} cores, {platform.machine()})"


def recorded_pace(record: Path | None) -> Pace | None:
    """The pace ``record`` holds, when it was measured on this machine; else None."""
    if record is None or not record.is_file():
        return None
    try:
        data = read_json(record)
        if data.get("machine") != this_machine():
            return None
        return Pace(float(data["per_unit"]), float(data["per_cost"]))
    except (ValueError, KeyError, TypeError, AttributeError):  # not a record of ours: no minutes, no crash
        return None


def minutes(seconds: float) -> str:
    return "under a minute" if seconds < 60 else f"about {round(seconds / 60):,} min"


class Progress:
    """Counts finished units of one stage. Made, it logs the work to do: ``total`` units to run now
    (``kept`` more were stored by an earlier run and are not rerun), ``what`` they are, ``workers``
    at a time. Then a line per finished unit, with an ETA.

    The ETA (issue #57: it began 3-25x too high) is the :class:`Pace` fitted to the finished
    units' own durations (``seconds``, measured where each ran) and costs (e.g. training FLOPs,
    so the narrow trials left after the widest do not inherit its time, nor take a third of it
    where a step's fixed work dominates), applied to the units and cost left, divided by the
    units that run at once. Not the wall time since the stage began: that holds the start-up (a
    Dask cluster, its workers' imports) and counts parallel units' time once, so after the first
    unit it overstated the rest by the start-up share times the workers.

    The first line's minutes come from the pace this stage measured on this machine in its last
    run (``record``, rewritten as each unit ends, so a stopped run leaves one); with none, the line
    says they come after the first unit rather than guess a FLOP rate."""

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
        record: Path | None = None,
    ) -> None:
        self.stage, self.unit, self.total, self.logger = stage, unit, total, logger
        self.units = plural or f"{unit}s"
        self.total_cost, self.done_cost, self.workers = total_cost, 0.0, max(1, workers)
        self.done, self.started = 0, time.perf_counter()
        self.ended: list[tuple[float, float]] = []  # (cost, seconds) of each finished unit
        self.last_finish, self.record = self.started, record
        self.outcomes: Counter[str] = Counter()
        logger.info(self.work(kept, what))
        self.bar = _bar(total, unit) if sys.stderr.isatty() else None
        self.artifact = _artifact(stage, self.line()) if total and _in_flow_run() else None

    def work(self, kept: int, what: str) -> str:
        """``search: 2 of 24 trials kept from the last run; 22 to run (...; about 9 min at ...), 2
        at a time``."""
        to_run = f"{self.total} to run" if kept else f"{self.total} {self.units} to run"
        head = f"{kept} of {kept + self.total} {self.units} kept from the last run; " if kept else ""
        detail = "; ".join([what, self.duration()] if what else [self.duration()]) if self.total else what
        at_once = f", {min(self.workers, self.total)} at a time" if self.total else ""
        return f"{self.stage}: {head}{to_run}" + (f" ({detail})" if detail else "") + at_once

    def duration(self) -> str:
        """The minutes the work should take, at the pace of this stage's last run here, or why
        they come later."""
        pace = recorded_pace(self.record)
        if pace is None:
            why = f": no earlier {self.stage} run of this config on this machine to time it by" if self.record else ""
            return f"minutes after the first {self.unit}{why}"
        took = pace.seconds(self.total, self.total_cost) / min(self.workers, self.total)
        return f"{minutes(took)} at this machine's last {self.stage} pace, {pace.words(self.unit)}"

    def eta(self) -> float | None:
        if not self.done:
            return None
        left = self.total - self.done
        work = work_left(self.ended, left, max(0.0, self.total_cost - self.done_cost))
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
        self.ended.append((cost, now - self.last_finish if seconds is None else seconds))
        self.last_finish = now
        self.outcomes[outcome] += 1
        line = self.line(name, outcome)
        self.logger.info(line)
        if self.record is not None:
            write_json(self.record, {**fit_pace(self.ended)._asdict(), "machine": this_machine()})
        if self.bar is not None:
            self.bar.set_postfix_str(", ".join(f"{n} {k}" for k, n in sorted(self.outcomes.items())))
            self.bar.update(1)
        if self.artifact is not None:
            from prefect.artifacts import update_progress_artifact

            update_progress_artifact(self.artifact, 100.0 * self.done / self.total, description=line)

    def failed(self, name: str, error: BaseException) -> None:
        """A ``name`` (e.g. a search's group) crashed outside any unit: one line, its error's first
        line, the counts as they stand (no unit is counted)."""
        message = (str(error).strip().splitlines() or [""])[0]
        self.logger.error(f"{name}: failed ({type(error).__name__}: {message}) · {self.line()}")

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
