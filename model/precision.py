"""Compute precision of the forward pass: fp32, bf16, fp16 (real autocast or CPU emulation).

Master weights, gradients and Adam state stay fp32 in every mode; only matrix products run in the
low-precision type, as on a GPU under autocast.

  fp32   no autocast, no loss scaling
  bf16   autocast to bfloat16; fp32's exponent range, so no loss scaling (the stable recipe)
  fp16   autocast to float16 + dynamic loss scaling (GradScaler; skips and counts overflow steps);
         ``precision.loss_scaling: false`` gives unscaled fp16, which overflows and underflows

EMULATION (``precision.emulate``). A CPU without bf16/fp16 hardware runs real autocast several times
slower than fp32, so there (``emulate: auto`` decides by the CPU's flags, see
:func:`resolve_precision`) the low-precision modes are emulated: every matrix product
(F.linear, matmul/@, bmm, mm, scaled_dot_product_attention) rounds its inputs to the low-precision
type, multiplies in fp32 (tensor cores accumulate in fp32 too) and rounds its output to the
low-precision type. Values keep the fp32 dtype but are exactly representable in bf16/fp16, so range
effects are the real ones: an fp16 output >= 65520 rounds to inf (``FP16_MAX``, 65504, is the largest finite
fp16), bf16 keeps fp32's range. Autograd carries the rounding into the backward pass (the gradient
of a rounding is a rounding), so fp16 gradients overflow and underflow as on the GPU, which is what
loss scaling is about. Not emulated: element-wise ops that real autocast runs in low precision
(activations, the SwiGLU gate product, residual adds of two low-precision tensors) stay fp32, and
inside attention the softmax probabilities are not rounded before P·V. It is an emulation of the
numerics that drive stability (range, matmul rounding), not a bit-exact model of any kernel.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from model.config import PrecisionConfig
from model.gpt import causal_attention

LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}

# fp16's range (IEEE half: 5 exponent bits): why fp16 needs loss scaling and bf16 does not.
FP16_MAX = 65504.0
"""Largest finite fp16; magnitudes from 65520 up round to inf."""
FP16_SMALLEST_NORMAL = 2.0**-14
"""Below it fp16 is subnormal: fewer than 11 significant bits."""
FP16_SMALLEST_SUBNORMAL = 2.0**-24
"""Smallest positive fp16; magnitudes below it round to 0 (under 2^-25) or up to it."""

# The matrix products a GPU would send to tensor cores under autocast.
MATRIX_PRODUCTS = frozenset(
    {
        F.linear,
        torch.matmul,
        torch.Tensor.matmul,
        torch.Tensor.__matmul__,
        torch.Tensor.__rmatmul__,
        torch.mm,
        torch.Tensor.mm,
        torch.bmm,
        torch.Tensor.bmm,
        F.scaled_dot_product_attention,
        causal_attention,  # the fused trainer's attention on the CPU: rounded as SDPA is, as one product
    }
)


class EmulatedMatmuls(TorchFunctionMode):
    """Round the fp32 inputs and outputs of every matrix product to ``dtype`` (see module doc)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def _round(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dtype == torch.float32:
            return x.to(self.dtype).to(torch.float32)
        return x

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Collection[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func not in MATRIX_PRODUCTS:
            return func(*args, **kwargs)
        args = tuple(self._round(a) for a in args)
        kwargs = {k: self._round(v) for k, v in kwargs.items()}
        return self._round(func(*args, **kwargs))


@dataclass(frozen=True)
class Precision:
    """The resolved precision of a run: what wraps the forward pass and how the loss is scaled."""

    mode: str  # fp32 | bf16 | fp16
    emulated: bool  # low precision emulated in fp32 (see module doc) instead of autocast
    loss_scaling: bool  # dynamic loss scaling (fp16 only)
    device_type: str
    native: str | None = None  # the hardware path real autocast uses ("CUDA", "AVX512-BF16")

    @property
    def dtype(self) -> torch.dtype | None:
        return LOW_PRECISION.get(self.mode)

    def autocast(self) -> contextlib.AbstractContextManager:
        """Context for the forward pass (and the loss); backward needs none."""
        if self.dtype is None:
            return contextlib.nullcontext()
        if self.emulated:
            return EmulatedMatmuls(self.dtype)
        return torch.autocast(self.device_type, dtype=self.dtype)

    def grad_scaler(self, cfg: PrecisionConfig) -> torch.amp.GradScaler:
        """A GradScaler; disabled (every call a no-op) unless this is fp16 with loss scaling."""
        return torch.amp.GradScaler(
            self.device_type, init_scale=cfg.init_scale, growth_interval=cfg.growth_interval, enabled=self.loss_scaling
        )

    def describe(self) -> str:
        if self.dtype is None:
            return self.mode
        how = "emulated" if self.emulated else f"autocast, {self.native or 'no native path'}"
        scaling = ", loss scaling" if self.loss_scaling else ", unscaled" if self.mode == "fp16" else ""
        return f"{self.mode} ({how}{scaling})"


NATIVE_CPU_FLAGS = {"bf16": ("avx512_bf16", "amx_bf16"), "fp16": ("avx512_fp16", "amx_fp16")}
"""CPU features (``/proc/cpuinfo`` flags) with which oneDNN runs autocast's matrix products natively.
Measured on an AMD EPYC with avx512_bf16: real bf16 autocast 0.70x the fp32 step time, emulation
1.10x; without such a flag real autocast ran ~3x slower than fp32 and emulation is the fast path."""


@functools.cache
def cpu_info() -> dict[str, str]:
    """The first processor's fields in ``/proc/cpuinfo`` (vendor_id, cpu family, model, flags...);
    empty where it cannot be read (not Linux)."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                info[key.strip()] = value.strip()
    except OSError:
        pass
    return info


def cpu_flags() -> frozenset[str]:
    return frozenset(cpu_info().get("flags", "").split())


def native_low_precision(mode: str, device_type: str) -> str | None:
    """Why real autocast is the fast path for ``mode`` here (None: it is not)."""
    if device_type == "cuda":
        return "CUDA"
    native = [flag for flag in NATIVE_CPU_FLAGS.get(mode, ()) if flag in cpu_flags()]
    return native[0].upper().replace("_", "-") if native else None


def resolve_precision(cfg: PrecisionConfig, device_type: str) -> Precision:
    """``emulate: auto`` runs real autocast where the hardware has the type natively (CUDA, a CPU
    with AVX512-BF16/AMX) and numerics are native, emulation elsewhere (a CPU's autocast kernels
    differ from CPU to CPU); ``always``/``never`` force the choice."""
    native = native_low_precision(cfg.mode, device_type)
    portable_cpu = cfg.numerics == "portable" and device_type == "cpu"
    emulate = cfg.emulate == "always" or (cfg.emulate == "auto" and (native is None or portable_cpu))
    return Precision(
        mode=cfg.mode,
        emulated=emulate and cfg.mode != "fp32",
        loss_scaling=cfg.mode == "fp16" and cfg.loss_scaling,
        device_type=device_type,
        native=None if emulate else native,
    )
