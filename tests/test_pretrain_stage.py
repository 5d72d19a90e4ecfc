"""The pretrain stage resumes only its own run: persisted checkpoints of another config, other
data, or unknown provenance are discarded; a manifest that does not fit the config is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model.config import Config, InputError
from tasks.train import IDENTITY_FILE, claim_checkpoints, read_manifest, pretrain_identity

MANIFEST = {"vocab_size": 4096, "splits": {"train": {"sha256": "aa"}, "val": {"sha256": "bb"}}}


def checkpoint_dir_of(tmp_path: Path, identity: dict | None) -> Path:
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    (ckpt / "step_00000010.pt").write_bytes(b"weights")
    if identity is not None:
        (ckpt / IDENTITY_FILE).write_text(json.dumps(identity))
    return ckpt


def test_the_same_run_keeps_its_checkpoints(tmp_path):
    identity = run_identity(Config(), MANIFEST)
    ckpt = checkpoint_dir_of(tmp_path, identity)
    claim_checkpoints(ckpt, identity)
    assert (ckpt / "step_00000010.pt").is_file()


@pytest.mark.parametrize("change", ["config", "data"])
def test_another_config_or_dataset_starts_fresh(tmp_path, change, capsys):
    old = run_identity(Config(), MANIFEST)
    new_cfg = Config().replace(**{"optim.lr": 1e-2}) if change == "config" else Config()
    new_manifest = {**MANIFEST, "splits": {**MANIFEST["splits"], "train": {"sha256": "cc"}}} \
        if change == "data" else MANIFEST
    ckpt = checkpoint_dir_of(tmp_path, old)
    claim_checkpoints(ckpt, pretrain_identity(new_cfg, new_manifest).spec)
    assert not (ckpt / "step_00000010.pt").exists()
    assert json.loads((ckpt / IDENTITY_FILE).read_text()) == json.loads(json.dumps(
        pretrain_identity(new_cfg, new_manifest)).spec)
    assert "starting fresh" in capsys.readouterr().err


def test_checkpoints_without_a_recorded_identity_are_not_resumed(tmp_path):
    ckpt = checkpoint_dir_of(tmp_path, identity=None)
    claim_checkpoints(ckpt, pretrain_identity(Config(), MANIFEST).spec)
    assert not (ckpt / "step_00000010.pt").exists()


def test_settings_outside_training_do_not_invalidate_a_run():
    cfg = Config()
    assert run_identity(cfg, MANIFEST) == run_identity(cfg.replace(**{"filter.min_chars": 10}), MANIFEST)


def test_a_manifest_of_another_vocabulary_is_refused_naming_the_file_and_key(tmp_path):
    (tmp_path / "data/tokens").mkdir(parents=True)
    (tmp_path / "data/tokens/manifest.json").write_text(json.dumps(MANIFEST))
    with pytest.raises(InputError, match=r"manifest.json: vocab_size 4096 differs from tokenizer.vocab_size=1024"):
        read_manifest(tmp_path, Config().replace(**{"tokenizer.vocab_size": 1024}))
    with pytest.raises(InputError, match="run the tokenize stage first"):
        read_manifest(tmp_path / "elsewhere", Config())
