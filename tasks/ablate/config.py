"""The ablate stage's section of the study config: the grid of arms (tasks/ablate/grid.py expands it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from model.config import Block
from model.typed_config import ConfigError, Section, in_open_unit, non_negative, not_empty, positive

PrecisionVariant = Literal["fp32", "bf16", "fp16", "fp16_unscaled"]
Stabilizer = Literal["none", "qk_norm", "z_loss"]
ArmInjection = Literal["lr", "grad", "param"]


@dataclass(frozen=True)
class AblationConfig(Section):
    """The ablation grid (tasks/ablate/grid.py: expand). Every arm trains from scratch at the arm scale
    below and takes one injected spike. The first value of each factor list is the base arm's;
    each family varies its factors from the base, the rest held there:

      block x warmup       blocks x warmups               (Xiong et al. 2020)
      precision            precisions                     (Micikevicius et al. 2017)
      beta2                beta2s                         (PaLM; Bai et al. 2025)
      stabilizer x LR      stabilizers x lrs              (Wortsman et al. 2023, LR sensitivity)

    all of them x seeds. An arm in two families (the base arm is in all) runs once."""

    blocks: list[Block] = field(default_factory=lambda: ["pre_ln", "post_ln"])
    """Block placements compared (``model.block``)."""
    precisions: list[PrecisionVariant] = field(default_factory=lambda: ["fp32", "bf16", "fp16", "fp16_unscaled"])
    """Precisions compared: ``fp16`` with dynamic loss scaling, ``fp16_unscaled`` without. The first,
    every other family's, is fp32: those families vary the architecture and the optimizer, not the
    format, and on a CPU without bf16 hardware fp32 is the fastest path (emulated bf16 took 1.4x its
    step time here, benchmarks/bench_arms.py)."""
    beta2s: list[float] = field(default_factory=lambda: [0.95, 0.999])
    """Adam β₂ values compared."""
    warmups: list[int] = field(default_factory=lambda: [20, 0])
    """LR warmup lengths in steps compared (0: none)."""
    stabilizers: list[Stabilizer] = field(default_factory=lambda: ["none", "qk_norm", "z_loss"])
    """What the LR-sensitivity family compares: nothing, ``model.qk_norm``, ``model.z_loss``."""
    lrs: list[float] = field(default_factory=lambda: [3e-4, 3e-3, 3e-2, 3e-1])
    """The LR grid of the stabilizer family, the range Wortsman et al. measure LR sensitivity on."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """Seeds of every arm (``train.seed``: init and data order)."""
    lr: float = 0.01
    """Peak LR of every family but the stabilizer one."""
    z_loss: float = 1e-4
    """``model.z_loss`` coefficient of the ``z_loss`` stabilizer (PaLM's)."""
    steps: int = 300
    """Training steps per arm."""
    d_model: int = 64
    """Arm scale: width (``model.d_model``)."""
    n_layer: int = 2
    """Arm scale: blocks (``model.n_layer``)."""
    n_head: int = 2
    """Arm scale: attention heads (``model.n_head``)."""
    seq_len: int = 64
    """Arm scale: context length (``model.seq_len``)."""
    batch_size: int = 8
    """Arm scale: sequences per step (``train.batch_size``)."""
    inject: ArmInjection = "lr"
    """The spike every arm takes (model/spike.py): ``lr`` (LR x magnitude), ``grad`` (pre-clip
    gradients x magnitude), ``param`` (block 0's matrices x magnitude)."""
    inject_step: int = 150
    """The first step that takes the injection."""
    inject_magnitude: float = 100.0
    """Its factor."""
    inject_duration: int = 3
    """Steps it lasts."""
    workers: int = 0
    """Arms trained at once, each in its own process on one thread (0: the cores available)."""
    retries: int = 1
    """Retries of an arm whose process crashed (a diverged arm is a result, never retried)."""

    def check(self) -> None:
        for b2 in self.beta2s:
            in_open_unit("ablation.beta2s", b2)
        for key in (
            "lr",
            "z_loss",
            "steps",
            "d_model",
            "n_layer",
            "n_head",
            "seq_len",
            "batch_size",
            "inject_magnitude",
            "inject_duration",
        ):
            positive(f"ablation.{key}", getattr(self, key))
        for lr in self.lrs:
            positive("ablation.lrs", lr)
        non_negative("ablation.workers", self.workers)
        non_negative("ablation.retries", self.retries)
        if self.d_model % (2 * self.n_head):
            raise ConfigError(
                f"ablation.d_model: {self.d_model} is not a multiple of 2·ablation.n_head="
                f"{2 * self.n_head} (heads of even size)"
            )
        for w in self.warmups:
            if not 0 <= w < self.steps:
                raise ConfigError(f"ablation.warmups: {w} is outside 0..ablation.steps-1={self.steps - 1}")
        if not self.inject_step > 0 or self.inject_step + self.inject_duration > self.steps:
            raise ConfigError(
                f"ablation.inject_step: the injection (steps {self.inject_step}.."
                f"{self.inject_step + self.inject_duration - 1}) must end within "
                f"ablation.steps={self.steps}"
            )
        for key in ("blocks", "precisions", "beta2s", "warmups", "stabilizers", "lrs", "seeds"):
            values = getattr(self, key)
            not_empty(f"ablation.{key}", values)
            if len(set(values)) != len(values):
                raise ConfigError(f"ablation.{key}: {values} repeats a value (an arm would run twice)")
