"""The arithmetic a run used, recorded beside its numbers: one place for that fact.

The same arm gives other bits on another CPU (issue 28: 1e-3 to 1e-1 nats on an AMD EPYC against
the committed outputs) because each library picks its code path per CPU: ATen's vectorised kernels
by the CPU's widest ISA (``ATEN_CPU_CAPABILITY`` caps it), MKL's fp32 matrix products by its
conditional-numerical-reproducibility branch (``MKL_CBWR``) and the CPU's vendor, oneDNN's bf16
autocast kernels by its ISA (``ONEDNN_MAX_CPU_ISA`` caps it), and ``precision.emulate: auto`` by
the CPU's bf16/fp16 flags (model/precision.py). :func:`provenance` records all of it for the
process that calls it; :func:`numeric_path` digests the fields that change bits (:data:`PATH_FIELDS`)
into a short id that runs, ``metrics/*.json`` and the report compare.

Not in the digest: the CPU's marketing name (the family/model numbers and flags say what matters),
the run's precision mode (its config, already in the run identity; what ``auto`` resolves to on
this machine is in), and the thread counts. Those change bits too (benchmarks/bench_numerics.py:
the default grid's fp32 arm, 1 against 2 threads, in both numerics modes), but they are each run's
setting, not the machine's (arms run on one; pretrain picks by load): the record keeps them beside
the path, so runs that share a path are compared on ``threads.intra_op`` as well.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
from typing import Any

import torch

from model.config import TrainingConfig
from model.precision import NATIVE_CPU_FLAGS, Precision, cpu_flags, cpu_info, native_low_precision, resolve_precision
from model.train import resolve_device

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16")
"""The ``/proc/cpuinfo`` flags that decide which kernels ATen, MKL and oneDNN run."""
NUMERICS_ENV = (
    "MKL_CBWR",
    "MKL_ENABLE_INSTRUCTIONS",
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_DEFAULT_FPMATH_MODE",
)
"""Environment settings that move a library off its per-CPU default path (read at process start)."""
PATH_FIELDS = (
    "device",
    "cpu.vendor",
    "cpu.family",
    "cpu.model",
    "cpu.isa",
    "torch",
    "aten_capability",
    "mkl",
    "onednn",
    "autocast",
    "float32_matmul_precision",
    "env",
)
"""The fields of a :func:`provenance` record that change a run's bits: what :func:`numeric_path` hashes."""
MKL_CBWR_ALL = -1
"""``mkl_cbwr_get``'s argument for the whole setting: the branch, and :data:`MKL_STRICT`."""
MKL_STRICT = 0x10000
"""The bit of MKL's CBWR setting for strict mode (``MKL_CBWR=<branch>,STRICT``)."""


def provenance(precision: Precision | None = None) -> dict[str, Any]:
    """This process's arithmetic: CPU, library versions and the code paths they take, threads,
    numerics settings, and ``precision``'s resolved path; ``numeric_path`` is its digest."""
    config = torch.__config__.show()
    record = {
        "device": precision.device_type if precision else "cpu",
        "cpu": cpu_record(),
        "torch": torch.__version__,
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        "mkl": {"version": _version(config, r"Math Kernel Library Version ([\d.]+)"), "cbwr": mkl_cbwr()},
        "onednn": {
            "version": _version(config, r"MKL-DNN v(\S+)"),
            "max_isa": os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "native",
        },
        "autocast": {mode: native_low_precision(mode, "cpu") for mode in NATIVE_CPU_FLAGS},
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "env": {k: os.environ[k] for k in NUMERICS_ENV if k in os.environ},
        "threads": {"intra_op": torch.get_num_threads(), "interop": torch.get_num_interop_threads()},
        "precision": precision.describe() if precision else None,
        **({"gpu": gpu_record()} if precision and precision.device_type == "cuda" else {}),
    }
    return {**record, "numeric_path": numeric_path(record)}


def config_provenance(cfg: TrainingConfig) -> dict[str, Any]:
    """:func:`provenance` for runs of ``cfg`` in this process: its device and precision resolved
    as the trainer resolves them (a stage's record, beside the records of the runs it made)."""
    return provenance(resolve_precision(cfg.precision, resolve_device(cfg.train.device).type))


def numeric_path(record: dict[str, Any]) -> str:
    """12 hex characters over the record's :data:`PATH_FIELDS`: equal paths, same kernels."""
    fields = {name: _field(record, name) for name in PATH_FIELDS}
    for optional in ("gpu", "trainer"):  # absent from most records: their digests stay as they were
        if optional in record:
            fields[optional] = record[optional]
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


def with_trainer(record: dict[str, Any], trainer: str) -> dict[str, Any]:
    """``record`` of a run that another trainer than model/train.py's made (a fused group's arm,
    model/fused.py: other kernels, other bits), its ``numeric_path`` taking the trainer in."""
    marked = {**record, "trainer": trainer}
    return {**marked, "numeric_path": numeric_path(marked)}


def cpu_record() -> dict[str, Any]:
    info = cpu_info()
    return {
        "name": info.get("model name"),
        "vendor": info.get("vendor_id"),
        "family": info.get("cpu family"),
        "model": info.get("model"),
        "isa": [flag for flag in ISA_FLAGS if flag in cpu_flags()],
    }


def gpu_record() -> dict[str, Any]:
    return {
        "name": torch.cuda.get_device_name(),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "tf32": torch.backends.cuda.matmul.allow_tf32,
    }


def mkl_cbwr() -> int | None:
    """The CBWR setting MKL itself reports (what it took from ``MKL_CBWR``, not what was asked):
    its branch code, plus :data:`MKL_STRICT`; None where torch's MKL is not reachable."""
    try:
        mkl = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        get = mkl.mkl_serv_cbwr_get  # mkl_cbwr_get, under the name torch's static MKL exports
    except (OSError, AttributeError):
        return None
    get.argtypes, get.restype = [ctypes.c_int], ctypes.c_int
    return int(get(MKL_CBWR_ALL))


def _version(config: str, pattern: str) -> str | None:
    found = re.search(pattern, config)
    return found.group(1) if found else None


def _field(record: dict[str, Any], dotted: str) -> Any:
    value: Any = record
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value
