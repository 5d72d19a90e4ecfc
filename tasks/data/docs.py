"""The document format passed between the data stages: one JSON object per line,
``{"id": ..., "text": ...}``.

Undecodable input bytes are kept in ``text`` as surrogate escapes (U+DC80..U+DCFF, Python's
``surrogateescape``), so the invalid-UTF-8 filter can see them and
``text.encode("utf-8", "surrogateescape")`` gives the original bytes back. Lines are written with
``ensure_ascii`` so every file stays valid UTF-8 JSON.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def write_doc(f, record: dict[str, Any]) -> None:
    f.write(json.dumps(record, ensure_ascii=True) + "\n")


def read_docs(path: Path) -> Iterator[dict[str, Any]]:
    """Stream the records of a docs file, one line at a time."""
    return (record for _, record in read_lines(path))


def read_lines(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each line of a docs file with its record: a stage that passes a record on unchanged
    copies its line (what :func:`write_doc` would write again) instead of encoding it anew."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield line, json.loads(line)


UNDECODABLE = re.compile("[\ud800-\udfff]")
"""Surrogates: undecodable input bytes kept as surrogate escapes, or lone escapes from JSON."""


def repair_undecodable(text: str) -> str:
    """Undecodable bytes as U+FFFD: what a kept document carries when ``filter.invalid_utf8`` is
    off, and what the tokenizer (which takes only valid Unicode) sees of a poison document."""
    return UNDECODABLE.sub("\ufffd", text)
