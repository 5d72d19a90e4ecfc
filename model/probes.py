"""Two measurement probes for textbook stability claims, in plain torch.

fp16 range (Micikevicius et al. 2017: the reason fp16 needs loss scaling)
    fp16_range_shares(t)   share of a tensor's nonzero elements that fp16 would flush to zero,
                           keep with reduced precision, or overflow to inf
    RangeRecorder          hooks on a GPT that count those shares per block during forward/backward
    RangeProbe             a trainer callback running the recorder at step 1 and every ``every`` steps
    overflow_multiplier    the smallest power of two by which one block's weight matrices must be
                           scaled for fp16's forward pass to overflow while bf16's does not
    underflow_by_shift     per loss shift k, the worst block's share of activation gradients that
                           fp16 would flush to zero once the loss is multiplied by 2^-k

Depth (Xiong et al. 2020, Theorem 1: Post-LN has large gradients near the output at init; Pre-LN's
last-layer gradient shrinks like 1/√L)
    gradient_norms_at_init per-layer gradient norms of a standard-parametrization GPT after one backward
    depth_sweep            those norms over blocks (pre_ln, post_ln) and depths
    summarize_depth        last-layer norm and last/first ratio per arm, log-log slope over depth
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, get_args

import numpy as np
import torch
from torch.nn.utils import get_total_norm

from model.callbacks import Callback, TrainerView
from model.config import Block, ModelConfig, MupConfig, Precision, PrecisionConfig
from model.gpt import GPT
from model.precision import FP16_MAX, FP16_SMALLEST_NORMAL, FP16_SMALLEST_SUBNORMAL, resolve_precision

if TYPE_CHECKING:
    from model.step import PendingStep

# ----------------------------------------------------------------------------------------------
# fp16 range
# ----------------------------------------------------------------------------------------------

RANGES = ("below_subnormal", "below_normal", "above_max")
"""Columns 1.. of :func:`fp16_range_counts` (column 0 counts the nonzero elements)."""


@torch.no_grad()
def fp16_range_counts(t: torch.Tensor) -> torch.Tensor:
    """(nonzero, below 2^-24, below 2^-14, above 65504) element counts of ``t`` by magnitude, on
    ``t``'s device (no host sync). Zeros are left out: they are exact in every format."""
    a = t.detach().abs()
    nonzero = a != 0  # NaN counts as nonzero and lands in no range
    return torch.stack(
        [
            nonzero.sum(),
            (nonzero & (a < FP16_SMALLEST_SUBNORMAL)).sum(),
            (nonzero & (a < FP16_SMALLEST_NORMAL)).sum(),
            (a > FP16_MAX).sum(),
        ]
    )


def fp16_range_shares(t: torch.Tensor) -> dict[str, float]:
    """Of ``t``'s nonzero elements (``count``), the share fp16 cannot hold: ``below_subnormal``
    (|x| < 2^-24: rounds to 0 or to 2^-24), ``below_normal`` (|x| < 2^-14, which includes the
    former: subnormal, fewer significant bits) and ``above_max`` (|x| > 65504: 65520 and up round to
    inf). Shares are NaN when ``t`` has no nonzero element. One host sync."""
    count, *hits = fp16_range_counts(t).tolist()
    return {"count": count, **{name: h / count if count else float("nan") for name, h in zip(RANGES, hits)}}


QUANTITIES = {
    "act_grad_below_subnormal": "below_subnormal",  # gradient at the block's output (the residual stream)
    "param_grad_below_subnormal": "below_subnormal",  # gradient of the block's parameters
    "act_above_max": "above_max",  # the block's output
    "mlp_pre_above_max": "above_max",  # the MLP's pre-activation (its up projection's output)
}
"""What :class:`RangeRecorder` measures per block, and the fp16 range (a key of
:func:`fp16_range_shares`) it reports the share of."""


class RangeRecorder:
    """Counts, per block of ``model``, the :data:`QUANTITIES` over every forward and backward pass
    until :meth:`remove`. Gradients are taken as the backward pass computes them, so they include
    the loss scale (GradScaler) and the 1/micro-batches factor, and not the trainer's later unscale
    or ``scale_grad``: that is what a real fp16 backward would have to represent. Counts stay on
    the device; :meth:`shares` reads them in one sync. Usable as a context manager."""

    def __init__(self, model: GPT):
        self.counts: dict[tuple[str, str], torch.Tensor] = {}  # (layer, quantity) -> (hits, nonzero)
        self.handles: list[Any] = []
        for i, block in enumerate(model.layers):
            count = functools.partial(self._count, f"block{i}")
            self.handles += [
                block.register_forward_hook(lambda _m, _i, out, count=count: _on_block_output(count, out)),
                block.mlp.up.register_forward_hook(lambda _m, _i, out, count=count: count("mlp_pre_above_max", out)),
                *(
                    p.register_hook(lambda g, count=count: count("param_grad_below_subnormal", g))
                    for p in block.parameters()
                ),
            ]

    def _count(self, layer: str, quantity: str, t: torch.Tensor) -> None:
        counts = fp16_range_counts(t)
        hits_and_nonzero = counts[[1 + RANGES.index(QUANTITIES[quantity]), 0]]
        self.counts[(layer, quantity)] = self.counts.get((layer, quantity), 0) + hits_and_nonzero

    def shares(self) -> dict[tuple[str, str], float]:
        """(layer, quantity) -> share of the nonzero elements (NaN when none was nonzero)."""
        if not self.counts:
            return {}
        pairs = torch.stack(list(self.counts.values())).tolist()
        return {key: hits / n if n else float("nan") for key, (hits, n) in zip(self.counts, pairs)}

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def __enter__(self) -> RangeRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _on_block_output(count: Callable[[str, torch.Tensor], None], out: torch.Tensor) -> None:
    count("act_above_max", out)
    if out.requires_grad:  # the residual-stream gradient reaches this tensor during backward
        out.register_hook(lambda g: count("act_grad_below_subnormal", g))


class RangeRow(NamedTuple):
    step: int  # the optimizer step whose forward/backward was measured (1: the model at init)
    layer: str  # block0, block1, ...
    quantity: str  # a key of QUANTITIES
    share: float


class RangeProbe(Callback):
    """Runs a :class:`RangeRecorder` over the forward/backward of step 1 (the model at init) and
    of every ``every``-th step; :attr:`rows` holds one :class:`RangeRow` per block and quantity.

    Meant for fp32 runs (and bf16, which has fp32's range): it tells what fp16 would lose at the
    run's loss scale. In an fp16 run, emulated or not, the matrix products have already rounded,
    so values fp16 flushed are zeros here and leave the count. Other steps cost nothing (no hooks);
    a probe step runs eagerly and syncs once."""

    name, order = "range_probe", 70

    def __init__(self, every: int, also_at: Iterable[int] = ()):
        if every < 1:
            raise ValueError(f"range probe: every must be >= 1, got {every}")
        self.every, self.also_at = every, frozenset(also_at)  # also_at: e.g. the steps after an injected spike
        self.rows: list[RangeRow] = []
        self.recorder: RangeRecorder | None = None  # installed during a probe step only

    def due(self, step: int) -> bool:
        return step == 1 or step % self.every == 0 or step in self.also_at

    def on_step_start(self, trainer: TrainerView) -> None:
        if self.due(trainer.step + 1):
            self.recorder = RangeRecorder(trainer.model)
            trainer.request_eager()  # hooks would break a compiled graph

    def on_before_optimizer(self, trainer: TrainerView, pending: PendingStep) -> None:
        if self.recorder is None:
            return
        shares = self.recorder.shares()
        self._stop_recording()
        self.rows += [RangeRow(pending.step, layer, quantity, share) for (layer, quantity), share in shares.items()]

    def on_close(self, trainer: TrainerView) -> None:
        self._stop_recording()  # a step that raised between its start and the optimizer

    def _stop_recording(self) -> None:
        if self.recorder is not None:
            self.recorder.remove()
            self.recorder = None

    def state_dict(self) -> dict[str, Any]:
        return {"rows": [list(row) for row in self.rows]}  # plain lists: checkpoints load weights_only

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rows = [RangeRow(*row) for row in state["rows"]]


@torch.no_grad()
def finite_forward(model: GPT, x: torch.Tensor, y: torch.Tensor, mode: Precision) -> bool:
    """Whether an emulated ``mode`` forward pass of ``model`` on (x, y) ends in a finite loss."""
    precision = resolve_precision(PrecisionConfig(mode=mode, emulate="always"), x.device.type)
    with precision.autocast():
        _, ce, z = model(x, y)
    return bool(torch.isfinite(ce + z))


@torch.no_grad()
def overflow_multiplier(model: GPT, x: torch.Tensor, y: torch.Tensor, block: int, max_doublings: int = 40) -> float:
    """The smallest power of two by which the weight matrices of ``block`` must be multiplied for
    an emulated fp16 forward pass on (x, y) to go non-finite while bf16's stays finite: the size a
    ``param`` injection needs to put fp16, and not bf16, past its range. Measured on a copy (the
    model is untouched); raises when no multiplier up to 2^max_doublings separates the two."""
    probe = copy.deepcopy(model)
    matrices = probe.block_matrices(block)
    for k in range(1, max_doublings + 1):
        torch._foreach_mul_(matrices, 2.0)  # exact: the same bits as one multiplication by 2^k
        if not finite_forward(probe, x, y, "fp16"):
            if not finite_forward(probe, x, y, "bf16"):
                raise ValueError(f"block {block} x 2^{k}: bf16 overflows as soon as fp16 does")
            return 2.0**k
    raise ValueError(f"block {block}: no multiplier up to 2^{max_doublings} overflows fp16")


def underflow_by_shift(model: GPT, x: torch.Tensor, y: torch.Tensor, shifts: Iterable[int]) -> dict[int, float]:
    """One fp32 forward/backward of ``model`` on (x, y): for each k in ``shifts``, the largest share
    over blocks of nonzero activation-gradient values (the residual stream at each block's output,
    as :class:`RangeRecorder` measures them) below fp16's smallest subnormal once the loss is
    multiplied by 2^-k (``precision.loss_shift``). fp32 gradients scale exactly by a power of two,
    so one pass answers every k: |g| 2^-k < 2^-24 exactly when |g| < 2^(k-24). The model's
    gradients are left as the pass made them (call it on a model that is about to be discarded)."""
    magnitudes: list[torch.Tensor] = []

    def keep(out: torch.Tensor) -> None:
        out.register_hook(lambda g: magnitudes.append(g.detach().abs().flatten()))

    handles = [block.register_forward_hook(lambda _m, _i, out: keep(out)) for block in model.layers]
    try:
        _, ce, z = model(x, y)
        (ce + z).backward()
    finally:
        for handle in handles:
            handle.remove()
    nonzero = [m[m != 0] for m in magnitudes]
    return {
        k: max(float((m < FP16_SMALLEST_SUBNORMAL * 2.0**k).float().mean()) if m.numel() else 0.0 for m in nonzero)
        for k in shifts
    }


# ----------------------------------------------------------------------------------------------
# Depth
# ----------------------------------------------------------------------------------------------

DEPTH_PROBE_MODEL = ModelConfig(d_model=64, n_head=4, seq_len=32)
"""Small enough that one model's forward/backward takes well under a second on a CPU core."""
BLOCKS: tuple[Block, ...] = get_args(Block)
DEPTHS = (2, 4, 6, 8, 12)


def _fixed_tokens(batch: int, seq_len: int, vocab: int) -> torch.Tensor:
    """The fixed (batch, seq_len + 1) token ids every model of a sweep sees."""
    return torch.randint(0, vocab, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))


def gradient_norms_at_init(
    cfg: ModelConfig = DEPTH_PROBE_MODEL,
    depth: int = 2,
    block: Block = "pre_ln",
    seeds: Sequence[int] = (0,),
    batch: int = 8,
    vocab: int = 256,
) -> dict[str, float]:
    """Gradient Frobenius norm of each block's weight matrices (``block0``..) and of the readout,
    after one forward/backward at init (no optimizer step) of a ``depth``-block GPT with
    ``block`` layout and the standard parametrization (the project's GPT under ``cfg.init``: GPT-2's
    std ``cfg.init_std`` with residual projections ÷ √(2L), or the original Transformer's Xavier init;
    no zero-init readout). The batch is fixed; each seed draws a new init; the norms are averaged
    over the seeds."""
    cfg = dataclasses.replace(cfg, n_layer=depth, block=block)
    idx = _fixed_tokens(batch, cfg.seq_len, vocab)
    per_seed = [_layer_grad_norms(cfg, seed, vocab, idx) for seed in seeds]
    return {layer: float(np.mean([norms[layer] for norms in per_seed])) for layer in per_seed[0]}


def _layer_grad_norms(cfg: ModelConfig, seed: int, vocab: int, idx: torch.Tensor) -> dict[str, float]:
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG stream alone
        torch.manual_seed(seed)
        model = GPT(cfg, MupConfig(parametrization="sp"), vocab)
        _, ce, z = model(idx[:, :-1], idx[:, 1:])
        (ce + z).backward()
    layers = {f"block{i}": block for i, block in enumerate(model.layers)} | {"readout": model.readout}
    norms = {name: get_total_norm([_grad(p) for p in m.parameters() if p.dim() == 2]) for name, m in layers.items()}
    return dict(zip(norms, torch.stack(list(norms.values())).tolist()))


def _grad(p: torch.nn.Parameter) -> torch.Tensor:
    assert p.grad is not None, "after backward every weight matrix of the GPT has a gradient"
    return p.grad


def depth_sweep(
    cfg: ModelConfig = DEPTH_PROBE_MODEL,
    blocks: Sequence[Block] = BLOCKS,
    depths: Sequence[int] = DEPTHS,
    seeds: Sequence[int] = (0,),
    batch: int = 8,
) -> dict[tuple[str, int], dict[str, float]]:
    """(block, depth) -> :func:`gradient_norms_at_init` for every arm."""
    return {(b, L): gradient_norms_at_init(cfg, L, b, seeds, batch) for b in blocks for L in depths}


@dataclasses.dataclass(frozen=True)
class DepthSummary:
    rows: list[dict[str, Any]]  # per (block, depth): last-layer norm, first-layer norm, last/first
    slopes: dict[str, float]  # per block: d log(last-layer norm) / d log L (Xiong, Pre-LN: -1/2)


def summarize_depth(sweep: dict[tuple[str, int], dict[str, float]]) -> DepthSummary:
    """The last block's gradient norm and its ratio to the first block's, per arm of a
    :func:`depth_sweep`, and a least-squares log-log slope of the last-block norm over depth."""
    rows: list[dict[str, Any]] = []
    for (block, depth), norms in sweep.items():
        first, last = norms["block0"], norms[f"block{depth - 1}"]
        rows.append({"block": block, "depth": depth, "last": last, "first": first, "last_over_first": last / first})
    slopes = {}
    for block in dict.fromkeys(row["block"] for row in rows):
        arm = [row for row in rows if row["block"] == block]
        depths, lasts = np.log([r["depth"] for r in arm]), np.log([r["last"] for r in arm])
        slopes[block] = float(np.polyfit(depths, lasts, 1)[0])
    return DepthSummary(rows, slopes)
