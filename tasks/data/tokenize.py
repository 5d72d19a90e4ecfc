"""tokenize: a byte-level BPE trained on the clean training split, then memory-mapped token shards
(train, val, and the poison pool for spike injection) and the manifest the trainer reads.

The split is by document and a pure function of (``data.seed``, the text): the same document
always lands on the same side, whatever the order or the other documents, and no document is on
both. Documents are encoded in batches and appended to the shards as they stream by, each
followed by the end-of-text token.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import TypedDict

import numpy as np
from prefect import task
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from model.config import TokenizerConfig
from model.typed_config import InputError
from tasks.data.config import DataConfig
from tasks.data.docs import read_docs, repair_undecodable
from tasks.runtime.files import file_sha256, read_json, write_json
from tasks.runtime.outputs import DOCS_FILE, MANIFEST, SOURCE_FILE, TOKENIZER_FILE

EOT = "<|endoftext|>"
"""Separates documents in the shards (the BPE's only special token, id 0)."""
ENCODE_BATCH = 512
"""Documents per ``encode_batch`` call (the tokenizer spreads a batch over the cores)."""
SPLITS = ("train", "val", "poison")
MANIFEST_FORMAT = 1


def is_validation(text: str, seed: int, fraction: float) -> bool:
    """A document goes to validation when its seeded content hash falls below ``fraction``."""
    h = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8, key=str(seed).encode())
    return int.from_bytes(h.digest(), "little") < fraction * 2**64


def shard_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def training_texts(clean_dir: Path, cfg: DataConfig) -> Iterator[str]:
    for doc in read_docs(clean_dir / DOCS_FILE):
        if not is_validation(doc["text"], cfg.seed, cfg.val_fraction):
            yield doc["text"]


@task(name="train-tokenizer")
def train_tokenizer(cfg: TokenizerConfig, data: DataConfig, clean_dir: Path, out_dir: Path) -> Path:
    """Train the byte-level BPE on the training split only (validation stays unseen) and save it."""
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
    tokenizer.train_from_iterator(training_texts(clean_dir, data), trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / TOKENIZER_FILE
    tokenizer.save(str(path))
    return path


class ShardSummary(TypedDict):
    """A closed shard, as the manifest lists it."""

    path: str
    documents: int
    tokens: int
    sha256: str


class ShardWriter:
    """Appends documents' token ids, each followed by end-of-text, to a flat binary file, in
    batches, hashing what it writes."""

    def __init__(self, path: Path, dtype: str, tokenizer: Tokenizer):
        self.path, self.dtype, self.tokenizer = path, dtype, tokenizer
        self.eot = tokenizer.token_to_id(EOT)
        self.file = open(path, "wb")  # noqa: SIM115 (closed by close())
        self.sha256 = hashlib.sha256()
        self.documents = self.tokens = 0
        self.pending: list[str] = []

    def add(self, text: str) -> None:
        self.pending.append(text)
        if len(self.pending) >= ENCODE_BATCH:
            self.flush()

    def flush(self) -> None:
        ids = [i for enc in self.tokenizer.encode_batch_fast(self.pending) for i in (*enc.ids, self.eot)]
        block = np.array(ids, dtype=self.dtype).tobytes()
        self.file.write(block)
        self.sha256.update(block)
        self.documents += len(self.pending)
        self.tokens += len(ids)
        self.pending = []

    def close(self) -> ShardSummary:
        self.flush()
        self.file.close()
        return {
            "path": self.path.name,
            "documents": self.documents,
            "tokens": self.tokens,
            "sha256": self.sha256.hexdigest(),
        }


@task(name="encode-shards")
def encode_shards(
    cfg: TokenizerConfig, data: DataConfig, tokenizer_path: Path, clean_dir: Path, poison_dir: Path
) -> dict[str, float]:
    """Encode the clean documents into ``train.bin``/``val.bin`` and the poison pool into
    ``poison.bin`` (one contiguous token range per reason), beside the tokenizer; write the
    manifest there; return the counts."""
    out_dir = tokenizer_path.parent
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    dtype = shard_dtype(cfg.vocab_size)
    shards = {name: ShardWriter(out_dir / f"{name}.bin", dtype, tokenizer) for name in SPLITS}
    for doc in read_docs(clean_dir / DOCS_FILE):
        shards["val" if is_validation(doc["text"], data.seed, data.val_fraction) else "train"].add(doc["text"])
    reasons = {}
    for path in sorted(poison_dir.glob("*.jsonl")):
        start, documents = shards["poison"].tokens, shards["poison"].documents
        for doc in read_docs(path):
            shards["poison"].add(repair_undecodable(doc["text"]))
        shards["poison"].flush()
        reasons[path.stem] = {
            "offset": start,
            "tokens": shards["poison"].tokens - start,
            "documents": shards["poison"].documents - documents,
        }
    splits = {name: shard.close() for name, shard in shards.items()}
    for name in ("train", "val"):
        if not splits[name]["documents"]:
            raise InputError(
                f"data.val_fraction: no document fell into the {name} split of "
                f"{clean_dir / DOCS_FILE} ({splits['train']['documents'] + splits['val']['documents']} "
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
            "eot_id": shards["train"].eot,
            "dtype": dtype,
            "split": {"by": "document", "seed": data.seed, "val_fraction": data.val_fraction},
            "splits": {**splits, "poison": {**splits["poison"], "reasons": reasons}},
            "source": read_json(clean_dir / SOURCE_FILE),
        },
    )
    return {f"{name}_{key}": splits[name][key] for name in SPLITS for key in ("documents", "tokens")}
