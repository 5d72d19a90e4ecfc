"""Where the stages write and how: the one list of their output paths (``dvc.yaml`` names
the same ones), atomic publishing, the JSON-lines document format passed between stages, and
recording the outputs in MLflow.

Document records are one JSON object per line: ``{"id": ..., "text": ...}``. Undecodable input
bytes are kept in ``text`` as surrogate escapes (U+DC80..U+DCFF, Python's ``surrogateescape``),
so the invalid-UTF-8 filter can see them and ``text.encode("utf-8", "surrogateescape")`` gives
the original bytes back. Lines are written with ``ensure_ascii`` so every file stays valid
UTF-8 JSON.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import Metric, RunTag
from prefect import task

RAW_DIR = Path("data/raw")
"""prepare: the source documents, unfiltered."""
CLEAN_DIR = Path("data/clean")
"""filter: the documents that passed every filter."""
POISON_DIR = Path("data/poison")
"""filter: what the filters removed as garbage, plus generated garbage, one ``<reason>.jsonl`` per
reason (spike injection draws here)."""
FILTER_REPORT = Path("metrics/filter.json")
"""filter: counts per filter and per prepare-time skip (a DVC metric)."""
TOKENS_DIR = Path("data/tokens")
"""tokenize: tokenizer, token shards and their manifest."""

DOCS_FILE = "docs.jsonl"
"""The documents inside RAW_DIR and CLEAN_DIR."""
SOURCE_FILE = "source.json"
"""Provenance of the corpus (source, Python version, counts) in RAW_DIR, carried into CLEAN_DIR."""
TOKENIZER_FILE = "tokenizer.json"
"""The byte-level BPE inside TOKENS_DIR."""
MANIFEST = TOKENS_DIR / "manifest.json"
"""What the trainer reads: vocab size, dtype, shard paths (relative to it), counts and hashes."""

SEARCH_LR = Path("search/lr.yaml")
"""search: the LR transferred to the target width, as ``optim: {lr: ...}``; pretrain's input
when ``search.transfer_lr`` is true (tasks/train.py: pretrain_config)."""
SEARCH_METRICS = Path("metrics/search.json")
"""search: optimum and spread per parametrization and width, slopes, transfer check, trial counts."""
SEARCH_REPORTS = Path("reports/search")
"""search: the μTransfer, coordinate-check and transfer figures (PNG)."""

PRETRAIN_RUN = Path("runs/pretrain")
"""pretrain: the run directory, locked while a run writes (not a DVC out itself)."""
PRETRAIN_CHECKPOINTS = PRETRAIN_RUN / "checkpoints"
"""pretrain: scheduled checkpoints, the run's identity and last summary; a persistent out (a
preempted run resumes from them)."""
PRETRAIN_SET_ASIDE = PRETRAIN_RUN / "set-aside"
"""pretrain: checkpoint folders of earlier run identities, moved here (never deleted) when the
training config or data change; ``<identity>/``."""
PRETRAIN_MODEL = Path("models/pretrain.pt")
"""pretrain: final weights and the resolved config (``torch.load(weights_only=True)``)."""
PRETRAIN_MILESTONES = Path("models/milestones")
"""pretrain: the milestone checkpoints (``checkpoint.milestones``) with their sha256 sidecars, a
cached out: the spike study starts from one (model/checkpoint.py names the files)."""
PRETRAIN_METRICS = Path("metrics/pretrain.json")
"""pretrain: the run summary (a DVC metric)."""
PRETRAIN_PLOTS = Path("plots/pretrain")
"""pretrain: curves as CSV, one file per metric namespace (train, val, stats); DVC plots."""
PRETRAIN_REPORTS = Path("reports/pretrain")
"""pretrain: the curves drawn as PNG figures (tasks/figures.py), offline."""

SPIKE_RUN = Path("runs/spike")
"""spike: the study's scratch checkpoints (warm-up, rollback segments), rebuilt on a rerun."""
SPIKE_METRICS = Path("metrics/spike.json")
"""spike: scores per injection and policy, detection latency, false alarms, replay (a DVC metric)."""
SPIKE_FIGURES = Path("reports/spike")
"""spike: per injection, the control and every policy's loss and grad norm around the spike (PNG)."""
POSTMORTEMS = Path("reports/postmortems")
"""spike: one seed-004 post-mortem per injected spike (markdown) and its token histogram (PNG)."""

ABLATE_ARMS = Path("runs/ablate/arms")
"""ablate: one directory per arm, named by its key (tasks/ablate.py: arm_key): its checkpoints (a
retried arm resumes) and ``result.json``. A persistent out: unchanged arms are not trained again."""
ABLATE_METRICS = Path("metrics/ablate.json")
"""ablate: every arm (failed ones too) with its figures and command, and per variant the mean,
SD and 95 % interval of each figure over seeds (a DVC metric)."""
ABLATE_FIGURES = Path("reports/ablate")
"""ablate: one figure per family: loss curves with seeds as bands, LR sensitivity (PNG)."""

REPORT_MD = Path("reports/REPORT.md")
"""report: the findings table with verdicts, the stages' key results, links to every run."""
REPORT_HTML = Path("reports/report.html")
"""report: the same, one self-contained page (figures embedded), opens offline."""
REPORT_METRICS = Path("metrics/report.json")
"""report: each finding's verdict, numbers and test (a DVC metric)."""

STAGE_OUTS = {
    "prepare": [RAW_DIR],
    "filter": [CLEAN_DIR, POISON_DIR, FILTER_REPORT],
    "tokenize": [TOKENS_DIR],
    "search": [SEARCH_LR, SEARCH_METRICS, SEARCH_REPORTS],
    "pretrain": [PRETRAIN_CHECKPOINTS, PRETRAIN_MODEL, PRETRAIN_MILESTONES, PRETRAIN_METRICS, PRETRAIN_PLOTS,
                 PRETRAIN_REPORTS],
    "spike": [SPIKE_METRICS, SPIKE_FIGURES, POSTMORTEMS],
    "ablate": [ABLATE_ARMS, ABLATE_METRICS, ABLATE_FIGURES],
    "report": [REPORT_MD, REPORT_HTML, REPORT_METRICS],
}
"""Every output of every stage, relative to the project; dvc.yaml declares exactly these."""


# --------------------------------------------------------------------------------------------
# Atomic outputs
# --------------------------------------------------------------------------------------------


@contextmanager
def staged(*finals: Path) -> Iterator[list[Path]]:
    """Temporary paths beside each final output (file or directory) for the block to write;
    only when the whole block succeeds are they renamed over the finals, so a failure anywhere
    leaves no half-written output (and the previous outputs untouched)."""
    temps = [f.with_name(f".{f.name}.tmp-{os.getpid()}") for f in finals]
    for final, temp in zip(finals, temps):
        final.parent.mkdir(parents=True, exist_ok=True)
        for stale in final.parent.glob(f".{final.name}.tmp-*"):  # left by a killed run
            _remove(stale)
    try:
        yield temps
    except BaseException:
        for temp in temps:
            _remove(temp)
        raise
    for final, temp in zip(finals, temps):
        _publish(temp, final)


def _publish(temp: Path, final: Path) -> None:
    if temp.is_dir() and final.exists():  # os.replace cannot replace a non-empty directory
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
        os.replace(temp, final)
        _remove(old)
    else:
        os.replace(temp, final)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Strict JSON (RFC 8259): NaN and infinities, which JSON cannot hold, become null. Written
    whole or not at all (a temporary file renamed over the old one)."""
    text = json.dumps(_finite_or_null(data), indent=2, sort_keys=True, allow_nan=False, default=str) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temp.write_text(text, encoding="utf-8")
    os.replace(temp, path)


def _finite_or_null(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(v) for v in value]
    return value


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


# --------------------------------------------------------------------------------------------
# Documents as JSON lines
# --------------------------------------------------------------------------------------------


def write_doc(f, record: dict[str, Any]) -> None:
    f.write(json.dumps(record, ensure_ascii=True) + "\n")


def read_docs(path: Path) -> Iterator[dict[str, Any]]:
    """Stream the records of a docs file, one line at a time."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)


UNDECODABLE = re.compile("[\ud800-\udfff]")
"""Surrogates: undecodable input bytes kept as surrogate escapes, or lone escapes from JSON."""


def repair_undecodable(text: str) -> str:
    """Undecodable bytes as U+FFFD: what a kept document carries when ``filter.invalid_utf8`` is
    off, and what the tokenizer (which takes only valid Unicode) sees of a poison document."""
    return UNDECODABLE.sub("\ufffd", text)


# --------------------------------------------------------------------------------------------
# Digests and tracking
# --------------------------------------------------------------------------------------------


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def digest(project: Path, outputs: Iterable[Path]) -> str:
    """sha256 over the files under ``outputs`` (relative names and contents): one id per dataset
    version, the same wherever the project lives."""
    h = hashlib.sha256()
    for out in outputs:
        root = project / out
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
        for f in files:
            h.update(f"{f.relative_to(project).as_posix()}\0{file_sha256(f)}\0".encode())
    return h.hexdigest()


@task(name="record-outputs")
def record_outputs(run_id: str, project: Path, outputs: list[Path], metrics: dict[str, float],
                   artifacts: list[Path]) -> str:
    """Log a stage's counts, its report files and the digest of its outputs to its MLflow run."""
    client = mlflow.MlflowClient()
    dataset_digest = digest(project, outputs)
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()],
                     tags=[RunTag("dataset_digest", dataset_digest)])
    for path in artifacts:
        client.log_artifact(run_id, str(project / path))
    return dataset_digest
