"""The data stages' unit of work: a shard, a slice of the corpus of about ``data.shard_bytes`` (a
document never splits), ``<n>-docs.jsonl`` in data/raw and data/clean. A stage maps one function
over its shards on a pool of workers and combines the results in shard order, so what it writes
does not depend on how many workers ran or which finished first.

Where shards run (:func:`shard_pool`): ``data.workers`` processes on this machine
(concurrent.futures; one worker runs in this process), or the workers of the Dask cluster that
``executor.scheduler`` / ``$SPIKELAB_SCHEDULER`` names, over the cluster's mutual TLS (its workers
must see the project at the same path: a shared file system).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import pickle
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from tasks.runtime import tls
from tasks.runtime.config import LOCAL
from tasks.runtime.outputs import DOCS_FILE
from tasks.runtime.progress import Progress, run_logger
from tasks.runtime.workers import CONNECT_TIMEOUT_S, available_cores, scheduler


def shard_path(directory: Path, index: int) -> Path:
    return directory / f"{index:05d}-{DOCS_FILE}"


def shard_paths(directory: Path) -> list[Path]:
    """The shards of a stage's output folder, in corpus order."""
    return sorted(directory.glob(f"*-{DOCS_FILE}"))


class ShardedWriter:
    """Writes JSON-lines records into consecutive shards, starting a new one once a shard holds
    ``shard_bytes``. Each closed shard gets a marker (``.<shard>.done``: how many records the
    shards up to it hold), so a killed run can go on after its last finished shard
    (:meth:`resume`)."""

    def __init__(self, directory: Path, shard_bytes: int):
        self.directory, self.shard_bytes = directory, shard_bytes
        directory.mkdir(parents=True, exist_ok=True)
        self.shards = self.size = self.records = self.logged = 0
        self.rate = Rate()
        self.file: TextIO | None = None

    def resume(self) -> int:
        """Go on after the finished shards a killed run left (a half-written one is dropped);
        returns how many records they hold, which the caller does not add again."""
        while self._marker(self.shards).exists():
            self.shards += 1
        for partial in shard_paths(self.directory)[self.shards :]:
            partial.unlink()
        if self.shards:
            self.records = self.logged = json.loads(self._marker(self.shards - 1).read_text())["records"]
        return self.records

    def add(self, record: dict[str, Any]) -> None:
        if self.file is None or self.size >= self.shard_bytes:
            self.close()
            self.file = open(shard_path(self.directory, self.shards), "w", encoding="utf-8")  # noqa: SIM115 (closed by close())
            self.size = 0
        line = json.dumps(record, ensure_ascii=True) + "\n"
        self.file.write(line)
        self.size += len(line)
        self.records += 1

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
            self._marker(self.shards).write_text(json.dumps({"records": self.records}))
            self.rate.add(self.size, self.records - self.logged)
            self.logged = self.records
            run_logger().info(f"prepare: shard {shard_path(self.directory, self.shards).name} written ({self.rate})")
            self.shards += 1

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(self, error: type[BaseException] | None, *_: Any) -> None:
        """A run that fails leaves its open shard unmarked: a resumed run writes it again."""
        if error is None:
            self.close()
        elif self.file is not None:
            self.file.close()
            self.file = None

    def publish(self, out_dir: Path) -> None:
        """The finished shards moved into ``out_dir`` (the stage's output), their markers dropped."""
        for index, shard in enumerate(shard_paths(self.directory)):
            os.replace(shard, out_dir / shard.name)
            self._marker(index).unlink()

    def _marker(self, index: int) -> Path:
        return self.directory / f".{shard_path(self.directory, index).name}.done"


@contextmanager
def shard_pool(workers: int, scheduler_setting: str) -> Iterator[Executor]:
    """Where the shards run: the Dask cluster at ``executor.scheduler`` (or ``$SPIKELAB_SCHEDULER``),
    else ``workers`` local processes (0: one per available core). Fresh ``spawn`` processes, not
    forks: the stage process holds Prefect's and MLflow's threads."""
    address = scheduler(scheduler_setting)
    if address != LOCAL:
        from distributed import Client

        with Client(address, security=tls.security(), timeout=CONNECT_TIMEOUT_S, set_as_default=False) as client:
            yield client.get_executor()
        return
    count = workers or available_cores()
    if count == 1:
        with ThreadPoolExecutor(max_workers=1) as pool:
            yield pool
        return
    with ProcessPoolExecutor(max_workers=count, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


def map_shards(
    pool: Executor,
    stage: str,
    fn: Callable[..., Any],
    shards: list[Path],
    *per_shard: list[Any],
    done: Path | None = None,
) -> list[Any]:
    """``fn(shard, *per_shard_i)`` for every shard on the pool (bind constant arguments with
    ``functools.partial``), results in shard order; a progress line per finished shard (MB/s and
    documents/s of shard files so far, shards done/total, elapsed, ETA). With ``done`` (a stage's
    scratch folder), each result is kept there as it arrives and a shard with a kept result is not
    run again: a killed stage resumes from its finished shards."""
    kept = {i: _kept(done, stage, shard) for i, shard in enumerate(shards)} if done else {}
    todo = [i for i, shard in enumerate(shards) if kept.get(i) is None]
    progress = Progress(stage, "shard", len(todo), run_logger())
    rate, results = Rate(), {i: r for i, r in kept.items() if r is not None}
    args = [[column[i] for i in todo] for column in per_shard]
    for i, result in zip(todo, pool.map(fn, [shards[i] for i in todo], *args)):
        if done:
            _keep(done, stage, shards[i], result)
        rate.add(shards[i].stat().st_size, count_lines(shards[i]))
        progress.finished(f"{shards[i].name} ({rate})", "done")
        results[i] = result
    progress.close()
    return [results[i] for i in range(len(shards))]


class Rate:
    """MB and documents per second since it was made: what a progress line says of throughput."""

    def __init__(self) -> None:
        self.started, self.bytes, self.documents = time.perf_counter(), 0, 0

    def add(self, size: int, documents: int) -> None:
        self.bytes += size
        self.documents += documents

    def __str__(self) -> str:
        seconds = max(time.perf_counter() - self.started, 1e-9)
        return f"{self.bytes / 1e6 / seconds:.1f} MB/s, {self.documents / seconds:,.0f} docs/s so far"


def count_lines(path: Path) -> int:
    """A shard's documents (one a line), counted in 16 MiB reads: no document is decoded."""
    lines = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            lines += block.count(b"\n")
    return lines


def _kept(done: Path, stage: str, shard: Path) -> Any:
    path = done / shard.stem / f"{stage}.pkl"
    return pickle.loads(path.read_bytes()) if path.exists() else None


def _keep(done: Path, stage: str, shard: Path, result: Any) -> None:
    """Beside the shard's other scratch files (``done/<shard>/``): a pass that starts a shard
    afresh clears that folder, and with it the later passes' results, which no longer hold."""
    (done / shard.stem).mkdir(parents=True, exist_ok=True)
    temp = done / shard.stem / f".{stage}.pkl.tmp"
    temp.write_bytes(pickle.dumps(result))
    os.replace(temp, done / shard.stem / f"{stage}.pkl")  # whole or absent, never half-written


def scratch(parent: Path, stage: str, *identity: Any) -> Path:
    """A stage's scratch folder under ``parent``, named by ``identity`` (the stage's config and
    its input files' names, sizes and times) and the data stages' code. The flow removes it when
    the stage succeeds; a killed stage leaves it, and a rerun with the same identity resumes from
    it. Folders of another identity are stale and removed."""
    h = hashlib.sha256(repr(identity).encode())
    for code in sorted(Path(__file__).parent.glob("*.py")):
        h.update(code.read_bytes())
    path = parent / f".{stage}-work-{h.hexdigest()[:16]}"
    for stale in parent.glob(f".{stage}-work-*"):
        if stale != path:
            shutil.rmtree(stale)
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def resumable(work: Path) -> Iterator[Path]:
    """The stage's work in its scratch folder ``work``: removed when the stage succeeds; kept when
    it fails with something to resume from; removed, and the folder it was made in too where
    that is left empty, when it fails having written nothing (a bad input must leave no trace)."""
    try:
        yield work
    except BaseException:
        if not any(p.is_file() for p in work.rglob("*")):
            shutil.rmtree(work)
            with contextlib.suppress(OSError):
                work.parent.rmdir()  # only if empty: the stage made it
        raise
    shutil.rmtree(work)


def listing(directory: Path) -> list[tuple[str, int, int]]:
    """Names, sizes and modification times of a folder's files: the identity of a stage's input."""
    return [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(directory.iterdir()) if p.is_file()]
