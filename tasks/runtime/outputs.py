"""Where each stage writes, relative to the project: the one list of output paths (``dvc.yaml``
declares the same ones; the stage registry, flows/stages.py, says which stage owns which).
Pure constants, so any stage may import them for free."""

from __future__ import annotations

from pathlib import Path

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
when ``search.transfer_lr`` is true (tasks/pretrain/train.py: pretrain_config)."""
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
"""pretrain: the curves drawn as PNG figures (tasks/pretrain/figures.py), offline."""

SPIKE_RUN = Path("runs/spike")
"""spike: the study's scratch checkpoints (warm-up, rollback segments), rebuilt on a rerun."""
SPIKE_METRICS = Path("metrics/spike.json")
"""spike: scores per injection and policy, detection latency, false alarms, replay (a DVC metric)."""
SPIKE_FIGURES = Path("reports/spike")
"""spike: per injection, the control and every policy's loss and grad norm around the spike (PNG)."""
POSTMORTEMS = Path("reports/postmortems")
"""spike: one seed-004 post-mortem per injected spike (markdown) and its token histogram (PNG)."""

ABLATE_ARMS = Path("runs/ablate/arms")
"""ablate: one directory per arm, named by its key (tasks/ablate/grid.py: arm_key): its checkpoints (a
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
REPORT_FIGURES = Path("reports/report")
"""report: its own figures."""
REPORT_FOREST = REPORT_FIGURES / "forest.png"
"""report: every claim's paired effect with its 95 % interval, findings side by side."""
REPORT_METRICS = Path("metrics/report.json")
"""report: each finding's verdict, numbers and test (a DVC metric)."""
