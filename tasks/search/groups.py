"""The search's pruning rule, live (issue #47): each trial compared with the earlier trials of its
group only, so that what is stopped does not depend on the workers or their timing.

Groups. A group is one (parametrization, width, seed): one study's trials of one seed
(tasks/search/spec.py: a study per parametrization × width holds every (log2 LR, seed) point). Its
order is ascending log2 LR, the order the replay (tasks/search/pruning.py) measured the rule in:
the queue holds a study's points LR-major, so a group meets its LRs from the smallest up.

Determinism. Optuna's MedianPruner compares a trial with the study's COMPLETE trials as they are
when it asks, so in a parallel search its verdict depends on which trials happened to finish first.
Two things make it a function of the trials' reported losses alone:

1. The order (:func:`unfinished_below`, used by tasks/search/queue.py: claim). A queued trial is
   claimed only when every lower LR of its group has a finished (COMPLETE or PRUNED) trial. So the
   group's trials run one after another, in LR order, whichever worker takes them, and each starts
   after the ones it is compared with have ended: their curves are final.
2. The view (:func:`group_view`). The median is taken over an in-memory study that holds exactly
   those earlier trials of the group (``Study.add_trials``), not over the live study, where other
   seeds' trials and, after a restart, anything else may sit. :class:`SearchPruner` hands that view
   to Optuna's own ``MedianPruner.prune``, so the rule is Optuna's, with the replay's settings
   (``search.prune_startup_trials``, ``search.prune_warmup_steps``, every report a check).

A worker trains a group's trials in a row (tasks/search/trial.py: train_queued_group), so the
order costs no waiting; the parallelism is over groups (24 in the default search, on 2 cores).

A trial's last report (step ``search.steps``) is its final value: it is not judged by the median
(stopping it there saves nothing and takes a complete point from the fit). The search's
ThresholdPruner (``search.prune_above``) still applies at every report, startup trials included:
its verdict depends on the trial alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)
"""States of a trial whose curve is final: it has ended, by completing or by being pruned."""

PERCENTILE = 50.0
"""MedianPruner's percentile (fixed: the rule is the median)."""
INTERVAL_STEPS = 1
"""Every report is a check (reports come every ``search.eval_every`` steps already)."""


def grid_point(trial: FrozenTrial) -> tuple[float, int]:
    """The trial's (log2 LR, seed): the LR its param (or, before its suggestion, its queued value),
    the seed its ``seed`` user attribute. The seed is no Optuna param (issue #57: optuna-dashboard
    would rank it among the hyperparameters and crown the luckiest seed); trials queued before
    that hold it as a param, read here so their studies resume and report unchanged."""
    params = {**trial.system_attrs.get("fixed_params", {}), **trial.params}
    return params["log2_lr"], int(trial.user_attrs["seed"] if "seed" in trial.user_attrs else params["seed"])


def unfinished_below(trials: Iterable[FrozenTrial], log2_lr: float, seed: int) -> list[float]:
    """The LRs of the group ``seed`` below ``log2_lr`` that have a trial (queued, running, failed)
    but no finished one: while any is left, a trial at ``log2_lr`` may not start."""
    points: set[tuple[float, int]] = set()
    done: set[tuple[float, int]] = set()
    for t in trials:
        point = grid_point(t)
        points.add(point)
        if t.state in FINISHED:
            done.add(point)
    return sorted(lr for lr, s in points - done if s == seed and lr < log2_lr)


def group_view(trials: Sequence[FrozenTrial], trial: FrozenTrial, direction: Any) -> optuna.Study:
    """An in-memory study of the trials ``trial`` is compared with: its group's finished trials at
    lower LRs. Raises when one of those has not finished (the queue's order was broken: the
    verdict would depend on timing)."""
    log2_lr, seed = grid_point(trial)
    if missing := unfinished_below(trials, log2_lr, seed):
        raise RuntimeError(
            f"trial {trial.number} (log2 LR {log2_lr:g}, seed {seed}) runs before its group's LRs {missing} "
            "finished: the pruner's verdict would depend on the workers' timing"
        )
    earlier = [t for t in trials if t.state in FINISHED and grid_point(t)[1] == seed and grid_point(t)[0] < log2_lr]
    view = optuna.create_study(direction=direction)  # in memory
    view.add_trials(sorted(earlier, key=lambda t: grid_point(t)[0]))
    return view


@dataclass(frozen=True)
class MedianRule:
    """The median rule's settings (tasks/search/config.py: ``search.prune_*``)."""

    n_startup_trials: int
    n_warmup_steps: int

    def pruner(self) -> optuna.pruners.MedianPruner:
        return optuna.pruners.MedianPruner(
            n_startup_trials=self.n_startup_trials, n_warmup_steps=self.n_warmup_steps, interval_steps=INTERVAL_STEPS
        )


class SearchPruner(optuna.pruners.BasePruner):
    """The search's pruner: Optuna's ThresholdPruner on the trial alone (``bound``), then, when
    ``median`` is given, Optuna's MedianPruner over the trial's group (:func:`group_view`) at every
    report before ``last_step``. ``last`` names the rule that stopped the latest trial it pruned
    (``threshold`` or ``median``); the views are built once per trial (the trials they hold have
    finished before it started)."""

    def __init__(self, bound: float, median: MedianRule | None, last_step: int) -> None:
        self.bound = bound
        self.threshold = optuna.pruners.ThresholdPruner(upper=bound)
        self.median_rule = median
        self.median = median.pruner() if median is not None else None
        self.last_step = last_step
        self.last: str | None = None
        self._views: dict[tuple[str, int], optuna.Study] = {}

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        self.last = self.verdict(study, trial)
        return self.last is not None

    def verdict(self, study: optuna.Study, trial: FrozenTrial) -> str | None:
        """``threshold``, ``median`` or None (go on)."""
        if self.threshold.prune(study, trial):
            return "threshold"
        if self.median is None or trial.last_step is None or trial.last_step >= self.last_step:
            return None
        key = (study.study_name, trial.number)
        if key not in self._views:
            self._views[key] = group_view(study.get_trials(deepcopy=False), trial, study.direction)
        return "median" if self.median.prune(self._views[key], trial) else None

    def settings(self) -> dict[str, Any]:
        """What metrics/search.json records of the rule."""
        out: dict[str, Any] = {"prune_above": self.bound, "median": self.median_rule is not None}
        if self.median_rule is not None:
            out.update(
                {
                    "pruner": "MedianPruner",
                    "percentile": PERCENTILE,
                    "n_startup_trials": self.median_rule.n_startup_trials,
                    "n_warmup_steps": self.median_rule.n_warmup_steps,
                    "interval_steps": INTERVAL_STEPS,
                    "group": "parametrization, width, seed",
                    "order": "ascending log2 LR, each trial after the group's lower LRs finished",
                    "not_at_step": self.last_step,
                }
            )
        return out
