"""The filters: what each keeps and drops, the perplexity model, the poison pool's separation from
the clean corpus, and precision/recall on a corpus with planted garbage."""

from __future__ import annotations

import base64
import dataclasses
import itertools
import json
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from datasketch import MinHash

from model.typed_config import InputError
from tasks.data.config import FilterConfig
from tasks.data.docs import read_docs, write_doc
from tasks.data.filters import (
    GENERATED,
    SIGNATURE_CHUNK,
    SURVIVORS_FILE,
    UNICODE_ONLY_SPACE,
    Deduplicator,
    Screen,
    filter_corpus,
    generated_garbage,
    has_char_run,
    has_repeated_ngram,
    longest_char_run,
    minhash_signature,
    nonprintable_ratio,
    perplexity_outliers,
    perplexity_sample,
    screen_shard,
    word_hashes,
)
from tasks.data.perplexity import ByteNgramModel, robust_zscores
from tasks.data.quality import PLANTED, measure_filters, planted_corpus
from tasks.data.shards import shard_path, shard_paths, shard_pool
from tasks.data.sources import Skips, stdlib_documents
from tasks.runtime.outputs import SOURCE_FILE

PROSE = (
    "The quick brown fox jumps over the lazy dog. Return a new list containing all items from "
    "the iterable in ascending order; a custom key function can be supplied to customise the sort order."
)


@pytest.fixture(scope="module")
def base_docs() -> list[str]:
    """Real prose: standard-library docstrings of ordinary length."""
    docs = (d.text for d in stdlib_documents(1 << 22, Skips()) if 200 <= len(d.text) <= 5000)
    return list(itertools.islice(docs, 300))


def write_raw(raw_dir: Path, docs: list[dict[str, str]], shard: Path | None = None) -> Path:
    raw_dir.mkdir(parents=True, exist_ok=True)
    with open(shard or shard_path(raw_dir, 0), "w", encoding="utf-8") as f:
        for doc in docs:
            write_doc(f, doc)
    (raw_dir / SOURCE_FILE).write_text(json.dumps({"source": "test"}))
    return raw_dir


def run_filter(cfg: FilterConfig, raw_dir: Path, out: Path, workers: int = 1) -> dict[str, float]:
    with shard_pool(workers, "local") as pool:
        return filter_corpus(cfg, raw_dir, out / "work", out / "clean", out / "poison", out / "filter.json", pool)


# --------------------------------------------------------------------------------------------
# Each check: what it keeps and what it drops
# --------------------------------------------------------------------------------------------


def test_invalid_utf8_drops_undecodable_bytes_and_keeps_any_valid_unicode():
    screen = Screen(FilterConfig())
    assert screen.reason(PROSE + " naïve café — 漢字 ✓") is None
    garbage = PROSE + b"\xff\xfe\x80".decode("utf-8", "surrogateescape")
    assert screen.reason(garbage) == "invalid_utf8"
    assert Screen(FilterConfig(invalid_utf8=False, nonprintable=False)).reason(garbage) is None


def test_nonprintable_drops_binary_above_the_ratio_and_keeps_tabs_and_newlines():
    assert nonprintable_ratio("a\tb\nc\r\n") == 0
    assert nonprintable_ratio("ab\x00\x01") == 0.5
    screen = Screen(FilterConfig(max_nonprintable_ratio=0.05))
    assert screen.reason(PROSE + "\x07") is None  # one bell in 200 characters is tolerated
    assert screen.reason(PROSE + "\x00\x01\x02" * 10) == "nonprintable"


def test_length_drops_too_short_and_too_long_and_keeps_the_bounds():
    screen = Screen(FilterConfig(min_chars=10, max_chars=20, char_run=False))
    assert screen.reason("x" * 9) == "too_short"
    assert screen.reason("y" * 10) is None
    assert screen.reason("z" * 20) is None
    assert screen.reason("w" * 21) == "too_long"
    assert Screen(FilterConfig(length=False)).reason("short") is None


def test_char_run_drops_a_hundred_thousand_spaces_and_keeps_runs_up_to_the_limit():
    assert has_char_run("a" + " " * 100_000 + "b", 200)
    assert not has_char_run("=" * 200, 200)
    assert has_char_run("=" * 201, 200)
    assert has_char_run("\n" * 300, 200)  # runs of newlines too
    assert Screen(FilterConfig()).reason(PROSE + " " * 100_000 + PROSE) == "char_run"


def test_repeated_ngram_follows_olmo_core_rule_period_up_to_13_repeated_32_times():
    phrase = "one two three four five six seven eight nine ten eleven twelve thirteen"
    assert has_repeated_ngram(PROSE + (" " + phrase) * 32, 13, 32)
    assert not has_repeated_ngram(PROSE + (" " + phrase) * 31, 13, 32)  # one repeat short
    assert not has_repeated_ngram((phrase + " fourteen ") * 40, 13, 32)  # period 14 is too long
    assert has_repeated_ngram(PROSE + " ha" * 32, 13, 32)
    assert not has_repeated_ngram(PROSE * 3, 13, 32)
    assert Screen(FilterConfig()).reason(PROSE + " spam eggs" * 40) == "repeated_ngram"


def test_dedup_drops_exact_and_near_copies_and_keeps_the_first_and_distinct_documents(base_docs):
    dedup = Deduplicator(FilterConfig())
    original = base_docs[0]
    words = original.split(" ")
    near = " ".join(words[:-1] + ["changed"])
    assert dedup.reason(original) is None
    assert dedup.reason(original) == "duplicate_exact"
    assert dedup.reason(near) == "duplicate_near"
    assert [dedup.reason(d) for d in base_docs[1:50]].count(None) >= 45  # distinct docstrings stay


def test_an_lsh_candidate_is_a_near_duplicate_only_at_a_signature_jaccard_estimate_of_the_threshold():
    cfg = FilterConfig()  # 0.8 of 128 permutations: 102.4, so 103 equal minima are the fewest that count
    rng = np.random.default_rng(0)
    original = rng.integers(0, 2**32, cfg.dedup_num_perm, dtype=np.uint32)

    def sharing(equal: int) -> np.ndarray:
        """A signature whose first ``equal`` minima are the original's (its first bands too)."""
        other = original.copy()
        other[equal:] ^= np.uint32(1)
        return other

    dedup = Deduplicator(cfg)
    assert dedup.judge(1, original) is None
    assert dedup.judge(2, sharing(102)) is None  # 7 bands in common: a candidate, estimate 0.797
    assert dedup.judge(3, sharing(103)) == "duplicate_near"  # estimate 0.805
    assert dedup.judge(4, sharing(13)) is None  # one band: LSH proposes it, the estimate (0.10) refuses


def test_disabled_filters_keep_what_they_would_drop():
    off = FilterConfig(invalid_utf8=False, nonprintable=False, length=False, char_run=False, repeated_ngram=False)
    garbage = "\x00" * 10 + b"\xff".decode("utf-8", "surrogateescape") + " " * 1000 + " la" * 50
    assert Screen(off).reason(garbage) is None


# --------------------------------------------------------------------------------------------
# Perplexity model
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# Each decision at its threshold's edge, at the end of a document longer than any window, prefix,
# sample or batch a faster filter might look at (the perplexity model's batch is 256 KiB)
# --------------------------------------------------------------------------------------------

NO_LENGTH_CAP = FilterConfig(max_chars=50_000_000)


@pytest.fixture(scope="module")
def long_prose() -> str:
    """Real prose of over 300 000 characters, longer than a perplexity batch."""
    docs = (d.text for d in stdlib_documents(1 << 22, Skips()) if 200 <= len(d.text) <= 5000)
    text = "\n\n".join(itertools.islice(docs, 800))
    assert len(text.encode()) > 300_000
    return text


def test_invalid_utf8_sees_one_undecodable_byte_at_the_end_of_a_long_document(long_prose):
    screen = Screen(NO_LENGTH_CAP)
    assert screen.reason(long_prose) is None
    assert screen.reason(long_prose + b"\xff".decode("utf-8", "surrogateescape")) == "invalid_utf8"


def test_nonprintable_ratio_edge_counts_every_character_of_a_long_document(long_prose):
    screen = Screen(dataclasses.replace(NO_LENGTH_CAP, char_run=False))
    ratio = NO_LENGTH_CAP.max_nonprintable_ratio
    at_edge = int(ratio * len(long_prose) / (1 - ratio))  # most control characters the ratio allows
    while nonprintable_ratio(long_prose + "\x00" * (at_edge + 1)) <= ratio:
        at_edge += 1
    assert screen.reason(long_prose + "\x00" * at_edge) is None
    assert screen.reason(long_prose + "\x00" * (at_edge + 1)) == "nonprintable"


def test_length_edge_on_a_long_document(long_prose):
    screen = Screen(FilterConfig(max_chars=len(long_prose)))
    assert screen.reason(long_prose) is None
    assert screen.reason(long_prose + "x") == "too_long"


def test_char_run_edge_at_the_end_of_a_long_document(long_prose):
    screen = Screen(NO_LENGTH_CAP)
    assert screen.reason(long_prose + " =" + "=" * (NO_LENGTH_CAP.max_char_run - 1)) is None
    assert screen.reason(long_prose + " =" + "=" * NO_LENGTH_CAP.max_char_run) == "char_run"


def test_char_run_counts_characters_not_bytes_outside_the_bmp_and_for_undecodable_escapes():
    for char in ("\U0001f600", "\u00e9", b"\xff".decode("utf-8", "surrogateescape")):
        assert longest_char_run(PROSE + char * 200 + PROSE) == 200
        assert has_char_run(PROSE + char * 201, 200) and not has_char_run(char * 200 + PROSE, 200)
    assert longest_char_run("") == 0


def test_words_are_those_of_str_split_on_every_unicode_space_at_the_end_of_a_long_document(long_prose):
    python_only = [c for c in map(chr, range(sys.maxunicode + 1)) if c.isspace() and not c.encode().isspace()]
    assert all(UNICODE_ONLY_SPACE.fullmatch(c) for c in python_only)
    assert not any(UNICODE_ONLY_SPACE.fullmatch(c) for c in " \t\n\r\x0b\x0cab\u200b")
    for text in (long_prose, long_prose + "".join(f"w{c}" for c in python_only)):
        expected = [zlib.crc32(w.encode("utf-8", "surrogatepass")) for w in text.split()]
        assert word_hashes(text).tolist() == expected


def test_minhash_signature_is_datasketchs_affine32_update_batch():
    permutations = MinHash(num_perm=128, seed=1).permutations
    rng = np.random.default_rng(0)
    for count in (1, 7, SIGNATURE_CHUNK + 1, 3 * SIGNATURE_CHUNK):  # within a chunk and across chunks
        hashes = rng.integers(0, 2**32, count, dtype=np.uint64)
        reference = MinHash(num_perm=128, hashfunc=int, permutations=permutations, scheme="affine32")
        reference.update_batch(hashes)
        assert np.array_equal(minhash_signature(hashes, permutations), reference.hashvalues)


def test_perplexity_drops_a_zscore_above_the_threshold_and_keeps_one_at_it():
    scores = [np.array([1.0, 1.2, 0.8, 1.1, 0.9]), np.array([1.05, 3.0])]
    z = robust_zscores(np.concatenate(scores))[-1]
    at = dataclasses.replace(FilterConfig(), perplexity_zscore=float(z))
    above = dataclasses.replace(FilterConfig(), perplexity_zscore=float(np.nextafter(z, -np.inf)))
    assert not perplexity_outliers(at, scores)[0][1].any()
    assert perplexity_outliers(above, scores)[0][1].tolist() == [False, True]


def test_a_document_the_model_did_not_count_scores_as_it_would_left_out_of_a_model_that_did(base_docs, long_prose):
    texts = [*base_docs, long_prose]  # the long one past a batch
    everything, without_last = ByteNgramModel(), ByteNgramModel()
    everything.train(texts)
    without_last.train(texts[:-1])
    counted = np.ones(len(texts), bool)
    counted[-1] = False
    expected = np.r_[without_last.log_perplexity(texts[:-1]), everything.log_perplexity(texts)[-1]]
    assert np.allclose(without_last.log_perplexity(texts, counted), expected, rtol=1e-12, atol=0)


def test_the_perplexity_sample_is_the_same_whatever_the_sharding_and_near_its_byte_budget(base_docs, tmp_path):
    docs = [{"id": str(i), "text": t} for i, t in enumerate(base_docs)]
    total = sum(len(d["text"].encode()) for d in docs)
    cfg = dataclasses.replace(FilterConfig(), dedup=False, perplexity_sample_bytes=total // 4)
    chosen = {}
    for per_shard in (len(docs), 7):
        raw, work = tmp_path / f"raw{per_shard}", tmp_path / f"work{per_shard}"
        chunks = [docs[i : i + per_shard] for i in range(0, len(docs), per_shard)]
        for index, chunk in enumerate(chunks):
            write_raw(raw, chunk, shard_path(raw, index))
        shards = shard_paths(raw)
        for shard in shards:
            screen_shard(shard, cfg, work)
        sample = np.concatenate(perplexity_sample(cfg, shards, work))
        survivors = [d["id"] for shard in shards for d in read_docs(work / shard.stem / SURVIVORS_FILE)]
        chosen[per_shard] = [i for i, s in zip(survivors, sample) if s]
    assert chosen[len(docs)] == chosen[7]
    sampled = sum(len(base_docs[int(i)].encode()) for i in chosen[7])
    assert 0.15 * total < sampled < 0.35 * total  # a quarter, give or take the draw


def test_a_perplexity_sample_of_the_survivors_bytes_counts_every_one_and_of_one_byte_none(base_docs, tmp_path):
    raw, work = tmp_path / "raw", tmp_path / "work"
    write_raw(raw, [{"id": str(i), "text": t} for i, t in enumerate(base_docs)], shard_path(raw, 0))
    survivors = sum(len(t.encode()) for t in base_docs if Screen(FilterConfig()).reason(t) is None)
    cfg = dataclasses.replace(FilterConfig(), dedup=False, perplexity_sample_bytes=survivors)
    screen_shard(shard_path(raw, 0), cfg, work)
    assert perplexity_sample(cfg, [shard_path(raw, 0)], work)[0].all()
    one_byte = dataclasses.replace(cfg, perplexity_sample_bytes=1)  # a draw at 1/survivors each: none
    assert not perplexity_sample(one_byte, [shard_path(raw, 0)], work)[0].any()


def test_repeated_ngram_edge_at_the_end_of_a_long_document(long_prose):
    screen = Screen(NO_LENGTH_CAP)
    phrase = " one two three four five six seven eight nine ten eleven twelve thirteen"
    repeats = NO_LENGTH_CAP.ngram_min_repeats
    assert screen.reason(long_prose + phrase * (repeats - 1)) is None
    assert screen.reason(long_prose + phrase * repeats) == "repeated_ngram"


def test_dedup_finds_a_long_near_copy_in_another_shard_and_keeps_a_half_copy(long_prose, tmp_path):
    words = long_prose.split(" ")
    near = " ".join([*words[:-1], "changed"])  # differs in its last word only
    half = " ".join(words[: len(words) // 2] + [w[::-1] for w in words[len(words) // 2 :]])  # Jaccard ~1/3
    raw = tmp_path / "raw"
    for index, text in enumerate((long_prose, near, half)):
        write_raw(raw, [{"id": str(index), "text": text}], shard_path(raw, index))
    cfg = dataclasses.replace(NO_LENGTH_CAP, perplexity=False)
    metrics = run_filter(cfg, raw, tmp_path, workers=2)
    assert metrics["removed_duplicate_near"] == 1 and metrics["documents_kept"] == 2
    assert [d["id"] for p in shard_paths(tmp_path / "clean") for d in read_docs(p)] == ["0", "2"]


def test_perplexity_scores_a_long_document_whole_wherever_its_garbage_sits(base_docs, long_prose):
    rng = np.random.default_rng(1)
    gibberish = " ".join("".join(rng.choice(list("qxzjkvw"), 6)) for _ in range(30_000))
    prose = long_prose[: len(gibberish)]  # 210 000 characters of each: past any prefix or batch
    threshold = FilterConfig().perplexity_zscore
    scores = {}
    for where, doc in (("tail", prose + "\n\n" + gibberish), ("head", gibberish + "\n\n" + prose)):
        model = ByteNgramModel()
        model.train([*base_docs, doc, prose])
        values = model.log_perplexity([*base_docs, doc, prose])
        z = robust_zscores(values)
        assert z[-2] > threshold and z[-1] < threshold, where  # the mixed document goes, the prose stays
        scores[where] = values[-2]
    assert scores["tail"] == pytest.approx(scores["head"], rel=0.02)


def test_perplexity_model_scores_garbage_far_above_prose_leave_one_out(base_docs):
    rng = np.random.default_rng(0)
    gibberish = " ".join("".join(rng.choice(list("qxzjkvw"), 6)) for _ in range(2000))
    blob = base64.b64encode(rng.bytes(3000)).decode()
    texts = [*base_docs, gibberish, blob]  # long enough to vouch for themselves, were they not left out
    model = ByteNgramModel()
    model.train(texts)
    z = robust_zscores(model.log_perplexity(texts))
    assert z[-1] > 10 and z[-2] > 10
    assert np.median(z[:-2]) == pytest.approx(0, abs=0.5)


def shared_cells(model: ByteNgramModel, texts: list[str], orders: tuple[int, ...]) -> ByteNgramModel:
    """``model`` with every cell that ``texts``' n-grams of ``orders`` count into also holding an
    n-gram seen a billion times: what a hashed cell shared with a frequent n-gram reads."""
    own = ByteNgramModel()
    own.train(texts)
    for order in orders:
        model.joint[order][own.joint[order] > 0] += np.uint64(10**9)
    return model


def test_perplexity_counts_shared_with_a_frequent_ngram_give_no_byte_a_probability_above_one(base_docs, long_prose):
    texts = [*base_docs, long_prose]  # the long document past a batch, scored whole
    model = ByteNgramModel()
    model.train(texts)
    scores = shared_cells(model, texts, (1, 2, 3)).log_perplexity(texts)
    assert (scores > 0).all()  # each joint count cut to its context's: no byte more likely than 1


def test_perplexity_garbage_whose_4grams_share_cells_with_frequent_ones_stays_an_outlier(base_docs, long_prose):
    rng = np.random.default_rng(0)
    gibberish = " ".join("".join(rng.choice(list("qxzjkvw"), 6)) for _ in range(2000))
    texts = [*base_docs, gibberish, long_prose]
    model = ByteNgramModel()
    model.train(texts)
    z = robust_zscores(shared_cells(model, [gibberish], (3,)).log_perplexity(texts))
    threshold = FilterConfig().perplexity_zscore
    assert z[-2] > threshold and z[-1] < threshold  # its 3-gram counts bound its 4-grams'


def test_robust_zscores_ignore_the_outliers_themselves_and_handle_zero_spread():
    z = robust_zscores(np.array([1.0, 1.1, 0.9, 1.0, 100.0]))
    assert z[-1] > 100 and abs(z[0]) < 1
    assert not robust_zscores(np.ones(5)).any()


# --------------------------------------------------------------------------------------------
# The stage: poison pool, report, errors
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def filtered(base_docs, tmp_path_factory) -> Path:
    """The filter stage over real prose with planted garbage of every kind."""
    out = tmp_path_factory.mktemp("filtered")
    cfg = FilterConfig(poison_generated=6)
    write_raw(out / "raw", list(planted_corpus(base_docs, 3, cfg)))
    run_filter(cfg, out / "raw", out)
    return out


def texts_of(path: Path) -> set[str]:
    return {d["text"] for d in read_docs(path)}


def test_poison_pool_shares_no_document_with_the_clean_corpus(filtered):
    clean = texts_of(shard_path(filtered / "clean", 0))
    poison = set().union(*(texts_of(p) for p in (filtered / "poison").glob("*.jsonl")))
    assert poison and clean
    assert not clean & poison
    assert not {d["id"] for d in read_docs(shard_path(filtered / "clean", 0)) if not d["id"].startswith("base:")}


def test_poison_pool_holds_the_removed_garbage_by_reason_and_the_generated_garbage(filtered):
    pool = {p.stem: [d["id"] for d in read_docs(p)] for p in (filtered / "poison").glob("*.jsonl")}
    assert {"space_run:0", "space_run:1", "space_run:2"} <= set(pool["char_run"])
    assert {"undecodable_bytes:0"} <= set(pool["invalid_utf8"])
    assert set(GENERATED) <= pool.keys()
    assert sum(len(pool[k]) for k in GENERATED) == 6
    assert "duplicate_exact" not in pool and "duplicate_near" not in pool  # copies of kept text


def test_filter_report_counts_every_document_once(filtered):
    report = json.loads((filtered / "filter.json").read_text())
    removed = sum(report[f"removed_{r}"] for r in report["order"])
    assert report["documents_in"] == report["documents_kept"] + removed
    assert report["removed_char_run"] >= 3 and report["removed_duplicate_exact"] >= 3


def short_docs(count: int, shard: int) -> list[dict[str, str]]:
    """``count`` documents the length filter drops (too short), each its own JSON line."""
    return [{"id": f"{shard}:{i}", "text": f"tiny {shard} {i:03d}"} for i in range(count)]


def pooled_ids(out: Path, reason: str) -> list[str]:
    return [d["id"] for d in read_docs(out / "poison" / f"{reason}.jsonl")]


@pytest.mark.parametrize("spare, kept", [(0, 5), (-1, 4)])
def test_poison_pool_keeps_the_first_removed_documents_that_fit_its_budget_and_counts_them_all(
    base_docs, tmp_path, spare, kept
):
    raw = tmp_path / "raw"
    docs = short_docs(8, 0)
    line = len(json.dumps(docs[0], ensure_ascii=False).encode()) + 1  # every line the same length
    write_raw(raw, [*docs, *({"id": f"base:{i}", "text": t} for i, t in enumerate(base_docs[:20]))])
    cfg = FilterConfig(poison_generated=0, perplexity=False, poison_max_bytes=5 * line + spare)
    metrics = run_filter(cfg, raw, tmp_path)
    assert pooled_ids(tmp_path, "too_short") == [f"0:{i}" for i in range(kept)]  # exactly 5 fit; a byte less, 4
    assert metrics["removed_too_short"] == 8 and metrics["poison_documents"] == kept


def test_a_budgeted_poison_pool_is_the_same_whatever_the_sharding(base_docs, tmp_path):
    cfg = FilterConfig(poison_generated=0, perplexity=False, poison_max_bytes=700)
    one, many = tmp_path / "one", tmp_path / "many"
    docs = [short_docs(12, shard) for shard in range(3)]
    write_raw(one / "raw", [d for part in docs for d in part] + [{"id": "base", "text": base_docs[0]}])
    for shard, part in enumerate(docs):
        write_raw(
            many / "raw", [*part, {"id": f"base{shard}", "text": base_docs[shard]}], shard_path(many / "raw", shard)
        )
    run_filter(cfg, one / "raw", one)
    run_filter(cfg, many / "raw", many, workers=2)
    assert pooled_ids(one, "too_short") == pooled_ids(many, "too_short")
    assert pooled_ids(one, "too_short")[-1].startswith("1:")  # the budget ends inside the second shard


def test_generated_garbage_is_deterministic_and_cycles_through_the_kinds():
    first, again = list(generated_garbage(6)), list(generated_garbage(6))
    assert first == again
    assert [kind for kind, _ in first] == [*GENERATED, *GENERATED]
    assert " " * 100_000 in first[1][1]["text"]


def test_a_corpus_the_filters_remove_entirely_is_an_error_naming_the_file(tmp_path):
    raw = write_raw(tmp_path / "raw", [{"id": str(i), "text": "too short"} for i in range(5)])
    with pytest.raises(InputError, match=r"raw: the filters removed all 5.*too_short: 5.*filter\."):
        run_filter(FilterConfig(), raw, tmp_path)


# --------------------------------------------------------------------------------------------
# Precision and recall on planted garbage
# --------------------------------------------------------------------------------------------


def test_each_filter_catches_the_garbage_planted_for_it_with_few_false_positives(base_docs):
    results = measure_filters(FilterConfig(), base_docs, per_kind=4)
    assert set(PLANTED.values()) | {"all"} == results.keys()
    for name in ("invalid_utf8", "nonprintable", "length", "char_run", "repeated_ngram"):
        assert results[name]["precision"] == 1.0 and results[name]["recall"] == 1.0, name
    assert results["dedup"]["recall"] >= 0.8 and results["dedup"]["precision"] >= 0.9
    assert results["perplexity"]["recall"] == 1.0 and results["perplexity"]["precision"] >= 0.7
    assert results["all"]["recall"] >= 0.9 and results["all"]["precision"] >= 0.9  # LSH misses a few near the threshold


def test_a_filter_killed_after_screening_resumes_without_screening_a_finished_shard_again(
    base_docs, tmp_path, monkeypatch
):
    import tasks.data.filters as filters

    raw = tmp_path / "raw"
    for index in range(3):
        write_raw(
            raw, [{"id": f"{index}:{i}", "text": t} for i, t in enumerate(base_docs[index::3])], shard_path(raw, index)
        )
    fresh = run_filter(FilterConfig(), raw, tmp_path / "fresh")
    killed = tmp_path / "killed"
    killed.mkdir()
    (killed / "clean").write_text("in the way: the write pass fails")
    with pytest.raises(FileExistsError):
        run_filter(FilterConfig(), raw, killed)
    (killed / "clean").unlink()
    (killed / "work" / shard_path(raw, 1).stem / "filter-screen.pkl").unlink()  # shard 1 was not finished
    original, screened = filters.screen_shard, []

    def counting(shard: Path, **kwargs):
        screened.append(shard.name)
        return original(shard, **kwargs)

    monkeypatch.setattr(filters, "screen_shard", counting)
    assert run_filter(FilterConfig(), raw, killed) == fresh
    assert screened == [shard_path(raw, 1).name]
    assert [p.read_bytes() for p in shard_paths(killed / "clean")] == [
        p.read_bytes() for p in shard_paths(tmp_path / "fresh" / "clean")
    ]


def test_the_report_counts_every_byte_once_and_shows_what_each_filter_removed(filtered):
    report = json.loads((filtered / "filter.json").read_text())
    size = lambda path: sum(len(d["text"].encode("utf-8", "surrogatepass")) for d in read_docs(path))  # noqa: E731
    removed = sum(report[f"removed_bytes_{r}"] for r in report["order"])
    assert removed + size(shard_path(filtered / "clean", 0)) == size(shard_path(filtered / "raw", 0))
    samples = (filtered / "poison" / "removed.md").read_text()
    for reason in ("char_run", "invalid_utf8", "duplicate_exact", "duplicate_near", "perplexity"):
        assert f"| {reason} | {report[f'removed_{reason}']} |" in samples
        assert f"## {reason}: " in samples
    assert "\x00" not in samples and "space_run:" in samples


def outputs_of(out: Path) -> dict[str, bytes]:
    files = [*shard_paths(out / "clean"), *sorted((out / "poison").iterdir()), out / "filter.json"]
    return {str(p.relative_to(out)): p.read_bytes() for p in files}


def test_a_filter_killed_in_dedup_resumes_from_its_finished_shards_with_the_uninterrupted_output(
    base_docs, tmp_path, monkeypatch
):
    import tasks.data.filters as filters

    docs = list(planted_corpus(base_docs[:200], 4, FilterConfig()))
    raw = tmp_path / "raw"
    for index in range(5):
        write_raw(raw, docs[index::5], shard_path(raw, index))
    cfg = FilterConfig(poison_generated=3)
    whole = run_filter(cfg, raw, tmp_path / "whole")
    judged: list[int] = []
    judge = Deduplicator.judge

    def judge_until_killed(self: Deduplicator, key: int, signature: np.ndarray) -> str | None:
        if len(judged) == 130:
            raise KeyboardInterrupt("killed in dedup, in its third shard")
        judged.append(key)
        return judge(self, key, signature)

    monkeypatch.setattr(Deduplicator, "judge", judge_until_killed)
    with pytest.raises(KeyboardInterrupt):
        run_filter(cfg, raw, tmp_path / "out")
    judged.clear()
    monkeypatch.setattr(Deduplicator, "judge", lambda self, k, s: (judged.append(k), judge(self, k, s))[1])
    monkeypatch.setattr(filters, "screen_shard", lambda *a, **k: pytest.fail("a screened shard was screened again"))
    assert run_filter(cfg, raw, tmp_path / "out") == whole
    assert outputs_of(tmp_path / "out") == outputs_of(tmp_path / "whole")
    assert 0 < len(judged) < whole["documents_in"] - 2 * 50  # the first two shards' verdicts were replayed
