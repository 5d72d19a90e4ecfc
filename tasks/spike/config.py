"""The spike stage's sections of the study config: ``spike`` (the injections, the detector, the
collapse check) and ``recovery`` (the policies). Whether every ``spike.origins`` step is a
pretrain milestone and ``spike.param_block`` a block of the model are rules across sections
(tasks/config.py). model/spike/ takes these sections as they are (duck-typed: model/ imports
no study code)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from model.typed_config import ConfigError, Section, in_open_unit, non_negative, not_empty, positive

SpikeKind = Literal["data", "lr", "grad", "param", "adam"]
RecoveryPolicy = Literal["continue", "skip_step", "skip_batch", "rollback", "lower_lr", "swap_data"]

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
    kinds: list[SpikeKind] = field(default_factory=lambda: ["data", "lr"])
    """Injections of the study, each scored against the clean control with every policy:
    ``data`` replaces the next batches with poison-pool sequences, ``lr`` multiplies the LR,
    ``grad`` multiplies the gradients before clipping, ``param`` multiplies every weight matrix
    of one block once. Empty: no spike study (runs that never study one, e.g. unit tests)."""
    origins: list[int] = field(default_factory=lambda: [200])
    """Pretrain milestones (``checkpoint.milestones``) the study branches from, each with its own
    warm-up, control and policy branches: the pairing units of the recovery finding, which needs
    at least 6 (tasks/report/findings.py: spike)."""
    warm_steps: int = 64
    """Steps of clean training from the milestone before the injection: the detector's warm-up
    (at least ``detect_warmup``) and the pre-spike checkpoints a rollback goes back to."""
    magnitude: float = 100.0
    """Multiplier of ``lr``, ``grad`` and ``param`` injections and divisor of ``adam``'s second
    moment (x30 on the default model at its
    milestone: every policy back within 40 steps; x100 leaves a lasting gap)."""
    duration: int = 3
    """How long an injection lasts: ``data`` replaces this many batches of the stream (a policy may
    skip them); ``lr`` and ``grad`` multiply this many optimizer steps, tied to the steps so no
    policy can remove them (tasks/spike/study.py: TIED_TO); ``param`` and ``adam`` strike once, at
    the first, and a branch that goes back to a clean state does not meet them again."""
    data_reasons: list[str] = field(default_factory=lambda: list(SPIKE_CAUSING_POISON))
    """Poison-pool reasons ``data`` injection draws from (only spike-causing ones allowed)."""
    param_block: int = 0
    """Block whose weight matrices a ``param`` injection scales (``adam``: whose second moments)."""
    detect_window: int = 128
    """Trailing values of loss and pre-clip grad norm the z-score detector keeps (OLMo-core: 128)."""
    detect_warmup: int = 64
    """Values in the window before the z-score and ratio rules may fire (OLMo-core: 64)."""
    detect_zscore: float = 6.0
    """A value this many standard deviations above the trailing mean is a spike (one-sided)."""
    detect_ratio: float = 10.0
    """A pre-clip grad norm this many times its trailing mean is a spike (seed 000)."""
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
            "detect_window",
            "detect_zscore",
            "detect_ratio",
            "gpu_hour_usd",
            "sample_tokens",
        ):
            positive(f"spike.{key}", getattr(self, key))
        non_negative("spike.sample_prompts", self.sample_prompts)
        if self.kinds:
            not_empty("spike.origins", self.origins)
        if len(set(self.origins)) != len(self.origins):
            raise ConfigError(f"spike.origins: {self.origins} names a milestone twice")
        if not 2 <= self.detect_warmup <= self.detect_window:
            raise ConfigError(
                f"spike.detect_warmup: need 2 <= {self.detect_warmup} <= spike.detect_window={self.detect_window}"
            )
        if self.warm_steps < self.detect_warmup:
            raise ConfigError(
                f"spike.warm_steps: {self.warm_steps} is below spike.detect_warmup="
                f"{self.detect_warmup}; the detector would be blind at the injection"
            )
        harmless = sorted(set(self.data_reasons) - set(SPIKE_CAUSING_POISON))
        if harmless or not self.data_reasons:
            raise ConfigError(
                f"spike.data_reasons: {harmless or 'empty'}; choose among the spike-causing "
                f"poison reasons {list(SPIKE_CAUSING_POISON)}"
            )


@dataclass(frozen=True)
class RecoveryConfig(Section):
    policies: list[RecoveryPolicy] = field(
        default_factory=lambda: ["continue", "skip_step", "skip_batch", "rollback", "lower_lr", "swap_data"]
    )
    """Policies compared after a detected spike (seed 004 playbook A-E, plus OLMo-core's skip-step);
    each is a branch with the same injection, fired by the detector alone."""
    skip_batches: int = 10
    """``skip_batch``: batches skipped from the detected step on (PaLM: 5-20)."""
    rollback_steps: int = 50
    """``rollback``: restart from the newest checkpoint at least this many steps before the
    detected step (the n-th retry: n+1 times as far)."""
    lr_factor: float = 0.5
    """``rollback`` (per attempt, compounding) and ``lower_lr``: LR multiplier from then on."""
    max_retries: int = 2
    """``rollback``: rollbacks after the first before the branch gives up (status ``stopped``)."""
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
