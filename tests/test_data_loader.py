"""The trainer's loader: seeded, exactly resumable from a saved position, with worker processes."""

from __future__ import annotations

import json
import tempfile

import numpy as np
import pytest
import torch

from model.data import (
    UNIX_SOCKET_PATH_MAX,
    ArmsLoader,
    TokenLoader,
    check_worker_sockets_fit,
    open_split,
    open_tokens,
)
from model.typed_config import ConfigError

SEQ_LEN, BATCH = 8, 4


@pytest.fixture
def tokens(tmp_path) -> np.ndarray:
    """A shard of 23 windows of 9 tokens: 5 batches per epoch, so 12 batches cross two epochs."""
    path = tmp_path / "train.bin"
    (np.arange(23 * (SEQ_LEN + 1)) % 1000).astype(np.uint16).tofile(path)
    return open_tokens(path, "uint16")


def stream(loader: TokenLoader, n: int) -> list[torch.Tensor]:
    return [loader.next_batch()[0] for _ in range(n)]


@pytest.mark.parametrize("workers", [0, 2])
def test_restored_position_continues_the_uninterrupted_stream_exactly(tokens, workers):
    uninterrupted = stream(TokenLoader(tokens, SEQ_LEN, BATCH, seed=3, num_workers=workers), 12)
    first = TokenLoader(tokens, SEQ_LEN, BATCH, seed=3, num_workers=workers)
    stream(first, 5)
    state = first.state_dict()
    resumed = TokenLoader(tokens, SEQ_LEN, BATCH, seed=3, num_workers=workers)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(stream(resumed, 7), uninterrupted[5:]))


@pytest.mark.filterwarnings("ignore:.pin_memory. argument is set as true but no accelerator")
def test_workers_do_not_change_the_stream(tokens):
    single = stream(TokenLoader(tokens, SEQ_LEN, BATCH, seed=3), 6)
    multi = stream(TokenLoader(tokens, SEQ_LEN, BATCH, seed=3, num_workers=2, pin_memory=True), 6)
    assert all(torch.equal(a, b) for a, b in zip(single, multi))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_fused_groups_loader_serves_each_arm_the_stream_its_own_seed_gives_across_epochs(tokens, workers):
    seeds = [3, 4, 3]  # two arms may share a seed: each row is still its own stream
    arms = ArmsLoader(tokens, SEQ_LEN, BATCH, seeds, num_workers=workers)
    stacked = [arms.next_batch() for _ in range(12)]  # 12 batches: past the first epoch's 5
    for k, seed in enumerate(seeds):
        alone = TokenLoader(tokens, SEQ_LEN, BATCH, seed=seed)
        for x, y in stacked:
            one_x, one_y = alone.next_batch()
            assert torch.equal(x[k], one_x) and torch.equal(y[k], one_y)
    arms.rewind()
    assert torch.equal(arms.next_batch()[0], stacked[0][0])


def test_targets_are_inputs_shifted_by_one_and_each_epoch_visits_every_window_once(tokens):
    loader = TokenLoader(tokens, SEQ_LEN, BATCH, seed=3)
    x, y = loader.next_batch()
    assert torch.equal(x[:, 1:], y[:, :-1])
    starts = [int(b[i, 0]) for b in [x, *stream(loader, 4)] for i in range(BATCH)]
    assert len(set(starts)) == 20  # 5 batches of 4 distinct windows (the ragged 23rd-window tail dropped)


def test_seed_changes_the_order_and_skip_jumps_ahead(tokens):
    a = stream(TokenLoader(tokens, SEQ_LEN, BATCH, seed=3), 4)
    assert not torch.equal(a[0], stream(TokenLoader(tokens, SEQ_LEN, BATCH, seed=4), 1)[0])
    skipping = TokenLoader(tokens, SEQ_LEN, BATCH, seed=3)
    skipping.next_batch()
    skipping.skip(2)
    assert torch.equal(skipping.next_batch()[0], a[3])


def test_a_checkpoint_from_another_seed_is_refused(tokens):
    loader = TokenLoader(tokens, SEQ_LEN, BATCH, seed=3)
    with pytest.raises(ValueError, match="seed"):
        loader.load_state_dict({"batches_served": 2, "seed": 9})


@pytest.mark.parametrize("workers", [0, 2])
def test_a_split_in_several_token_files_streams_as_the_one_file_they_join(tmp_path, tokens, workers):
    ids = np.asarray(tokens)
    cuts = [0, 1, 50, 50, 120, len(ids)]  # an empty file too, and cuts inside windows
    folder = tmp_path / "train"
    folder.mkdir()
    for n, (a, b) in enumerate(zip(cuts, cuts[1:])):
        ids[a:b].tofile(folder / f"{n:05d}-docs.bin")
    sharded = open_tokens(folder, "uint16")
    assert len(sharded) == len(ids) and np.array_equal(np.asarray(sharded), ids)
    assert np.array_equal(sharded[45:130], ids[45:130]) and sharded[-1] == ids[-1] and sharded[50] == ids[50]
    joined = stream(TokenLoader(tokens, SEQ_LEN, BATCH, seed=3), 12)
    assert all(
        torch.equal(a, b)
        for a, b in zip(stream(TokenLoader(sharded, SEQ_LEN, BATCH, seed=3, num_workers=workers), 12), joined)
    )


def test_a_manifest_of_the_one_file_layout_is_still_read(tmp_path, tokens):
    manifest = tmp_path / "manifest.json"
    split = {"path": "train.bin", "tokens": len(tokens), "documents": 1, "sha256": ""}
    manifest.write_text(json.dumps({"format": 1, "dtype": "uint16", "splits": {"train": split}}))
    assert np.array_equal(np.asarray(open_split(manifest, "train")), np.asarray(tokens))


def test_workers_are_refused_where_their_sockets_would_not_fit_the_temporary_folder_at_the_last_byte():
    """A DataLoader worker's batch goes back through <tmp>/pymp-XXXXXXXX/listener-XXXXXXXX (32
    bytes past the folder); past 107 bytes the batch is lost silently and the trainer waits forever,
    so a folder of 75 bytes is the longest that works."""
    longest = "/" + "t" * (UNIX_SOCKET_PATH_MAX - 32 - 1)
    check_worker_sockets_fit(longest)  # 107 bytes: fits
    with pytest.raises(ConfigError, match=r"^train\.num_workers: .* at most 75 bytes .* has 76: set TMPDIR"):
        check_worker_sockets_fit(longest + "t")


def test_a_loader_with_workers_is_refused_before_any_worker_starts_under_a_too_long_tmpdir(tokens, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", "/" + "t" * 200)
    with pytest.raises(ConfigError, match="train.num_workers"):
        TokenLoader(tokens, SEQ_LEN, BATCH, seed=3, num_workers=2)
    with pytest.raises(ConfigError, match="train.num_workers"):
        ArmsLoader(tokens, SEQ_LEN, BATCH, [3, 4], num_workers=2)
    TokenLoader(tokens, SEQ_LEN, BATCH, seed=3, num_workers=0)  # no workers, no sockets: accepted
