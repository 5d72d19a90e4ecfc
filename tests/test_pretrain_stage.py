"""The pretrain stage's run lifecycle: it resumes only its own run, sets other runs' checkpoints
aside (never deletes them), replays milestones added after the fact, republishes a finished
run's figures, publishes only completed runs, and refuses a manifest that does not fit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from trainer_kit import markov_tokens, tiny_config

from model.checkpoint import list_checkpoints, load_checkpoint
from model.train import Trainer, train
from model.typed_config import InputError
from tasks.config import Config
from tasks.pretrain.train import (
    IDENTITY_FILE,
    _with_previous_figures,
    backfill_milestones,
    claim_checkpoints,
    pretrain_identity,
    publish,
    read_manifest,
)
from tasks.runtime.outputs import PRETRAIN_METRICS, PRETRAIN_MODEL

MANIFEST = {"vocab_size": 4096, "splits": {"train": {"sha256": "aa"}, "val": {"sha256": "bb"}}}
TOKENS, VAL = np.split(markov_tokens(24_000, vocab=64), [20_000])


def checkpoint_dir_of(tmp_path: Path, digest: str | None) -> Path:
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    (ckpt / "step_00000010.pt").write_bytes(b"weights")
    if digest is not None:
        (ckpt / IDENTITY_FILE).write_text(json.dumps({"digest": digest}))
    return ckpt


def test_the_same_run_keeps_its_checkpoints(tmp_path):
    identity = pretrain_identity(Config(), MANIFEST)
    ckpt = checkpoint_dir_of(tmp_path, identity.digest)
    assert claim_checkpoints(ckpt, identity, tmp_path / "aside") is None
    assert (ckpt / "step_00000010.pt").is_file()


@pytest.mark.parametrize("change", ["config", "data"])
def test_an_identity_change_moves_the_old_checkpoints_aside_under_their_identity(tmp_path, change, capsys):
    old = pretrain_identity(Config(), MANIFEST)
    new_cfg = Config().replace(**{"optim.lr": 1e-2}) if change == "config" else Config()
    new_manifest = (
        {**MANIFEST, "splits": {**MANIFEST["splits"], "train": {"sha256": "cc"}}} if change == "data" else MANIFEST
    )
    new = pretrain_identity(new_cfg, new_manifest)
    ckpt = checkpoint_dir_of(tmp_path, old.digest)
    moved = claim_checkpoints(ckpt, new, tmp_path / "aside")

    assert moved == tmp_path / "aside" / old.digest
    assert (moved / "step_00000010.pt").read_bytes() == b"weights"  # kept, not deleted
    assert list_checkpoints(ckpt) == []
    assert json.loads((ckpt / IDENTITY_FILE).read_text())["digest"] == new.digest
    assert f"moved it to {moved}" in capsys.readouterr().err


def test_checkpoints_without_a_recorded_identity_are_set_aside_not_resumed(tmp_path):
    ckpt = checkpoint_dir_of(tmp_path, digest=None)
    moved = claim_checkpoints(ckpt, pretrain_identity(Config(), MANIFEST), tmp_path / "aside")
    assert moved.name.startswith("unrecorded-") and (moved / "step_00000010.pt").is_file()
    assert list_checkpoints(ckpt) == []


def test_cadence_worker_and_thread_settings_are_not_part_of_the_identity():
    cfg = Config()
    same = cfg.replace(
        **{
            "train.log_every": 7,
            "train.layer_stats_every": 9,
            "train.eval_every": 3,
            "train.num_workers": 2,
            "train.cpu_threads": 1,
            "filter.min_chars": 10,
            "checkpoint.every_steps": 5,
            "tracking.experiment": "x",
        }
    )
    assert pretrain_identity(cfg, MANIFEST) == pretrain_identity(same, MANIFEST)
    for key, value in {"train.steps": 700, "optim.beta2": 0.99, "train.seed": 1, "model.block": "post_ln"}.items():
        assert pretrain_identity(cfg, MANIFEST) != pretrain_identity(cfg.replace(**{key: value}), MANIFEST), key


def test_a_cadence_only_change_resumes_the_run(tmp_path):
    cfg = tiny_config(**{"train.steps": 6, "checkpoint.every_steps": 3})
    train(cfg.replace(**{"train.steps": 6}), TOKENS, VAL, tmp_path)
    longer_logs = cfg.replace(**{"train.log_every": 3, "train.cpu_threads": 2})
    summary = train(longer_logs, TOKENS, VAL, tmp_path)
    assert summary["start_step"] == 6 and summary["status"] == "completed"


def test_a_milestone_added_to_a_finished_run_is_produced_bitwise_as_the_run_would_have(tmp_path):
    base = {"train.steps": 8, "checkpoint.every_steps": 0, "checkpoint.keep_last": 1}
    straight = tmp_path / "straight"
    train(tiny_config(**base, **{"checkpoint.milestones": [3]}), TOKENS, VAL, straight)
    later = tmp_path / "later"
    train(tiny_config(**base), TOKENS, VAL, later)  # finished without the milestone
    assert [s for s, _ in list_checkpoints(later / "checkpoints")] == [8]

    cfg = tiny_config(**base, **{"checkpoint.milestones": [3]})
    identity = Trainer(cfg, TOKENS, VAL).identity
    assert backfill_milestones(cfg, TOKENS, VAL, later / "checkpoints", identity) == [3]
    assert [s for s, _ in list_checkpoints(later / "checkpoints")] == [3, 8]
    want = load_checkpoint(straight / "checkpoints/step_00000003.pt")["model"]
    got = load_checkpoint(later / "checkpoints/step_00000003.pt")["model"]
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_rerunning_a_finished_run_keeps_the_figures_of_the_run_that_did_the_work(tmp_path):
    stored = tmp_path / "summary.json"
    worked = {"identity": "abc", "steps": 8, "start_step": 0, "tokens_per_s": 5000.0, "wall_s": 12.0}
    assert _with_previous_figures(worked, stored) == worked
    rerun = {**worked, "start_step": 8, "tokens_per_s": None, "wall_s": 0.0001}
    assert _with_previous_figures(rerun, stored) == worked


def test_only_a_completed_run_publishes_weights_and_metrics_are_strict_json(tmp_path):
    cfg = tiny_config(**{"train.steps": 4, "train.diverge_loss": 1.0})  # loss starts at ln 257 > 1
    trainer = Trainer(cfg, TOKENS, VAL)
    summary = trainer.run()
    assert summary["status"] == "diverged" and summary["diverged_at"] == 1
    summary["final_loss"] = float("nan")  # what a run whose every step is non-finite logs
    publish(tmp_path, trainer, summary)
    assert not (tmp_path / PRETRAIN_MODEL).exists()
    text = (tmp_path / PRETRAIN_METRICS).read_text()
    metrics = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert metrics["status"] == "diverged" and metrics["final_loss"] is None


def test_a_manifest_of_another_vocabulary_is_refused_naming_the_file_and_key(tmp_path):
    (tmp_path / "data/tokens").mkdir(parents=True)
    (tmp_path / "data/tokens/manifest.json").write_text(json.dumps(MANIFEST))
    with pytest.raises(InputError, match=r"manifest.json: vocab_size 4096 differs from tokenizer.vocab_size=1024"):
        read_manifest(tmp_path, Config().replace(**{"tokenizer.vocab_size": 1024}))
    with pytest.raises(InputError, match="run the tokenize stage first"):
        read_manifest(tmp_path / "elsewhere", Config())
