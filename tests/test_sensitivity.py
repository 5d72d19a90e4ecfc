"""Data sensitivity (issue #46, item 7): the perturbation drops the registered share of training
documents, exactly and deterministically, leaving validation as it was (and everything at share 0);
an arm on the perturbed copy never shares a key with one on the full data; bad values are refused
naming the key; and the sensitivity stage end to end on a tiny project: the ablate stage, then the
perturbed arms of the discovery seeds, their estimates beside the full data's, and the report's
section."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from flows.ablate import plan
from model.data import open_split
from model.typed_config import ConfigError, InputError
from tasks.ablate.grid import arm_key, code_digest, data_hashes
from tasks.config import load_config
from tasks.data.perturb import document_lengths, drop_documents
from tasks.report.render import render_markdown
from tasks.report.sections.stages import sensitivity_section
from tasks.runtime.outputs import PERTURBED_DIR, SENSITIVITY_ARMS, TOKENS_DIR
from tasks.sensitivity.compare import compared_findings, unmatched
from tests.trainer_kit import markov_tokens

REPO = Path(__file__).resolve().parents[1]
EOT = 0


def documents(count: int, seed: int = 0) -> list[np.ndarray]:
    """``count`` documents of learnable tokens (1..256), 20-80 tokens each, no end-of-text in them."""
    rng = np.random.default_rng(seed)
    stream = markov_tokens(count * 80, vocab=256, seed=seed) + 1
    lengths, out, at = rng.integers(20, 81, count), [], 0
    for n in lengths:
        out.append(stream[at : at + n].astype(np.uint16))
        at += n
    return out


def write_split(folder: Path, split: str, docs: list[np.ndarray], shards: int) -> dict:
    """A split as tasks/data/tokenize.py writes it (format 2): each document followed by end-of-text,
    ``shards`` token files in order, indexed with offsets, counts and hashes."""
    (folder / split).mkdir(parents=True, exist_ok=True)
    index, whole, offset = [], hashlib.sha256(), 0
    for i, part in enumerate(np.array_split(np.arange(len(docs)), shards)):
        tokens = np.concatenate([np.append(docs[j], np.uint16(EOT)) for j in part]).astype(np.uint16)
        path = f"{split}/{i:05d}-docs.bin"
        (folder / path).write_bytes(tokens.tobytes())
        whole.update(tokens.tobytes())
        sha = hashlib.sha256(tokens.tobytes()).hexdigest()
        index.append(
            {
                "path": path,
                "offset": offset,
                "tokens": len(tokens),
                "documents": len(part),
                "dtype": "uint16",
                "sha256": sha,
            }
        )
        offset += len(tokens)
    return {"documents": len(docs), "tokens": offset, "sha256": whole.hexdigest(), "shards": index}


def token_project(root: Path, train_docs: int = 300, val_docs: int = 60, shards: int = 2) -> Path:
    """A project whose data/tokens holds ``train_docs`` and ``val_docs`` documents."""
    tokens = root / TOKENS_DIR
    splits = {
        "train": write_split(tokens, "train", documents(train_docs), shards),
        "val": write_split(tokens, "val", documents(val_docs, seed=1), 1),
    }
    (tokens / "tokenizer.json").write_text("{}")
    manifest = {
        "format": 2,
        "dtype": "uint16",
        "vocab_size": 257,
        "eot_id": EOT,
        "tokenizer": {"path": "tokenizer.json"},
        "splits": splits,
    }
    (tokens / "manifest.json").write_text(json.dumps(manifest))
    return root


def split_documents(manifest: Path, split: str) -> list[tuple[int, ...]]:
    tokens = np.asarray(open_split(manifest, split)[:])
    ends = np.cumsum(document_lengths(tokens, EOT))
    return [tuple(d.tolist()) for d in np.split(tokens, ends[:-1])]


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ----------------------------------------------------------------------------------------------
# The perturbation
# ----------------------------------------------------------------------------------------------


def test_the_copy_drops_the_registered_share_of_training_documents_and_keeps_the_rest_whole_and_in_order(tmp_path):
    project = token_project(tmp_path)
    record = drop_documents(project / TOKENS_DIR, project / PERTURBED_DIR, 0.1, 7)
    full = split_documents(project / TOKENS_DIR / "manifest.json", "train")
    kept = split_documents(project / PERTURBED_DIR / "manifest.json", "train")
    assert len(full) == 300 and record["documents"] == 300
    assert record["dropped"] == 30 and len(kept) == 270 == record["kept"]
    positions = [full.index(d) for d in kept]  # every kept document is one of the originals, whole
    assert positions == sorted(positions) and len(set(positions)) == 270, "in their original order, none twice"
    manifest = json.loads((project / PERTURBED_DIR / "manifest.json").read_text())
    train = manifest["splits"]["train"]
    assert train["documents"] == 270 and train["tokens"] == sum(len(d) for d in kept) == record["kept_tokens"]
    assert [s["documents"] for s in train["shards"]] and sum(s["documents"] for s in train["shards"]) == 270
    assert manifest["perturbation"]["drop_share"] == 0.1 and manifest["perturbation"]["seed"] == 7


def test_validation_is_left_exactly_as_it_was(tmp_path):
    project = token_project(tmp_path)
    drop_documents(project / TOKENS_DIR, project / PERTURBED_DIR, 0.3, 7)
    source, copy = project / TOKENS_DIR, project / PERTURBED_DIR
    assert data_hashes(copy / "manifest.json")["val"] == data_hashes(source / "manifest.json")["val"]
    assert (copy / "val/00000-docs.bin").read_bytes() == (source / "val/00000-docs.bin").read_bytes()
    assert split_documents(copy / "manifest.json", "val") == split_documents(source / "manifest.json", "val")
    assert (copy / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()


def test_share_zero_keeps_every_document_and_the_training_stream_bit_for_bit(tmp_path):
    project = token_project(tmp_path)
    record = drop_documents(project / TOKENS_DIR, project / PERTURBED_DIR, 0.0, 7)
    assert record["dropped"] == 0 and record["kept"] == record["documents"] == 300
    source, copy = project / TOKENS_DIR, project / PERTURBED_DIR
    assert data_hashes(copy / "manifest.json")["train"] == data_hashes(source / "manifest.json")["train"]
    for shard in ("train/00000-docs.bin", "train/00001-docs.bin"):
        assert (copy / shard).read_bytes() == (source / shard).read_bytes()
    full, same = open_split(source / "manifest.json", "train"), open_split(copy / "manifest.json", "train")
    assert np.array_equal(np.asarray(full[:]), np.asarray(same[:]))


def test_the_draw_is_a_function_of_the_seed_alone(tmp_path):
    project = token_project(tmp_path)
    built = {}
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        drop_documents(project / TOKENS_DIR, tmp_path / name, 0.2, seed)
        built[name] = files_of(tmp_path / name)
    assert built["a"] == built["b"], "same seed, same copy, byte for byte"
    assert built["a"]["train/00000-docs.bin"] != built["c"]["train/00000-docs.bin"], "another seed, another draw"
    other = split_documents(tmp_path / "c" / "manifest.json", "train")
    assert len(other) == len(split_documents(tmp_path / "a" / "manifest.json", "train")) == 240


def test_a_rebuild_replaces_the_copy_whole_and_leaves_no_scratch_behind(tmp_path):
    project = token_project(tmp_path)
    drop_documents(project / TOKENS_DIR, project / PERTURBED_DIR, 0.5, 7)
    drop_documents(project / TOKENS_DIR, project / PERTURBED_DIR, 0.1, 7)
    assert json.loads((project / PERTURBED_DIR / "manifest.json").read_text())["perturbation"]["dropped"] == 30
    assert sorted(p.name for p in (project / "data").iterdir()) == ["perturbed", "tokens"]


def test_a_share_that_drops_every_document_is_refused_naming_the_key_and_writes_nothing(tmp_path):
    project = token_project(tmp_path, train_docs=3)
    with pytest.raises(InputError, match=r"^sensitivity\.drop_share: 0\.9 drops all 3 training documents"):
        drop_documents(project / TOKENS_DIR, project / PERTURBED_DIR, 0.9, 7)
    assert not (project / PERTURBED_DIR).exists()
    with pytest.raises(InputError, match="run the tokenize stage first"):
        drop_documents(tmp_path / "nothing", tmp_path / "out", 0.1, 7)


# ----------------------------------------------------------------------------------------------
# The arms' keys, the config
# ----------------------------------------------------------------------------------------------


def test_an_arm_on_the_perturbed_copy_never_shares_a_key_with_its_full_data_twin_even_at_share_zero(tmp_path):
    project = token_project(tmp_path)
    cfg = load_config(REPO / "params.yaml", "smoke")
    assert set(data_hashes(project / TOKENS_DIR / "manifest.json")) == {"train", "val"}, "full-data keys unchanged"
    code = code_digest()
    full = arm_key(cfg, data_hashes(project / TOKENS_DIR / "manifest.json"), code, "none", 0)
    for share in (0.0, 0.1):
        drop_documents(project / TOKENS_DIR, project / PERTURBED_DIR, share, 7)
        assert arm_key(cfg, data_hashes(project / PERTURBED_DIR / "manifest.json"), code, "none", 0) != full, share
    main = {r["name"]: r for r in plan(cfg, project, {}, 0)}
    moved = {r["name"]: r for r in plan(cfg, project, {}, 0, data_dir=PERTURBED_DIR, arms_dir=SENSITIVITY_ARMS)}
    assert main.keys() == moved.keys()
    for name, row in moved.items():
        assert row["key"] != main[name]["key"]
        assert row["directory"] == project / SENSITIVITY_ARMS / row["key"]
        assert row["command"][row["command"].index("--data") + 1] == str(PERTURBED_DIR)
        assert "--data" not in main[name]["command"], "the full data's commands are as before"


@pytest.mark.parametrize(
    "key, value",
    [
        ("sensitivity.drop_share", 1.0),
        ("sensitivity.drop_share", -0.1),
        ("sensitivity.drop_share", float("nan")),
        ("sensitivity.seed", -1),
        ("sensitivity.workers", -2),
        ("sensitivity.drop_share", "some"),
    ],
)
def test_a_bad_sensitivity_value_is_refused_naming_its_key(key, value):
    with pytest.raises(ConfigError, match=rf"^{key.replace('.', chr(92) + '.')}\b"):
        load_config(REPO / "params.yaml", "smoke", {key: value})


def test_the_compared_findings_are_the_declared_built_in_ones_less_the_machinery_check():
    cfg = load_config(REPO / "params.yaml", "default")
    compared = compared_findings(cfg)
    assert list(compared) == ["xiong", "fp16", "beta2", "wortsman"]
    assert {k: f.name for k, f in compared.items()}["fp16"] == "precision"


def test_full_data_arms_missing_from_or_keyed_otherwise_in_the_ablate_metrics_are_named():
    planned = [{"name": "a/x/s0", "key": "k1"}, {"name": "a/y/s0", "key": "k2"}, {"name": "a/z/s0", "key": "k3"}]
    ablate = {"arms": [{"name": "a/x/s0", "key": "k1"}, {"name": "a/y/s0", "key": "old"}]}
    assert unmatched(planned, ablate) == ["a/y/s0", "a/z/s0"]


def test_the_report_section_is_a_table_of_both_estimates_and_their_difference_and_absent_without_the_stage():
    assert sensitivity_section(None) is None
    claim = {
        "statement": "β₂ 0.999 − 0.95",
        "unit": "nats",
        "main": {"estimate": 0.25},
        "perturbed": {"estimate": 0.2},
        "difference": {"estimate": -0.05, "ci95": [-0.1, 0.0], "n": 4},
    }
    metrics = {
        "perturbation": {"drop_share": 0.1, "dropped": 489, "documents": 4890, "seed": 7},
        "seeds": [0, 1, 2, 3],
        "findings": {
            "beta2": {"claims": [claim], "precondition_failed": {"main": None, "perturbed": "on the plateau"}},
            "xiong": {"claims": [], "missing": "the grid crosses one block"},
        },
    }
    section = sensitivity_section(metrics)
    assert section is not None
    text = render_markdown([section], Path("."))
    assert text.startswith("## Data sensitivity") and "10% of the training documents dropped (489 of 4,890" in text
    assert "| β₂ 0.999 − 0.95 | +0.25 nats | +0.2 nats | -0.05 [-0.1 to +0] (n 4) |" in text
    assert "its precondition failed on the perturbed data only: on the plateau" in text
    assert "not in this grid (the grid crosses one block)" in text


# ----------------------------------------------------------------------------------------------
# The stage end to end
# ----------------------------------------------------------------------------------------------

GRID = {
    "ablation.blocks": ["pre_ln"],  # xiong: one arm, no claim it can state (shown as not in this grid)
    "ablation.xiong_warmups": [0.2],
    "ablation.xiong_lrs": [0.003],
    "ablation.precisions": ["fp32", "fp16", "fp16_unscaled"],
    "ablation.overflow_precisions": ["fp32"],
    "ablation.beta2s": [0.95, 0.999],
    "ablation.beta2_lr_mults": [1.0],
    "ablation.stabilizers": ["none", "qk_norm"],
    "ablation.lrs": [0.003, 0.3],
    "ablation.seeds": [0, 1],
    "ablation.confirm_seeds": [],
    "ablation.workers": 2,
    "sensitivity.workers": 2,
    "tracking.experiment": "sensitivity-test",
}
"""Three families with claims (fp16, beta2, wortsman: 9 arms a seed), xiong without, two seeds."""


@contextlib.contextmanager
def on_test_servers(project: Path):
    """Run flows in this process against the session's servers, in ``project`` (as
    tests/test_ablate_stage.py does: Prefect read its settings before the servers' addresses were set)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with pytest.MonkeyPatch.context() as patch, temporary_settings({PREFECT_API_URL: os.environ["PREFECT_API_URL"]}):
        patch.chdir(project)
        yield


@pytest.fixture(scope="module")
def stage(tmp_path_factory, live_services):
    """The ablate stage, then the sensitivity stage, on a tiny project at the smoke profile; the
    sensitivity stage's wall time."""
    from flows.ablate import ablate_flow
    from flows.sensitivity import sensitivity_flow

    project = token_project(tmp_path_factory.mktemp("sensitivity"))
    shutil.copy(REPO / "params.yaml", project / "params.yaml")
    shutil.copytree(REPO / "profiles", project / "profiles")
    with on_test_servers(project):
        with pytest.raises(InputError, match="run the ablate stage first"):
            sensitivity_flow(profile="smoke", overrides=GRID)
        assert ablate_flow(profile="smoke", overrides=GRID, return_state=True).is_completed()
        started = time.perf_counter()
        state = sensitivity_flow(profile="smoke", overrides=GRID, return_state=True)
        wall = time.perf_counter() - started
    assert state.is_completed(), state.message
    print(f"\nsensitivity stage (smoke, {len(GRID)} overrides): {wall:.1f} s")
    return project, json.loads((project / "metrics" / "sensitivity.json").read_text()), wall


@pytest.mark.e2e
def test_the_stage_trains_the_discovery_seeds_arms_on_the_perturbed_copy_under_keys_of_their_own(stage):
    project, metrics, _ = stage
    ablate = {a["name"]: a for a in json.loads((project / "metrics" / "ablate.json").read_text())["arms"]}
    assert metrics["perturbation"]["dropped"] == 30 and metrics["perturbation"]["data"] == "data/perturbed"
    assert metrics["families"] == ["beta2", "precision", "wortsman"] and metrics["seeds"] == [0, 1]
    arms = metrics["arms"]
    assert len(arms) == 18 and {a["family"] for a in arms} == {"beta2", "precision", "wortsman"}
    assert metrics["counts"]["completed"] == 18
    for arm in arms:
        assert arm["key"] != ablate[arm["name"]]["key"], arm["name"]
        assert (project / SENSITIVITY_ARMS / arm["key"] / "result.json").is_file()
        assert "--data data/perturbed" in arm["command"]


@pytest.mark.e2e
def test_each_claim_has_both_estimates_and_their_per_seed_difference_and_the_full_side_is_the_reports(stage):
    from flows.report import report_flow

    project, metrics, _ = stage
    findings = metrics["findings"]
    assert set(findings) == {"xiong", "fp16", "beta2", "wortsman"}, "overflow, a check of the machinery, left out"
    assert findings["xiong"]["claims"] == [] and findings["xiong"]["missing"]
    with on_test_servers(project):
        assert report_flow(profile="smoke", overrides=GRID, return_state=True).is_completed()
    report = json.loads((project / "metrics" / "report.json").read_text())["findings"]
    for key in ("fp16", "beta2", "wortsman"):
        assert findings[key]["claims"], key
        by_claim = {c["what"]: c for c in report[key]["claims"]}
        for c in findings[key]["claims"]:
            main, moved, d = c["main"], c["perturbed"], c["difference"]
            # every seed here is a discovery seed: the full side is the report's own estimate
            reported = by_claim[c["statement"]]["estimate"]
            assert main["estimate"] == (None if reported is None else pytest.approx(reported))
            shared = sorted(main["per_seed"].keys() & moved["per_seed"].keys())
            assert d["n"] == len(shared) and d["per_seed"] == {
                s: pytest.approx(moved["per_seed"][s] - main["per_seed"][s]) for s in shared
            }
            if d["n"] == 2 and d["ci95"] is not None:
                assert d["ci95"][0] <= d["estimate"] <= d["ci95"][1]
    text = (project / "reports" / "REPORT.md").read_text()
    assert "| finding | claim | full data | perturbed | difference [95 % interval] |" in text
    assert text.index("## Data sensitivity") > text.index('<a id="wortsman"></a>'), "after the findings' sections"


@pytest.mark.e2e
def test_a_second_run_trains_nothing_and_a_perturbed_arm_reproduces_from_its_command(stage, tmp_path):
    from flows.sensitivity import sensitivity_flow

    project, metrics, _ = stage
    with on_test_servers(project):
        assert sensitivity_flow(profile="smoke", overrides=GRID, return_state=True).is_completed()
    again = json.loads((project / "metrics" / "sensitivity.json").read_text())
    assert again["cached"] == len(again["arms"]) == 18
    assert again["findings"] == metrics["findings"]
    arm = next(a for a in metrics["arms"] if a["name"] == "beta2/beta2=0.999·lr_mult=1/s1")
    stored = json.loads((project / SENSITIVITY_ARMS / arm["key"] / "result.json").read_text())
    command = shlex.split(arm["command"])
    command[command.index("--out") + 1] = str(tmp_path / "again")
    done = subprocess.run([sys.executable, *command[1:]], cwd=project, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    rerun = json.loads((tmp_path / "again" / "result.json").read_text())
    assert rerun["key"] == stored["key"] and rerun["weights_sha256"] == stored["weights_sha256"]
