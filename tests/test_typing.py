"""What mypy cannot check of its own rules (pyproject.toml: [tool.mypy]): an ignore comment in the
checked packages names its error codes (mypy checks that) and says why on its line (this test)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IGNORE = re.compile(r"#\s*type:\s*ignore\b(?P<rest>.*)$")
CODES_AND_REASON = re.compile(r"\[[a-z-]+(,\s*[a-z-]+)*\]\s+#\s*\S")


def ignores_without_reason(text: str) -> list[int]:
    """Line numbers of the ``type: ignore`` comments in ``text`` without ``[code]  # why``."""
    return [
        n
        for n, line in enumerate(text.splitlines(), 1)
        if (m := IGNORE.search(line)) and not CODES_AND_REASON.match(m["rest"])
    ]


def test_every_type_ignore_says_why() -> None:
    bad = [
        f"{path.relative_to(ROOT)}:{n}"
        for package in ("model", "tasks", "flows")
        for path in sorted((ROOT / package).rglob("*.py"))
        for n in ignores_without_reason(path.read_text(encoding="utf-8"))
    ]
    assert not bad, "type: ignore without `[code]  # why` on its line: " + ", ".join(bad)


def test_the_rule_reads_codes_and_reasons() -> None:
    assert ignores_without_reason("x = f()  # type: ignore[arg-type]  # the stub lacks the overload\n") == []
    assert ignores_without_reason("x = f()  # type: ignore[arg-type, call-overload]  # why\n") == []
    assert ignores_without_reason("x = f()  # type: ignore\n") == [1]
    assert ignores_without_reason("x = 1\nx = f()  # type: ignore[arg-type]\n") == [2]
    assert ignores_without_reason("x = f()  # type: ignore[arg-type]  #\n") == [1]
