"""prepare: stream documents from the configured source into shards ``data/raw/<n>-docs.jsonl``.

Sources: the running Python's standard-library docstrings and help topics (the offline default),
a user's text file or folder, JSON-lines files (plain, gzip or zstandard), Parquet files, or a
Hugging Face dataset (the ``hf`` extra). JSON-lines and Parquet sources are a file, a folder or a
glob, on this machine or at any URL fsspec reads (``file://``, ``s3://`` with s3fs and the
environment's credentials, ...), or on a DVC remote's storage: ``remote://<name>/<path>`` opens
<path> under the remote with the remote's own settings and credentials, as ``dvc push`` would.
Everything is read in bounded pieces: a document longer than ``data.max_doc_bytes`` is skipped
and counted as it streams past, so even a 1 GB single line never sits in memory whole. A single
bad document or line is skipped and counted; only a source with no usable document at all is an
error, and it names the file and the key to look at.
"""

from __future__ import annotations

import ast
import glob
import gzip
import hashlib
import io
import itertools
import json
import logging
import platform
import posixpath
import pydoc_data.topics
import sysconfig
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, BinaryIO, Protocol

import fsspec
import zstandard
from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from prefect import task

from model.typed_config import InputError, UserError
from tasks.data.config import DataConfig
from tasks.data.shards import ShardedWriter
from tasks.runtime.files import write_json
from tasks.runtime.outputs import SOURCE_FILE

log = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
"""What a ``jsonl`` folder's files are named (gzip and zstandard are read streaming)."""
ZSTD_PIECE = 1 << 16
"""Compressed bytes decompressed at once (text inflates ~5x, so ~300 KiB out)."""
PARQUET_SUFFIXES = (".parquet",)
PARQUET_BATCH_ROWS = 256
"""Rows read from a Parquet file at once (pyarrow record batches): with ``data.max_doc_bytes``
it bounds the memory of reading, whatever the size of the file's row groups."""
UNREADABLE = (OSError, EOFError, zlib.error, zstandard.ZstdError, ValueError)
"""What a file that cannot be read to its end raises: a truncated gzip or zstandard stream, an
I/O error, a corrupt Parquet file (pyarrow's ``ArrowInvalid`` is a ``ValueError``)."""
READ_CHUNK = 1 << 20
"""Largest piece read at once; with ``data.max_doc_bytes`` it bounds the memory of reading."""
STDLIB_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages"}
"""Test suites are code and fixtures, not prose; installed packages are not the standard library."""
DOCSTRING_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


@dataclass(frozen=True)
class Doc:
    id: str
    text: str


@dataclass
class Skips:
    """What the source could not turn into a document: counts per reason, and the first few places."""

    counts: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)

    def add(self, reason: str, where: str, detail: str = "") -> None:
        self.counts[reason] += 1
        if len(self.examples) < 3:
            self.examples.append(f"{where}: {detail or reason}")


# --------------------------------------------------------------------------------------------
# Bounded reading
# --------------------------------------------------------------------------------------------


class ReadsLines(Protocol):
    """A binary file, plain or gzip: all :func:`bounded_lines` reads of it."""

    def readline(self, size: int = -1, /) -> bytes: ...


def bounded_lines(f: ReadsLines, limit: int) -> Iterator[tuple[bytes, int]]:
    """(first ``limit`` bytes, full length) of each line, reading at most READ_CHUNK at a time."""
    while True:
        kept: list[bytes] = []
        length = 0
        while True:
            part = f.readline(READ_CHUNK)
            if not part:
                break
            if length < limit:
                kept.append(part[: limit - length])
            length += len(part)
            if part.endswith(b"\n"):
                break
        if not length:
            return
        yield b"".join(kept), length


def decode(raw: bytes) -> str:
    """Undecodable bytes survive as surrogate escapes for the invalid-UTF-8 filter to judge."""
    return raw.decode("utf-8", "surrogateescape")


# --------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------


def stdlib_documents(limit: int, skips: Skips) -> Iterator[Doc]:
    """Docstrings of the standard library's modules, classes and functions, then the help topics
    of ``pydoc_data`` (what ``help("topic")`` shows): English prose written by people, PSF licence,
    on every machine with Python; it varies a little between Python versions."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if STDLIB_SKIP_DIRS.intersection(relative.parts[:-1]):
            continue
        module = ".".join(relative.with_suffix("").parts).removesuffix(".__init__")
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError):
            skips.add("unparseable", str(path))
            continue
        for node in ast.walk(tree):
            if not isinstance(node, DOCSTRING_NODES):
                continue
            text = ast.get_docstring(node)
            if text:
                name = module if isinstance(node, ast.Module) else f"{module}:{node.name}@{node.lineno}"
                if _fits(name, text, limit, skips):
                    yield Doc(name, text)
    for topic, text in sorted(pydoc_data.topics.topics.items()):
        if _fits(topic, text, limit, skips):
            yield Doc(f"pydoc_data.topics:{topic}", text)


def python_source_files() -> list[tuple[str, Path]]:
    """Every ``*.py`` file of the running Python's standard library (its test suites and any
    site-packages inside it aside) and of its installed distributions (site-packages), each with
    its id ``<stdlib|site>:<relative path>``, in that order. An editable install's finder module
    names the checkout's own path, so it is left out: the corpus is the environment's alone."""
    paths = sysconfig.get_paths()
    stdlib = Path(paths["stdlib"])
    site = sorted({Path(paths["purelib"]).resolve(), Path(paths["platlib"]).resolve()})
    files = [
        (f"stdlib:{p.relative_to(stdlib).as_posix()}", p)
        for p in sorted(stdlib.rglob("*.py"))
        if not STDLIB_SKIP_DIRS.intersection(p.relative_to(stdlib).parts[:-1])
    ]
    for root in site:
        files += [
            (f"site:{p.relative_to(root).as_posix()}", p)
            for p in sorted(root.rglob("*.py"))
            if not p.name.startswith("__editable__")
        ]
    return files


def python_source_documents(limit: int, skips: Skips) -> Iterator[Doc]:
    """One document per Python source file (:func:`python_source_files`): code and its comments
    and docstrings, written by people, each under its distribution's licence; with the pinned
    environment (constraints.txt) the same files on every machine of one platform."""
    for name, path in python_source_files():
        if path.stat().st_size > limit:
            skips.add("oversize", name, "longer than data.max_doc_bytes")
            continue
        yield Doc(name, decode(path.read_bytes()))


def _fits(where: str, text: str, limit: int, skips: Skips) -> bool:
    """For sources that hand over whole strings: is the text within ``data.max_doc_bytes``?"""
    if len(text.encode("utf-8", "surrogatepass")) <= limit:
        return True
    skips.add("oversize", where, "longer than data.max_doc_bytes")
    return False


def text_documents(path: Path, limit: int, skips: Skips) -> Iterator[Doc]:
    """A folder: one document per ``*.txt`` file. A file: one document per blank-line separated block."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not files:
            raise InputError(f"data.path: folder {path} holds no *.txt files")
        for file in files:
            if file.stat().st_size > limit:
                skips.add("oversize", str(file), "longer than data.max_doc_bytes")
                continue
            yield Doc(file.relative_to(path).as_posix(), decode(file.read_bytes()))
        return
    with open(path, "rb") as f:
        for first_line, block in _blocks(f, limit):
            if block is None:
                skips.add("oversize", f"{path}:{first_line}", "longer than data.max_doc_bytes")
            else:
                yield Doc(f"{path.name}:{first_line}", decode(block).strip("\r\n"))


def _blocks(f: BinaryIO, limit: int) -> Iterator[tuple[int, bytes | None]]:
    """(first line number, bytes) of each blank-line separated block; None for a block over ``limit``,
    whose lines are dropped as they stream past."""
    parts: list[bytes] = []
    size = first = 0
    for number, (line, length) in enumerate(bounded_lines(f, limit), start=1):
        if length == len(line) and not line.strip():
            if size:
                yield first, b"".join(parts) if size <= limit else None
            parts, size = [], 0
            continue
        if not size:
            first = number
        size += length
        if size <= limit:
            parts.append(line)
        else:
            parts.clear()
    if size:
        yield first, b"".join(parts) if size <= limit else None


@dataclass(frozen=True)
class SourceFile:
    """One file of a JSON-lines or Parquet source, on any file system fsspec reads."""

    fs: AbstractFileSystem
    path: str

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)

    def __str__(self) -> str:
        """A local file's path, or a remote file's URL: what a log line names."""
        return self.path if isinstance(self.fs, LocalFileSystem) else str(self.fs.unstrip_protocol(self.path))

    def open(self) -> IO[bytes] | io.BufferedIOBase:
        """The file's bytes, decompressed as they stream by (``.gz``, ``.zst``)."""
        raw: IO[bytes] = self.fs.open(self.path, "rb")
        if self.path.endswith(".gz"):
            return gzip.GzipFile(fileobj=raw, mode="rb")
        if self.path.endswith(".zst"):
            return io.BufferedReader(ZstdFrames(raw))
        return raw


class ZstdFrames(io.RawIOBase):
    """A zstandard file's bytes as they decompress, frame after frame, fed ZSTD_PIECE bytes at a
    time. A file that ends inside a frame raises ``ZstdError``: python-zstandard's own readers end
    such a file quietly, which would hide a truncated download."""

    def __init__(self, raw: IO[bytes]):
        self.raw, self.pending = raw, b""
        self.frame = zstandard.ZstdDecompressor().decompressobj()
        self.started = False  # inside a frame: some of its bytes fed, its end not reached

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self.pending:
            piece = self.frame.unused_data if self.frame.eof else self.raw.read(ZSTD_PIECE)
            if self.frame.eof:
                self.frame = zstandard.ZstdDecompressor().decompressobj()
                self.started = False
                piece = piece or self.raw.read(ZSTD_PIECE)
            if not piece:
                if self.started:
                    raise zstandard.ZstdError("the file ends inside a zstandard frame (truncated)")
                return 0
            self.started = True
            self.pending = self.frame.decompress(piece)
            self.started = not self.frame.eof
        size = min(len(buffer), len(self.pending))
        buffer[:size] = self.pending[:size]
        self.pending = self.pending[size:]
        return size

    def close(self) -> None:
        self.raw.close()
        super().close()


DVC_REMOTE = "remote://"
"""DVC's own prefix for a path on a remote's storage (as in an external dependency's URL)."""


def source_files(location: str, suffixes: tuple[str, ...], project: Path) -> list[SourceFile]:
    """The files of a source, in name order: one file, a folder's files with one of ``suffixes``
    (hidden ones aside), or a glob's matches; on this machine, at a URL (fsspec) or on a DVC
    remote of ``project``."""
    fs, root = filesystem(location, project)
    if glob.has_magic(root):
        paths = [p for p in fs.glob(root) if p.endswith(suffixes) and fs.isfile(p)]
    elif fs.isdir(root):
        paths = [p for p in fs.find(root) if p.endswith(suffixes) and not _hidden(posixpath.relpath(p, root))]
    elif fs.isfile(root):
        paths = [root]
    else:
        raise InputError(f"data.path: {location} does not exist")
    if not paths:
        raise InputError(f"data.path: {location} holds no {' or '.join('*' + s for s in suffixes)} files")
    return [SourceFile(fs, p) for p in sorted(paths)]


def filesystem(location: str, project: Path) -> tuple[AbstractFileSystem, str]:
    """fsspec's file system and path for ``location``. ``remote://<name>/<path>`` is <path> under
    the DVC remote <name> of ``project``, opened by fsspec with the arguments DVC derives from the
    remote's settings (.dvc/config, and .dvc/config.local where its credentials belong), so the
    source needs no credentials of its own and none ever sits in params.yaml. fsspec's own class,
    not DVC's wrapper of it: DVC's local one cannot glob."""
    if not location.startswith(DVC_REMOTE):
        fs, path = url_to_fs(location)
        return fs, path
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    name, _, path = location.removeprefix(DVC_REMOTE).partition("/")
    try:
        with Repo(str(project)) as repo:
            remote = repo.cloud.get_remote(name)
    except DvcException as e:
        raise InputError(
            f"data.path: {location}: no DVC remote {name!r} in {project} ({e}; see `dvc remote list`)"
        ) from e
    fs = fsspec.filesystem(remote.fs.protocol, **remote.fs.fs_args)
    return fs, remote.fs.join(remote.path, path) if path else remote.path


def _hidden(relative: str) -> bool:
    return any(part.startswith(".") for part in relative.split("/"))


def file_documents(files: list[SourceFile], read: Callable[[SourceFile], Iterator[Doc]], skips: Skips) -> Iterator[Doc]:
    """Each file's documents in turn. A file that cannot be read to its end (truncated, corrupt,
    an I/O error) is counted and logged by name, keeping what was read before."""
    for file in files:
        try:
            yield from read(file)
        except UNREADABLE as e:  # gzip.BadGzipFile is an OSError
            skips.add("unreadable_file", str(file), f"{type(e).__name__}: {e}")
            log.warning(
                "prepare: %s is unreadable past some point, skipped the rest (%s: %s)", file, type(e).__name__, e
            )


def jsonl_file_documents(file: SourceFile, key: str, limit: int, skips: Skips) -> Iterator[Doc]:
    """The string under ``key`` of each JSON object line; other lines are skipped and counted."""
    with file.open() as f:
        for number, (line, length) in enumerate(bounded_lines(f, limit), start=1):
            where = f"{file}:{number}"
            if length > limit:
                skips.add("oversize", where, "longer than data.max_doc_bytes")
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(decode(line))
            except ValueError:
                skips.add("bad_json", where, "not JSON")
                continue
            text = record.get(key) if isinstance(record, dict) else None
            if isinstance(text, str):
                yield Doc(f"{file.name}:{number}", text)
            else:
                skips.add("missing_field", where, f"no string field {key!r} (data.jsonl_field)")


def parquet_file_documents(file: SourceFile, key: str, limit: int, skips: Skips) -> Iterator[Doc]:
    """The string in column ``key`` of each row, read in record batches of PARQUET_BATCH_ROWS;
    a row whose value is missing, not a string or over ``limit`` bytes is skipped and counted."""
    import pyarrow.parquet as pq  # a stage that reads no Parquet does not import pyarrow

    with file.open() as f:
        parquet = pq.ParquetFile(f)
        if key not in parquet.schema_arrow.names:
            skips.add("missing_field", str(file), f"no column {key!r} (data.jsonl_field)")
            return
        rows = itertools.chain.from_iterable(
            batch.column(0).to_pylist() for batch in parquet.iter_batches(PARQUET_BATCH_ROWS, columns=[key])
        )
        for number, text in enumerate(rows, start=1):
            where = f"{file}:{number}"
            if not isinstance(text, str):
                skips.add("missing_field", where, f"no string in column {key!r} (data.jsonl_field)")
            elif _fits(where, text, limit, skips):
                yield Doc(f"{file.name}:{number}", text)


def hf_documents(cfg: DataConfig, limit: int, skips: Skips) -> Iterator[Doc]:
    """Stream a Hugging Face dataset (needs network and ``pip install -e '.[hf]'``)."""
    try:
        import datasets  # the optional ``hf`` extra
    except ImportError:
        raise UserError(
            "data.source: 'hf' needs the optional Hugging Face extra; install it with: pip install -e '.[hf]'"
        ) from None
    stream = datasets.load_dataset(cfg.hf_dataset, cfg.hf_config or None, split=cfg.hf_split, streaming=True)
    for number, record in enumerate(stream):
        where = f"{cfg.hf_dataset}/{cfg.hf_split}:{number}"
        text = record.get(cfg.jsonl_field)
        if not isinstance(text, str):
            skips.add("missing_field", where, f"no string field {cfg.jsonl_field!r} (data.jsonl_field)")
        elif _fits(where, text, limit, skips):
            yield Doc(where, text)


def documents(cfg: DataConfig, project: Path, skips: Skips) -> Iterator[Doc]:
    """The configured source's documents, at most ``data.max_docs`` of them."""
    limit = cfg.max_doc_bytes
    if cfg.source == "stdlib_docs":
        docs = stdlib_documents(limit, skips)
    elif cfg.source == "python_sources":
        docs = python_source_documents(limit, skips)
    elif cfg.source == "hf":
        docs = hf_documents(cfg, limit, skips)
    elif cfg.source == "text":
        docs = text_documents(source_path(cfg, project), limit, skips)
    else:
        docs = file_documents(
            source_files(location(cfg, project), SUFFIXES[cfg.source], project), reader(cfg, skips), skips
        )
    return itertools.islice(docs, cfg.max_docs or None)


SUFFIXES = {"jsonl": JSONL_SUFFIXES, "parquet": PARQUET_SUFFIXES}


def reader(cfg: DataConfig, skips: Skips) -> Callable[[SourceFile], Iterator[Doc]]:
    """How one file of the configured source turns into documents."""
    read = jsonl_file_documents if cfg.source == "jsonl" else parquet_file_documents
    return lambda file: read(file, cfg.jsonl_field, cfg.max_doc_bytes, skips)


def source_path(cfg: DataConfig, project: Path) -> Path:
    path = project / cfg.path
    if not path.exists():
        raise InputError(f"data.path: {path} does not exist")
    return path


def location(cfg: DataConfig, project: Path) -> str:
    """``data.path`` as fsspec reads it: a URL as it is, a local path relative to the project."""
    return cfg.path if "://" in cfg.path else str(project / cfg.path)


def source_identity(cfg: DataConfig, project: Path) -> list:
    """What the source's documents depend on besides ``data``: the Python version (the standard
    library), or the names, sizes and modification times of a local source's files; a URL or a
    Hugging Face dataset by its name alone. Names prepare's scratch folder (a killed run resumes
    only on the same input)."""
    if cfg.source == "stdlib_docs":
        return [platform.python_version()]
    if cfg.source == "python_sources":
        listing = "\n".join(f"{name}\0{path.stat().st_size}" for name, path in python_source_files())
        return [platform.python_version(), hashlib.sha256(listing.encode()).hexdigest()]
    if cfg.source == "hf" or "://" in cfg.path:
        return [cfg.path]
    path = project / cfg.path
    files = [Path(p) for p in glob.glob(str(path))] if glob.has_magic(cfg.path) else [path]
    files = sorted(f for top in files for f in ([top, *top.rglob("*")] if top.is_dir() else [top]) if f.is_file())
    return [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]


def origin(cfg: DataConfig) -> str:
    if cfg.source == "stdlib_docs":
        return f"Python {platform.python_version()} standard library docstrings and pydoc topics"
    if cfg.source == "python_sources":
        return f"Python {platform.python_version()} standard library and installed distributions' *.py files"
    if cfg.source == "hf":
        return "/".join(filter(None, (cfg.hf_dataset, cfg.hf_config, cfg.hf_split)))
    return cfg.path


# --------------------------------------------------------------------------------------------
# The stage
# --------------------------------------------------------------------------------------------


@task(name="read-corpus")
def read_corpus(cfg: DataConfig, project: Path, out_dir: Path, work_dir: Path | None = None) -> dict[str, int]:
    """Write the source's documents to shards ``out_dir/<n>-docs.jsonl`` (tasks/data/shards.py) and
    their provenance to ``out_dir/source.json``; return the counts (documents, bytes, shards,
    skipped per reason). With ``work_dir`` (the stage's scratch folder) the shards are written
    there first and a killed run resumes after its finished shards: the source is read again
    from the start (so the counts and skips are whole), its documents in those shards not
    written again."""
    out_dir.mkdir(parents=True, exist_ok=True)
    skips = Skips()
    count = size = 0
    with ShardedWriter(work_dir or out_dir, cfg.shard_bytes) as shards:
        written = shards.resume() if work_dir else 0
        for doc in documents(cfg, project, skips):
            if count >= written:
                shards.add({"id": doc.id, "text": doc.text})
            count += 1
            size += len(doc.text.encode("utf-8", "surrogatepass"))
    shards.publish(out_dir)
    if not count:
        where = location(cfg, project) if cfg.source in ("text", "jsonl", "parquet") else origin(cfg)
        raise InputError(f"{where}: no usable document (data.source={cfg.source!r}){_skip_summary(skips)}")
    if skips.counts:
        log.warning("prepare skipped %s%s", dict(skips.counts), _skip_summary(skips))
    counts = {
        "documents": count,
        "bytes": size,
        "shards": shards.shards,
        **{f"skipped_{k}": v for k, v in sorted(skips.counts.items())},
    }
    write_json(
        out_dir / SOURCE_FILE,
        {"source": cfg.source, "origin": origin(cfg), "python_version": platform.python_version(), **counts},
    )
    return counts


def _skip_summary(skips: Skips) -> str:
    if not skips.counts:
        return ""
    return f" (skipped {dict(skips.counts)}; e.g. {'; '.join(skips.examples)})"
