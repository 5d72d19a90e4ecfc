"""The ablate stage's section of the study config: the values the built-in families read, one family
of arms per finding, each in the conditions its source names (tasks/design/preregistration.yaml
declares each family and what it tests, referencing these keys; tasks/ablate/grid.py expands them).

Every arm trains from scratch at the arm scale (``d_model`` ... ``batch_size``) on the study's
parametrization (``mup.parametrization`` at ``mup.base_width``) unless its family names another
condition; clean arms take no injection (an injected spike goes only into the overflow family,
beside an un-injected twin). Each family's base arm (its declaration's ``base``; the report prints
its loss) is the first value of each of its factor lists, except: overflow's is bf16's clean twin,
wortsman's is ``none`` at its best LR on the grid.

  xiong       block x warmup x LR   SP init, depth ``xiong_depth``        (Xiong et al. 2020)
  precision   precision             SP, emulated, loss x 2^-k (probe)     (Micikevicius et al. 2017)
  overflow    precision x spike     SP, probe-sized weight excursion      (Micikevicius et al. 2017)
  beta2       β₂ x LR multiple      clean, >= 2/(1-β₂) steps              (Shazeer & Stern 2018;
                                                                           Wortsman et al. 2023b)
  wortsman    stabilizer x LR       SP, independent decay, 5 % warmup     (Wortsman et al. 2023)

all of them x ``seeds`` and ``confirm_seeds``. Arms of one seed share initialisation, data order and validation
batches: the report pairs them by seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from model.config import Block, Precision
from model.typed_config import ConfigError, Section, in_open_unit, non_negative, not_empty, positive

MIN_FIRST_ROUND = 3
"""The first look of a sequential design needs a t-test with at least 2 degrees of freedom."""

PrecisionVariant = Literal["fp32", "bf16", "fp16", "fp16_unscaled"]
Stabilizer = Literal["none", "qk_norm", "z_loss"]
NaturalPolicy = Literal["skip_step", "lower_lr"]
"""The recovery policies an arm can carry (model/spike/policies.py): those that act within the run.
skip_batch and the rollbacks restart from an earlier state (the spike stage's branch driver);
swap_data has no source to swap on a natural spike."""


@dataclass(frozen=True)
class AblationConfig(Section):
    """The study's arms, family by family (see the module doc)."""

    seeds: list[int] = field(default_factory=lambda: [0, 1, 2, 3])
    """Discovery seeds of every arm (``train.seed``: init and data order)."""
    confirm_seeds: list[int] = field(default_factory=lambda: [4, 5, 6, 7])
    """Confirmation seeds, trained exactly like the discovery seeds: a verdict holds only where both
    halves point the same way (tasks/design/preregistration.yaml, ``method: replication``)."""
    rounds: list[int] = field(default_factory=list)
    """Group-sequential looks (issue #47): cumulative counts of ``seeds`` + ``confirm_seeds``, in
    that order, after which a family's claims are tested against the registered boundaries
    (preregistration.yaml ``sequential``; tasks/report/sequential.py). A family stops at the first
    look where every claim is decided or a gate fails. Empty: the fixed design, one look at every seed."""
    budget_seeds: int = 0
    """The study's cap on arm-steps, in seeds, reserved per family up front: a family's looks are
    the rounds at or below it, and its alpha is spent over those (tasks/ablate/rounds.py:
    reachable_rounds). 0: no cap below the last round."""

    # --- the arm scale, shared by every family -------------------------------------------------
    d_model: int = 64
    """Width (``model.d_model``); the study's ``mup.base_width`` is the same, so μP arms run at m = 1."""
    n_layer: int = 2
    """Blocks (``model.n_layer``) of every family but xiong's."""
    n_head: int = 2
    """Attention heads (``model.n_head``)."""
    seq_len: int = 64
    """Context length in tokens (``model.seq_len``)."""
    batch_size: int = 8
    """Sequences per step (``train.batch_size``)."""
    steps: int = 400
    """Steps of the precision and overflow arms (SP at ``sp_lr``: an SP arm at LR 3e-3 crossed 0.5
    nats below the unigram baseline at ~155-205 steps in the sizing runs)."""
    sp_lr: float = 3e-3
    """Peak LR of the precision and overflow arms (standard parametrization, this project's GPT-2 init)."""
    lr: float = 0.01
    """Peak LR of the beta2 family (μP at the base width, m = 1): the search's optimum there."""
    warmup_fraction: float = 0.05
    """Warmup of every family but xiong's, as a fraction of its steps (Wortsman et al. use 5 %)."""
    precision: Precision = "fp32"
    """The format every arm trains in but where its family sets its own (the precision and overflow
    families' variants): fp32 on the CPU, where bf16 is emulated or a kernel path of its own; the
    gpu profile's bf16 autocast with fp32 master weights, as the papers studied trained (issue 60)."""

    # --- xiong: Post-LN needs warmup ---------------------------------------------------------
    blocks: list[Block] = field(default_factory=lambda: ["pre_ln", "post_ln"])
    """Block placements compared (``model.block``)."""
    xiong_warmups: list[float] = field(default_factory=lambda: [0.1, 0.0])
    """Warmup as a fraction of ``xiong_steps`` (0: none); Xiong et al. compare none against warmup."""
    xiong_lrs: list[float] = field(default_factory=lambda: [2e-3, 1e-3])
    """The LR grid (Adam, SP), one claim per LR: 1e-3, the paper's, and 2e-3, where Post-LN without
    warmup fails to train while Post-LN with it and Pre-LN train (version 3's pilots, seeds 200-202;
    version 2's 5e-4 and 1e-3 never reached the failure the paper is about, version 2's 3e-3 left
    Post-LN with warmup on the plateau at 400 steps)."""
    xiong_depth: int = 6
    """Blocks of the xiong arms: the Post-LN gap in gradient scale grows with depth (Theorem 1)."""
    xiong_steps: int = 1200
    """Steps of the xiong arms: the smallest of ``sizing_xiong_steps`` at which every arm the plateau
    gate reads leaves the plateau at every sizing seed (tasks/ablate/sizing.py)."""
    sizing_seeds: list[int] = field(default_factory=lambda: [100, 101, 102, 103])
    """Seeds of the xiong sizing probe (tasks/ablate/sizing.py), none of them a discovery or
    confirmation seed: ``xiong_steps`` is chosen on these seeds' gated variants, never on the
    study's seeds or on the claim's variant."""
    sizing_xiong_steps: list[int] = field(default_factory=lambda: [400, 800, 1200, 1600])
    """Candidates of ``xiong_steps``, ascending (the rule takes the smallest at which every gated
    variant leaves the plateau at every sizing seed); from version 2's 400 to four times it."""
    probe_depths: list[int] = field(default_factory=lambda: [2, 4, 6, 8, 12])
    """Depths of the gradient-at-initialisation probe (Theorem 1's direct check), Pre-LN vs Post-LN."""

    # --- precision: fp16 needs loss scaling ---------------------------------------------------
    precisions: list[PrecisionVariant] = field(default_factory=lambda: ["fp32", "bf16", "fp16", "fp16_unscaled"])
    """Formats compared on clean runs, every one through the same emulated numeric path
    (model/precision.py: ``precision.emulate: always``): ``fp16`` with dynamic loss scaling,
    ``fp16_unscaled`` without."""
    range_probe_every: int = 100
    """Steps between measurements of the fp16 range shares (model/probes.py: RangeProbe)."""
    underflow_target: float = 0.02
    """The precision family's loss shift is the smallest k whose one-step probe puts this share of the
    worst layer's activation gradients below fp16's smallest subnormal (tasks/ablate/conditions.py).
    The probe reads the gradients at initialisation, their largest: over training the share grew
    4-6x in version 2 (14 % at its 10 % target, then 59-82 %), so version 3 aims at 2 % to land
    inside the gate's band (1-50 %)."""

    # --- overflow: an LR spike drives the forward pass past fp16's range -----------------------
    overflow_precisions: list[PrecisionVariant] = field(default_factory=lambda: ["bf16", "fp16"])
    """Formats that take the LR spike, each beside its clean twin of the precision family."""
    inject_fraction: float = 0.5
    """Where the injection strikes, as a fraction of ``steps``: block 0's weight matrices x the
    smallest power of two that takes the arm's fp16 forward pass past its range there
    (tasks/ablate/conditions.py: OverflowProbeSpike)."""

    # --- beta2: β₂ = 0.999 is more spike-prone than 0.95 -------------------------------------
    beta2s: list[float] = field(default_factory=lambda: [0.95, 0.999])
    """Adam β₂ values compared."""
    beta2_lr_mults: list[float] = field(default_factory=lambda: [1.0, 4.0])
    """LRs of the beta2 arms as multiples of ``lr``: the searched LR and a few times above it."""
    beta2_steps: int = 2000
    """Steps of the beta2 arms: >= 2 x 1/(1 - 0.999), two memories of the slow second moment."""
    beta2_batch_size: int = 4
    """Sequences per step of the beta2 arms: the finding counts steps, and 2,000 steps of 8
    sequences would pass the corpus twice."""
    detect_zscore: float = 16.0
    """The z-score of every arm's spike detector (a trailing window, no lag; tasks/ablate/arm.py:
    arm_detector): the detector rule's choice for that window (versions 2-3: the smallest of
    spike.sizing_zscores with no false alarm on the sizing seeds), kept so that the β₂ family's
    spikes_per_1k counts what version 3 counted. The spike study's lagged detector has its own
    (spike.detect_zscore)."""
    natural_policies: list[NaturalPolicy] = field(default_factory=lambda: ["skip_step", "lower_lr"])
    """The spike finding's secondary analysis (tasks/report/natural.py): the beta2 family's arm at
    β₂ = 0.999 and 4 x ``lr`` retrained on the first round's seeds with each of these policies
    attached to its detector, scored against the family's own arm (continue). [] runs none."""

    # --- wortsman: qk-norm and z-loss lower LR sensitivity -------------------------------------
    stabilizers: list[Stabilizer] = field(default_factory=lambda: ["none", "qk_norm", "z_loss"])
    """What the family compares: nothing, ``model.qk_norm``, ``model.z_loss``."""
    lrs: list[float] = field(default_factory=lambda: [3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1])
    """The LR grid, half-decade spacing over Wortsman et al.'s 3e-4 ... 3e-1."""
    z_loss: float = 1e-4
    """``model.z_loss`` coefficient of the ``z_loss`` stabilizer (Wortsman et al.; PaLM)."""
    independent_weight_decay: float = 1e-4
    """Weight decay of the wortsman arms, not scaled by the LR (``optim.weight_decay_mode:
    independent``), as in the paper: coupled decay would change with the LR across the grid."""
    wortsman_steps: int = 300
    """Steps of the wortsman arms."""

    # --- which families train --------------------------------------------------------------
    families: list[str] = field(default_factory=list)
    """The families whose arms this profile's study trains, by name (a built-in family's
    ``family.name`` in tasks/design/preregistration.yaml, or a studies.yaml family's); the others
    train no arm and their findings are not tested. Empty: every family. A profile drops a family
    here, never by emptying its grid (the gpu profile: the families the CPU cannot test,
    docs/gpu-study.md). A name that is no family is refused where the families are known
    (tasks/ablate/grid.py: trained)."""

    # --- execution ---------------------------------------------------------------------------
    workers: int = 0
    """Arms trained at once, each in its own worker process on one thread (0: the cores available)."""
    retries: int = 1
    """Retries of an arm whose process crashed (a diverged arm is a result, never retried)."""

    def check(self) -> None:
        for key in (
            "d_model",
            "n_layer",
            "n_head",
            "seq_len",
            "batch_size",
            "steps",
            "lr",
            "sp_lr",
            "xiong_depth",
            "xiong_steps",
            "range_probe_every",
            "beta2_steps",
            "beta2_batch_size",
            "detect_zscore",
            "z_loss",
            "wortsman_steps",
        ):
            positive(f"ablation.{key}", getattr(self, key))
        non_negative("ablation.independent_weight_decay", self.independent_weight_decay)
        non_negative("ablation.workers", self.workers)
        non_negative("ablation.retries", self.retries)
        non_negative("ablation.budget_seeds", self.budget_seeds)
        for b2 in self.beta2s:
            in_open_unit("ablation.beta2s", b2)
        for key in ("xiong_lrs", "lrs", "beta2_lr_mults", "probe_depths"):
            for value in getattr(self, key):
                positive(f"ablation.{key}", value)
        if not 0 <= self.warmup_fraction < 1:
            raise ConfigError(f"ablation.warmup_fraction: must be in [0, 1), got {self.warmup_fraction!r}")
        for w in self.xiong_warmups:
            if not 0 <= w < 1:
                raise ConfigError(f"ablation.xiong_warmups: {w} is outside [0, 1) (a fraction of xiong_steps)")
        if self.d_model % (2 * self.n_head):
            raise ConfigError(
                f"ablation.d_model: {self.d_model} is not a multiple of 2·ablation.n_head="
                f"{2 * self.n_head} (heads of even size)"
            )
        in_open_unit("ablation.inject_fraction", self.inject_fraction)
        in_open_unit("ablation.underflow_target", self.underflow_target)
        if overlap := sorted(set(self.seeds) & set(self.confirm_seeds)):
            raise ConfigError(f"ablation.confirm_seeds: {overlap} also discovery seeds (ablation.seeds)")
        if len(set(self.sizing_seeds)) != len(self.sizing_seeds):
            raise ConfigError(f"ablation.sizing_seeds: {self.sizing_seeds} names a seed twice")
        for seed in self.sizing_seeds:
            non_negative("ablation.sizing_seeds", seed)
        if shared := sorted(set(self.sizing_seeds) & set(self.all_seeds)):
            raise ConfigError(
                f"ablation.sizing_seeds: {shared} are study seeds (ablation.seeds, ablation.confirm_seeds); size on others"
            )
        self._check_rounds()
        for steps in self.sizing_xiong_steps:
            positive("ablation.sizing_xiong_steps", steps)
        if self.sizing_xiong_steps != sorted(set(self.sizing_xiong_steps)):
            raise ConfigError(f"ablation.sizing_xiong_steps: {self.sizing_xiong_steps} is not strictly ascending")
        if not set(self.overflow_precisions) <= set(self.precisions):
            raise ConfigError(
                f"ablation.overflow_precisions: {self.overflow_precisions} must be among ablation.precisions="
                f"{self.precisions} (each spiked arm is compared with its clean twin there)"
            )
        for key in (
            "seeds",
            "confirm_seeds",
            "blocks",
            "xiong_warmups",
            "xiong_lrs",
            "probe_depths",
            "precisions",
            "overflow_precisions",
            "beta2s",
            "beta2_lr_mults",
            "stabilizers",
            "lrs",
        ):
            values = getattr(self, key)
            if key != "confirm_seeds":  # a profile may run no confirmation half (the smoke profile)
                not_empty(f"ablation.{key}", values)
            if len(set(values)) != len(values):
                raise ConfigError(f"ablation.{key}: {values} repeats a value (an arm would run twice)")
        if len(set(self.families)) != len(self.families):
            raise ConfigError(f"ablation.families: {self.families} names a family twice")
        if len(set(self.natural_policies)) != len(self.natural_policies):
            raise ConfigError(
                f"ablation.natural_policies: {self.natural_policies} repeats a policy (an arm would run twice)"
            )

    def _check_rounds(self) -> None:
        if not self.rounds:
            if self.budget_seeds:
                raise ConfigError("ablation.budget_seeds: a cap on seeds needs sequential looks (ablation.rounds)")
            return
        if self.rounds[0] < MIN_FIRST_ROUND:
            raise ConfigError(
                f"ablation.rounds: the first look needs at least {MIN_FIRST_ROUND} seeds (a t-test with 2 degrees "
                f"of freedom), got {self.rounds[0]}"
            )
        if any(b <= a for a, b in zip(self.rounds, self.rounds[1:])):
            raise ConfigError(f"ablation.rounds: cumulative seed counts must strictly increase, got {self.rounds}")
        if self.rounds[-1] != len(self.all_seeds):
            raise ConfigError(
                f"ablation.rounds: the last look is at {self.rounds[-1]} seeds, but ablation.seeds and "
                f"ablation.confirm_seeds name {len(self.all_seeds)}"
            )
        if self.budget_seeds and not self.rounds[0] <= self.budget_seeds <= self.rounds[-1]:
            raise ConfigError(
                f"ablation.budget_seeds: {self.budget_seeds} is outside the looks' range "
                f"[{self.rounds[0]}, {self.rounds[-1]}] (ablation.rounds): every family trains the first round"
            )

    def arm_scale(self, steps: int, seed: int) -> dict[str, Any]:
        """The dotted keys every arm trains with before its family's conditions: the arm scale, one
        thread, μP's LR (``lr``) in ``precision``, warmup ``warmup_fraction`` of ``steps``, checkpoints a
        retried arm resumes from, and no injection of the study's own."""
        return {
            "model.d_model": self.d_model,
            "model.n_layer": self.n_layer,
            "model.n_head": self.n_head,
            "model.seq_len": self.seq_len,
            "model.block": "pre_ln",
            "model.qk_norm": False,
            "model.z_loss": 0.0,
            "train.batch_size": self.batch_size,
            "train.grad_accum": 1,
            "train.steps": steps,
            "train.seed": seed,
            "train.eval_every": steps,
            "train.layer_stats_every": max(1, steps // 20),  # 20 points of each per-layer trajectory
            "train.cpu_threads": 1,
            "optim.lr": self.lr,
            "optim.beta2": 0.95,
            "schedule.warmup_steps": round(self.warmup_fraction * steps),
            "precision.mode": self.precision,
            "precision.loss_scaling": True,
            "precision.loss_shift": 0,
            "checkpoint.every_steps": max(1, steps // 4),  # a retried arm resumes
            "checkpoint.keep_last": 1,
            "checkpoint.milestones": [],
            "checkpoint.every_minutes": 0.0,
            "spike.kinds": [],  # the overflow family's spike is the arm's own (tasks/ablate/arm.py)
        }

    @property
    def all_seeds(self) -> list[int]:
        """Every seed an arm trains at: discovery, then confirmation."""
        return [*self.seeds, *self.confirm_seeds]

    @property
    def inject_step(self) -> int:
        """The first step of the overflow family's spike."""
        return max(1, round(self.steps * self.inject_fraction))
