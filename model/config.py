"""The one typed config of a spikelab study, loaded from ``params.yaml`` plus a profile overlay.

Every field is declared once, here, with its meaning in the docstring under it. Variants are
named strings (``Literal``) checked at load time; cross-field invariants are checked in one place
(``Config.validate``); what needs the machine (a CUDA device) in :func:`check_runtime`. Any
problem raises :class:`ConfigError` naming the dotted key or the file, before any work starts.
Which value wins when params.yaml, a profile and overrides disagree: :func:`resolve`.

Pure Python + PyYAML: importable on a bare GPU box next to ``model/``.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml

Block = Literal["pre_ln", "post_ln"]
Norm = Literal["layernorm", "rmsnorm"]
Mlp = Literal["gelu", "swiglu"]
Precision = Literal["fp32", "bf16", "fp16"]
Parametrization = Literal["sp", "mup"]
ScheduleKind = Literal["cosine", "linear", "constant"]
DataSource = Literal["stdlib_docs", "text", "jsonl", "hf"]
Device = Literal["auto", "cpu", "cuda"]
Emulation = Literal["auto", "always", "never"]
SpikeKind = Literal["data", "lr", "grad", "param"]
PrecisionVariant = Literal["fp32", "bf16", "fp16", "fp16_unscaled"]
Stabilizer = Literal["none", "qk_norm", "z_loss"]
ArmInjection = Literal["lr", "grad", "param"]
RecoveryPolicy = Literal["continue", "skip_step", "skip_batch", "rollback", "lower_lr", "swap_data"]

SPIKE_CAUSING_POISON = ("generated_binary", "generated_space_run", "generated_rare_tokens", "char_run",
                        "nonprintable", "invalid_utf8", "repeated_ngram")
"""Poison-pool reasons (``data/poison/<reason>.jsonl``) whose documents cause large gradients: long
single-token runs, binary read as text, rare characters. The pool also holds harmless text the
length filter drops (headings: ``too_short``), which must never be injected."""

FP32_SMALLEST_NORMAL = 2.0 ** -126
"""The smallest fp32 number with full precision; ``optim.eps`` must not be below it."""

PROFILES_DIR = "profiles"
"""Profile overlays live in ``<project>/profiles/<name>.yaml`` next to ``params.yaml``;
``default.yaml`` there is the default profile, under every other one."""


class UserError(ValueError):
    """A mistake the user can fix; the CLI prints it without a traceback and exits with code 2."""


class ConfigError(UserError):
    """A bad key or value in params.yaml or a profile overlay; the message names the dotted key."""


class InputError(UserError):
    """A missing, empty or malformed input file; the message names the file (and key)."""


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataConfig:
    source: DataSource = "stdlib_docs"
    """Where documents come from. ``stdlib_docs``: docstrings and help topics of the running
    Python's standard library (offline everywhere, PSF licence). ``text``: ``path`` is a UTF-8
    file or a folder of ``*.txt`` files (one document per file; a single file is split on blank
    lines). ``jsonl``: ``path`` is a JSON-lines file, text under ``jsonl_field``. ``hf``: a Hugging
    Face dataset (needs network and the ``hf`` extra)."""
    path: str = ""
    """File or folder for ``text``/``jsonl``; relative paths are relative to the project."""
    jsonl_field: str = "text"
    """Field holding the document text in each JSON line (and in each Hugging Face record)."""
    hf_dataset: str = ""
    """Hugging Face dataset name for ``source: hf``, e.g. ``wikitext``."""
    hf_config: str = ""
    """Optional Hugging Face dataset config name, e.g. ``wikitext-2-raw-v1``."""
    hf_split: str = "train"
    """Hugging Face split to stream."""
    max_docs: int = 0
    """Keep at most this many source documents (0 = all)."""
    max_doc_bytes: int = 4_194_304
    """Reading guard: a document (or JSON line) longer than this many bytes is skipped and counted
    while it streams past in bounded chunks, never held in memory whole (a 1 GB single line costs
    at most this much). Must be at least ``filter.max_chars``, so the length filter decides first."""
    val_fraction: float = 0.05
    """Fraction of filtered documents held out for validation (split by document)."""
    seed: int = 1234
    """Seed of the deterministic document split."""


@dataclass(frozen=True)
class FilterConfig:
    invalid_utf8: bool = True
    """Drop documents whose bytes are not valid UTF-8."""
    nonprintable: bool = True
    """Drop documents with too many binary / non-printable characters."""
    max_nonprintable_ratio: float = 0.05
    """Largest tolerated share of non-printable characters."""
    length: bool = True
    """Drop length outliers."""
    min_chars: int = 64
    """Shorter documents are dropped."""
    max_chars: int = 200_000
    """Longer documents are dropped."""
    char_run: bool = True
    """Drop documents containing a long run of one repeated character."""
    max_char_run: int = 200
    """Longest tolerated run of a single repeated character."""
    repeated_ngram: bool = True
    """Drop documents with a short token pattern repeated many times in a row (OLMo-core rule)."""
    ngram_max_period: int = 13
    """Longest repeating period (in whitespace tokens) that is checked."""
    ngram_min_repeats: int = 32
    """Consecutive repeats of one period that mark a document as degenerate."""
    dedup: bool = True
    """Drop exact and near-duplicate documents (MinHash LSH)."""
    dedup_threshold: float = 0.8
    """Estimated Jaccard similarity of word shingles above which a document is a near duplicate."""
    dedup_num_perm: int = 128
    """MinHash permutations."""
    dedup_shingle: int = 5
    """Word shingle size for near-duplicate detection."""
    perplexity: bool = True
    """Drop perplexity outliers scored by a small model trained on the corpus itself."""
    perplexity_zscore: float = 6.0
    """Drop documents whose per-character log-perplexity is this many robust z-scores above the
    median. The scores are right-skewed (code-heavy prose sits high), so 3 drops ~4 % of the
    standard-library corpus; planted garbage scores above 20."""
    poison_generated: int = 64
    """Generated garbage documents (binary bytes, space runs, rare-token runs) added to the poison pool."""


@dataclass(frozen=True)
class TokenizerConfig:
    vocab_size: int = 4096
    """Byte-level BPE vocabulary size (including special tokens)."""
    min_frequency: int = 2
    """Minimum pair frequency for a BPE merge."""


@dataclass(frozen=True)
class ModelConfig:
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


@dataclass(frozen=True)
class MupConfig:
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


@dataclass(frozen=True)
class OptimConfig:
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
    """Decoupled weight decay on hidden matrices (μP: scaled with the LR so lr·wd is width-invariant)."""
    decay_norms_and_biases: bool = False
    """Also decay norm gains and biases."""
    decay_embeddings: bool = False
    """Also decay the token embedding (and an untied readout)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 = off). The pre-clip norm is always logged."""
    implementation: Literal["auto", "fused", "foreach", "loop"] = "auto"
    """AdamW kernel: ``auto`` is fused (on CPU and CUDA alike; see model/optim.py)."""


@dataclass(frozen=True)
class ScheduleConfig:
    kind: ScheduleKind = "cosine"
    """Shape after warmup: cosine or linear decay to ``min_lr_ratio``·lr, or constant."""
    warmup_steps: int = 20
    """Linear warmup from 0 to the peak LR; must not exceed ``train.steps``."""
    min_lr_ratio: float = 0.1
    """Final LR as a fraction of the peak."""


@dataclass(frozen=True)
class PrecisionConfig:
    mode: Precision = "fp32"
    """Compute precision of matrix products. Master weights and optimizer state are always fp32."""
    emulate: Emulation = "auto"
    """Emulate low-precision tensor-core semantics (bf16/fp16 rounding around fp32 matmuls) instead
    of real autocast (see model/precision.py). ``auto``: emulate where the device has no fast
    low-precision path (CPU); ``always`` / ``never`` force it. (Not on/off: YAML 1.1 reads those
    as booleans.)"""
    loss_scaling: bool = True
    """fp16 only: dynamic loss scaling; off reproduces unscaled fp16 for the ablation."""
    init_scale: float = 65536.0
    """fp16 only: initial loss scale."""
    growth_interval: int = 2000
    """fp16 only: steps without overflow before the loss scale doubles."""


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 300
    """Optimizer steps."""
    batch_size: int = 16
    """Sequences per micro-batch."""
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
    """Intra-op CPU threads of torch for the run (0 = torch's default, one per core). Where the
    cores are shared with other jobs, 1 avoids OpenMP threads waiting at barriers for a busy
    core (measured here: a small model trained ~10x slower with 2 threads than with 1)."""
    diverge_after: int = 20
    """The run counts as diverged (exit 3, no model published; a result in a search trial or an
    ablation arm) after this many consecutive non-finite steps (fp16 loss-scale overflows, which
    the scaler handles, do not count). 0 = never. Checked at log points, so it fires up to
    ``log_every`` steps late, without a host sync per step."""
    diverge_loss: float = 0.0
    """The run also counts as diverged once the training loss exceeds this (0 = no bound); e.g.
    a little above ln(vocab_size), the loss of a uniform guess."""


@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int = 100
    """Save every this many steps (0 = off)."""
    every_minutes: float = 0.0
    """Also save when this many wall-clock minutes passed since the last save (0 = off)."""
    keep_last: int = 2
    """Rolling checkpoints kept; milestones are never deleted."""
    milestones: list[int] = field(default_factory=lambda: [200])
    """Steps whose checkpoints are pinned and exported (the spike study starts from one)."""


@dataclass(frozen=True)
class SpikeConfig:
    kinds: list[SpikeKind] = field(default_factory=lambda: ["data", "lr"])
    """Injections of the study, each scored against the clean control with every policy:
    ``data`` replaces the next batches with poison-pool sequences, ``lr`` multiplies the LR,
    ``grad`` multiplies the gradients before clipping, ``param`` multiplies every weight matrix
    of one block once. Empty: no spike study (runs that never study one, e.g. unit tests)."""
    at_step: int = 200
    """The pretrain milestone (``checkpoint.milestones``) every branch starts from."""
    warm_steps: int = 64
    """Steps of clean training from the milestone before the injection: the detector's warm-up
    (at least ``detect_warmup``) and the pre-spike checkpoints a rollback goes back to."""
    magnitude: float = 100.0
    """Multiplier of ``lr``, ``grad`` and ``param`` injections (x30 on the default model at its
    milestone: every policy back within 40 steps; x100 leaves a lasting gap)."""
    duration: int = 3
    """Batches of the stream window an injection is tied to (the steps that consume them get the
    LR or gradient multiplier; ``data`` replaces them; ``param`` strikes at the first)."""
    data_reasons: list[str] = field(default_factory=lambda: list(SPIKE_CAUSING_POISON))
    """Poison-pool reasons ``data`` injection draws from (only spike-causing ones allowed)."""
    param_block: int = 0
    """Block whose weight matrices a ``param`` injection scales."""
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


@dataclass(frozen=True)
class RecoveryConfig:
    policies: list[RecoveryPolicy] = field(
        default_factory=lambda: ["continue", "skip_step", "skip_batch", "rollback", "lower_lr", "swap_data"])
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


@dataclass(frozen=True)
class SearchConfig:
    parametrizations: list[Parametrization] = field(default_factory=lambda: ["sp", "mup"])
    """Parametrizations whose LR optimum is compared across widths; must include
    ``mup.parametrization`` (the one pretrain uses, whose optimum is transferred)."""
    widths: list[int] = field(default_factory=lambda: [32, 64, 128])
    """Widths (d_model) swept for each parametrization. Those below ``model.d_model`` are the
    proxies the LR is transferred from; the target width itself is swept directly (added when
    missing) to check the transfer."""
    log2_lr_min: float = -13.0
    """Smallest LR of the grid, as log2 (for μP: the LR at ``mup.base_width``)."""
    log2_lr_max: float = -5.0
    """Largest LR of the grid, as log2."""
    lr_points: int = 5
    """LR grid points, evenly spaced in log2 from ``log2_lr_min`` to ``log2_lr_max``; each is
    trained once per seed (an Optuna trial)."""
    seeds: list[int] = field(default_factory=lambda: [0, 1])
    """Seeds of every grid point; the optimum is fitted per seed and its spread is over seeds."""
    steps: int = 150
    """Training steps per trial (warmup: ``schedule.warmup_steps``, capped at a fifth of these)."""
    batch_size: int = 4
    """Sequences per step in a trial (the other training keys are pretrain's)."""
    eval_every: int = 50
    """Steps between the validation losses a trial reports to Optuna's pruner."""
    prune_above: float = 0.0
    """Optuna's ThresholdPruner stops a trial whose reported validation loss exceeds this;
    0 = ln(tokenizer.vocab_size) + 1, a nat worse than a uniform guess, which a trial that is
    learning, however slowly, does not reach. A threshold depends on the trial alone, so what is
    pruned does not depend on the worker count."""
    workers: int = 0
    """Worker processes on the study storage, each training one trial at a time with one torch
    thread (0 = the cores this process may use)."""
    storage: str = ""
    """Optuna storage: an RDB URL (e.g. ``postgresql://...``, workers across nodes) or
    ``journal:<path>`` (a JournalStorage file, workers on one node); empty = the journal file
    under the state directory, ``.spikelab/optuna.journal``."""
    transfer_lr: bool = True
    """pretrain trains with the LR this stage transfers (``search/lr.yaml``, a DVC dependency of
    pretrain) instead of ``optim.lr``."""


@dataclass(frozen=True)
class AblationConfig:
    """The ablation grid (tasks/ablate.py: expand). Every arm trains from scratch at the arm scale
    below and takes one injected spike. The first value of each factor list is the base arm's;
    each family varies its factors from the base, the rest held there:

      block x warmup       blocks x warmups               (Xiong et al. 2020)
      precision            precisions                     (Micikevicius et al. 2017)
      beta2                beta2s                         (PaLM; Bai et al. 2025)
      stabilizer x LR      stabilizers x lrs              (Wortsman et al. 2023, LR sensitivity)

    all of them x seeds. An arm in two families (the base arm is in all) runs once."""

    blocks: list[Block] = field(default_factory=lambda: ["pre_ln", "post_ln"])
    """Block placements compared (``model.block``)."""
    precisions: list[PrecisionVariant] = field(default_factory=lambda: ["bf16", "fp32", "fp16", "fp16_unscaled"])
    """Precisions compared: ``fp16`` with dynamic loss scaling, ``fp16_unscaled`` without."""
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


@dataclass(frozen=True)
class TrackingConfig:
    experiment: str = "spikelab"
    """MLflow experiment (one per study)."""
    async_logging: bool = True
    """Log metrics to MLflow from a background thread so the training loop never waits on it."""


# --------------------------------------------------------------------------------------------
# The whole config
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    profile: str = "default"
    """Name of the overlay in ``profiles/`` applied over params.yaml (``default`` = none)."""
    data: DataConfig = field(default_factory=DataConfig)
    filter: FilterConfig = field(default_factory=FilterConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    mup: MupConfig = field(default_factory=MupConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    ablation: AblationConfig = field(default_factory=AblationConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def validate(self) -> Config:
        """Value constraints and cross-field invariants; raises ConfigError naming the key."""
        _check_values(self)
        return self

    def to_flat_dict(self) -> dict[str, Any]:
        """``{"optim.lr": 0.003, ...}``: the resolved config as MLflow params."""
        return flatten(dataclasses.asdict(self))

    def replace(self, **dotted: Any) -> Config:
        """A copy with dotted keys overridden and re-validated: ``cfg.replace(**{"optim.lr": 1e-3})``."""
        return from_dict(_deep_merge(dataclasses.asdict(self), _unflatten(dotted)), "override")


def _positive(key: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{key}: must be > 0, got {value!r}")


def _non_negative(key: str, value: float) -> None:
    if not value >= 0:
        raise ConfigError(f"{key}: must be >= 0, got {value!r}")


def _in_open_unit(key: str, value: float) -> None:
    if not 0 < value < 1:
        raise ConfigError(f"{key}: must be in (0, 1), got {value!r}")


def _check_eps(eps: float) -> None:
    if eps >= FP32_SMALLEST_NORMAL:
        return
    in_fp32 = struct.unpack("f", struct.pack("f", eps))[0]
    why = ("rounds to 0.0 there, so √v + ε is 0 where v is and the step is NaN" if in_fp32 == 0 else
           f"is subnormal there ({in_fp32!r}: few bits, and 0 wherever flush-to-zero is on)")
    raise ConfigError(f"optim.eps: {eps!r} underflows in fp32, the dtype of the parameters and Adam "
                      f"state: it {why}; use at least {FP32_SMALLEST_NORMAL:.3g}")


def _check_values(c: Config) -> None:
    m, t = c.model, c.train
    for key in ("n_layer", "n_head", "d_model", "seq_len"):
        _positive(f"model.{key}", getattr(m, key))
    if m.d_model % m.n_head:
        raise ConfigError(f"model.d_model: {m.d_model} is not divisible by model.n_head={m.n_head}")
    if (m.d_model // m.n_head) % 2:
        raise ConfigError(f"model.n_head: head dim d_model/n_head={m.d_model // m.n_head} must be even")
    _non_negative("model.z_loss", m.z_loss)
    if not 0 <= m.dropout < 1:
        raise ConfigError(f"model.dropout: must be in [0, 1), got {m.dropout!r}")
    _positive("model.init_std", m.init_std)
    _positive("mup.base_width", c.mup.base_width)
    if c.mup.parametrization == "mup" and m.tie_embeddings:
        raise ConfigError("model.tie_embeddings: must be false with mup.parametrization=mup "
                          "(μP scales the readout apart from the embedding)")
    _positive("optim.lr", c.optim.lr)
    _in_open_unit("optim.beta1", c.optim.beta1)
    _in_open_unit("optim.beta2", c.optim.beta2)
    _positive("optim.eps", c.optim.eps)
    _check_eps(c.optim.eps)
    _non_negative("optim.weight_decay", c.optim.weight_decay)
    _non_negative("optim.grad_clip", c.optim.grad_clip)
    _positive("train.steps", t.steps)
    _positive("train.batch_size", t.batch_size)
    _positive("train.grad_accum", t.grad_accum)
    _positive("train.log_every", t.log_every)
    _positive("train.layer_stats_every", t.layer_stats_every)
    _non_negative("train.eval_every", t.eval_every)
    _positive("train.eval_batches", t.eval_batches)
    _non_negative("train.num_workers", t.num_workers)
    _non_negative("train.cpu_threads", t.cpu_threads)
    _non_negative("train.diverge_after", t.diverge_after)
    _non_negative("train.diverge_loss", t.diverge_loss)
    _non_negative("schedule.warmup_steps", c.schedule.warmup_steps)
    if c.schedule.warmup_steps > t.steps:
        raise ConfigError(f"schedule.warmup_steps: {c.schedule.warmup_steps} exceeds "
                          f"train.steps={t.steps}")
    if not 0 <= c.schedule.min_lr_ratio <= 1:
        raise ConfigError(f"schedule.min_lr_ratio: must be in [0, 1], got {c.schedule.min_lr_ratio!r}")
    _positive("precision.init_scale", c.precision.init_scale)
    _positive("precision.growth_interval", c.precision.growth_interval)
    _non_negative("checkpoint.every_steps", c.checkpoint.every_steps)
    _non_negative("checkpoint.every_minutes", c.checkpoint.every_minutes)
    _positive("checkpoint.keep_last", c.checkpoint.keep_last)
    for s in c.checkpoint.milestones:
        if not 0 < s <= t.steps:
            raise ConfigError(f"checkpoint.milestones: step {s} is outside 1..train.steps={t.steps}")
    _positive("tokenizer.vocab_size", c.tokenizer.vocab_size)
    if c.tokenizer.vocab_size < 257:
        raise ConfigError(f"tokenizer.vocab_size: must be >= 257 (256 bytes + end-of-text), "
                          f"got {c.tokenizer.vocab_size}")
    _in_open_unit("data.val_fraction", c.data.val_fraction)
    _non_negative("data.max_docs", c.data.max_docs)
    if c.data.max_doc_bytes < c.filter.max_chars:
        raise ConfigError(f"data.max_doc_bytes: {c.data.max_doc_bytes} is below "
                          f"filter.max_chars={c.filter.max_chars}")
    if c.data.source in ("text", "jsonl") and not c.data.path:
        raise ConfigError(f"data.path: required when data.source={c.data.source!r}")
    if c.data.source == "hf" and not c.data.hf_dataset:
        raise ConfigError("data.hf_dataset: required when data.source='hf'")
    f = c.filter
    if not 0 <= f.max_nonprintable_ratio <= 1:
        raise ConfigError(f"filter.max_nonprintable_ratio: must be in [0, 1], got {f.max_nonprintable_ratio!r}")
    _non_negative("filter.min_chars", f.min_chars)
    if f.max_chars <= f.min_chars:
        raise ConfigError(f"filter.max_chars: {f.max_chars} must exceed filter.min_chars={f.min_chars}")
    _positive("filter.max_char_run", f.max_char_run)
    _positive("filter.ngram_max_period", f.ngram_max_period)
    _positive("filter.ngram_min_repeats", f.ngram_min_repeats)
    _in_open_unit("filter.dedup_threshold", f.dedup_threshold)
    _positive("filter.dedup_num_perm", f.dedup_num_perm)
    _positive("filter.dedup_shingle", f.dedup_shingle)
    _positive("filter.perplexity_zscore", f.perplexity_zscore)
    _non_negative("filter.poison_generated", f.poison_generated)
    _check_spike(c)
    if c.search.log2_lr_min >= c.search.log2_lr_max:
        raise ConfigError(f"search.log2_lr_min: {c.search.log2_lr_min} must be below "
                          f"search.log2_lr_max={c.search.log2_lr_max}")
    for w in c.search.widths:
        if w <= 0 or w % (2 * m.n_head):
            raise ConfigError(f"search.widths: width {w} is not a positive multiple of 2·model.n_head="
                              f"{2 * m.n_head} (heads of even size)")
    _positive("search.lr_points", c.search.lr_points)
    _positive("search.steps", c.search.steps)
    _positive("search.batch_size", c.search.batch_size)
    _positive("search.eval_every", c.search.eval_every)
    _non_negative("search.prune_above", c.search.prune_above)
    _non_negative("search.workers", c.search.workers)
    if c.mup.parametrization not in c.search.parametrizations:
        raise ConfigError(f"search.parametrizations: {c.search.parametrizations} lacks "
                          f"mup.parametrization={c.mup.parametrization!r}, whose LR pretrain takes")
    _check_ablation(c.ablation)
    for key in ("search.widths", "search.seeds", "search.parametrizations", "ablation.blocks",
                "ablation.precisions", "ablation.beta2s", "ablation.warmups", "ablation.stabilizers",
                "ablation.lrs", "ablation.seeds", "recovery.policies"):
        section, name = key.split(".")
        if not getattr(getattr(c, section), name):
            raise ConfigError(f"{key}: must not be empty")


def _check_ablation(a: AblationConfig) -> None:
    for b2 in a.beta2s:
        _in_open_unit("ablation.beta2s", b2)
    for key in ("lr", "z_loss", "steps", "d_model", "n_layer", "n_head", "seq_len", "batch_size",
                "inject_magnitude", "inject_duration"):
        _positive(f"ablation.{key}", getattr(a, key))
    for lr in a.lrs:
        _positive("ablation.lrs", lr)
    _non_negative("ablation.workers", a.workers)
    _non_negative("ablation.retries", a.retries)
    if a.d_model % (2 * a.n_head):
        raise ConfigError(f"ablation.d_model: {a.d_model} is not a multiple of 2·ablation.n_head={2 * a.n_head} "
                          f"(heads of even size)")
    for w in a.warmups:
        if not 0 <= w < a.steps:
            raise ConfigError(f"ablation.warmups: {w} is outside 0..ablation.steps-1={a.steps - 1}")
    if not 0 < a.inject_step or a.inject_step + a.inject_duration > a.steps:
        raise ConfigError(f"ablation.inject_step: the injection (steps {a.inject_step}.."
                          f"{a.inject_step + a.inject_duration - 1}) must end within ablation.steps={a.steps}")
    for key in ("blocks", "precisions", "beta2s", "warmups", "stabilizers", "lrs", "seeds"):
        values = getattr(a, key)
        if len(set(values)) != len(values):
            raise ConfigError(f"ablation.{key}: {values} repeats a value (an arm would run twice)")


def _check_spike(c: Config) -> None:
    sp, r = c.spike, c.recovery
    if sp.kinds and sp.at_step not in c.checkpoint.milestones:
        raise ConfigError(f"spike.at_step: {sp.at_step} is not a pretrain milestone "
                          f"(checkpoint.milestones={c.checkpoint.milestones}); the study starts from one")
    for key in ("magnitude", "duration", "detect_window", "detect_zscore", "detect_ratio", "gpu_hour_usd",
                "sample_tokens"):
        _positive(f"spike.{key}", getattr(sp, key))
    _non_negative("spike.sample_prompts", sp.sample_prompts)
    if not 2 <= sp.detect_warmup <= sp.detect_window:
        raise ConfigError(f"spike.detect_warmup: need 2 <= {sp.detect_warmup} <= spike.detect_window="
                          f"{sp.detect_window}")
    if sp.warm_steps < sp.detect_warmup:
        raise ConfigError(f"spike.warm_steps: {sp.warm_steps} is below spike.detect_warmup="
                          f"{sp.detect_warmup}; the detector would be blind at the injection")
    harmless = sorted(set(sp.data_reasons) - set(SPIKE_CAUSING_POISON))
    if harmless or not sp.data_reasons:
        raise ConfigError(f"spike.data_reasons: {harmless or 'empty'}; choose among the spike-causing "
                          f"poison reasons {list(SPIKE_CAUSING_POISON)}")
    if not 0 <= sp.param_block < c.model.n_layer:
        raise ConfigError(f"spike.param_block: {sp.param_block} is outside 0..model.n_layer-1")
    _in_open_unit("recovery.lr_factor", r.lr_factor)
    _in_open_unit("recovery.recover_epsilon", r.recover_epsilon)
    for key in ("skip_batches", "rollback_steps", "checkpoint_every", "eval_steps", "recover_steps",
                "smooth_steps"):
        _positive(f"recovery.{key}", getattr(r, key))
    _non_negative("recovery.max_retries", r.max_retries)
    if r.recover_steps > r.eval_steps:
        raise ConfigError(f"recovery.recover_steps: {r.recover_steps} exceeds recovery.eval_steps={r.eval_steps}")


# --------------------------------------------------------------------------------------------
# Loading: YAML -> typed, checked dataclasses
# --------------------------------------------------------------------------------------------


def load_config(params: str | Path = "params.yaml", profile: str | None = None,
                overrides: dict[str, Any] | None = None) -> Config:
    """The validated config of ``params`` under a profile, with ``overrides`` on top.

    ``profile`` (else the ``profile`` key of ``params``) names the overlay; ``overrides`` maps
    dotted keys to values and wins over everything (the CLI's ``--set``, the Prefect form).
    Precedence and the reasons for it: :func:`resolve`.
    """
    return resolve(params, profile, overrides).config


@dataclass(frozen=True)
class Resolved:
    """A config and where its values came from."""

    config: Config
    from_profile: dict[str, Any]
    """Dotted keys whose value the profile overlay set (params.yaml holds the default profile's
    value there, so the profile's value applies)."""

    def notice(self) -> str:
        """One line naming the keys the profile set, or ``""`` under the default profile."""
        if not self.from_profile:
            return ""
        pairs = ", ".join(f"{k}={v!r}" for k, v in sorted(self.from_profile.items()))
        return (f"profile {self.config.profile!r} set {len(self.from_profile)} keys: {pairs}. A value in "
                f"params.yaml equal to the default profile's does not override them; to run one of "
                f"these keys at that value, change the profile file or pass it as an override")


def resolve(params: str | Path = "params.yaml", profile: str | None = None,
            overrides: dict[str, Any] | None = None) -> Resolved:
    """Resolve the config from its files; each value comes from the first source that sets it:

    1. ``overrides`` (dotted keys; strings are read as YAML like ``dvc exp run -S``, except for
       string-typed keys);
    2. **explicit** values of ``params``: those that differ from the default profile's;
    3. the profile overlay ``profiles/<profile>.yaml`` (none for ``default``);
    4. the default profile: the declared defaults above, changed by ``profiles/default.yaml``
       where that file exists.

    Why "explicit" means "differs from the default profile": ``dvc exp run -S key=value`` can
    only write into params.yaml (and only keys already there), so params.yaml lists every key at
    its default-profile value (a test keeps it so) and a value the user changed is told apart
    from the file's own default by comparing the two. Both come from files, never from git
    history, so the result (and DVC's cache of it) is a function of the files alone. The one
    case this rule cannot see: a key set back to its default-profile value under another
    profile; the profile's value applies and :meth:`Resolved.notice` names every key the
    profile set.
    """
    params = Path(params)
    raw = _read_yaml(params, "params file")
    _typecheck(Config, raw, "", str(params), partial=True)
    overridden = _typed(_read_overrides(overrides or {}))
    name = _profile_name(params, raw, profile, overridden.get("profile"))
    profiles = params.parent / PROFILES_DIR
    default_profile = _default_profile(profiles / "default.yaml")
    explicit = {k: v for k, v in _typed(raw).items() if k != "profile" and v != default_profile[k]}
    overlay = _typed(_read_overlay(profiles / f"{name}.yaml")) if name != "default" else {}
    from_profile = {k: v for k, v in overlay.items() if k not in explicit and k not in overridden}
    values = {**default_profile, **from_profile, **explicit, **overridden, "profile": name}
    return Resolved(from_dict(_unflatten(values), str(params)), from_profile)


def from_dict(raw: dict[str, Any], source: str = "<dict>") -> Config:
    """Build and validate a Config from a nested dict; missing keys take their defaults."""
    _typecheck(Config, raw, "", source, partial=True)
    return _build(Config, raw).validate()


def check_runtime(cfg: Config) -> None:
    """The checks that need this machine, not just the files: call before anything is deleted
    or moved. Imports torch only when the config asks for a device that needs it."""
    check_device(cfg.train.device)


def check_device(name: str) -> None:
    """``train.device`` must exist here: ``cuda`` needs a CUDA build and a visible device."""
    if name == "cuda":
        import torch

        if not torch.cuda.is_available():
            why = "a CPU-only build" if torch.version.cuda is None else "no CUDA device visible"
            raise ConfigError(f"train.device: 'cuda' is not available here (torch {torch.__version__}, "
                              f"{why}); use 'auto' or 'cpu'")


def _profile_name(params: Path, raw: dict[str, Any], profile: str | None, chosen: str | None) -> str:
    """The profile named by the argument, else the overrides, else params.yaml, else ``default``."""
    if profile is not None and chosen is not None and profile != chosen:
        raise ConfigError(f"profile: given twice, {profile!r} and {chosen!r} in the overrides")
    name = profile or chosen or raw.get("profile", "default")
    if not isinstance(name, str):
        raise ConfigError(f"profile: must be a string, got {name!r} ({params})")
    known = ["default", *sorted(p.stem for p in (params.parent / PROFILES_DIR).glob("*.yaml")
                                if p.stem != "default")]
    if name not in known:
        raise ConfigError(f"profile: unknown profile {name!r}; allowed: {', '.join(known)} "
                          f"(no file {params.parent / PROFILES_DIR / f'{name}.yaml'})")
    return name


def _default_profile(overlay: Path) -> dict[str, Any]:
    """Every dotted key at the default profile's value: the declared defaults, changed by ``overlay``."""
    config = _build(Config, _read_overlay(overlay)) if overlay.is_file() else Config()
    return flatten(dataclasses.asdict(config))


def _read_overlay(path: Path) -> dict[str, Any]:
    overlay = _read_yaml(path, "profile")
    if "profile" in overlay:
        raise ConfigError(f"profile: not allowed inside a profile ({path})")
    _typecheck(Config, overlay, "", str(path), partial=True)
    return overlay


def _read_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    nested = _unflatten({key: _override_value(key, value) for key, value in overrides.items()})
    _typecheck(Config, nested, "", "overrides", partial=True)
    return nested


def _override_value(key: str, value: Any) -> Any:
    """A command-line string as the key's type reads it: ``"100"`` -> 100, ``"[16, 32]"`` -> a list."""
    if not isinstance(value, str) or _declared_type(key) in (str, None):
        return value
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError:
        return value  # the type check names the key


def _declared_type(key: str) -> Any:
    """The annotation of a dotted key (``str`` for string variants), or None for an unknown key."""
    cls: Any = Config
    for part in key.split("."):
        hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
        if part not in hints:
            return None
        cls = hints[part]
    if get_origin(cls) is Literal and all(isinstance(a, str) for a in get_args(cls)):
        return str
    return cls


def _typed(raw: dict[str, Any]) -> dict[str, Any]:
    """The dotted keys ``raw`` sets, valued as the config types them (``"3e-4"`` -> 3e-4)."""
    built = flatten(dataclasses.asdict(_build(Config, raw)))
    return {key: built[key] for key in flatten(raw)}


def _read_yaml(path: Path, what: str) -> dict[str, Any]:
    """A non-empty mapping from ``path``. PyYAML keeps the last of two equal keys without a word,
    so the document's nodes are checked for duplicates before they are turned into values."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    loader = yaml.SafeLoader(path.read_text(encoding="utf-8"))
    try:
        node, data = loader.get_single_node(), None
        if node is not None:  # a file of comments only has none
            _reject_duplicate_keys(node, path)
            data = loader.construct_document(node)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    finally:
        loader.dispose()
    if data is None or data == {}:
        raise ConfigError(f"{path}: empty {what}; it must set at least one key")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    return data


def _reject_duplicate_keys(node: yaml.Node, path: Path, prefix: str = "") -> None:
    if not isinstance(node, yaml.MappingNode):
        return
    first_line: dict[str, int] = {}
    for key_node, value_node in node.value:
        key, line = f"{prefix}{key_node.value}", key_node.start_mark.line + 1
        if key in first_line:
            raise ConfigError(f"{key}: duplicate key in {path} (lines {first_line[key]} and {line}); "
                              f"YAML would silently keep only the last")
        first_line[key] = line
        _reject_duplicate_keys(value_node, path, f"{key}.")


def _typecheck(cls: type, raw: Any, prefix: str, source: str, partial: bool) -> None:
    """Reject unknown keys and values of the wrong type, naming the dotted key."""
    where = prefix.rstrip(".") or "<top level>"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must be a mapping, got {type(raw).__name__} ({source})")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if key not in hints:
            raise ConfigError(f"{dotted}: unknown key ({source}); allowed: {', '.join(names)}")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            _typecheck(hint, value, f"{dotted}.", source, partial)
        else:
            _check_type(dotted, hint, value, source)


def _check_type(key: str, hint: Any, value: Any, source: str) -> None:
    origin, args = get_origin(hint), get_args(hint)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(repr, args))} ({source})")
    elif origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: must be a list, got {value!r} ({source})")
        for i, item in enumerate(value):
            _check_type(f"{key}[{i}]", args[0], item, source)
    elif origin in (Union, types.UnionType):
        if not any(_matches(a, value) for a in args):
            raise ConfigError(f"{key}: {value!r} does not match {hint} ({source})")
    elif not _matches(hint, value):
        raise ConfigError(f"{key}: must be {hint.__name__}, got {type(value).__name__} {value!r} ({source})")


def _matches(hint: Any, value: Any) -> bool:
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        number = _as_float(value)
        return number is not None and math.isfinite(number)
    return isinstance(value, hint)


def _as_float(value: Any) -> float | None:
    """Ints, floats, and numeric strings: PyYAML (YAML 1.1) reads ``3e-4`` as a string, DVC does not."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _build(cls: type, raw: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in raw.items():
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            value = _build(hint, value)
        elif hint is float:
            value = _as_float(value)
        elif get_origin(hint) is list and get_args(hint)[0] is float:
            value = [_as_float(v) for v in value]
        kwargs[key] = value
    return cls(**kwargs)


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _unflatten(dotted: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in dotted.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out
