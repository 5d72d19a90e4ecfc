"""benchmarks/label_removals.py's decision rule: labels read whole, LOW removals counted right,
and the labelled precision standing only where the labeller tells removals from kept documents."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import label_removals  # noqa: E402

JUDGED = {"garbage": 90, "removals": 100}  # by origin: 10 false positives


def _key(removed: int, kept: int) -> dict[str, dict]:
    arms = ["removed"] * removed + ["kept"] * kept
    return {str(n): {"line": n, "arm": arm} for n, arm in enumerate(arms, start=1)}


def test_removals_labelled_low_count_as_right_and_good_or_unsure_stay_wrong():
    key = _key(10, 10)
    labels = {str(n): "LOW" for n in range(1, 7)} | {"7": "UNSURE"} | {str(n): "GOOD" for n in range(8, 21)}
    result = label_removals.precision_from_labels(key, labels, JUDGED)
    assert result["precision_by_origin"] == 0.9
    assert result["precision_labelled"] == pytest.approx(0.96)  # 90 + 6 LOW of 100
    assert result["counts"]["removed"] == {"GOOD": 3, "LOW": 6, "UNSURE": 1}
    assert result["discriminates"]  # 6/10 LOW among removals, 0/10 among kept: p = 0.0054


def test_a_labeller_who_calls_kept_documents_low_as_often_does_not_discriminate():
    key = _key(10, 10)
    labels = {str(n): "LOW" if n % 2 else "GOOD" for n in range(1, 21)}  # 5 of 10 LOW in each arm
    result = label_removals.precision_from_labels(key, labels, JUDGED)
    assert result["precision_labelled"] == pytest.approx(0.95)
    assert not result["discriminates"]
    assert result["precision_conservative"] == pytest.approx(0.9)  # 5 LOW less 0.5 x 10


def test_fisher_p_just_above_alpha_does_not_discriminate():
    # 4/10 LOW among removals against 0/10 kept: one-sided Fisher p = 0.0433; 3/10 against 0/10: 0.105
    key = _key(10, 10)
    four = {str(n): "LOW" if n <= 4 else "GOOD" for n in range(1, 21)}
    three = {str(n): "LOW" if n <= 3 else "GOOD" for n in range(1, 21)}
    assert label_removals.precision_from_labels(key, four, JUDGED)["discriminates"]
    assert not label_removals.precision_from_labels(key, three, JUDGED)["discriminates"]


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
