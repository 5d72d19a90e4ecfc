"""The numerics modes (``precision.numerics``): which code paths the CPU libraries take. Torch-free:
the settings are environment variables that MKL, oneDNN and ATen read once, when torch loads, so a
launcher applies them (:func:`apply_numerics`) after reading the config and before importing torch;
every process it starts (Dask workers, torchrun's ranks) inherits them. A process started without
such a launcher (``python -m model.train``, an arm's own command, the tests) takes the mode named by
``SPIKELAB_NUMERICS``, else the default, when ``model`` is first imported (model/__init__.py); the
trainer refuses a run whose config asks for another mode than the process runs
(model/provenance.py: check_numerics).

  native    the default: each library's fastest path for this CPU (MKL's strict CNR on its
            automatic branch: the same bits on any thread count). Bits differ between CPU kinds
            (issue 28), so the study's verdicts are built to survive that (tasks/report/robustness.py).
  portable  one code path on every x86-64 CPU with AVX2: MKL's CNR at its COMPATIBLE branch, oneDNN
            capped at AVX2, ATen's kernels at AVX2, and ``emulate: auto`` emulating bf16/fp16 on the
            CPU (real autocast kernels are per CPU). Measured (benchmarks/bench_numerics.py, same
            torch build): an AMD EPYC Zen 4 and an Intel Xeon with AMX gave bitwise-equal arms, fp32
            and bf16, at 0.58-0.63x native's tokens per CPU-second. MKL's cheaper strict AVX2 branch
            did not hold: asked for it on AMD, MKL runs its automatic branch, and the bits differ
            from the Intel Xeon's. The cost is past the issue's 25 %, hence not the default.
"""

from __future__ import annotations

import os

MODE_ENV = "SPIKELAB_NUMERICS"
"""The mode of a process started without a launcher that read the config."""
DEFAULT_MODE = "native"
MODES = {
    "portable": {"MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
    "native": {"MKL_CBWR": "AUTO,STRICT"},
}
"""Each mode's library settings (environment variables, read when torch loads)."""


def process_mode() -> str:
    """The mode this process was started in (``SPIKELAB_NUMERICS``, else the default)."""
    return os.environ.get(MODE_ENV, DEFAULT_MODE)


def check_mode(mode: str, device_type: str = "cpu") -> None:
    """Refuse to train in ``mode`` in a process whose libraries were set up for the other one, or,
    on the CPU, whose ATen kernels are not the mode's: portable needs AVX2's (a setting given by
    hand, or torch ops run before the mode's settings were made, would keep another path while
    the process still names itself portable; a CPU without AVX2 has no portable path)."""
    from model.typed_config import ConfigError  # here: model/private.py, under the system Python, imports this package

    if mode != process_mode():
        raise ConfigError(
            f"precision.numerics: {mode!r}, but this process runs {process_mode()!r} numerics, fixed when "
            f"torch loaded; start it with {MODE_ENV}={mode} in its environment (spikelab run sets it)"
        )
    import torch  # here, not at the top: the modes are read before torch may load (model/__init__.py)

    capability = torch.backends.cpu.get_cpu_capability()
    if device_type == "cpu" and mode == "portable" and capability != "AVX2":
        raise ConfigError(
            f"precision.numerics: 'portable', but ATen runs its {capability} kernels in this process "
            f"(ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY')!r}); portable needs its AVX2 "
            f"ones (on a CPU without AVX2, use precision.numerics: native)"
        )


def apply_numerics(mode: str) -> None:
    """Set ``mode``'s library settings for torch to read when it loads, here and in every process
    started from here: the settings the process mode put there (model/__init__.py) are replaced,
    one given by hand is kept."""
    for key, value in MODES[process_mode()].items():
        if os.environ.get(key) == value:
            del os.environ[key]
    os.environ[MODE_ENV] = mode
    for key, value in MODES[mode].items():
        os.environ.setdefault(key, value)
