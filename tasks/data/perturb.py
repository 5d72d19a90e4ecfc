"""The sensitivity stage's data perturbation: a copy of the tokenize output (data/tokens) whose
training split leaves out a registered share of its documents, its validation split unchanged so
the arms' losses stay comparable with the full data's.

A document is its tokens and the end-of-text token after it (``eot_id`` in the manifest:
tasks/data/tokenize.py writes each document followed by it; tokens after the last one, in a split
that does not end with it, count as one more document). Which documents go is drawn with the
registered seed, and only with it: each document's place in the split is hashed under the seed
(blake2b, keyed as the tokenize split's hash is) and the ``round(share x documents)`` lowest are
dropped. So the draw is exact in number, the same on every machine and numpy version, and a
share of 0 drops nothing: the copy's training stream is the original's, bit for bit.

The copy (``data/perturbed/`` by default) is a format-2 manifest like the original's: the training
split's token files, one per original shard (a shard left empty is left out), each kept document
in its original order; the validation files and the tokenizer copied as they are (same sha256);
the poison pool left out (no arm reads it). Its ``perturbation`` entry records the share, the seed
and the counts, and makes every arm trained on it a different run from the full data's
(tasks/ablate/grid.py: data_hashes). Written whole or not at all (tasks/runtime/files.py: staged).
"""

from __future__ import annotations

import copy
import hashlib
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from model.typed_config import InputError
from tasks.runtime.files import read_json, staged, write_json

MANIFEST_NAME = "manifest.json"
KIND = "drop_documents"
"""The one perturbation there is: a share of the training documents left out."""


def split_files(entry: dict[str, Any], dtype: str) -> list[tuple[str, str]]:
    """A split's token files in order, each as (path relative to the manifest, dtype): its shards
    (format 2) or its one file (format 1)."""
    if "path" in entry:
        return [(entry["path"], dtype)]
    return [(s["path"], s["dtype"]) for s in entry["shards"]]


def read_tokens(path: Path, dtype: str) -> np.ndarray:
    """A token file, memory-mapped (an empty one as an empty array: numpy cannot map 0 bytes)."""
    if path.stat().st_size == 0:
        return np.empty(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def document_lengths(tokens: np.ndarray, eot: int) -> np.ndarray:
    """The length in tokens of each document of ``tokens``, its end-of-text included; a tail with
    no end-of-text after it is a document too."""
    ends = np.flatnonzero(tokens == eot) + 1
    if len(tokens) and (not len(ends) or ends[-1] != len(tokens)):
        ends = np.append(ends, len(tokens))
    return np.diff(np.concatenate([[0], ends])).astype(np.int64)


def drawn(count: int, share: float, seed: int) -> np.ndarray:
    """Which of ``count`` documents (by place) are dropped: the ``round(share x count)`` whose keyed
    hash under ``seed`` is lowest (a boolean mask)."""
    k = int(round(share * count))
    key = f"drop-{seed}".encode()
    scores = np.array(
        [
            int.from_bytes(hashlib.blake2b(i.to_bytes(8, "little"), digest_size=8, key=key).digest(), "little")
            for i in range(count)
        ],
        dtype=np.uint64,
    )
    order = np.lexsort((np.arange(count), scores))  # lowest score first, ties by place
    dropped = np.zeros(count, dtype=bool)
    dropped[order[:k]] = True
    return dropped


def drop_documents(source: Path, out: Path, share: float, seed: int) -> dict[str, Any]:
    """Build ``out``, a copy of the tokenize output in ``source`` (a folder holding manifest.json)
    whose training split lacks ``share`` of its documents, drawn with ``seed``; its validation
    split and tokenizer copied unchanged. Written whole or not at all. Returns the manifest's
    ``perturbation`` record. Raises InputError when ``source`` has no manifest or every training
    document would go."""
    manifest_path = source / MANIFEST_NAME
    if not manifest_path.is_file():
        raise InputError(f"{manifest_path}: missing; run the tokenize stage first (dvc repro tokenize)")
    manifest = read_json(manifest_path)
    eot, dtype = int(manifest.get("eot_id", 0)), manifest["dtype"]
    train = manifest["splits"]["train"]
    files = split_files(train, dtype)
    lengths = [document_lengths(read_tokens(source / path, dt), eot) for path, dt in files]
    documents = sum(len(x) for x in lengths)
    dropped = drawn(documents, share, seed)
    if documents and dropped.all():
        raise InputError(
            f"sensitivity.drop_share: {share} drops all {documents} training documents of {manifest_path}; lower it"
        )
    with staged(out) as (temp,):
        temp.mkdir(parents=True)
        shards, sha256, offset, first = [], hashlib.sha256(), 0, 0
        for (path, dt), doc_lengths in zip(files, lengths):
            tokens = read_tokens(source / path, dt)
            drop = dropped[first : first + len(doc_lengths)]
            first += len(doc_lengths)
            kept = np.asarray(tokens[np.repeat(~drop, doc_lengths)])
            if not len(kept):
                continue
            name = f"train/{Path(path).name}"
            (temp / "train").mkdir(exist_ok=True)
            block = kept.tobytes()
            (temp / name).write_bytes(block)
            sha256.update(block)
            shards.append(
                {
                    "path": name,
                    "offset": offset,
                    "tokens": len(kept),
                    "documents": int((~drop).sum()),
                    "dtype": dt,
                    "sha256": hashlib.sha256(block).hexdigest(),
                }
            )
            offset += len(kept)
        if not shards:
            raise InputError(f"{manifest_path}: the training split holds no tokens")
        val = manifest["splits"]["val"]
        for path, _ in split_files(val, dtype):
            (temp / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / path, temp / path)
        tokenizer = (manifest.get("tokenizer") or {}).get("path")
        if tokenizer and (source / tokenizer).is_file():
            shutil.copyfile(source / tokenizer, temp / tokenizer)
        record = {
            "kind": KIND,
            "drop_share": float(share),
            "seed": seed,
            "documents": documents,
            "dropped": int(dropped.sum()),
            "kept": documents - int(dropped.sum()),
            "tokens": sum(int(x.sum()) for x in lengths),
            "kept_tokens": offset,
            "source_train_sha256": train.get("sha256"),
        }
        copied = copy.deepcopy(manifest)
        copied["format"] = 2
        copied["splits"] = {
            "train": {"documents": record["kept"], "tokens": offset, "sha256": sha256.hexdigest(), "shards": shards},
            "val": val,
        }
        copied["perturbation"] = record
        write_json(temp / MANIFEST_NAME, copied)
    return record
