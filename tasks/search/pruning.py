"""Pruned search (issue #47): the unpruned LR search's trials replayed through a real Optuna pruner,
to measure what pruning would save and whether it moves the fitted optima and the μ-transfer slopes.
This replay is the evidence the rule was chosen on; the search now prunes live by the same rule
and settings (tasks/search/groups.py, ``search.prune_*``), in the same order within each group.

What is replayed. Each sweep trial's validation losses, as :class:`tasks.search.trial.ReportToOptuna`
reported them (``trial.report(val_loss, step)`` every ``search.eval_every`` steps), and its final
value and status. They live in the search's Optuna storage (``trial.intermediate_values``,
:func:`records_from_storage`), which is state, not a committed output: ``metrics/search.json``
keeps only the per-seed fitted optima. :func:`record_search` retrains the same grid with the
search's own objective (same config, same queue order, the search's ThresholdPruner) into a JSON
lines file, for when the storage is gone (with ``search.prune_median: false``: a search that
prunes live keeps no curve past the step it stopped a trial at).

The replay (:func:`replay`). One group per (parametrization, width, seed), in the order the queue
runs it (tasks/search/queue.py: the study's points are queued LR-major with the seeds inner, so a
group meets its LRs in ascending order, each after the group's previous one has finished as long
as no more workers than seeds run a study). Each group gets its own in-memory study
(``optuna.create_study(storage=None)``) with :func:`make_pruner`; each trial is ``study.ask()``-ed,
its recorded losses ``trial.report``-ed step by step with ``trial.should_prune()`` after each, and
``study.tell``-ed PRUNED at the first step the pruner says so, else with its recorded final value
(ln V for a diverged run, as tasks/search/trial.py tells it). The pruner sees only the trials of
its group told before it. A trial stopped at step s has trained s steps: the replay saves the steps
it ran past s (``steps`` recorded, fewer than ``search.steps`` for a diverged run).

The fits (tasks/search/fit.py, the search's own code). A trial the replay pruned becomes a
``pruned`` point, which :func:`tasks.search.fit.optima_per_seed` leaves out like every point that did
not complete: the optima come from the trials that ran to the end only, and the slopes
(:func:`tasks.search.fit.slope`) from those optima. Each group's optimum is compared with the
unpruned one in grid steps (the log2-LR spacing of ``search.lr_points``).

Why the median rule (:class:`optuna.pruners.MedianPruner`, a PercentilePruner at 50) and not
successive halving or Hyperband. A group is 7 grid LRs, and its fitted optimum is the vertex of
the parabola through the best grid point and its two neighbours: pruning is safe only if it
spares the best three. Successive halving promotes at each rung only the top 1/η of the trials
that reached it, and of the first η - 1 only one that is the best so far: with 7 trials and
Optuna's η = 4 that is "the best so far or stop" at every rung, which stops the optimum's upper neighbour (it trails the
optimum, by definition, once the curves have sorted themselves) and so removes a point the parabola
needs. Hyperband runs several such brackets, each seeing a hash-chosen part of 7 trials. The
median rule stops a trial only when even its best loss so far is worse than the median of the
group's finished trials at the same step, however close: the best grid point survives whenever
it beats half the LRs before it, and a trial the rule stops is worse than most of what already ran.
Its limits: the median is of the trials that ran before, not of the group, so in queue order
(ascending LR) the optimum's upper neighbour is compared with the smaller LRs alone and is
stopped when it trails the middle one of them; then the best grid point is the last complete
LR, which fit.py takes as a bound (``censored``, version 4): the stopped neighbour was losing at
its step, not at the end. And
the rule compares with the trials that finished first, so in a parallel search what it stops
would depend on the finish order: the live search runs each group's trials in this order, each
after the ones before it (tasks/search/groups.py), so it stops what the replay stops. Here the
order is the queue's. (The live rule does not judge a trial's last report, its final value: a
replay that stops a trial there saves nothing; the measurement below had none.)

How ``censored`` reads now (version 4, issue 59): :func:`tasks.search.fit.optima_per_seed` judges
it against every LR of the group, stopped ones included: an optimum at the grid's end or next to a
stopped LR is a bound (version 3 read the second kind as inside the grid; the measurement's
"11 of 24 at the edge" was by the rule before that, against the complete points).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from tasks.config import Config
from tasks.search.fit import Optimum, Point, optima_per_seed, slope, width_summary
from tasks.search.groups import grid_point
from tasks.search.spec import StudySpec, lr_grid, search_digest, sweep_specs

# --------------------------------------------------------------------------------------------
# The pruner's settings: fixed before any replay was run; not tuned on its outcome.
# --------------------------------------------------------------------------------------------

PERCENTILE = 50.0
"""The median: a trial is stopped when its best loss so far is worse than the median of its group's
finished trials at the same step. A higher percentile stops less, a lower one more; the median is
the rule Optuna names (MedianPruner) and the one the module docstring argues for."""

N_STARTUP_TRIALS = 3
"""A group's first three trials always finish: the parabola needs three complete points, and from
the fourth trial on the median is of at least three curves (of two it would be their mean, of one
the single earlier curve). In queue order these are the group's three smallest LRs."""

N_WARMUP_STEPS = 0
"""Pruning may act at the first report (step ``search.eval_every``, past the LR warm-up of
``schedule.warmup_steps`` <= 20 steps): in queue order a trial is compared with smaller LRs only,
which learn more slowly, so a trial behind them at its first report is not slow but unstable.
(The replay found a counterexample, SP w32 seed 0's best LR, slow over its first 100 steps:
docs/search-reference.md. Left at 0: the settings are not tuned on the outcome.)"""

INTERVAL_STEPS = 1
"""Every report is a pruning check (reports come every ``search.eval_every`` steps already)."""


def make_pruner() -> optuna.pruners.BasePruner:
    """The replay's pruner: Optuna's MedianPruner at the settings above."""
    return optuna.pruners.MedianPruner(
        n_startup_trials=N_STARTUP_TRIALS, n_warmup_steps=N_WARMUP_STEPS, interval_steps=INTERVAL_STEPS
    )


# --------------------------------------------------------------------------------------------
# Records: one finished trial of the unpruned search
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TrialRecord:
    """One sweep trial as the unpruned search finished it. ``curve``: (step, validation loss) as
    reported to Optuna, in step order (a loss may be non-finite); ``value``: what the search told
    Optuna (ln V for a diverged run; None when the search's own pruner stopped it); ``status``:
    completed | diverged | pruned; ``steps``: steps trained; ``order``: its place in the queue."""

    parametrization: str
    width: int
    seed: int
    log2_lr: float
    curve: tuple[tuple[int, float], ...]
    value: float | None
    status: str
    steps: int
    flops: float = 0.0
    order: int = 0

    @property
    def group(self) -> tuple[str, int, int]:
        return self.parametrization, self.width, self.seed

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "curve": [[s, v] for s, v in self.curve]}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> TrialRecord:
        curve = tuple((int(s), float(v)) for s, v in raw["curve"])
        return cls(**{**raw, "curve": curve})


def write_records(path: Path, records: Iterable[TrialRecord]) -> None:
    """JSON lines, one record a line (non-finite losses as NaN/Infinity, which json reads back)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r.to_json()) + "\n")


def read_records(path: Path) -> list[TrialRecord]:
    """The records of a JSON lines file, in queue order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return sorted((TrialRecord.from_json(json.loads(line)) for line in lines if line.strip()), key=lambda r: r.order)


def queue_order(cfg: Config, digest: str) -> list[tuple[StudySpec, float, int]]:
    """Every sweep point (study, log2 LR, seed) in the order the queue hands them out: the studies
    widest first (tasks/search/spec.py: sweep_specs), each study's points as queued."""
    return [(spec, lr, seed) for spec in sweep_specs(cfg, digest) for lr, seed in spec.points]


def records_from_storage(cfg: Config, project: Path, storage: optuna.storages.BaseStorage) -> list[TrialRecord]:
    """The finished sweep trials of the search's studies (the config's and data's digest) in
    ``storage``, in queue order (a study's trial numbers are its queue order)."""
    from tasks.search.study import data_hashes

    records: list[TrialRecord] = []
    for spec in sweep_specs(cfg, search_digest(cfg, data_hashes(project))):
        study = optuna.load_study(study_name=spec.name, storage=storage)
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
            records.append(
                TrialRecord(
                    spec.parametrization,
                    spec.width,
                    grid_point(t)[1],
                    grid_point(t)[0],
                    tuple(sorted(t.intermediate_values.items())),
                    t.value if t.state == TrialState.COMPLETE else None,  # Optuna gives a pruned one its last report
                    "pruned" if t.state == TrialState.PRUNED else str(t.user_attrs.get("status", "completed")),
                    int(t.user_attrs.get("steps", cfg.search.steps)),
                    float(t.user_attrs.get("flops", 0.0)),
                    len(records),
                )
            )
    return records


def _train_point(cfg: Config, project: Path, spec: StudySpec, log2_lr: float, seed: int, order: int) -> TrialRecord:
    """In a worker process: the search's objective at one point, in an in-memory study with the
    unpruned search's own pruner (queue.py: threshold_pruner), as tasks/search/trial.py: run_trial
    tells it."""
    from tasks.runtime.workers import clean_state
    from tasks.search.queue import threshold_pruner
    from tasks.search.trial import objective, worker_tokens

    clean_state()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=None, direction="minimize", pruner=threshold_pruner(cfg))
    study.set_user_attr("log2_lr_range", list(spec.log2_lr_range))
    study.enqueue_trial({"log2_lr": log2_lr}, user_attrs={"seed": seed})
    trial = study.ask()
    try:
        study.tell(trial, objective(trial, cfg, spec.parametrization, spec.width, worker_tokens(project)))
    except optuna.TrialPruned:
        study.tell(trial, state=TrialState.PRUNED)
    done = study.trials[-1]
    return TrialRecord(
        spec.parametrization,
        spec.width,
        seed,
        log2_lr,
        tuple(sorted(done.intermediate_values.items())),
        done.value if done.state == TrialState.COMPLETE else None,
        "pruned" if done.state == TrialState.PRUNED else str(done.user_attrs["status"]),
        int(done.user_attrs["steps"]),
        float(done.user_attrs["flops"]),
        order,
    )


def record_search(
    cfg: Config, project: Path, out: Path, workers: int = 1, log: Callable[[str], None] = print
) -> list[TrialRecord]:
    """Train every sweep point of the search (no MLflow, no Prefect, no storage) on ``workers``
    processes, appending each record to ``out`` as it finishes; points already in ``out`` are
    kept (a killed run resumes). Returns every record, in queue order."""
    import multiprocessing

    from tasks.search.study import data_hashes

    points = queue_order(cfg, search_digest(cfg, data_hashes(project)))
    done = {r.order: r for r in (read_records(out) if out.exists() else [])}
    todo = [(i, spec, lr, seed) for i, (spec, lr, seed) in enumerate(points) if i not in done]
    out.parent.mkdir(parents=True, exist_ok=True)
    with (
        ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool,
        out.open("a", encoding="utf-8") as f,
    ):
        futures = [pool.submit(_train_point, cfg, project, spec, lr, seed, i) for i, spec, lr, seed in todo]
        for n, future in enumerate(as_completed(futures), 1):
            r = future.result()
            done[r.order] = r
            f.write(json.dumps(r.to_json()) + "\n")
            f.flush()
            log(
                f"{len(done)}/{len(points)} {r.parametrization} w{r.width} lr 2^{r.log2_lr:g} seed {r.seed}: "
                f"{r.status} {r.value} ({n}/{len(todo)} this run)"
            )
    return [done[i] for i in sorted(done)]


# --------------------------------------------------------------------------------------------
# The replay
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Replayed:
    """One trial in the replay: stopped by the pruner (at ``pruned_at``) or run to its end, and the
    steps pruning saved (those it trained past ``pruned_at``)."""

    record: TrialRecord
    pruned_at: int | None
    steps_saved: int

    @property
    def pruned(self) -> bool:
        return self.pruned_at is not None

    def point(self) -> Point:
        """The trial as a fit point: a pruned trial has no final loss and leaves the fits."""
        r = self.record
        if self.pruned:
            return Point(r.log2_lr, r.seed, None, "pruned", r.flops * self.trained_share)
        return Point(r.log2_lr, r.seed, r.value, r.status, r.flops)

    @property
    def trained_share(self) -> float:
        """The share of its recorded steps the trial trains in the replay."""
        return 1.0 - self.steps_saved / self.record.steps if self.record.steps else 1.0


def groups(records: Iterable[TrialRecord]) -> dict[tuple[str, int, int], list[TrialRecord]]:
    """Records by (parametrization, width, seed), each group in queue order."""
    out: dict[tuple[str, int, int], list[TrialRecord]] = {}
    for r in sorted(records, key=lambda r: r.order):
        out.setdefault(r.group, []).append(r)
    return out


def replay_group(
    records: Sequence[TrialRecord], pruner: Callable[[], optuna.pruners.BasePruner] = make_pruner
) -> list[Replayed]:
    """One group's trials, in the given order, through a fresh in-memory study with ``pruner()``."""
    study = optuna.create_study(storage=None, direction="minimize", pruner=pruner())
    lrs = [r.log2_lr for r in records]
    low, high = min(lrs), max(lrs)
    out = []
    for r in records:
        study.enqueue_trial({"log2_lr": r.log2_lr})
        trial = study.ask()
        trial.suggest_float("log2_lr", low, high)
        pruned_at = None
        for step, loss in r.curve:
            trial.report(loss, step)
            if trial.should_prune():
                pruned_at = step
                break
        if pruned_at is not None or r.status == "pruned" or r.value is None:
            study.tell(trial, state=TrialState.PRUNED)  # the search's own pruner: pruned there too
        else:
            study.tell(trial, r.value)
        out.append(Replayed(r, pruned_at, max(r.steps - pruned_at, 0) if pruned_at is not None else 0))
    return out


def replay(
    records: Iterable[TrialRecord], pruner: Callable[[], optuna.pruners.BasePruner] = make_pruner
) -> list[Replayed]:
    """Every group replayed on its own; the trials back in queue order."""
    out = [t for group in groups(records).values() for t in replay_group(group, pruner)]
    return sorted(out, key=lambda t: t.record.order)


# --------------------------------------------------------------------------------------------
# Optima and slopes: pruned vs unpruned
# --------------------------------------------------------------------------------------------


def grid_step(cfg: Config) -> float:
    """The log2-LR spacing of the search's grid."""
    grid = lr_grid(cfg)
    return (grid[-1] - grid[0]) / (len(grid) - 1)


EQUAL_TOL = 1e-9
"""Two optima closer than this (log2 LR) are equal: the same points, the same fit."""


CLOSENESS = ("equal", "within", "further", "lost")


def closeness(difference: float | None, step: float) -> str:
    """equal | within one grid step | further (or ``lost`` when no trial of a group completed)."""
    if difference is None:
        return "lost"
    if abs(difference) <= EQUAL_TOL:
        return "equal"
    return "within" if abs(difference) <= step + EQUAL_TOL else "further"


@dataclasses.dataclass(frozen=True)
class GroupOptima:
    """One (parametrization, width, seed)'s fitted optimum from every trial (the unpruned search)
    and from the trials the replay ran to the end, and how far apart they are."""

    parametrization: str
    width: int
    seed: int
    unpruned: Optimum | None
    complete_only: Optimum | None
    pruned: int  # trials of the group the replay stopped
    grid_step: float

    @property
    def difference(self) -> float | None:
        """Complete-only minus unpruned optimum, log2 LR."""
        if self.unpruned is None or self.complete_only is None:
            return None
        return self.complete_only.log2_lr - self.unpruned.log2_lr

    @property
    def closeness(self) -> str:
        return closeness(self.difference, self.grid_step)

    def to_json(self) -> dict[str, Any]:
        d = self.difference
        return {
            "parametrization": self.parametrization,
            "width": self.width,
            "seed": self.seed,
            "unpruned": optimum_json(self.unpruned),
            "complete_only": optimum_json(self.complete_only),
            "difference_log2": d,
            "difference_grid_steps": d / self.grid_step if d is not None else None,
            "closeness": self.closeness,
            "pruned": self.pruned,
        }


def optimum_json(o: Optimum | None) -> dict[str, Any] | None:
    return None if o is None else dataclasses.asdict(o)


Groups = dict[tuple[str, int, int], list[Point]]


def fit_points(replayed: Sequence[Replayed]) -> tuple[Groups, Groups]:
    """Per group, its points as the unpruned search has them and as the replay leaves them (a
    stopped trial a ``pruned`` point, which the fits leave out)."""
    unpruned: Groups = {}
    complete: Groups = {}
    for t in replayed:
        r = t.record
        unpruned.setdefault(r.group, []).append(Point(r.log2_lr, r.seed, r.value, r.status, r.flops))
        complete.setdefault(r.group, []).append(t.point())
    return unpruned, complete


def group_optima(cfg: Config, replayed: Sequence[Replayed]) -> list[GroupOptima]:
    """Every group's optimum both ways, by the search's own fit (tasks/search/fit.py: optima_per_seed)."""
    unpruned, complete = fit_points(replayed)
    pruned = {g: sum(t.pruned for t in replayed if t.record.group == g) for g in unpruned}
    return [
        GroupOptima(
            p,
            w,
            seed,
            optima_per_seed(unpruned[(p, w, seed)]).get(seed),
            optima_per_seed(complete[(p, w, seed)]).get(seed),
            pruned[(p, w, seed)],
            grid_step(cfg),
        )
        for p, w, seed in sorted(unpruned)
    ]


def slopes_of(points: Groups, parametrization: str) -> dict[str, Any]:
    """The search's slope of log2 η* on log2 width (tasks/search/fit.py: slope; its per-seed
    slopes are what the report's mu_transfer finding tests) over one parametrization's groups."""
    by_width: dict[int, list[Point]] = {}
    for (p, w, _), pts in points.items():
        if p == parametrization:
            by_width.setdefault(w, []).extend(pts)
    return slope({w: width_summary(pts) for w, pts in sorted(by_width.items())})


def compare(cfg: Config, replayed: Sequence[Replayed]) -> dict[str, Any]:
    """The replay's numbers: per trial whether and at which step it was stopped and the steps
    saved; per group the optimum from complete trials only against the unpruned one (in grid
    steps); per (parametrization, width) how many seeds' optima are equal / within one grid step /
    further; the slopes both ways; the steps (and FLOPs) saved as a share of the sweep's."""
    optima = group_optima(cfg, replayed)
    counts: dict[str, dict[str, dict[str, int]]] = {}
    for g in optima:
        by_width = counts.setdefault(g.parametrization, {})
        by_width.setdefault(str(g.width), dict.fromkeys(CLOSENESS, 0))[g.closeness] += 1
    unpruned, complete = fit_points(replayed)
    total_steps = sum(t.record.steps for t in replayed)
    saved_steps = sum(t.steps_saved for t in replayed)
    total_flops = sum(t.record.flops for t in replayed)
    saved_flops = sum(t.record.flops * (1.0 - t.trained_share) for t in replayed)
    return {
        "pruner": pruner_settings(),
        "grid_step_log2": grid_step(cfg),
        "trials": len(replayed),
        "pruned": sum(t.pruned for t in replayed),
        "steps": total_steps,
        "steps_saved": saved_steps,
        "steps_saved_share": saved_steps / total_steps if total_steps else 0.0,
        "flops_saved_share": saved_flops / total_flops if total_flops else 0.0,
        "per_trial": [
            {
                "parametrization": t.record.parametrization,
                "width": t.record.width,
                "seed": t.record.seed,
                "log2_lr": t.record.log2_lr,
                "status": t.record.status,
                "pruned_at": t.pruned_at,
                "steps_saved": t.steps_saved,
            }
            for t in replayed
        ],
        "per_group": [g.to_json() for g in optima],
        "optima": counts,
        "censored": {  # fit.py's bounds: the best point at the grid's end or next to a stopped LR
            "unpruned": sum(g.unpruned is not None and g.unpruned.censored is not None for g in optima),
            "complete_only": sum(g.complete_only is not None and g.complete_only.censored is not None for g in optima),
        },
        "slopes": {p: {"unpruned": slopes_of(unpruned, p), "complete_only": slopes_of(complete, p)} for p in counts},
    }


def pruner_settings() -> dict[str, Any]:
    """The replay's pruner and its settings, as the report records them."""
    return {
        "pruner": "MedianPruner",
        "percentile": PERCENTILE,
        "n_startup_trials": N_STARTUP_TRIALS,
        "n_warmup_steps": N_WARMUP_STEPS,
        "interval_steps": INTERVAL_STEPS,
    }


def against_committed(cfg: Config, replayed: Sequence[Replayed], metrics: dict[str, Any]) -> dict[str, Any]:
    """The records' unpruned optima against a committed metrics/search.json's per-seed optima, in
    grid steps: whether the replayed trials are the committed search's (retrained on another CPU,
    they may differ by its arithmetic)."""
    ours = {(g.parametrization, g.width, g.seed): g.unpruned for g in group_optima(cfg, replayed)}
    rows = []
    for p in ("sp", "mup"):
        for w, entry in sorted(metrics.get(p, {}).get("widths", {}).items(), key=lambda kv: int(kv[0])):
            for seed, committed in sorted(entry["per_seed"].items()):
                mine = ours.get((p, int(w), int(seed)))
                diff = mine.log2_lr - committed if mine is not None else None
                rows.append(
                    {
                        "parametrization": p,
                        "width": int(w),
                        "seed": int(seed),
                        "committed": committed,
                        "records": mine.log2_lr if mine is not None else None,
                        "difference_grid_steps": diff / grid_step(cfg) if diff is not None else None,
                        "closeness": closeness(diff, grid_step(cfg)),
                    }
                )
    return {
        "per_group": rows,
        "counts": {c: sum(r["closeness"] == c for r in rows) for c in CLOSENESS},
        "slope_per_seed": {p: metrics.get(p, {}).get("slope_per_seed") for p in ("sp", "mup")},
        "slope": {p: metrics.get(p, {}).get("slope") for p in ("sp", "mup")},
    }
