"""prepare: every source, bounded reading of huge lines, bad input with clear messages, and
outputs that are never half-written."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import sysconfig
import tracemalloc
from pathlib import Path

import pytest

from model.typed_config import InputError, UserError
from tasks.data.config import DataConfig
from tasks.data.docs import read_docs
from tasks.data.shards import ShardedWriter, shard_path
from tasks.data.sources import bounded_lines, python_source_files, read_corpus
from tasks.runtime.files import staged
from tasks.runtime.outputs import SOURCE_FILE


def prepare(tmp_path: Path, **data) -> tuple[dict[str, int], list[dict[str, str]]]:
    counts = read_corpus.fn(DataConfig(**data), tmp_path, tmp_path / "raw")
    return counts, list(read_docs(shard_path(tmp_path / "raw", 0)))


def test_stdlib_docs_are_docstrings_and_record_the_python_version(tmp_path):
    counts, docs = prepare(tmp_path, max_docs=50)
    assert counts["documents"] == len(docs) == 50
    assert docs[0]["id"] == "__future__" and "__future__" in docs[0]["text"]
    source = json.loads((tmp_path / "raw" / SOURCE_FILE).read_text())
    assert source["python_version"] == ".".join(map(str, sys.version_info[:3]))
    assert not any(".test." in d["id"] or d["id"].startswith("test.") for d in docs)


def test_text_file_is_split_on_blank_lines_and_a_folder_gives_one_document_per_file(tmp_path):
    (tmp_path / "corpus.txt").write_text("first line\nstill first\n\n\nsecond\n   \nthird\n")
    _, docs = prepare(tmp_path, source="text", path="corpus.txt")
    assert [d["text"] for d in docs] == ["first line\nstill first", "second", "third"]
    assert [d["id"] for d in docs] == ["corpus.txt:1", "corpus.txt:5", "corpus.txt:7"]
    (tmp_path / "folder" / "sub").mkdir(parents=True)
    (tmp_path / "folder" / "a.txt").write_text("alpha\n\nstill alpha")
    (tmp_path / "folder" / "sub" / "b.txt").write_text("beta")
    (tmp_path / "folder" / "ignored.md").write_text("not text")
    _, docs = prepare(tmp_path, source="text", path="folder")
    assert [(d["id"], d["text"]) for d in docs] == [("a.txt", "alpha\n\nstill alpha"), ("sub/b.txt", "beta")]


def test_undecodable_bytes_reach_the_filter_as_surrogate_escapes(tmp_path):
    (tmp_path / "corpus.txt").write_bytes(b"ok \xff\xfe bytes")
    _, docs = prepare(tmp_path, source="text", path="corpus.txt")
    assert docs[0]["text"].encode("utf-8", "surrogateescape") == b"ok \xff\xfe bytes"


def test_jsonl_skips_and_counts_lines_that_are_not_json_or_lack_the_field(tmp_path):
    lines = [
        json.dumps({"body": "good one"}),
        "{not json",
        json.dumps({"text": "wrong field"}),
        json.dumps({"body": 42}),
        "",
        json.dumps(["a list"]),
        json.dumps({"body": "good two"}),
    ]
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
    counts, docs = prepare(tmp_path, source="jsonl", path="c.jsonl", jsonl_field="body")
    assert [d["text"] for d in docs] == ["good one", "good two"]
    assert counts["skipped_bad_json"] == 1 and counts["skipped_missing_field"] == 3


def test_a_jsonl_file_without_any_usable_line_names_the_file_and_the_key(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"body": "x"}\nnot json\n')
    with pytest.raises(
        InputError,
        match=r"c\.jsonl.*no usable document.*c\.jsonl:1: no string field 'text' "
        r"\(data\.jsonl_field\).*c\.jsonl:2: not JSON",
    ):
        prepare(tmp_path, source="jsonl", path="c.jsonl")


def test_a_missing_path_names_the_key_and_the_path(tmp_path):
    with pytest.raises(InputError, match=r"data\.path: .*nowhere\.txt does not exist"):
        prepare(tmp_path, source="text", path="nowhere.txt")


def test_an_empty_corpus_names_the_file_and_an_empty_folder_names_the_folder(tmp_path):
    (tmp_path / "empty.txt").write_text("\n\n  \n")
    with pytest.raises(InputError, match=r"empty\.txt: no usable document"):
        prepare(tmp_path, source="text", path="empty.txt")
    (tmp_path / "nothing").mkdir()
    with pytest.raises(InputError, match=r"data\.path: folder .*nothing holds no \*\.txt files"):
        prepare(tmp_path, source="text", path="nothing")


def test_huge_single_line_is_skipped_while_streaming_in_bounded_memory(tmp_path):
    """The 1 GB single line, scaled down: a 32 MiB line against a 64 KiB guard. Reading holds at
    most the guard plus a 1 MiB chunk (and the file buffer), whatever the line's length."""
    with open(tmp_path / "huge.txt", "wb") as f:
        f.write(b"a normal first document\n\n")
        for _ in range(32):
            f.write(b"x" * (1 << 20))
        f.write(b"\n\nthe document after it\n")
    tracemalloc.start()
    try:
        counts, docs = prepare(tmp_path, source="text", path="huge.txt", max_doc_bytes=1 << 16)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [d["text"] for d in docs] == ["a normal first document", "the document after it"]
    assert counts["skipped_oversize"] == 1
    assert peak < 4 << 20, f"peak {peak / 2**20:.1f} MiB while reading a 32 MiB line"


def test_bounded_lines_keep_the_head_and_the_full_length_of_each_line(tmp_path):
    (tmp_path / "f").write_bytes(b"short\n" + b"y" * 3_000_000 + b"\nend")
    with open(tmp_path / "f", "rb") as f:
        lines = list(bounded_lines(f, limit=10))
    assert lines == [(b"short\n", 6), (b"y" * 10, 3_000_001), (b"end", 3)]


def test_max_docs_caps_the_corpus(tmp_path):
    (tmp_path / "c.txt").write_text("\n\n".join(f"doc {i}" for i in range(10)))
    counts, docs = prepare(tmp_path, source="text", path="c.txt", max_docs=3)
    assert len(docs) == counts["documents"] == 3


def test_hugging_face_source_without_the_extra_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(UserError, match=r"pip install -e '\.\[hf\]'"):
        prepare(tmp_path, source="hf", hf_dataset="wikitext")


def test_a_failed_stage_leaves_no_output_and_keeps_the_previous_one(tmp_path):
    out = tmp_path / "data" / "raw"
    with staged(out) as (tmp,):
        tmp.mkdir()
        (tmp / "docs.jsonl").write_text("v1")
    assert (out / "docs.jsonl").read_text() == "v1"
    with pytest.raises(InputError), staged(out, tmp_path / "metrics" / "m.json") as (tmp, report):
        tmp.mkdir()
        (tmp / "docs.jsonl").write_text("half")
        report.write_text("{}")
        read_corpus.fn(DataConfig(source="text", path="missing.txt"), tmp_path, tmp)
    assert (out / "docs.jsonl").read_text() == "v1"
    assert not (tmp_path / "metrics" / "m.json").exists()
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["raw"]  # no temporaries left


def test_a_jsonl_folder_reads_gzip_skips_hidden_and_counts_a_truncated_file_by_name(tmp_path, caplog):
    import gzip

    folder = tmp_path / "corpus"
    (folder / "part" / ".cache").mkdir(parents=True)
    lines = lambda *texts: "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()  # noqa: E731
    (folder / "a.jsonl").write_bytes(lines("one", "two"))
    (folder / "part" / "b.jsonl.gz").write_bytes(gzip.compress(lines("three")))
    (folder / "part" / "c.jsonl.gz").write_bytes(gzip.compress(lines(*(f"long {i}" for i in range(5000))))[:-200])
    (folder / "part" / ".cache" / "d.jsonl").write_bytes(lines("hidden"))
    counts, docs = prepare(tmp_path, source="jsonl", path="corpus")
    texts = [d["text"] for d in docs]
    assert texts[:3] == ["one", "two", "three"] and "hidden" not in texts
    assert 3 < len(texts) < 5003 and counts["skipped_unreadable_file"] == 1  # what c held before the cut
    assert "c.jsonl.gz" in caplog.text


def jsonl_bytes(*texts: str) -> bytes:
    return "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()


def test_zstandard_jsonl_is_read_streaming_and_a_truncated_file_is_counted_by_name(tmp_path, caplog):
    import zstandard

    folder = tmp_path / "corpus"
    folder.mkdir()
    frames = [zstandard.ZstdCompressor().compress(jsonl_bytes(*texts)) for texts in (("one", "two"), ("three",))]
    (folder / "a.jsonl.zst").write_bytes(b"".join(frames))  # two frames, as `cat a.zst b.zst` makes
    whole = zstandard.ZstdCompressor().compress(jsonl_bytes(*(f"long {i}" for i in range(5000))))
    (folder / "b.jsonl.zst").write_bytes(whole[: len(whole) // 2])
    counts, docs = prepare(tmp_path, source="jsonl", path="corpus")
    assert [d["text"] for d in docs][:3] == ["one", "two", "three"] and [d["id"] for d in docs][:2] == [
        "a.jsonl.zst:1",
        "a.jsonl.zst:2",
    ]
    assert counts["skipped_unreadable_file"] == 1 and "b.jsonl.zst" in caplog.text


def write_parquet(path: Path, texts: list, column: str = "text") -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({column: texts, "other": list(range(len(texts)))}), path, row_group_size=1000)


def test_parquet_rows_stream_in_batches_and_bad_rows_and_files_are_counted_by_name(tmp_path, caplog):
    folder = tmp_path / "corpus"
    folder.mkdir()
    texts = [f"row {i}" for i in range(2500)]
    write_parquet(folder / "a.parquet", [*texts[:10], None, "x" * 300, *texts[10:]])
    write_parquet(folder / "b.parquet", ["elsewhere"], column="body")
    (folder / "c.parquet").write_bytes(b"PAR1 not really parquet PAR1")
    counts, docs = prepare(tmp_path, source="parquet", path="corpus", max_doc_bytes=200)
    assert [d["text"] for d in docs] == texts and docs[10]["id"] == "a.parquet:13"
    assert counts["skipped_missing_field"] == 2 and counts["skipped_oversize"] == 1  # the null row, b's column
    assert counts["skipped_unreadable_file"] == 1 and "c.parquet" in caplog.text


def test_a_glob_and_a_file_url_name_the_files_to_read(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for name, text in (("x-1.jsonl", "first"), ("x-2.jsonl", "second"), ("y.jsonl", "not matched")):
        (folder / name).write_bytes(jsonl_bytes(text))
    _, docs = prepare(tmp_path, source="jsonl", path="corpus/x-*.jsonl")
    assert [d["text"] for d in docs] == ["first", "second"]
    _, docs = prepare(tmp_path / "url", source="jsonl", path=(folder / "y.jsonl").as_uri())
    assert [d["text"] for d in docs] == ["not matched"]
    with pytest.raises(InputError, match=r"data\.path: .*z-\*\.jsonl holds no \*\.jsonl"):
        prepare(tmp_path, source="jsonl", path="corpus/z-*.jsonl")
    with pytest.raises(InputError, match=r"data\.path: file:///nowhere/at/all\.parquet does not exist"):
        prepare(tmp_path, source="parquet", path="file:///nowhere/at/all.parquet")


def dvc_project(path: Path) -> Path:
    """A git + DVC project at ``path`` (what `make setup` leaves a user with)."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=path, check=True)
    return path


def dvc(project: Path, *args: str) -> None:
    subprocess.run([sys.executable, "-m", "dvc", *args], cwd=project, check=True, capture_output=True)


def test_a_dvc_remote_path_is_read_with_the_remote_configured_in_the_local_config_only(tmp_path):
    project, store = dvc_project(tmp_path / "project"), tmp_path / "store"
    (store / "shards").mkdir(parents=True)
    for name, text in (("a.jsonl", "first"), ("b.jsonl.gz", "second"), ("c.txt", "not a source file")):
        data = jsonl_bytes(text)
        (store / "shards" / name).write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    dvc(project, "remote", "add", "--local", "lab", str(store))  # .dvc/config.local, where credentials go
    _, docs = prepare(project, source="jsonl", path="remote://lab/shards")
    assert [d["text"] for d in docs] == ["first", "second"]
    _, docs = prepare(project, source="jsonl", path="remote://lab/shards/b*")
    assert [d["text"] for d in docs] == ["second"]
    with pytest.raises(InputError, match=r"data\.path: remote://nowhere/shards: no DVC remote 'nowhere'"):
        prepare(project, source="jsonl", path="remote://nowhere/shards")


def test_a_dvc_remotes_credentials_reach_the_file_system_that_reads_the_source(tmp_path):
    from tasks.data.sources import filesystem

    project = dvc_project(tmp_path / "project")
    dvc(project, "remote", "add", "bucket", "s3://lab-corpora/pretraining")
    dvc(project, "remote", "modify", "--local", "bucket", "access_key_id", "AKIDEXAMPLE")
    dvc(project, "remote", "modify", "--local", "bucket", "secret_access_key", "not-a-real-secret")
    fs, path = filesystem("remote://bucket/shard-*.jsonl.zst", project)  # builds the client; no request is made
    assert (type(fs).__name__, path) == ("S3FileSystem", "lab-corpora/pretraining/shard-*.jsonl.zst")
    assert (fs.key, fs.secret) == ("AKIDEXAMPLE", "not-a-real-secret")


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_prepare_killed_midway_resumes_after_its_finished_shards_with_the_uninterrupted_output(tmp_path, monkeypatch):
    data = DataConfig(max_docs=600, shard_bytes=20_000)
    whole = read_corpus.fn(data, tmp_path, tmp_path / "whole", tmp_path / "whole-work")
    added: list[str] = []
    add = ShardedWriter.add

    def add_until_killed(self: ShardedWriter, record: dict) -> None:
        if len(added) == 350:
            raise KeyboardInterrupt("killed while writing its shards")
        added.append(record["id"])
        add(self, record)

    monkeypatch.setattr(ShardedWriter, "add", add_until_killed)
    with pytest.raises(KeyboardInterrupt):
        read_corpus.fn(data, tmp_path, tmp_path / "out", tmp_path / "work")
    finished = len(list((tmp_path / "work").glob(".*.done")))
    assert 0 < finished < whole["shards"]
    added.clear()
    monkeypatch.setattr(ShardedWriter, "add", lambda self, record: (added.append(record["id"]), add(self, record)))
    resumed = read_corpus.fn(data, tmp_path, tmp_path / "out", tmp_path / "work")
    assert resumed == whole and folder_bytes(tmp_path / "out") == folder_bytes(tmp_path / "whole")
    assert len(added) < 600 - 250  # the finished shards' documents were not written again
    assert not list((tmp_path / "work").iterdir())  # shards and markers moved out


def test_a_stage_keeps_its_scratch_only_when_it_failed_with_work_to_resume_from(tmp_path):
    from tasks.data.shards import resumable, scratch

    done = scratch(tmp_path / "ok", "prepare", "identity")
    with resumable(done):
        (done / "00000-docs.jsonl").write_text("{}\n")
    assert not done.exists(), "a stage that succeeded leaves no scratch"

    killed = scratch(tmp_path / "killed", "prepare", "identity")
    with pytest.raises(KeyboardInterrupt), resumable(killed):
        (killed / "00000-docs.jsonl").write_text("{}\n")
        raise KeyboardInterrupt
    assert (killed / "00000-docs.jsonl").is_file(), "a finished shard is kept for the rerun to resume from"

    bad = scratch(tmp_path / "bad" / "data", "prepare", "identity")
    with pytest.raises(ValueError), resumable(bad):
        raise ValueError("data.path: corpus/missing.jsonl does not exist")
    assert not (tmp_path / "bad" / "data").exists(), "a bad input leaves no trace, not even an empty folder"


def test_python_sources_are_the_environments_py_files_stdlib_first_without_test_suites_or_the_editable_finder(
    tmp_path,
):
    counts, docs = prepare(tmp_path, source="python_sources", max_docs=2)
    assert [d["id"] for d in docs] == ["stdlib:__future__.py", "stdlib:__hello__.py"]
    assert docs[0]["text"] == (Path(sysconfig.get_paths()["stdlib"]) / "__future__.py").read_text()
    names = [name for name, _ in python_source_files()]
    kinds = [name.split(":")[0] for name in names]
    assert kinds == sorted(kinds, key=["stdlib", "site"].index)  # the standard library, then site-packages
    assert not any(n.startswith(("stdlib:test/", "stdlib:idlelib/idle_test/")) for n in names)
    assert not any(n.rsplit("/", 1)[-1].startswith("__editable__") for n in names)  # names this checkout
    assert "site:torch/nn/modules/linear.py" in names  # the pinned environment's distributions
    source = json.loads((tmp_path / "raw" / SOURCE_FILE).read_text())
    assert source["source"] == "python_sources"
