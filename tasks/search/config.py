"""The search stage's section of the study config. Its widths against ``model.n_head`` and its
parametrizations against ``mup.parametrization`` are rules across sections (tasks/config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from model.config import Parametrization
from model.typed_config import ConfigError, Section, no_password, non_negative, not_empty, positive

MIN_STARTUP_TRIALS = 3
"""The fewest ``search.prune_startup_trials``: the three points of the fit's parabola (fit.py)."""


@dataclass(frozen=True)
class SearchConfig(Section):
    parametrizations: list[Parametrization] = field(default_factory=lambda: ["sp", "mup"])
    """Parametrizations whose LR optimum is compared across widths; must include
    ``mup.parametrization`` (the one pretrain uses, whose optimum is transferred)."""
    widths: list[int] = field(default_factory=lambda: [32, 64, 128])
    """Widths (d_model) swept for each parametrization. Those below ``model.d_model`` are the
    proxies the LR is transferred from; the target width itself is swept directly (added when
    missing) to check the transfer."""
    log2_lr_min: float = -13.0
    """Smallest LR of the grid, as log2 (for μP: the LR at ``mup.base_width``). With 800-step
    trials 9 of 12 per-seed optima sat at 2^-10, the lowest LR of the grid before version 2 of the
    design, while the sizing runs' best points were at 2^-7 ... 2^-8 (docs/search.md): the grid
    reaches three doublings below the one and two above the other."""
    log2_lr_max: float = -5.0
    """Largest LR of the grid, as log2."""
    lr_points: int = 7
    """LR grid points, evenly spaced in log2 from ``log2_lr_min`` to ``log2_lr_max``; each is
    trained once per seed (an Optuna trial)."""
    refine_points: int = 0
    """The search's second stage (version 4): once the grid has run, each seed of the transferred
    parametrization's sweeps (``mup.parametrization``, the one the transfer claim reads) trains
    this many more LRs around its best completed grid LR, half inside each grid step beside it,
    evenly (2: the two midpoints, a local step of half the grid's in log2), in the same study.
    The fits then read the finer spacing where the optimum is; the grid's 2.5x step over its whole
    range would cost 2-3x the trials. 0 = the grid alone. Even."""
    seeds: list[int] = field(default_factory=lambda: [0, 1])
    """Discovery seeds of every grid point; the optimum is fitted per seed and its spread is over
    seeds (the μ-transfer finding's unit: one seed's slope over the widths)."""
    confirm_seeds: list[int] = field(default_factory=lambda: [2, 3])
    """Confirmation seeds, trained exactly like the discovery seeds: the finding holds only where
    both halves point the same way (tasks/design/preregistration.yaml, ``method: replication``)."""
    steps: int = 800
    """Training steps per trial (warmup: ``schedule.warmup_steps``, capped at a fifth of these):
    800 steps of batch 2 left the unigram plateau in the sizing runs (140 did not: every optimum of
    the version-1 default search sat on it, and the μ-transfer finding was never tested)."""
    batch_size: int = 2
    """Sequences per step in a trial (the other training keys are pretrain's). Small: at a fixed
    token count, batch 2 left the unigram plateau faster than 4 or 8 in the sizing runs
    (docs/search.md) for the same CPU time."""
    eval_every: int = 100
    """Steps between the validation losses a trial reports to Optuna's pruner."""
    prune_above: float = 0.0
    """Optuna's ThresholdPruner stops a trial whose reported validation loss exceeds this;
    0 = ln(tokenizer.vocab_size) + 1, a nat worse than a uniform guess, which a trial that is
    learning, however slowly, does not reach. A threshold depends on the trial alone, so what is
    pruned does not depend on the worker count. It acts at every report, the median rule's
    startup trials included."""
    prune_median: bool = True
    """Optuna's MedianPruner within each (parametrization, width, seed) group (tasks/search/groups.py):
    a trial whose best validation loss so far is worse than the median of its group's earlier
    (lower-LR) complete trials at the same step is stopped; the group's trials run in ascending LR,
    each after the ones it is compared with, so the verdicts do not depend on the workers. Optima
    and slopes are fitted from the trials that ran to the end. The rule was chosen on a replay of
    the unpruned search (docs/search.md: 53 of 168 trials stopped, 25.6 % of the steps saved).
    false = the ThresholdPruner alone, every trial to its end (the studies of before the rule)."""
    prune_startup_trials: int = 3
    """MedianPruner's ``n_startup_trials``, per group: its first (lowest-LR) trials always run to
    the end; at least 3, the points the fit's parabola needs, and the median is of >= 3 curves."""
    prune_warmup_steps: int = 0
    """MedianPruner's ``n_warmup_steps``: no trial is stopped by the median before this step (0:
    from its first report, past the LR warm-up); below ``search.steps``."""
    workers: int = 0
    """Worker processes on the study storage, each training one trial at a time with one torch
    thread (0 = the cores this process may use)."""
    storage: str = ""
    """Optuna storage: an RDB URL (``postgresql://user@host:port/db``, workers across nodes; the
    password from ``PGPASSWORD`` or ``~/.pgpass``, never in the URL) or ``journal:<path>`` (a
    JournalStorage file, workers on one node); empty = the journal file under the state
    directory, ``.spikelab/optuna.journal``."""
    heartbeat_s: int = 10
    """On an RDB storage, seconds between the heartbeats a worker records for the trial it trains;
    a trial without one for twice this is stale (its worker died): the next worker to look fails it
    and queues its point again."""
    transfer_lr: bool = True
    """pretrain trains with the LR this stage transfers (``search/lr.yaml``, a DVC dependency of
    pretrain) instead of ``optim.lr``."""

    def check(self) -> None:
        if self.log2_lr_min >= self.log2_lr_max:
            raise ConfigError(
                f"search.log2_lr_min: {self.log2_lr_min} must be below search.log2_lr_max={self.log2_lr_max}"
            )
        for key in ("lr_points", "steps", "batch_size", "eval_every", "heartbeat_s"):
            positive(f"search.{key}", getattr(self, key))
        non_negative("search.prune_above", self.prune_above)
        if self.refine_points < 0 or self.refine_points % 2:
            raise ConfigError(
                f"search.refine_points: must be an even number >= 0, got {self.refine_points!r} "
                "(half of them inside each grid step beside the best LR)"
            )
        if self.prune_startup_trials < MIN_STARTUP_TRIALS:
            raise ConfigError(
                f"search.prune_startup_trials: must be >= {MIN_STARTUP_TRIALS}, got {self.prune_startup_trials!r} "
                "(a group's first trials run to the end: the fit's parabola needs three complete points)"
            )
        non_negative("search.prune_warmup_steps", self.prune_warmup_steps)
        if self.prune_warmup_steps >= self.steps:
            raise ConfigError(
                f"search.prune_warmup_steps: {self.prune_warmup_steps} must be below search.steps={self.steps} "
                "(the median rule would never act; search.prune_median: false turns it off)"
            )
        non_negative("search.workers", self.workers)
        no_password("search.storage", self.storage)
        for key in ("widths", "seeds", "parametrizations"):
            not_empty(f"search.{key}", getattr(self, key))
        if overlap := sorted(set(self.seeds) & set(self.confirm_seeds)):
            raise ConfigError(f"search.confirm_seeds: {overlap} also discovery seeds (search.seeds)")

    @property
    def all_seeds(self) -> list[int]:
        """Every seed a grid point trains at: discovery, then confirmation."""
        return [*self.seeds, *self.confirm_seeds]
