"""Numerics modes (model/numerics.py, ``precision.numerics``): a process takes its mode's library
settings before torch loads, a launcher replaces them with the config's, a trainer refuses a mode
its process does not run, ``portable`` emulates low precision on the CPU, and a portable run keeps
its bits when this CPU's wider paths are switched off, as on a lesser CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_kit import markov_tokens, tiny_config

import model.precision as precision_mod
from model.config import PrecisionConfig
from model.numerics import MODE_ENV, MODES, process_mode
from model.precision import cpu_flags
from model.train import Trainer
from model.typed_config import ConfigError

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {MODE_ENV, "MKL_ENABLE_INSTRUCTIONS", *(key for mode in MODES.values() for key in mode)}


def fresh_process(code: str, *args: str, **env: str) -> dict:
    """What ``code`` prints (JSON) in a new interpreter whose numerics settings are only ``env``."""
    clean = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    done = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=REPO, env={**clean, **env}, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


RECORD = "import json; from model.provenance import provenance; print(json.dumps(provenance()))"


@pytest.mark.parametrize(
    "numerics, device, expect",
    [
        ("portable", "cpu", "bf16 (emulated)"),
        ("native", "cpu", "bf16 (autocast, AVX512-BF16)"),
        ("portable", "cuda", "bf16 (autocast, CUDA)"),  # the mode pins CPU libraries only
    ],
)
def test_portable_numerics_emulate_where_auto_would_take_a_cpus_own_autocast(monkeypatch, numerics, device, expect):
    monkeypatch.setattr(precision_mod, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    chosen = precision_mod.resolve_precision(PrecisionConfig(mode="bf16", numerics=numerics), device)
    assert chosen.describe() == expect


def test_an_unknown_mode_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"precision\.numerics: 'fast' is not one of 'portable', 'native'"):
        tiny_config(**{"precision.numerics": "fast"})


def test_a_trainer_refuses_the_mode_its_process_does_not_run():
    other = "native" if process_mode() == "portable" else "portable"
    tokens = markov_tokens(4000, vocab=64)
    with pytest.raises(ConfigError, match=rf"precision\.numerics: '{other}'.*{MODE_ENV}={other}"):
        Trainer(tiny_config(**{"precision.numerics": other}), tokens, tokens)


REFUSED = """
import json
from model.typed_config import ConfigError
from model.train import Trainer
from tests.trainer_kit import markov_tokens, tiny_config
tokens = markov_tokens(4000, vocab=64)
try:
    Trainer(tiny_config(**{"precision.numerics": "portable"}), tokens, tokens)
    print(json.dumps("trained"))
except ConfigError as e:
    print(json.dumps(str(e)))
"""


@pytest.mark.skipif("avx512f" not in cpu_flags(), reason="needs a CPU whose ATen kernels go past AVX2")
def test_a_portable_trainer_refuses_a_process_whose_aten_kernels_are_not_avx2s():
    said = fresh_process(REFUSED, **{MODE_ENV: "portable", "ATEN_CPU_CAPABILITY": "avx512"})  # given by hand: kept
    assert said.startswith("precision.numerics: 'portable', but ATen runs its AVX512 kernels"), said
    assert fresh_process(REFUSED, **{MODE_ENV: "portable"}) == "trained"


@pytest.mark.parametrize("mode", ["portable", "native"])
def test_a_process_takes_the_mode_named_in_its_environment_before_torch_loads(mode):
    record = fresh_process(RECORD, **{MODE_ENV: mode})
    assert record["env"] == MODES[mode]
    assert (record["aten_capability"] == "AVX2") == (mode == "portable" or record["cpu"]["isa"] == ["avx2"])


def test_a_launcher_replaces_the_process_mode_with_the_configs_and_keeps_a_setting_given_by_hand():
    code = "import model.numerics as n; n.apply_numerics('native'); " + RECORD
    record = fresh_process(code, **{MODE_ENV: "portable", "ATEN_CPU_CAPABILITY": "default"})
    assert record["env"] == {"MKL_CBWR": "AUTO,STRICT", "ATEN_CPU_CAPABILITY": "default"}
    assert record["aten_capability"] == "DEFAULT"


TRAIN = """
import hashlib, json, sys
from model.provenance import provenance
from model.train import Trainer
from tests.trainer_kit import markov_tokens, tiny_config
tokens = markov_tokens(20_000, vocab=64)
cfg = tiny_config(**{"train.steps": 30, "precision.mode": "bf16", "precision.numerics": sys.argv[1]})
trainer = Trainer(cfg, tokens, tokens[:4000])
trainer.run()
h = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for _, t in sorted(trainer.model.state_dict().items())))
print(json.dumps({"weights": h.hexdigest(), "record": provenance(trainer.precision)}))
"""
AVX2_ONLY_CPU = {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
"""What a CPU without AVX-512 lets each library use."""


def trained(mode: str, **env: str) -> dict:
    return fresh_process(TRAIN, mode, **{MODE_ENV: mode, **env})


@pytest.mark.skipif("avx512f" not in precision_mod.cpu_flags(), reason="needs AVX-512 paths to switch off")
def test_a_portable_run_keeps_its_bits_where_the_cpu_looks_like_one_without_avx512_and_a_native_run_does_not():
    portable, lesser = trained("portable"), trained("portable", **AVX2_ONLY_CPU)
    assert portable["record"]["precision"] == "bf16 (emulated)"
    assert portable["weights"] == lesser["weights"]
    assert trained("native")["weights"] != trained("native", **AVX2_ONLY_CPU)["weights"]
