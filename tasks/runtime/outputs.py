"""Where each stage writes, relative to the project: the one list of output paths (``dvc.yaml``
declares the same ones; the stage registry, flows/stages.py, says which stage owns which), and
:class:`KeptOutputs`, which keeps a stage's versioned outputs until it completes. Constants and
the standard library only, so any stage may import them for free.

Three kinds of output, by how ``dvc.yaml`` declares them:
  cached     in DVC's cache, ignored by git (:data:`CACHED`): DVC removes them before the stage
             runs; ``dvc checkout`` brings back the version ``dvc.lock`` names.
  resumed    ``persist: true``, ``cache: false`` (:data:`RESUMED`): the state a rerun continues
             (checkpoints, appended curves, stored arms); kept across runs, never versioned.
  versioned  everything else: small files in git (metrics, the LR, figures, the report),
             ``persist: true`` and ``cache: false``, so DVC leaves them in place and the stage's
             command (``spikelab run``) replaces them whole: moved aside before the flow runs, put
             back when it does not complete (an interrupt, an error), so a stopped stage leaves
             what git has (:class:`KeptOutputs`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Iterable
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

ABLATE_ALONE = Path("runs/ablate/alone")
"""ablate, one family run alone (``spikelab run ablate --family NAME``): NAME/ablate.json and
NAME/figures/, beside the stage's outputs, never over them (the arms it trains are the stage's,
in ABLATE_ARMS, so a later ``dvc repro`` finds them stored)."""

PERTURBED_DIR = Path("data/perturbed")
"""sensitivity: a copy of TOKENS_DIR whose training split drops a registered share of its documents
(tasks/data/perturb.py); its validation split is TOKENS_DIR's, unchanged."""
SENSITIVITY_ARMS = Path("runs/sensitivity/arms")
"""sensitivity: one directory per arm trained on PERTURBED_DIR, named by its key (a persistent out,
as ABLATE_ARMS)."""
SENSITIVITY_METRICS = Path("metrics/sensitivity.json")
"""sensitivity: per finding and claim, the estimate on the full and on the perturbed data at the
discovery seeds, and their per-seed difference (a DVC metric)."""

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

RESUMED = (PRETRAIN_CHECKPOINTS, PRETRAIN_PLOTS, ABLATE_ARMS, SENSITIVITY_ARMS)
"""Persistent outs a rerun continues (``persist: true``, ``cache: false``): never moved aside."""
CACHED = (
    RAW_DIR,
    CLEAN_DIR,
    POISON_DIR,
    TOKENS_DIR,
    SEARCH_REPORTS,
    PRETRAIN_MODEL,
    PRETRAIN_MILESTONES,
    PERTURBED_DIR,
)
"""Outs in DVC's cache (git-ignored): DVC removes them before their stage runs."""
KEPT_DIR = Path(".spikelab/kept")
"""Where :class:`KeptOutputs` sets a stage's versioned outputs aside while it runs, relative to the
project (on its file system, so a move is a rename): ``<stage>/<output path>``."""


class KeptOutputs:
    """A stage's versioned outputs, set aside while it runs and put back unless it completes.

    :meth:`set_aside` moves each output that exists to ``<project>/.spikelab/kept/<stage>/`` (what
    DVC does to an out that is not persistent is delete it: the stage starts from nothing
    either way); :meth:`discard` drops them once the stage completed; :meth:`put_back` removes
    what the run wrote in their place and moves them back. A run killed before either (SIGKILL,
    a power cut) leaves them there, and the next :meth:`set_aside` of that stage puts them back
    first, saying so."""

    def __init__(self, project: Path, stage: str, outs: Iterable[Path]):
        self.project, self.stage, self.outs = project, stage, tuple(outs)
        self.aside = project / KEPT_DIR / stage

    def set_aside(self) -> list[Path]:
        """Move the outputs aside; returns those that existed."""
        if self.aside.exists():
            back = self.put_back()
            if back:
                print(
                    f"spikelab: {self.stage}: put back {', '.join(map(str, back))}, set aside by an earlier run "
                    "that was killed before it completed",
                    file=sys.stderr,
                )
        moved = []
        for out in self.outs:
            final = self.project / out
            if final.exists() or final.is_symlink():
                kept = self.aside / out
                folder = self.project
                for part in (*KEPT_DIR.parts, self.stage, *out.parent.parts):  # each made 0700
                    folder = folder / part
                    folder.mkdir(mode=0o700, exist_ok=True)
                os.replace(final, kept)
                moved.append(out)
        return moved

    def put_back(self, keep_written: bool = False) -> list[Path]:
        """Remove what the run wrote where an output was and move the kept one back; with
        ``keep_written``, an output the run wrote stays (a result it published whole, such as a
        diverged run's metrics) and only the others come back. Returns the outputs put back."""
        back = []
        for out in self.outs:
            final, kept = self.project / out, self.aside / out
            written = final.exists() or final.is_symlink()
            if written and keep_written:
                continue
            if written:
                _remove(final)
            if kept.exists() or kept.is_symlink():
                final.parent.mkdir(parents=True, exist_ok=True)
                os.replace(kept, final)
                back.append(out)
        self.discard()
        return back

    def discard(self) -> None:
        """Drop what was set aside (the stage completed: its new outputs stand)."""
        if self.aside.exists():
            shutil.rmtree(self.aside)
        with contextlib.suppress(OSError):  # the last stage's: .spikelab/kept goes too
            self.aside.parent.rmdir()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
