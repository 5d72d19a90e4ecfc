"""The training configuration: what ``python -m model.train`` reads and validates, and nothing else.

Sections: tokenizer, model, mup, optim, schedule, precision, train, checkpoint. Every field is
declared once, here, with its meaning in the docstring under it; each section checks its own
values in its ``check`` method, right under its fields; :class:`TrainingConfig` adds the rules
across them. The study's sections (data, filter, search, spike, recovery, ablation, tracking) live
with their stages under ``tasks/`` and join these in ``tasks/config.py``. Loading, profiles and
overrides: model/typed_config.py.

Pure Python + PyYAML: importable on a bare GPU box.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from model.typed_config import ConfigError, Section, SectionedConfig, in_open_unit, non_negative, positive, resolve

Block = Literal["pre_ln", "post_ln"]
Norm = Literal["layernorm", "rmsnorm"]
Mlp = Literal["gelu", "swiglu"]
Precision = Literal["fp32", "bf16", "fp16"]
Parametrization = Literal["sp", "mup"]
ScheduleKind = Literal["cosine", "linear", "constant"]
Device = Literal["auto", "cpu", "cuda"]
Emulation = Literal["auto", "always", "never"]
Numerics = Literal["portable", "native"]
Init = Literal["gpt2", "xavier"]
WeightDecayMode = Literal["coupled", "independent"]

FP32_SMALLEST_NORMAL = 2.0**-126
"""The smallest fp32 number with full precision; ``optim.eps`` must not be below it."""


@dataclass(frozen=True)
class TokenizerConfig(Section):
    vocab_size: int = 4096
    """Byte-level BPE vocabulary size (including special tokens)."""
    min_frequency: int = 2
    """Minimum pair frequency for a BPE merge."""

    def check(self) -> None:
        if self.vocab_size < 257:
            raise ConfigError(f"tokenizer.vocab_size: must be >= 257 (256 bytes + end-of-text), got {self.vocab_size}")


@dataclass(frozen=True)
class ModelConfig(Section):
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads; must divide ``d_model``."""
    d_model: int = 128
    """Residual stream width (the μP width)."""
    seq_len: int = 128
    """Context length in tokens."""
    block: Block = "pre_ln"
    """``pre_ln``: x + f(norm(x)) (GPT-2). ``post_ln``: norm(x + f(x)) (original Transformer)."""
    norm: Norm = "rmsnorm"
    """Normalisation layer."""
    mlp: Mlp = "swiglu"
    """``gelu``: 4d hidden, GELU. ``swiglu``: gated SiLU with a hidden width of ~8d/3 (same params)."""
    qk_norm: bool = False
    """Normalise queries and keys per head before the dot product (Wortsman et al. 2023)."""
    z_loss: float = 0.0
    """Coefficient of the PaLM z-loss, coef · log²Z, added to the training loss (PaLM: 1e-4)."""
    tie_embeddings: bool = False
    """Share the token embedding with the readout (not allowed with μP, whose readout scales differently)."""
    bias: bool = False
    """Biases in linear layers and LayerNorm."""
    dropout: float = 0.0
    """Dropout probability on attention and residual branches."""
    init_std: float = 0.02
    """Std of weight init at ``mup.base_width`` (SP uses it at every width)."""
    init: Init = "gpt2"
    """``gpt2``: every matrix N(0, init_std), residual output projections ÷ √(2L), embeddings N(0,
    init_std) (GPT-2; μP scales it with width). ``xavier``: the original Transformer's, the condition
    of Xiong et al. 2020: Xavier-normal matrices with no depth scaling and unit-scale embeddings (its
    √d-scaled embedding lookup); SP only."""

    def check(self) -> None:
        for key in ("n_layer", "n_head", "d_model", "seq_len"):
            positive(f"model.{key}", getattr(self, key))
        if self.d_model % self.n_head:
            raise ConfigError(f"model.d_model: {self.d_model} is not divisible by model.n_head={self.n_head}")
        if (self.d_model // self.n_head) % 2:
            raise ConfigError(f"model.n_head: head dim d_model/n_head={self.d_model // self.n_head} must be even")
        non_negative("model.z_loss", self.z_loss)
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"model.dropout: must be in [0, 1), got {self.dropout!r}")
        positive("model.init_std", self.init_std)


@dataclass(frozen=True)
class MupConfig(Section):
    parametrization: Parametrization = "sp"
    """``sp``: standard parametrization. ``mup``: maximal-update parametrization (Yang & Hu 2021)."""
    base_width: int = 128
    """Width at which μP and SP coincide; width multiplier m = d_model / base_width."""
    input_alpha: float = 1.0
    """Multiplier on the embedding output."""
    output_alpha: float = 1.0
    """Multiplier on the logits; μP divides it by m."""
    zero_init_readout: bool = True
    """μP only: initialise the readout (unembedding) to zero."""
    zero_init_query: bool = True
    """μP only: initialise the query projection to zero."""

    def check(self) -> None:
        positive("mup.base_width", self.base_width)


@dataclass(frozen=True)
class OptimConfig(Section):
    lr: float = 3e-3
    """Peak learning rate (for μP: the LR at ``base_width``; hidden matrices get lr / m)."""
    beta1: float = 0.9
    """Adam β₁."""
    beta2: float = 0.95
    """Adam β₂ (0.95 is the stable choice at scale; 0.999 is predicted to be more spike-prone)."""
    eps: float = 1e-8
    """Adam ε, added to √v in the parameters' dtype, fp32 (master weights and Adam state are fp32
    in every precision mode). Must be a normal fp32 number (≥ 1.18e-38): below 1.4e-45 it is 0,
    and a parameter whose gradients are all zero (μP's zero-initialised readout) then steps by
    0/0 = NaN; subnormals keep few bits and are flushed to 0 wherever flush-to-zero is on. Below
    about 1e-19 (√ of the smallest normal) a gradient whose square underflows steps by m/ε ≫ 1."""
    weight_decay: float = 0.1
    """Weight decay of hidden matrices (and of what ``decay_*`` adds); how a step applies it:
    ``weight_decay_mode``."""
    weight_decay_mode: WeightDecayMode = "coupled"
    """``coupled``: torch's AdamW, each step p -= lr·wd·p, so decay follows the LR schedule (μP:
    hidden matrices get wd × m, keeping lr·wd width-invariant). ``independent``: fully decoupled
    (Loshchilov & Hutter; Wortsman et al. 2023), each step p -= wd·p whatever the LR, so use a
    wd about lr times smaller (e.g. 1e-4); the decay is width-invariant as it is (no × m)."""
    decay_norms_and_biases: bool = False
    """Also decay norm gains and biases."""
    decay_embeddings: bool = False
    """Also decay the token embedding (and an untied readout)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 = off). The pre-clip norm is always logged."""
    implementation: Literal["auto", "fused", "foreach", "loop"] = "auto"
    """AdamW kernel: ``auto`` is fused (on CPU and CUDA alike; see model/optim.py)."""

    def check(self) -> None:
        positive("optim.lr", self.lr)
        in_open_unit("optim.beta1", self.beta1)
        in_open_unit("optim.beta2", self.beta2)
        positive("optim.eps", self.eps)
        _check_eps(self.eps)
        non_negative("optim.weight_decay", self.weight_decay)
        non_negative("optim.grad_clip", self.grad_clip)


@dataclass(frozen=True)
class ScheduleConfig(Section):
    kind: ScheduleKind = "cosine"
    """Shape after warmup: cosine or linear decay to ``min_lr_ratio``·lr, or constant."""
    warmup_steps: int = 20
    """Linear warmup from 0 to the peak LR; must not exceed ``train.steps``."""
    min_lr_ratio: float = 0.1
    """Final LR as a fraction of the peak."""

    def check(self) -> None:
        non_negative("schedule.warmup_steps", self.warmup_steps)
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"schedule.min_lr_ratio: must be in [0, 1], got {self.min_lr_ratio!r}")


MAX_LOSS_SHIFT = 40
"""fp16's finite range in binades (2^-24 to 2^16): the largest useful ``precision.loss_shift``."""


@dataclass(frozen=True)
class PrecisionConfig(Section):
    mode: Precision = "fp32"
    """Compute precision of matrix products. Master weights and optimizer state are always fp32."""
    emulate: Emulation = "auto"
    """Emulate low-precision tensor-core semantics (bf16/fp16 rounding around fp32 matmuls) instead
    of real autocast (see model/precision.py). ``auto``: emulate where the device has no fast
    low-precision path (CPU); ``always`` / ``never`` force it. (Not on/off: YAML 1.1 reads those
    as booleans.)"""
    numerics: Numerics = "native"
    """Which code paths the CPU libraries take (model/numerics.py). ``native``: each library's
    fastest path for the CPU, bits that differ between CPU kinds; ``portable``: one path on every
    x86-64 CPU with AVX2 (MKL's COMPATIBLE branch, oneDNN and ATen capped at AVX2, ``emulate:
    auto`` emulating on the CPU), the same bits on an AMD EPYC and an Intel Xeon at about 1.6x the
    CPU time (benchmarks/bench_numerics.py). Applied before torch loads: a process that runs the other mode
    refuses to train (start it with ``SPIKELAB_NUMERICS=<mode>``)."""
    loss_scaling: bool = True
    """fp16 only: dynamic loss scaling; off reproduces unscaled fp16 for the ablation."""
    init_scale: float = 65536.0
    """fp16 only: initial loss scale."""
    growth_interval: int = 2000
    """fp16 only: steps without overflow before the loss scale doubles."""
    loss_shift: int = 0
    """k: the loss is multiplied by 2^-k before the backward pass, Adam's ε by 2^-k and the clip
    decided on the unshifted gradient norm, so an fp32 run is bitwise unchanged (powers of two
    scale exactly) while every gradient is 2^-k smaller where fp16 represents it: Micikevicius et
    al.'s underflow, reached on a model whose gradients are otherwise too large for it. Logged
    gradient norms are the unshifted ones. 0 to 40: fp16 spans 40 binades (2^-24 to 2^16); past
    that no gradient is left to study."""

    def check(self) -> None:
        positive("precision.init_scale", self.init_scale)
        positive("precision.growth_interval", self.growth_interval)
        if not 0 <= self.loss_shift <= MAX_LOSS_SHIFT:
            raise ConfigError(f"precision.loss_shift: {self.loss_shift}; an integer from 0 to {MAX_LOSS_SHIFT}")

    @property
    def loss_multiplier(self) -> float:
        """2^-loss_shift: what the loss and Adam's ε are multiplied by."""
        return 2.0**-self.loss_shift


@dataclass(frozen=True)
class TrainConfig(Section):
    steps: int = 300
    """Optimizer steps."""
    batch_size: int = 16
    """Sequences per micro-batch, all ranks together under torchrun (each takes an equal slice)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    seed: int = 0
    """Seed of init, data order and dropout."""
    device: Device = "auto"
    """``auto``: cuda when available, else cpu."""
    compile: bool = False
    """Wrap the model in ``torch.compile``."""
    log_every: int = 10
    """Steps between telemetry reductions (no host sync in between)."""
    layer_stats_every: int = 50
    """Steps between per-layer gradient norms and activation statistics."""
    eval_every: int = 100
    """Steps between validation losses (0 = only at the end)."""
    eval_batches: int = 8
    """Validation batches per evaluation."""
    num_workers: int = 0
    """DataLoader worker processes."""
    pin_memory: bool = False
    """Pin host memory for faster host-to-device copies."""
    cpu_threads: int = 0
    """Intra-op CPU threads of torch for the run (0 = the cores of the process's affinity that no
    other process is busy on at the start, model/threads.py: an OpenMP team runs at the pace of
    its slowest thread, so a thread on a shared core slows the whole step)."""
    diverge_after: int = 20
    """The run counts as diverged (exit 3, no model published; a result in a search trial or an
    ablation arm) after this many consecutive non-finite steps (fp16 loss-scale overflows, which
    the scaler handles, do not count). 0 = never. Checked at log points, so it fires up to
    ``log_every`` steps late, without a host sync per step."""
    diverge_loss: float = 0.0
    """The run also counts as diverged once the training loss exceeds this (0 = no bound); e.g.
    a little above ln(vocab_size), the loss of a uniform guess."""

    def check(self) -> None:
        for key in ("steps", "batch_size", "grad_accum", "log_every", "layer_stats_every", "eval_batches"):
            positive(f"train.{key}", getattr(self, key))
        for key in ("eval_every", "num_workers", "cpu_threads", "diverge_after", "diverge_loss"):
            non_negative(f"train.{key}", getattr(self, key))


@dataclass(frozen=True)
class CheckpointConfig(Section):
    every_steps: int = 100
    """Save every this many steps (0 = off)."""
    every_minutes: float = 0.0
    """Also save when this many wall-clock minutes passed since the last save (0 = off)."""
    keep_last: int = 2
    """Rolling checkpoints kept; milestones are never deleted."""
    milestones: list[int] = field(default_factory=lambda: [200])
    """Steps whose checkpoints are pinned and exported (``models/milestones``: a run's states worth
    branching from); each must be within ``train.steps`` (tasks/config.py). The spike study's
    origin runs pin their own (``spike.origin_step``)."""

    def check(self) -> None:
        non_negative("checkpoint.every_steps", self.every_steps)
        non_negative("checkpoint.every_minutes", self.every_minutes)
        positive("checkpoint.keep_last", self.keep_last)
        for step in self.milestones:
            positive("checkpoint.milestones", step)


def _check_eps(eps: float) -> None:
    if eps >= FP32_SMALLEST_NORMAL:
        return
    in_fp32 = struct.unpack("f", struct.pack("f", eps))[0]
    why = (
        "rounds to 0.0 there, so √v + ε is 0 where v is and the step is NaN"
        if in_fp32 == 0
        else f"is subnormal there ({in_fp32!r}: few bits, and 0 wherever flush-to-zero is on)"
    )
    raise ConfigError(
        f"optim.eps: {eps!r} underflows in fp32, the dtype of the parameters and Adam "
        f"state: it {why}; use at least {FP32_SMALLEST_NORMAL:.3g}"
    )


@dataclass(frozen=True)
class TrainingConfig(SectionedConfig):
    """Everything a training run reads. The study's config (tasks/config.py) extends it."""

    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    mup: MupConfig = field(default_factory=MupConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def check_across(self) -> None:
        if self.mup.parametrization == "mup" and self.model.tie_embeddings:
            raise ConfigError(
                "model.tie_embeddings: must be false with mup.parametrization=mup "
                "(μP scales the readout apart from the embedding)"
            )
        if self.mup.parametrization == "mup" and self.model.init != "gpt2":
            raise ConfigError(f"model.init: {self.model.init!r} is an SP init; μP has its own (use gpt2)")
        if self.schedule.warmup_steps > self.train.steps:
            raise ConfigError(
                f"schedule.warmup_steps: {self.schedule.warmup_steps} exceeds train.steps={self.train.steps}"
            )


def load_training_config(
    params: str | Path = "params.yaml", profile: str | None = None, overrides: dict[str, Any] | None = None
) -> TrainingConfig:
    """The training sections of ``params`` under a profile, with ``overrides`` on top; the file's
    other sections (the study's) are not read. Precedence: model/typed_config.py: resolve."""
    return resolve(TrainingConfig, params, profile, overrides, own_sections_only=True).config


def check_device(name: str) -> None:
    """``train.device`` must exist here: ``cuda`` needs a CUDA build and a visible device. Imports
    torch only when the config asks for a device that needs it; call before anything is touched."""
    if name == "cuda":
        import torch

        if not torch.cuda.is_available():
            why = "a CPU-only build" if torch.version.cuda is None else "no CUDA device visible"
            raise ConfigError(
                f"train.device: 'cuda' is not available here (torch {torch.__version__}, {why}); use 'auto' or 'cpu'"
            )
