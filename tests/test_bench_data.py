"""benchmarks/bench_data.py's judge of the filters: which base texts are prose by their origin,
and how precision counts a removal of each kind of document."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tasks.config import load_config

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_data  # noqa: E402

DOCS = Path("/usr/share/doc")


@pytest.mark.parametrize(
    "name",
    ["copyright", "changelog.Debian.gz", "README.Debian", "NEWS.gz", "notes.txt", "guide.md", "intro.rst.gz"],
)
def test_a_debian_file_in_a_prose_format_is_prose(name):
    assert bench_data.prose_file(DOCS / "pkg" / name, "Some words.\n")


@pytest.mark.parametrize("name", ["index.html", "api.json.gz", "demo.c", "build.log", "paper.ps", "README.source"])
def test_a_debian_file_in_another_format_is_not_prose(name):
    assert not bench_data.prose_file(DOCS / "pkg" / name, "Some words.\n")


def test_an_example_a_script_and_a_makefile_are_not_prose_whatever_their_suffix():
    assert not bench_data.prose_file(DOCS / "pkg" / "examples" / "README", "Some words.\n")
    assert not bench_data.prose_file(DOCS / "pkg" / "example-configs" / "notes.txt", "Some words.\n")
    assert not bench_data.prose_file(DOCS / "pkg" / "postinst", "#!/bin/sh\nset -e\n")
    assert not bench_data.prose_file(DOCS / "pkg" / "Makefile", "all:\n\tcc demo.c\n")
    assert bench_data.prose_file(DOCS / "pkg" / "README", " #!/bin/sh is quoted here, not first.\n")


def _prose(seed: int) -> str:
    """A base text that breaks no rule: distinct words, no runs, longer than filter.min_chars."""
    return " ".join(f"word{seed}x{i}" for i in range(40))


def test_precision_leaves_out_only_unlabelled_perplexity_removals_that_break_no_rule(tmp_path):
    cfg = load_config(REPO / "params.yaml", "default")
    texts = [_prose(1), _prose(2), _prose(3), _prose(4), "too short", _prose(6), "planted garbage"]
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    planted = {7: "gibberish"}
    unlabelled = {3, 5}  # line 5 breaks a rule: garbage whatever its origin
    run = {
        # Kept: 1 and 6. Removed by the garbage filters: 2 (prose, perplexity: wrong), 3 (unlabelled,
        # perplexity: not judged), 5 (too short: right), 7 (planted: right). Line 4: removed by dedup.
        "kept_lines": [1, 6],
        "perplexity_removed_lines": [2, 3, 7],
        "report": {
            "documents_in": 7,
            "documents_kept": 2,
            "removed_duplicate_exact": 1,
            "removed_duplicate_near": 0,
        },
    }
    q = bench_data.filter_quality(
        run, planted, unlabelled, bench_data.base_removals(run, planted, unlabelled, path, cfg)
    )
    assert q["perplexity_removed_real_documents"] == {"prose": 1, "unlabelled": 1}
    assert q["removed_real_documents_breaking_a_rule"] == {"too_short": 1}
    assert q["precision"] == pytest.approx(2 / 3)  # 5 and 7 right, 2 wrong, 3 not judged
    assert q["judged"] == {"garbage": 2, "removals": 3}
    assert q["precision_rule_labelled"] == pytest.approx(2 / 4)
    assert q["precision_planted_only"] == pytest.approx(1 / 4)
    assert q["recall"] == 1.0


def test_base_index_follows_the_corpus_layout_copy_after_copy_with_a_planted_line_after_every_hundred():
    n_base = 250  # a pass: 250 texts and 2 planted lines, 252 lines
    assert bench_data.base_index(1, n_base) == 0
    assert bench_data.base_index(100, n_base) == 99
    assert bench_data.base_index(101, n_base) is None  # planted after the 100th text
    assert bench_data.base_index(102, n_base) == 100
    assert bench_data.base_index(202, n_base) is None
    assert bench_data.base_index(252, n_base) == 249  # the pass's last text: no planted line after 250
    assert bench_data.base_index(253, n_base) == 0  # the next copy starts over
