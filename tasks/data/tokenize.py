"""tokenize: a byte-level BPE trained on a sample of the clean training split, then memory-mapped
token files (train, val, and the poison pool for spike injection) and the manifest the trainer
reads. Each clean shard is sampled and encoded on the stage's workers into its own token file per
split (``train/<shard>.bin``, ``val/<shard>.bin``); the manifest indexes them in corpus order
(path, offset, token count, dtype, sha256), and the trainer maps a split's files as one sequence
(model/data.py: ``open_split``). Nothing is copied into one file: a split is as large as the
corpus, and joining it cost a pass over every token.

The split is by document and a pure function of (``data.seed``, the text): the same document
always lands on the same side, whatever the order or the other documents, and no document is on
both. Documents are encoded in batches and appended to the shards as they stream by, each
followed by the end-of-text token.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from concurrent.futures import Executor
from functools import partial
from pathlib import Path
from typing import TypedDict

import numpy as np
from prefect import task
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from model.config import TokenizerConfig
from model.typed_config import InputError
from tasks.data.config import DataConfig
from tasks.data.docs import read_docs, repair_undecodable
from tasks.data.shards import map_shards, shard_paths, shard_pool
from tasks.runtime.files import file_sha256, read_json, write_json
from tasks.runtime.outputs import MANIFEST, SOURCE_FILE, TOKENIZER_FILE

EOT = "<|endoftext|>"
"""Separates documents in the shards (the BPE's only special token, id 0)."""
ENCODE_BATCH = 512
"""Most documents per ``encode_batch`` call (the tokenizer spreads a batch over the cores)."""
ENCODE_BATCH_BYTES = 1 << 20
"""Most characters per call: a batch's ids live as Python ints (~36 bytes a token) until written,
so long documents (the poison pool's 100 000 spaces) must not come 512 at a time."""
SPLITS = ("train", "val", "poison")
MANIFEST_FORMAT = 2
"""2: a split is its shards' token files (``splits.<split>.shards``); 1 had one file (``path``)."""


def is_validation(text: str, seed: int, fraction: float) -> bool:
    """A document goes to validation when its seeded content hash falls below ``fraction``."""
    h = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8, key=str(seed).encode())
    return int.from_bytes(h.digest(), "little") < fraction * 2**64


def shard_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def in_sample(text: str, seed: int, rate: float) -> bool:
    """Is a training document in the tokenizer's sample? A seeded hash of its text below ``rate``
    (another key than the split's), so the sample does not depend on shards or workers."""
    if rate >= 1:
        return True
    h = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8, key=f"sample-{seed}".encode())
    return int.from_bytes(h.digest(), "little") < rate * 2**64


def sample_rate(clean_shards: list[Path], budget: int) -> float:
    """The share of documents to draw for about ``budget`` bytes (the shard files' size, JSON
    escapes included, stands in for the text's: the sample errs small)."""
    return min(1.0, budget / max(sum(p.stat().st_size for p in clean_shards), 1))


def sample_shard(clean_shard: Path, data: DataConfig, rate: float, work_dir: Path) -> Path:
    """One shard's training documents in the tokenizer's sample, as a JSON-lines file of texts."""
    path = work_dir / f"{clean_shard.stem}.sample.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for doc in read_docs(clean_shard):
            text = doc["text"]
            if not is_validation(text, data.seed, data.val_fraction) and in_sample(text, data.seed, rate):
                f.write(json.dumps(text, ensure_ascii=True) + "\n")
    return path


def sampled_texts(paths: list[Path]) -> Iterator[str]:
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)


def train_tokenizer(
    cfg: TokenizerConfig, data: DataConfig, clean_dir: Path, out_dir: Path, work_dir: Path, pool: Executor
) -> Path:
    """Train the byte-level BPE on a sample of the training split (validation stays unseen) and save it."""
    work_dir.mkdir(parents=True, exist_ok=True)
    shards = shard_paths(clean_dir)
    rate = sample_rate(shards, data.tokenizer_sample_bytes)
    samples = map_shards(
        pool, "tokenize-sample", partial(sample_shard, data=data, rate=rate, work_dir=work_dir), shards, done=work_dir
    )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(sampled_texts(samples), trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / TOKENIZER_FILE
    tokenizer.save(str(path))
    return path


class ShardSummary(TypedDict):
    """A closed shard, as the manifest lists it."""

    path: str
    documents: int
    tokens: int
    dtype: str
    sha256: str


class ShardWriter:
    """Appends documents' token ids, each followed by end-of-text, to a flat binary file, in
    batches, hashing what it writes."""

    def __init__(self, path: Path, dtype: str, tokenizer: Tokenizer):
        self.path, self.dtype, self.tokenizer = path, dtype, tokenizer
        self.eot = tokenizer.token_to_id(EOT)
        self.file = open(path, "wb")  # noqa: SIM115 (closed by close())
        self.sha256 = hashlib.sha256()
        self.documents = self.tokens = self.pending_chars = 0
        self.pending: list[str] = []

    def add(self, text: str) -> None:
        self.pending.append(text)
        self.pending_chars += len(text)
        if len(self.pending) >= ENCODE_BATCH or self.pending_chars >= ENCODE_BATCH_BYTES:
            self.flush()

    def flush(self) -> None:
        """Encode the pending documents (on every core) and append their ids, each document's
        followed by end-of-text; each document's list of ids goes to numpy whole (not id by id).
        A text pending twice is encoded once: the poison pool's generated garbage repeats (a
        100,000-space document takes the BPE 0.1 s)."""
        if not self.pending:
            return
        distinct = list(dict.fromkeys(self.pending))
        encoded = dict(zip(distinct, self.tokenizer.encode_batch_fast(distinct)))
        eot = np.array([self.eot], self.dtype)
        parts = [a for text in self.pending for a in (np.array(encoded[text].ids, self.dtype), eot)]
        block = np.concatenate(parts).tobytes()
        self.file.write(block)
        self.sha256.update(block)
        self.documents += len(self.pending)
        self.tokens += len(block) // eot.itemsize
        self.pending, self.pending_chars = [], 0

    def close(self) -> ShardSummary:
        self.flush()
        self.file.close()
        return {
            "path": self.path.name,
            "documents": self.documents,
            "tokens": self.tokens,
            "dtype": self.dtype,
            "sha256": self.sha256.hexdigest(),
        }


def encode_shard(clean_shard: Path, data: DataConfig, tokenizer_path: Path, dtype: str, work_dir: Path) -> dict:
    """One clean shard's train and val documents as token files in ``work_dir``; their counts."""
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    parts = {
        name: ShardWriter(work_dir / f"{clean_shard.stem}.{name}.bin", dtype, tokenizer) for name in ("train", "val")
    }
    for doc in read_docs(clean_shard):
        parts["val" if is_validation(doc["text"], data.seed, data.val_fraction) else "train"].add(doc["text"])
    return {name: part.close() for name, part in parts.items()}


def index_parts(out_dir: Path, split: str, shards: list[Path], parts: list[ShardSummary], work_dir: Path) -> dict:
    """One split's per-shard token files, placed in ``out_dir/<split>/`` (hard links to the
    scratch folder's files where the file system allows, so a stage killed now still resumes from
    them) and indexed in corpus order: each file's path, first token's offset in the split, token
    count, dtype and sha256. The split's sha256 is that of its tokens end to end, as it was when
    the split was one file, so the runs' identities do not change."""
    folder = out_dir / split
    folder.mkdir(parents=True, exist_ok=True)
    sha256, index, offset = hashlib.sha256(), [], 0
    for shard, part in zip(shards, parts):
        placed = folder / f"{shard.stem}.bin"
        _place(work_dir / part["path"], placed)
        with open(placed, "rb") as f:
            while block := f.read(1 << 24):
                sha256.update(block)
        index.append({"shard": shard.name, "path": f"{split}/{placed.name}", "offset": offset, **_entry(part)})
        offset += part["tokens"]
    return {
        "documents": sum(p["documents"] for p in parts),
        "tokens": offset,
        "sha256": sha256.hexdigest(),
        "shards": index,
    }


def _entry(part: ShardSummary) -> dict:
    return {"tokens": part["tokens"], "documents": part["documents"], "dtype": part["dtype"], "sha256": part["sha256"]}


def _place(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system, or one without hard links
        shutil.copyfile(source, target)


def encode_poison(tokenizer: Tokenizer, dtype: str, poison_dir: Path, out_dir: Path) -> dict:
    """The poison pool into ``poison.bin``, one contiguous token range per reason."""
    shard = ShardWriter(out_dir / "poison.bin", dtype, tokenizer)
    reasons = {}
    for path in sorted(poison_dir.glob("*.jsonl")):
        start, documents = shard.tokens, shard.documents
        for doc in read_docs(path):
            shard.add(repair_undecodable(doc["text"]))
        shard.flush()
        reasons[path.stem] = {"offset": start, "tokens": shard.tokens - start, "documents": shard.documents - documents}
    return {**shard.close(), "reasons": reasons}


def encode_corpus(
    cfg: TokenizerConfig,
    data: DataConfig,
    tokenizer_path: Path,
    clean_dir: Path,
    poison_dir: Path,
    work_dir: Path,
    pool: Executor,
) -> dict[str, float]:
    """Encode the clean shards into ``train/``/``val/`` token files (each shard on the pool,
    indexed in corpus order) and the poison pool into ``poison.bin``, beside the tokenizer; write
    the manifest there; return the counts."""
    out_dir = tokenizer_path.parent
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    dtype = shard_dtype(cfg.vocab_size)
    shards = shard_paths(clean_dir)
    encode = partial(encode_shard, data=data, tokenizer_path=tokenizer_path, dtype=dtype, work_dir=work_dir)
    parts = map_shards(pool, "tokenize-encode", encode, shards, done=work_dir)
    splits = {name: index_parts(out_dir, name, shards, [p[name] for p in parts], work_dir) for name in ("train", "val")}
    splits["poison"] = encode_poison(tokenizer, dtype, poison_dir, out_dir)
    for name in ("train", "val"):
        if not splits[name]["documents"]:
            raise InputError(
                f"data.val_fraction: no document fell into the {name} split of "
                f"{clean_dir} ({splits['train']['documents'] + splits['val']['documents']} "
                f"documents, val_fraction={data.val_fraction}); change it or add documents"
            )
    write_json(
        out_dir / MANIFEST.name,
        {
            "format": MANIFEST_FORMAT,
            "vocab_size": cfg.vocab_size,
            "tokenizer": {
                "path": tokenizer_path.name,
                "vocab_size": tokenizer.get_vocab_size(),
                "sha256": file_sha256(tokenizer_path),
            },
            "eot_token": EOT,
            "eot_id": tokenizer.token_to_id(EOT),
            "dtype": dtype,
            "split": {"by": "document", "seed": data.seed, "val_fraction": data.val_fraction},
            "splits": splits,
            "source": read_json(clean_dir / SOURCE_FILE),
        },
    )
    return {f"{name}_{key}": splits[name][key] for name in SPLITS for key in ("documents", "tokens")}


@task(name="tokenize-shards")
def tokenize_shards(
    cfg: TokenizerConfig,
    data: DataConfig,
    scheduler: str,
    clean_dir: Path,
    poison_dir: Path,
    out_dir: Path,
    work_dir: Path,
) -> dict[str, float]:
    """Train the BPE, then encode: each shard on ``data.workers`` local processes or the Dask
    cluster at ``scheduler``."""
    with shard_pool(data.workers, scheduler) as pool:
        tokenizer = train_tokenizer(cfg, data, clean_dir, out_dir, work_dir, pool)
        return encode_corpus(cfg, data, tokenizer, clean_dir, poison_dir, work_dir, pool)
