"""checks/label_removals.py's decision rule: labels read whole, LOW removals counted right,
the labelled precision standing only where the labeller tells removals from kept documents, and
copies of one text judged once."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))  # label_removals imports bench_data from there
sys.path.insert(0, str(REPO / "checks"))

import label_removals  # noqa: E402

JUDGED = {"garbage": 90, "removals": 100}  # by origin: 10 false positives


def _key(removed: int, kept: int) -> dict[str, dict]:
    """Items, each a copy of a text of its own."""
    arms = ["removed"] * removed + ["kept"] * kept
    return {str(n): {"line": n, "arm": arm, "text": n} for n, arm in enumerate(arms, start=1)}


def test_removals_labelled_low_count_as_right_and_good_or_unsure_stay_wrong():
    key = _key(10, 10)
    labels = {str(n): "LOW" for n in range(1, 7)} | {"7": "UNSURE"} | {str(n): "GOOD" for n in range(8, 21)}
    result = label_removals.precision_from_labels(key, labels, JUDGED)
    assert result["precision_by_origin"] == 0.9
    assert result["precision_labelled"] == pytest.approx(0.96)  # 90 + 6 LOW of 100
    assert result["counts"]["removed"] == {"GOOD": 3, "LOW": 6, "UNSURE": 1}
    assert result["by_items"]["discriminates"]  # 6/10 LOW among removals, 0/10 among kept: p = 0.0054
    assert result["other_false_positives"] == 0


def test_a_labeller_who_calls_kept_documents_low_as_often_does_not_discriminate():
    key = _key(10, 10)
    labels = {str(n): "LOW" if n % 2 else "GOOD" for n in range(1, 21)}  # 5 of 10 LOW in each arm
    result = label_removals.precision_from_labels(key, labels, JUDGED)
    assert result["precision_labelled"] == pytest.approx(0.95)
    assert not result["by_items"]["discriminates"]
    assert result["precision_conservative"] == pytest.approx(0.9)  # 5 LOW less 0.5 x 10


def test_fisher_p_just_above_alpha_does_not_discriminate():
    # 4/10 LOW among removals against 0/10 kept: one-sided Fisher p = 0.0433; 3/10 against 0/10: 0.105
    key = _key(10, 10)
    four = {str(n): "LOW" if n <= 4 else "GOOD" for n in range(1, 21)}
    three = {str(n): "LOW" if n <= 3 else "GOOD" for n in range(1, 21)}
    assert label_removals.precision_from_labels(key, four, JUDGED)["by_items"]["discriminates"]
    assert not label_removals.precision_from_labels(key, three, JUDGED)["by_items"]["discriminates"]


def test_an_unlabelled_item_or_an_unknown_label_is_an_error_naming_it(tmp_path):
    key = _key(2, 1)
    (tmp_path / "labels-0.json").write_text(json.dumps({"1": "LOW", "2": "GOOD"}))
    with pytest.raises(SystemExit, match=r"no label for items \['3'\]"):
        label_removals.read_labels(tmp_path, key)
    (tmp_path / "labels-1.json").write_text(json.dumps({"3": "bad"}))
    with pytest.raises(SystemExit, match="labels-1.json: item 3: 'bad'"):
        label_removals.read_labels(tmp_path, key)
    (tmp_path / "labels-1.json").write_text(json.dumps({"3": "GOOD", "2": "LOW"}))
    with pytest.raises(SystemExit, match="item 2 labelled twice"):
        label_removals.read_labels(tmp_path, key)
    (tmp_path / "labels-1.json").write_text(json.dumps({"3": "GOOD", "4": "LOW"}))
    with pytest.raises(SystemExit, match="item 4 is not in the key"):
        label_removals.read_labels(tmp_path, key)


def test_copies_of_one_text_are_one_judgement_by_their_majority_label():
    # 10 removals: copies of texts 1 (6 copies: 4 LOW) and 2 (4 copies: 2 LOW, not a majority)
    key = _key(10, 10)
    for n in range(1, 11):
        key[str(n)]["text"] = 1 if n <= 6 else 2
    labels = {str(n): "LOW" for n in (1, 2, 3, 4, 7, 8)} | {str(n): "GOOD" for n in (5, 6, 9, 10, *range(11, 21))}
    result = label_removals.precision_from_labels(key, labels, JUDGED)
    assert result["by_items"]["low"] == {"removed": 6, "kept": 0}
    labels["8"] = "GOOD"  # text 2: 1 LOW of 4; text 1 still LOW, all 6 of its copies right
    assert label_removals.precision_from_labels(key, labels, JUDGED)["precision_labelled"] == pytest.approx(0.95)
    assert label_removals.precision_from_labels(key, labels, JUDGED)["precision_by_text"] == pytest.approx(0.96)
    labels["8"] = "LOW"
    assert result["by_text"]["low"] == {"removed": 1, "kept": 0}
    assert result["by_text"]["total"] == {"removed": 2, "kept": 10}
    assert not result["by_text"]["discriminates"]  # 1 of 2 texts against 0 of 10: p = 0.167
    assert result["precision_labelled"] == pytest.approx(0.96)  # 6 LOW copies
    assert result["precision_by_text"] == pytest.approx(0.96)  # text 1's 6 copies


def test_a_false_positive_that_is_not_labelled_stays_one_and_more_labelled_than_there_are_is_an_error():
    key = _key(9, 9)
    labels = {str(n): "LOW" for n in range(1, 19)}
    assert label_removals.precision_from_labels(key, labels, JUDGED)["other_false_positives"] == 1
    with pytest.raises(SystemExit, match="11 removals labelled, more than the 10"):
        label_removals.precision_from_labels(_key(11, 1), {str(n): "LOW" for n in range(1, 13)}, JUDGED)


def test_every_item_lands_in_one_chunk_file_once_under_the_rubric(tmp_path):
    n = 2 * label_removals.CHUNKS + 3
    items = {str(i): {"line": 100 + i, "arm": "kept", "text": i} for i in range(1, n + 1)}
    label_removals.write_blind(items, {100 + i: f"text of line {100 + i}" for i in range(1, n + 1)}, tmp_path)
    chunks = [tmp_path / f"blind-{c}.md" for c in range(label_removals.CHUNKS)]
    found = [line for chunk in chunks for line in chunk.read_text().splitlines() if line.startswith("===== item ")]
    assert sorted(int(line.split()[2]) for line in found) == list(range(1, n + 1))
    first = chunks[0].read_text()
    assert first.startswith(label_removals.RUBRIC)
    assert f"Items: 1, {1 + label_removals.CHUNKS}, {1 + 2 * label_removals.CHUNKS}\n" in first
    assert "===== item 9 =====\ntext of line 109\n===== end of item 9 =====" in first


def test_draw_refuses_a_folder_that_exists_before_reading_anything(tmp_path):
    with pytest.raises(SystemExit, match="exists; draw writes a new folder"):
        label_removals.draw(2000, tmp_path / "no-project", tmp_path, seed=0)
