"""Four rules pinned against values written here, not read back from the code under test:

1. the design hash (tasks/design/preregistration.py) changes when any verdict-deciding file changes by one
   byte: every entry of DESIGN_CODE, and the declared families' files, which decide verdicts too;
2. an equivalence claim (tasks/report/verdict.py) and a paired TOST (tasks/design/stats.py) need
   p < ALPHA strictly: p exactly at ALPHA is not equivalence, the next float below it is;
3. ``precision.numerics: portable`` pins the CPU libraries to MKL's COMPATIBLE branch, oneDNN and
   ATen at AVX2 (model/numerics.py), in a process that takes the mode before torch loads;
4. a portable trainer refuses a process whose ATen kernels are wider than AVX2's on any CPU: the
   capability torch reports is faked, so no AVX-512 CPU is needed."""

from __future__ import annotations

import inspect
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trainer_kit import markov_tokens, tiny_config

import tasks.design.preregistration as design_mod
from model.numerics import MODE_ENV, MODES, apply_numerics, check_mode
from model.precision import cpu_flags
from model.train import Trainer
from model.typed_config import ConfigError
from tasks.design.stats import ALPHA, tost_paired
from tasks.report.verdict import EQUIVALENCE, INCONCLUSIVE, REPRODUCED, Claim, verdict

REPO = Path(__file__).resolve().parents[1]

# 1. The design hash -------------------------------------------------------------------------------

VERDICT_FILES = (
    "tasks/design/preregistration.yaml",  # the design, and the built-in families' declarations
    "tasks/report/verdict.py",
    "tasks/report/findings.py",
    "tasks/report/recovery.py",  # the spike finding's recovery and step-tied rules (version 4)
    "tasks/report/natural.py",  # the spike finding's secondary analysis: natural spikes (version 4)
    "tasks/ablate/natural.py",  # the arms it reads
    "tasks/report/method.py",  # the one method every finding and declared family shares
    "tasks/report/declared.py",  # the declared families' findings: their claims and tests
    "tasks/design/studies.py",  # the declared families and their claims, as they are read
    "tasks/design/families.py",  # a family's factors and the config keys each arm takes from them
    "tasks/design/stats.py",
    "tasks/ablate/grid.py",
    "tasks/ablate/conditions.py",
    "tasks/search/fit.py",
    "tasks/spike/study.py",
    "tasks/spike/scores.py",
    "tasks/spike/summary.py",
    "tasks/spike/sizing.py",
    "tasks/ablate/sizing.py",
    "tasks/report/sequential.py",  # the boundaries a look is tested against
    "tasks/ablate/rounds.py",  # which seeds each family is given, and when it stops
    "tasks/design/seed_registry.py",  # which seeds a study may train on
    "tasks/design/seed_registry.yaml",
    "tasks/design/registration.py",  # which runs are confirmatory
)
"""Every file that decides a verdict, written here: one dropped from DESIGN_CODE fails its case."""


@pytest.fixture
def design_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of every verdict-deciding file under tmp_path, which design.ROOT now points at."""
    for name in VERDICT_FILES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / name, tmp_path / name)
    monkeypatch.setattr(design_mod, "ROOT", tmp_path)
    return tmp_path


def test_the_design_hash_of_an_unchanged_copy_is_the_checkouts(design_copy, monkeypatch):
    copied = design_mod.design_hash()
    monkeypatch.setattr(design_mod, "ROOT", REPO)
    assert copied == design_mod.design_hash()
    assert len(copied) == 16 and int(copied, 16) >= 0


@pytest.mark.parametrize("name", VERDICT_FILES)
def test_a_one_byte_change_to_any_verdict_deciding_file_changes_the_design_hash(design_copy, name):
    before = design_mod.design_hash()
    path = design_copy / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of one byte, the length unchanged
    path.write_bytes(bytes(data))
    assert design_mod.design_hash() != before, (
        f"{name} decides verdicts, but tasks/design/preregistration.py: DESIGN_CODE does not cover it"
    )


# 2. Equivalence at p exactly ALPHA ----------------------------------------------------------------

SESOI = 0.01


def equivalence_claim(p: float) -> Claim:
    """An equivalence claim whose estimate, interval and halves all lie well inside ±SESOI: only
    its TOST p decides whether it holds."""
    return Claim(
        "no effect within ±0.01 nats",
        0.001,
        p,
        0,
        kind=EQUIVALENCE,
        sesoi=SESOI,
        ci95=[-0.004, 0.006],
        halves={"discovery": 0.0005, "confirmation": 0.0015},
    )


def test_alpha_is_five_percent():
    assert ALPHA == 0.05


def test_an_equivalence_claim_whose_tost_p_is_exactly_alpha_does_not_hold():
    claim = equivalence_claim(ALPHA)
    assert not claim.holds
    assert not claim.contradicted
    assert verdict([claim]) == INCONCLUSIVE


def test_an_equivalence_claim_whose_tost_p_is_the_float_just_below_alpha_holds():
    claim = equivalence_claim(math.nextafter(ALPHA, 0))
    assert claim.holds
    assert not claim.contradicted
    assert verdict([claim]) == REPRODUCED


def test_a_paired_tost_is_not_equivalent_at_p_exactly_alpha_and_is_just_below_it():
    diffs, margin = [0.001, 0.003, -0.002, 0.002, 0.0], 0.01
    p = tost_paired(diffs, margin)["p"]
    assert 0 < p < 1
    assert tost_paired(diffs, margin, alpha=p)["equivalent"] is False  # p == alpha
    assert tost_paired(diffs, margin, alpha=math.nextafter(p, 1))["equivalent"] is True  # p just below alpha
    assert inspect.signature(tost_paired).parameters["alpha"].default == 0.05


# 3. The portable mode's pins ------------------------------------------------------------------------

PORTABLE_PINS = {"MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
NATIVE_PINS = {"MKL_CBWR": "AUTO,STRICT"}
MKL_CBWR_COMPATIBLE = 3
"""mkl_cbwr.h's code for the COMPATIBLE branch (what MKL reports it took, strict bit clear)."""
SETTINGS = {MODE_ENV, "MKL_ENABLE_INSTRUCTIONS", "DNNL_MAX_CPU_ISA", *PORTABLE_PINS, *NATIVE_PINS}

PINNED = """
import json, os
import model  # takes the process's mode before torch loads
import torch
from model.provenance import mkl_cbwr
print(json.dumps({
    "env": {k: os.environ[k] for k in ("MKL_CBWR", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY") if k in os.environ},
    "aten": torch.backends.cpu.get_cpu_capability(),
    "mkl_cbwr": mkl_cbwr(),
}))
"""


def fresh_process(code: str, **env: str) -> dict:
    """What ``code`` prints (JSON) in a new interpreter whose numerics settings are only ``env``."""
    clean = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env={**clean, **env}, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    printed: dict = json.loads(done.stdout.splitlines()[-1])
    return printed


def test_the_modes_pin_these_library_settings():
    assert MODES["portable"] == PORTABLE_PINS
    assert MODES["native"] == NATIVE_PINS


def test_a_launcher_that_applies_portable_sets_mkl_compatible_and_onednn_and_aten_at_avx2(monkeypatch):
    for key in SETTINGS:  # set, then removed: monkeypatch puts back what was there, or nothing
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    apply_numerics("portable")
    assert os.environ[MODE_ENV] == "portable"
    assert {k: os.environ.get(k) for k in PORTABLE_PINS} == PORTABLE_PINS


def test_a_portable_process_takes_mkl_compatible_and_onednn_and_aten_at_avx2_before_torch_loads():
    record = fresh_process(PINNED, **{MODE_ENV: "portable"})
    assert record["env"] == PORTABLE_PINS
    if record["mkl_cbwr"] is not None:  # None: torch's MKL not reachable
        assert record["mkl_cbwr"] == MKL_CBWR_COMPATIBLE


@pytest.mark.skipif("avx2" not in cpu_flags(), reason="a CPU without AVX2 has no portable path")
def test_a_portable_process_runs_atens_avx2_kernels():
    assert fresh_process(PINNED, **{MODE_ENV: "portable"})["aten"] == "AVX2"


# 4. Refusing wider ATen kernels on any CPU ----------------------------------------------------------------

REFUSAL = r"precision\.numerics: 'portable', but ATen runs its AVX512 kernels in this process .*portable needs its AVX2"


@pytest.fixture
def portable_process(monkeypatch):
    """This process named portable (as SPIKELAB_NUMERICS=portable would), ATen's capability faked."""
    monkeypatch.setenv(MODE_ENV, "portable")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")

    def reports(capability: str) -> None:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)

    return reports


def test_the_portable_mode_refuses_avx512_aten_kernels_on_any_cpu(portable_process):
    portable_process("AVX512")
    with pytest.raises(ConfigError, match=REFUSAL):
        check_mode("portable", "cpu")


def test_the_portable_mode_accepts_avx2_aten_kernels_and_does_not_check_them_on_a_gpu(portable_process):
    portable_process("AVX2")
    check_mode("portable", "cpu")
    portable_process("AVX512")
    check_mode("portable", "cuda")  # the mode pins CPU libraries only
    assert torch.backends.cpu.get_cpu_capability() == "AVX512"


def test_a_portable_trainer_refuses_a_process_with_avx512_aten_kernels_on_any_cpu(portable_process):
    tokens = markov_tokens(4000, vocab=64)
    portable_process("AVX512")
    with pytest.raises(ConfigError, match=REFUSAL):
        Trainer(tiny_config(**{"precision.numerics": "portable"}), tokens, tokens)
    portable_process("AVX2")
    trainer = Trainer(tiny_config(**{"precision.numerics": "portable"}), tokens, tokens)  # AVX2's: accepted
    assert trainer.cfg.precision.numerics == "portable"
