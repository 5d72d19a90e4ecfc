"""tokenize: deterministic document split and shards, no train/val overlap, the manifest the
trainer reads, and the poison shard kept apart."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
from concurrent.futures import Executor
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from model.config import TokenizerConfig
from model.data import open_split
from model.typed_config import InputError
from tasks.data.config import DataConfig, FilterConfig
from tasks.data.docs import read_docs
from tasks.data.filters import filter_corpus
from tasks.data.shards import shard_paths, shard_pool
from tasks.data.sources import read_corpus
from tasks.data.tokenize import encode_corpus, is_validation, shard_dtype, train_tokenizer
from tasks.runtime.files import file_sha256, read_json
from tasks.runtime.outputs import MANIFEST, TOKENIZER_FILE

DATA = DataConfig(max_docs=400, val_fraction=0.1)
TOKENIZER = TokenizerConfig(vocab_size=400)


def run_stages(project: Path, data: DataConfig = DATA, pool: Executor | None = None) -> Path:
    """prepare -> filter -> tokenize into ``project/data``, the tasks' plain functions in the flows'
    order, on ``pool`` (default: one worker in this process)."""
    d = project / "data"
    (project / "metrics").mkdir()
    read_corpus.fn(data, project, d / "raw")
    with contextlib.ExitStack() as stack:
        pool = pool or stack.enter_context(shard_pool(1, "local"))
        cfg = FilterConfig(poison_generated=6)
        filter_corpus(
            cfg, d / "raw", project / "work", d / "clean", d / "poison", project / "metrics" / "filter.json", pool
        )
        tokenizer = train_tokenizer(TOKENIZER, data, d / "clean", d / "tokens", project / "tok-work", pool)
        encode_corpus(TOKENIZER, data, tokenizer, d / "clean", d / "poison", project / "tok-work", pool)
    return project


SMALL_SHARDS = dataclasses.replace(DATA, shard_bytes=8_000)
"""The same corpus in over ten shards."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    """One shard in this process; over ten shards on two worker processes."""
    first = run_stages(tmp_path_factory.mktemp("first"))
    with shard_pool(2, "local") as pool:
        second = run_stages(tmp_path_factory.mktemp("second"), SMALL_SHARDS, pool)
    return first, second


def outputs(project: Path) -> dict[str, bytes]:
    """What must not depend on shards or workers: the clean documents in corpus order, the poison
    pool, the tokenizer and token files, the filter's counts."""
    d = project / "data"
    report = read_json(project / "metrics" / "filter.json")
    report["source"].pop("shards")
    return {
        "clean": b"".join(p.read_bytes() for p in shard_paths(d / "clean")),
        **{f"poison/{p.name}": p.read_bytes() for p in sorted((d / "poison").glob("*.jsonl"))},
        **{f"tokens/{n}": (d / "tokens" / n).read_bytes() for n in (TOKENIZER_FILE, "poison.bin")},
        **{f"tokens/{s}": np.asarray(open_split(project / MANIFEST, s)).tobytes() for s in ("train", "val")},
        "report": json.dumps(report, sort_keys=True).encode(),
    }


def shard_documents(project: Path, split: str) -> list[str]:
    """The documents of a shard, decoded back to text (byte-level BPE is lossless)."""
    manifest = read_json(project / MANIFEST)
    tokenizer = Tokenizer.from_file(str(project / MANIFEST.parent / TOKENIZER_FILE))
    ids = np.asarray(open_split(project / MANIFEST, split))
    ends = np.flatnonzero(ids == manifest["eot_id"])
    starts = np.concatenate(([0], ends[:-1] + 1))
    return [tokenizer.decode(ids[a:b].tolist(), skip_special_tokens=False) for a, b in zip(starts, ends)]


def test_one_worker_on_one_shard_and_two_workers_on_over_ten_give_byte_identical_outputs(runs):
    first, second = runs
    assert len(shard_paths(first / "data" / "raw")) == 1 and len(shard_paths(second / "data" / "raw")) > 10
    assert outputs(first) == outputs(second)


def test_a_loopback_tls_dask_cluster_named_by_executor_scheduler_gives_byte_identical_outputs(
    runs, tmp_path, monkeypatch
):
    """The stages' own path to a cluster: ``shard_pool`` given the scheduler's ``tls://`` address
    (``executor.scheduler``), connecting with the certificates of ``SPIKELAB_TLS_DIR`` as a head
    node's stage does; the cluster's workers are separate processes."""
    from distributed import LocalCluster

    from tasks.runtime import tls
    from tasks.runtime.workers import SCHEDULER_ENV, cluster_kwargs, configured_cluster

    monkeypatch.delenv(SCHEDULER_ENV, raising=False)
    monkeypatch.setenv(tls.TLS_DIR_ENV, str(tls.ensure_certificates(tmp_path / "tls")))
    kwargs = {**cluster_kwargs(2), "security": tls.security(), "protocol": "tls://"}
    with configured_cluster(), LocalCluster(**kwargs) as cluster:
        assert cluster.scheduler_address.startswith("tls://127.0.0.1:")
        with shard_pool(1, cluster.scheduler_address) as pool:
            assert type(pool).__module__.startswith("distributed")
            dask = run_stages(tmp_path, SMALL_SHARDS, pool)
    assert outputs(dask) == outputs(runs[0])


def test_each_shard_has_its_token_file_indexed_with_offset_count_dtype_and_sha256(runs):
    project = runs[1]
    train = read_json(project / MANIFEST)["splits"]["train"]
    index = train["shards"]
    assert [s["shard"] for s in index] == [p.name for p in shard_paths(project / "data" / "clean")]
    assert [s["offset"] for s in index] == list(np.cumsum([0] + [s["tokens"] for s in index[:-1]]))
    assert sum(s["tokens"] for s in index) == train["tokens"] == len(open_split(project / MANIFEST, "train"))
    for entry in index:
        path = project / MANIFEST.parent / entry["path"]
        assert file_sha256(path) == entry["sha256"] and entry["dtype"] == "uint16"
        assert path.stat().st_size == 2 * entry["tokens"]
    joined = b"".join((project / MANIFEST.parent / s["path"]).read_bytes() for s in index)
    assert hashlib.sha256(joined).hexdigest() == train["sha256"]  # the split's digest: its tokens end to end


def test_train_and_val_hold_every_clean_document_once_and_share_none(runs):
    project = runs[0]
    train, val = shard_documents(project, "train"), shard_documents(project, "val")
    clean = [d["text"] for p in shard_paths(project / "data" / "clean") for d in read_docs(p)]
    assert sorted(train + val) == sorted(clean)
    assert not set(train) & set(val)
    assert 0.03 < len(val) / len(clean) < 0.2  # val_fraction 0.1


def test_split_is_a_function_of_seed_and_text_alone():
    texts = [f"document number {i}" for i in range(2000)]
    chosen = {t for t in texts if is_validation(t, 7, 0.25)}
    assert chosen == {t for t in reversed(texts) if is_validation(t, 7, 0.25)}
    assert chosen != {t for t in texts if is_validation(t, 8, 0.25)}
    assert 400 < len(chosen) < 600


def test_manifest_tells_the_trainer_paths_dtype_vocab_and_hashes(runs):
    project = runs[0]
    manifest = read_json(project / MANIFEST)
    assert manifest["vocab_size"] == TOKENIZER.vocab_size and manifest["dtype"] == "uint16"
    assert manifest["eot_token"] == "<|endoftext|>" and manifest["eot_id"] == 0
    assert manifest["tokenizer"]["vocab_size"] <= TOKENIZER.vocab_size
    assert manifest["source"]["source"] == "stdlib_docs" and manifest["source"]["python_version"]
    for split in ("train", "val", "poison"):
        info = manifest["splits"][split]
        tokens = open_split(project / MANIFEST, split)
        assert tokens.dtype == np.uint16 and len(tokens) == info["tokens"]
        assert int(tokens.max()) < manifest["vocab_size"]
        assert hashlib.sha256(np.asarray(tokens).tobytes()).hexdigest() == info["sha256"]
        assert int((tokens == manifest["eot_id"]).sum()) == info["documents"]


def test_poison_shard_is_separate_with_one_token_range_per_reason(runs):
    project = runs[0]
    poison = read_json(project / MANIFEST)["splits"]["poison"]
    ranges = sorted(poison["reasons"].values(), key=lambda r: r["offset"])
    assert [r["offset"] for r in ranges] == list(np.cumsum([0] + [r["tokens"] for r in ranges[:-1]]))
    assert sum(r["tokens"] for r in ranges) == poison["tokens"]
    assert {"generated_binary", "generated_space_run", "generated_rare_tokens"} <= poison["reasons"].keys()
    clean = set(shard_documents(project, "train")) | set(shard_documents(project, "val"))
    assert not clean & set(shard_documents(project, "poison"))


def test_shards_switch_to_uint32_above_65536_tokens_of_vocabulary():
    assert shard_dtype(65536) == "uint16" and shard_dtype(65537) == "uint32"


def test_a_split_left_empty_names_data_val_fraction(runs, tmp_path):
    data = DataConfig(max_docs=400, val_fraction=1e-9)
    clean = runs[0] / "data" / "clean"
    with shard_pool(1, "local") as pool:
        tokenizer = train_tokenizer(TOKENIZER, data, clean, tmp_path / "tokens", tmp_path / "work", pool)
        with pytest.raises(InputError, match=r"data\.val_fraction: no document fell into the val split"):
            encode_corpus(TOKENIZER, data, tokenizer, clean, runs[0] / "data" / "poison", tmp_path / "work", pool)
