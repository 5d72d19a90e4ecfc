"""The spike stage's sections of the study config: ``spike`` (the origin runs, the injections, the
detector, the collapse check) and ``recovery`` (the policies). The rules that tie the window to the
policies (a rollback target before the injection, the window inside the origin run's schedule) and
``spike.param_block`` to the arm model's blocks are across sections (tasks/config.py). model/spike/
takes these sections as they are (duck-typed: model/ imports no study code).

Why the origins are runs the stage trains itself, at the ablation arm scale, and not pretrain's
milestones: milestones of one pretraining run are not independent pairing units, and >= 4
independent pretraining seeds x 3 causes x 7 policies, each over a window of hundreds of steps,
do not fit the default study's 45-minute budget at the pretrain model's scale on 2 CPU cores. At
the arm scale (``ablation.d_model`` ... ``batch_size``, μP at ``mup.base_width``, LR
``ablation.lr``) they do, one seed per worker process (tasks/spike/study.py: origin_config)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from model.typed_config import ConfigError, Section, in_open_unit, non_negative, not_empty, positive

SpikeKind = Literal["data", "lr", "grad", "param", "adam"]
RecoveryPolicy = Literal[
    "continue", "skip_step", "skip_batch", "rollback", "rollback_lower_lr", "lower_lr", "swap_data"
]

OUTCOMES = ("recovered", "gap", "gave_up")
"""A branch's outcome (tasks/spike/study.py: outcome), what the spike finding counts per cause and
policy: back in time, completed with a gap (or diverged), or gave up at the retry cap. A branch that
gave up is still scored (tasks/spike/study.py: unreached_loss): the outcome says how it ended."""

SPIKE_CAUSING_POISON = (
    "generated_binary",
    "generated_space_run",
    "generated_rare_tokens",
    "char_run",
    "nonprintable",
    "invalid_utf8",
    "repeated_ngram",
)
"""Poison-pool reasons (``data/poison/<reason>.jsonl``) whose documents cause large gradients: long
single-token runs, binary read as text, rare characters. The pool also holds harmless text the
length filter drops (headings: ``too_short``), which must never be injected."""


@dataclass(frozen=True)
class SpikeConfig(Section):
    kinds: list[SpikeKind] = field(default_factory=lambda: ["data", "param", "lr"])
    """Injections of the study (its causes), each scored against the clean control with every
    policy: ``data`` (data-tied) replaces the next batches (a drawn number of them:
    ``poison_batches_range``) with poison-pool sequences, ``param`` (state-tied) multiplies every
    weight matrix of one block once, ``lr`` (step-tied) multiplies the LR at steps fixed by the
    step count, which every replay of them meets again, ``grad`` multiplies the gradients before
    clipping. Empty: no spike study (runs that never study one, e.g. unit tests)."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2, 3])
    """Discovery seeds: one independent origin run each (``train.seed``: init and data order),
    the pairing units of the recovery finding (tasks/report/findings.py: spike)."""
    confirm_seeds: list[int] = field(default_factory=lambda: [4, 5, 6, 7])
    """Confirmation seeds, none of them a discovery seed: the stage runs both sets alike and the
    report shows the estimate on each apart."""
    run_steps: int = 1000
    """Length of each origin run's cosine schedule; the branches continue on it, so the whole
    window (``origin_step + warm_steps + recovery.eval_steps``) must fit inside it."""
    origin_step: int = 600
    """Step of the origin run's scheduled checkpoint every branch of that seed starts from: past the
    unigram plateau (the arm-scale μP run at LR 0.01 crossed 0.5 nats below it at ~490 steps; at
    250 the origin runs were still on it), the LR still decaying. The plateau gate reads each
    origin run's validation loss there, one origin at a time (``min_origins_per_half``)."""
    warm_steps: int = 128
    """Steps of clean training from the origin checkpoint before the injection: the detector's
    warm-up (at least ``detect_warmup + detect_lag``) and the pre-spike checkpoints a rollback goes back to (at
    least ``recovery.rollback_steps``, so a rollback target exists). With ``origin_step`` and
    ``recovery.eval_steps``, inside ``run_steps``."""
    workers: int = 0
    """Seeds run at once, each in its own worker process on one thread (0: the cores available);
    the results do not depend on it."""
    magnitude: float = 100.0
    """Multiplier of ``lr``, ``grad`` and ``param`` injections and divisor of ``adam``'s second
    moment (x100 at the default arm scale, 8 seeds: ``lr`` left continue 3-13 % above the control
    at every seed, ``param`` 2-4 %)."""
    duration: int = 3
    """How long a step-tied injection lasts: ``lr`` and ``grad`` multiply this many optimizer steps,
    fixed by the step count (tasks/spike/study.py: TIED_TO), so no skip removes them and every
    restart that replays those steps (skip_batch, rollback) meets them again at the same LR;
    ``param`` and ``adam`` strike once, at the first, and a branch that goes back to a clean state
    does not meet them again."""
    poison_batches_range: list[int] = field(default_factory=lambda: [5, 10])
    """[shortest, longest] poisoned stretch of a ``data`` injection, in batches of the stream: each
    origin draws its own length from it, uniformly, both ends included, seeded by the origin's seed
    alone (tasks/spike/study.py: poison_length). The policies never read it: they act on the
    detector's flags, with a skip window fixed apart from it (``recovery.skip_batches``, PaLM's
    200-500 batches), so no policy is handed the stretch's length, and a stretch may outlast that
    window: the policy then meets poison past it. The longest draw ends at least
    ``recovery.recover_steps`` before the window does (tasks/config.py), so a gap at the window's
    end is what the spike left, not poison still served."""
    poison_ramp_batches: int = 0
    """Batches over which a ``data`` injection's poison comes on: the n-th batch of the stretch
    serves the last ceil(seq_len · n / ramp) tokens of each row poisoned, its own tokens before
    them, and every batch past the ramp is all poison (model/spike/injections.py:
    poisoned_tokens); 0: all poison from the first. A gradual onset is what lets the detector's latency vary: a threshold fixed on clean runs
    (``detect_zscore``) meets a spike that grows through it at a step the poison and the origin
    decide, not at the first poisoned batch by construction. Chosen by the onset rule from
    ``sizing_ramps`` on the sizing seeds (tasks/spike/sizing.py); at most the shortest stretch,
    so every stretch reaches full strength."""
    data_reasons: list[str] = field(default_factory=lambda: list(SPIKE_CAUSING_POISON))
    """Poison-pool reasons ``data`` injection draws from (only spike-causing ones allowed)."""
    param_block: int = 0
    """Block whose weight matrices a ``param`` injection scales (``adam``: whose second moments)."""
    detect_window: int = 128
    """Trailing values of loss and pre-clip grad norm the z-score detector keeps (OLMo-core: 128)."""
    detect_warmup: int = 64
    """Values in the window before the z-score and ratio rules may fire (OLMo-core: 64)."""
    detect_zscore: float = 6.0
    """A value this many standard deviations above the trailing mean is a spike (one-sided).
    Chosen by the detector rule from ``sizing_zscores`` on the sizing seeds' clean runs
    (tasks/spike/sizing.py): OLMo-core's 6σ flagged 1-3 steps of every clean control at the arm
    scale (pre-clip grad norms 2-3x their mean after warmup), on which skip_batch and rollback
    gave up."""
    detect_ratio: float = 10.0
    """A pre-clip grad norm this many times its trailing mean is a spike (seed 000)."""
    detect_lag: int = 0
    """The newest values that are not yet the detector's baseline: it compares each step with the
    ``detect_window`` values before the newest ``detect_lag`` (model/detect.py). 0: OLMo-core's
    trailing window, which a rise growing over several steps enters unflagged and lifts, so a slow
    enough rise is never flagged; with a lag, a rise is judged against the level before it for its
    first ``detect_lag`` steps. The detector is armed after ``detect_lag + detect_warmup`` values,
    so their sum is at most ``warm_steps``."""
    sizing_seeds: list[int] = field(default_factory=lambda: [100, 101, 102, 103])
    """Seeds of the sizing probe (tasks/spike/sizing.py), none of them a discovery or confirmation
    seed: the detector's z-score is chosen on these seeds' clean stretches, never on the study's
    seeds or on a policy's outcome."""
    sizing_zscores: list[float] = field(
        default_factory=lambda: [6.0, 7.0, 8.0, 9.0, 10.0, 12.0, 14.0, 16.0, 20.0, 24.0]
    )
    """Candidates of ``detect_zscore``, ascending (the detector rule takes the smallest that meets
    ``max_false_alarms``); from OLMo-core's 6σ up to four times it."""
    sizing_ramps: list[int] = field(default_factory=lambda: [0])
    """Candidates of ``poison_ramp_batches``, ascending, each at most the shortest stretch (the
    onset rule takes the longest the detector still catches at every sizing seed,
    tasks/spike/sizing.py). The default study's: whole poison at once (version 3) and doublings up
    to one token more per row per batch at the arm scale (``ablation.seq_len`` = 64)."""
    max_false_alarms: float = 0.0
    """Alarms per clean control (the mean over the sizing seeds' warm-up and clean window) the
    chosen ``detect_zscore`` may raise: every alarm after a skip_batch or rollback restart spends
    one of ``recovery.max_retries`` and the next gives the branch up, so false alarms, not the
    spike, would decide its outcome; a clean stretch must raise none."""
    detect_within: int = 100
    """A spike counts as detected when the detector flags a step from the injection's first step to
    this many steps after its last (the detection rate per cause, tasks/spike/study.py:
    detection): the playbook's loss spike is a jump over fewer than 100 steps, so a first flag later
    than that is on what the spike left, not on the spike. A missed spike's branches are scored
    all the same: their policy never acted."""
    min_origins_per_half: int = 2
    """Origins past the plateau (each on its own, tasks/spike/study.py: plateau_gate) each half of
    the seeds (discovery, confirmation; a half with no seeds aside) must keep for the finding to be
    tested: two, the fewest with which a half's estimate has an interval (the replication rule
    reads each half's estimate); with two halves at least four origins, the count the finding's
    precondition asks of each cause's continue gap."""
    gpu_hour_usd: float = 1.10
    """Price of one GPU-hour, for an incident's cost (seed 004's post-mortem template)."""
    sample_prompts: int = 4
    """Collapse check (seed 000): generations sampled before the spike and after each branch."""
    sample_tokens: int = 32
    """Tokens per generation of the collapse check."""

    def check(self) -> None:
        for key in (
            "magnitude",
            "duration",
            "run_steps",
            "detect_window",
            "detect_zscore",
            "detect_ratio",
            "gpu_hour_usd",
            "sample_tokens",
            "min_origins_per_half",
        ):
            positive(f"spike.{key}", getattr(self, key))
        non_negative("spike.sample_prompts", self.sample_prompts)
        non_negative("spike.workers", self.workers)
        non_negative("spike.detect_within", self.detect_within)
        non_negative("spike.detect_lag", self.detect_lag)
        self.check_seeds()
        self.check_sizing()
        self.check_poison_range()
        positive("spike.origin_step", self.origin_step)
        if not 2 <= self.detect_warmup <= self.detect_window:
            raise ConfigError(
                f"spike.detect_warmup: need 2 <= {self.detect_warmup} <= spike.detect_window={self.detect_window}"
            )
        if self.warm_steps < self.detect_warmup + self.detect_lag:
            raise ConfigError(
                f"spike.warm_steps: {self.warm_steps} is below spike.detect_warmup + spike.detect_lag = "
                f"{self.detect_warmup} + {self.detect_lag}; the detector would be blind at the injection"
            )
        harmless = sorted(set(self.data_reasons) - set(SPIKE_CAUSING_POISON))
        if harmless or not self.data_reasons:
            raise ConfigError(
                f"spike.data_reasons: {harmless or 'empty'}; choose among the spike-causing "
                f"poison reasons {list(SPIKE_CAUSING_POISON)}"
            )

    def check_seeds(self) -> None:
        """Discovery seeds given, no seed twice, and confirmation seeds the discovery does not use."""
        if self.kinds:
            not_empty("spike.seeds", self.seeds)
        for key in ("seeds", "confirm_seeds"):
            values = getattr(self, key)
            if len(set(values)) != len(values):
                raise ConfigError(f"spike.{key}: {values} names a seed twice")
            for seed in values:
                non_negative(f"spike.{key}", seed)
        shared = sorted(set(self.seeds) & set(self.confirm_seeds))
        if shared:
            raise ConfigError(f"spike.confirm_seeds: {shared} are discovery seeds (spike.seeds); confirm on others")

    def check_sizing(self) -> None:
        """Sizing seeds apart from the study's; each candidate list ascending and in range."""
        if len(set(self.sizing_seeds)) != len(self.sizing_seeds):
            raise ConfigError(f"spike.sizing_seeds: {self.sizing_seeds} names a seed twice")
        for seed in self.sizing_seeds:
            non_negative("spike.sizing_seeds", seed)
        shared = sorted(set(self.sizing_seeds) & set(self.all_seeds))
        if shared:
            raise ConfigError(
                f"spike.sizing_seeds: {shared} are study seeds (spike.seeds, spike.confirm_seeds); size on others"
            )
        non_negative("spike.max_false_alarms", self.max_false_alarms)
        for value in self.sizing_zscores:
            positive("spike.sizing_zscores", value)
        if self.sizing_zscores != sorted(set(self.sizing_zscores)):
            raise ConfigError(f"spike.sizing_zscores: {self.sizing_zscores} is not strictly ascending")
        for ramp in self.sizing_ramps:
            non_negative("spike.sizing_ramps", ramp)
        if self.sizing_ramps != sorted(set(self.sizing_ramps)):
            raise ConfigError(f"spike.sizing_ramps: {self.sizing_ramps} is not strictly ascending")

    def check_poison_range(self) -> None:
        """Two lengths, shortest first, each at least one batch (the window's end: tasks/config.py);
        the ramp no longer than the shortest."""
        lengths = self.poison_batches_range
        if len(lengths) != 2 or lengths[0] < 1 or lengths[0] > lengths[1]:
            raise ConfigError(
                f"spike.poison_batches_range: {lengths}; need [shortest, longest] with 1 <= shortest <= longest"
            )
        for key, ramps in (("poison_ramp_batches", [self.poison_ramp_batches]), ("sizing_ramps", self.sizing_ramps)):
            if any(not 0 <= ramp <= lengths[0] for ramp in ramps):
                raise ConfigError(
                    f"spike.{key}: {getattr(self, key)}; need 0 <= ramp <= the shortest stretch "
                    f"(spike.poison_batches_range[0] = {lengths[0]}), so every stretch reaches full poison"
                )

    @property
    def all_seeds(self) -> list[int]:
        """Every origin run of the stage: the discovery seeds, then the confirmation seeds."""
        return [*self.seeds, *self.confirm_seeds]

    @property
    def data_batches(self) -> int:
        """The longest poisoned stretch a draw can give (``poison_batches_range``'s upper end), as
        model/spike/injections.py's InjectionSettings reads it; the stage replaces it by each
        origin's own draw (tasks/spike/study.py: poison_length)."""
        return self.poison_batches_range[1]


@dataclass(frozen=True)
class RecoveryConfig(Section):
    policies: list[RecoveryPolicy] = field(
        default_factory=lambda: [
            "continue",
            "skip_step",
            "skip_batch",
            "rollback",
            "rollback_lower_lr",
            "lower_lr",
            "swap_data",
        ]
    )
    """Policies compared after a detected spike (seed 004 playbook A-E, PaLM's rollback, plus
    OLMo-core's skip-step); each is a branch with the same injection, fired by the detector alone.
    Every cause runs every policy: ``swap_data`` on a cause with no data source to exclude records
    that and continues (model/spike/policies.py: SwapData), a branch equal to ``continue``."""
    skip_batches: int = 10
    """``skip_batch``: batches skipped from the detected step on; ``rollback`` and
    ``rollback_lower_lr`` skip the same window past the detected step as well as the batches they
    go back over (PaLM §5.1: restart ~100 steps early, skip 200-500 batches). Fixed here, never
    sized to the poison: a data injection's length is drawn apart (``spike.poison_batches_range``)
    and may be longer, so a policy can meet poison past its window."""
    rollback_steps: int = 50
    """``rollback`` and ``rollback_lower_lr``: restart from the newest checkpoint at least this many
    steps before the detected step (the n-th retry: n+1 times as far), skipping the batches from
    there to the end of the skip window (``skip_batches`` from the detected step on)."""
    lr_factor: float = 0.5
    """``rollback_lower_lr`` (per attempt, compounding) and ``lower_lr``: LR multiplier from then on.
    ``rollback`` keeps the LR, as PaLM's restarts did."""
    max_retries: int = 2
    """``skip_batch``, ``rollback`` and ``rollback_lower_lr``: restarts after the first before the
    branch gives up (status ``stopped``)."""
    max_consecutive_vetoes: int = 4
    """``skip_step``: flagged steps vetoed in a row; the next flagged one is taken as a level shift
    (the loss settled higher): its update goes through and the detector restarts its window from
    it. 4 is what OLMo-core's skip-step amounts to, whose 128-step window takes in every value,
    skipped or not: a large shift is within its 6σ after 3-4 steps. Keep it at least
    ``spike.duration``, so an injected window is vetoed whole."""
    checkpoint_every: int = 10
    """Checkpoint cadence of the control and the branches (rollback targets)."""
    eval_steps: int = 60
    """Steps after the injection every branch runs and is scored over."""
    recover_epsilon: float = 0.03
    """A branch is back when its smoothed loss is within this fraction of the control's."""
    recover_steps: int = 40
    """Type 1 (recoverable): back within ``recover_epsilon`` at most this many steps after the
    injection; later or never, with a settled gap: type 2; non-finite or still climbing: type 3."""
    smooth_steps: int = 10
    """Trailing mean over which per-step losses are compared (batches differ between branches)."""

    def check(self) -> None:
        in_open_unit("recovery.lr_factor", self.lr_factor)
        in_open_unit("recovery.recover_epsilon", self.recover_epsilon)
        for key in (
            "skip_batches",
            "rollback_steps",
            "checkpoint_every",
            "eval_steps",
            "recover_steps",
            "smooth_steps",
            "max_consecutive_vetoes",
        ):
            positive(f"recovery.{key}", getattr(self, key))
        non_negative("recovery.max_retries", self.max_retries)
        if self.recover_steps > self.eval_steps:
            raise ConfigError(
                f"recovery.recover_steps: {self.recover_steps} exceeds recovery.eval_steps={self.eval_steps}"
            )
        not_empty("recovery.policies", self.policies)
