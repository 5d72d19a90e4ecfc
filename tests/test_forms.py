"""The Prefect form is generated from the config: profiles as a choice, the ablation keys typed
with the config's own field docs, choices keeping params.yaml's value unless set."""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic import ValidationError

from flows.forms import (
    FORM_KEYS,
    KEEP,
    LOADS_CACHED_CODE,
    OUTSIDE_BOUNDS,
    Overrides,
    ProfileChoice,
    carries_text,
    check_from_outside,
    dotted,
    field_docs,
)
from model.config import ModelConfig, OptimConfig
from model.typed_config import ConfigError, annotation, flatten
from tasks.config import Config, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_the_profile_is_a_choice_among_the_overlays_present_or_params_yaml_s_own():
    assert typing.get_args(ProfileChoice) == (KEEP, "default", "extended", "gpu", "smoke")


def test_each_field_is_typed_as_declared_and_described_by_the_config_docstring():
    schema = Overrides.model_json_schema()["$defs"]
    block = schema["ModelOverrides"]["properties"]["block"]
    assert block["enum"] == [KEEP, "pre_ln", "post_ln"] and block["default"] == KEEP
    assert block["description"] == field_docs(ModelConfig)["block"] and "``" not in block["description"]
    beta2 = schema["OptimOverrides"]["properties"]["beta2"]
    assert {"type": "number"} in beta2["anyOf"] and beta2["description"] == field_docs(OptimConfig)["beta2"]


def test_only_the_fields_a_user_filled_in_become_overrides():
    form = Overrides(model={"block": "post_ln", "qk_norm": True}, optim={"lr": 0.02})
    assert dotted(form, {"filter.min_chars": 100}) == {
        "model.block": "post_ln",
        "model.qk_norm": True,
        "optim.lr": 0.02,
        "filter.min_chars": 100,
    }
    assert dotted(Overrides()) == {}


@pytest.mark.parametrize("bad", [{"model": {"block": "sandwich"}}, {"optim": {"lr": "fast"}}, {"optim": {"nope": 1}}])
def test_a_value_outside_the_declared_type_is_refused_before_anything_runs(bad):
    with pytest.raises(ValidationError):
        Overrides(**bad)


# --------------------------------------------------------------------------------------------
# What a run started from the UI or the API may set (it runs as the project's owner)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("data.path", "/root/.ssh"),
        ("data.path", "../outside"),
        ("search.storage", "journal:/etc/cron.d/x"),
        ("search.storage", "sqlite:////root/x.db"),
        ("executor.scheduler", "tls://127.0.0.1:8786"),
        ("data.hf_dataset", "someone/else"),
        ("tracking.experiment", "theirs"),
    ],
)
def test_a_run_from_outside_may_not_set_a_key_that_reaches_the_file_system_or_the_network(tmp_path, key, value):
    with pytest.raises(ConfigError, match=f"^{key}: refused from a run started in the Prefect UI or API"):
        check_from_outside({key: value}, tmp_path)


@pytest.mark.parametrize(
    ("free_form", "key"),
    [
        ({"search": {"storage": "sqlite:////root/x.db"}}, "search.storage"),
        ({"executor": {"scheduler": "tls://127.0.0.1:8786"}}, "executor.scheduler"),
        ({"data": {"source": "text", "path": "/root/.ssh"}}, "data.path"),
        ({"spike.data_reasons": ["binary"]}, "spike.data_reasons"),  # text inside a list is text too
    ],
)
def test_a_whole_section_from_outside_is_checked_key_by_key(tmp_path, free_form, key):
    """A section given whole (``{"search": {...}}``) once slipped past the check: its key named no field."""
    with pytest.raises(ConfigError, match=f"^{key}: refused from a run started in the Prefect UI or API"):
        check_from_outside(dotted(None, free_form), tmp_path)


@pytest.mark.parametrize("section", ["search", "executor", "data"])
def test_a_section_given_as_text_is_refused_since_the_config_would_read_it_as_yaml(tmp_path, section):
    with pytest.raises(ConfigError, match=rf"^{section}: a section; give its keys one by one"):
        check_from_outside(dotted(None, {section: '{storage: "sqlite:////root/x.db"}'}), tmp_path)


def test_a_section_given_whole_becomes_its_keys_so_params_yaml_keeps_the_others():
    assert dotted(None, {"filter": {"min_chars": 100}, "optim.lr": 0.01}) == {"filter.min_chars": 100, "optim.lr": 0.01}


@pytest.mark.parametrize(
    "path", [".spikelab/credentials.json", ".spikelab/tls/key.pem", ".git/config", ".dvc/cache", ".", "corpus/.."]
)
def test_a_path_into_the_projects_hidden_folders_is_refused(tmp_path, path):
    with pytest.raises(ConfigError, match="data.path: refused .* outside its hidden folders"):
        check_from_outside({"data.path": path}, tmp_path)


@pytest.mark.parametrize("path", ["work/state/credentials.json", "work/state", "work"])
def test_a_path_into_or_above_the_state_directory_is_refused_wherever_it_lies(tmp_path, monkeypatch, path):
    monkeypatch.setenv("SPIKELAB_STATE", str(tmp_path / "work" / "state"))
    with pytest.raises(ConfigError, match="data.path: refused"):
        check_from_outside({"data.path": path}, tmp_path)


def test_a_profile_from_outside_must_be_one_of_the_overlays():
    with pytest.raises(ConfigError, match="^profile: 'elsewhere' is not one of default, extended, gpu, smoke$"):
        check_from_outside({"profile": "elsewhere"}, Path("."))


def test_a_path_that_escapes_the_project_through_a_symlink_is_refused(tmp_path):
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "corpus").symlink_to(tmp_path)
    with pytest.raises(ConfigError, match="data.path: refused .* only a path inside the project folder"):
        check_from_outside({"data.path": "corpus/secret.txt"}, tmp_path / "project")


def test_numbers_flags_choices_and_a_path_inside_the_project_pass(tmp_path):
    check_from_outside(
        {
            "profile": "smoke",
            "filter.min_chars": 100,
            "model.qk_norm": True,
            "model.block": "post_ln",
            "ablation.seeds": [0, 2],
            "data.source": "jsonl",
            "data.path": "corpus/missing.jsonl",  # inside: the stage, not this rule, says it is missing
        },
        tmp_path,
    )


# --------------------------------------------------------------------------------------------
# data.path from outside: what the reader would open (fsspec), not the string, stays inside
# --------------------------------------------------------------------------------------------


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A project holding ``corpus/train.jsonl``, beside a root-only ``secret.jsonl`` and an
    ``outside/`` folder of JSON lines: what a run from outside must not read as the owner."""
    monkeypatch.setenv("SPIKELAB_STATE", str(tmp_path / "state"))
    (tmp_path / "project" / "corpus").mkdir(parents=True)
    (tmp_path / "project" / "corpus" / "train.jsonl").write_text('{"text": "ours"}\n')
    (tmp_path / "secret.jsonl").write_text('{"text": "the owner\'s secret"}\n')
    (tmp_path / "secret.jsonl").chmod(0o600)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "theirs.jsonl").write_text('{"text": "theirs"}\n')
    return tmp_path / "project"


def refused_path(reason: str) -> str:
    return rf"^data\.path: refused from a run started in the Prefect UI or API \(.*{reason}.*\); only a path inside"


def test_a_file_url_to_a_root_only_file_is_refused(project):
    """``file:///...`` once passed: joined onto the project it looked inside, and fsspec read it."""
    with pytest.raises(ConfigError, match=refused_path("a URL or a chain of file systems")):
        check_from_outside({"data.path": f"file://{project.parent / 'secret.jsonl'}"}, project)


def test_a_file_url_glob_outside_the_project_is_refused(project):
    with pytest.raises(ConfigError, match=refused_path("a URL or a chain of file systems")):
        check_from_outside({"data.path": f"file://{project.parent / 'outside'}/*.jsonl"}, project)


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:1/x.jsonl",
        "simplecache::http://127.0.0.1:1/x.jsonl",
        "memory://x",
        "remote://storage/x.jsonl",
        "simplecache::/etc/passwd",
    ],
)
def test_a_url_or_a_chain_of_file_systems_is_refused_before_anything_is_fetched(project, url):
    """``simplecache::/etc/passwd`` holds no ``://``: only the ``::`` mark refuses it (without it,
    fsspec's answer for it is the local file system, and a path inside the project)."""
    with pytest.raises(ConfigError, match=refused_path("a URL or a chain of file systems")):
        check_from_outside({"data.path": url}, project)


@pytest.mark.parametrize("path", ["corpus", "corpus/*.jsonl"])
def test_a_folder_or_glob_inside_the_project_holding_a_symlink_out_is_refused(project, path):
    """The path itself is inside, as a string and resolved; the reader then walks the folder or
    takes the glob's matches, and follows ``corpus/leak.jsonl`` to the root-only file."""
    (project / "corpus" / "leak.jsonl").symlink_to(project.parent / "secret.jsonl")
    with pytest.raises(ConfigError, match=refused_path("reaches .*corpus/leak.jsonl, outside what it may read")):
        check_from_outside({"data.path": path}, project)


def test_a_symlink_out_under_a_symlinked_folder_that_stays_inside_is_refused(project):
    (project / "elsewhere").mkdir()
    (project / "elsewhere" / "leak.jsonl").symlink_to(project.parent / "secret.jsonl")
    (project / "corpus" / "more").symlink_to(project / "elsewhere")
    with pytest.raises(ConfigError, match=refused_path("reaches .*corpus/more/leak.jsonl")):
        check_from_outside({"data.path": "corpus"}, project)


def test_a_value_fsspec_reads_through_another_file_system_without_a_url_is_refused(tmp_path, monkeypatch):
    """From a project named relatively, ``data:...`` is what the reader hands fsspec as it is:
    the check asks fsspec which file system it would get, not whether the string has ``://``."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPIKELAB_STATE", str(tmp_path / "state"))
    with pytest.raises(ConfigError, match=refused_path("read through fsspec's .*data.* file system")):
        check_from_outside({"data.path": "data:,x"}, Path("."))


def test_a_path_with_a_null_byte_is_refused_by_name_not_with_a_traceback(project):
    with pytest.raises(ConfigError, match=refused_path("cannot be followed: embedded null byte")):
        check_from_outside({"data.path": "corpus/\0train.jsonl"}, project)


@pytest.mark.parametrize("path", ["corpus/train.jsonl", "corpus", "corpus/*.jsonl"])
def test_a_plain_relative_path_inside_the_project_passes(project, path):
    check_from_outside({"data.path": path}, project)


def test_a_plain_absolute_path_inside_the_project_passes(project):
    check_from_outside({"data.path": str(project / "corpus" / "train.jsonl")}, project)


def test_symlinks_that_stay_inside_the_project_pass_and_a_link_back_up_is_walked_once(project):
    (project / "corpus" / "alias.jsonl").symlink_to(project / "corpus" / "train.jsonl")
    (project / "corpus" / "again").symlink_to(project / "corpus")
    check_from_outside({"data.path": "corpus"}, project)


# --------------------------------------------------------------------------------------------
# Keys that make the owner load compiled code from a cache
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sets", [{"train.compile": True}, dotted(None, {"train": {"compile": True}})])
def test_torch_compile_from_outside_is_refused(tmp_path, sets):
    with pytest.raises(ConfigError, match=r"^train\.compile: refused .*load compiled code from a cache"):
        check_from_outside(sets, tmp_path)


def test_the_form_offers_no_key_a_run_from_outside_is_refused():
    offered = [f"{section}.{key}" for section, keys in FORM_KEYS.items() for key in keys]
    assert not set(offered) & set(LOADS_CACHED_CODE)
    assert not [key for key in offered if carries_text(annotation(Config, key))]


# --------------------------------------------------------------------------------------------
# Bounds on every whole number and list a run from outside may set (issue #55)
# --------------------------------------------------------------------------------------------

TWICE_THE_CORES = 2 * len(os.sched_getaffinity(0))
"""Workers and threads from outside: two per core this process may run on."""
PER_CORE = (
    "train.num_workers",
    "train.cpu_threads",
    "data.workers",
    "spike.workers",
    "search.workers",
    "ablation.workers",
    "sensitivity.workers",
)
NUMBER_BOUNDS = {
    "tokenizer.vocab_size": 201_216,
    "tokenizer.min_frequency": 8,
    "model.n_layer": 48,
    "model.n_head": 48,
    "model.d_model": 3072,
    "model.seq_len": 4096,
    "mup.base_width": 3072,
    "schedule.warmup_steps": 400,
    "precision.growth_interval": 8000,
    "precision.loss_shift": 40,
    "train.steps": 20_000,
    "train.batch_size": 128,
    "train.grad_accum": 16,
    "train.seed": 9999,
    "train.log_every": 40,
    "train.layer_stats_every": 400,
    "train.eval_every": 2000,
    "train.eval_batches": 32,
    "train.num_workers": TWICE_THE_CORES,
    "train.cpu_threads": TWICE_THE_CORES,
    "train.diverge_after": 80,
    "checkpoint.every_steps": 4000,
    "checkpoint.keep_last": 8,
    "data.max_docs": 1_000_000,
    "data.max_doc_bytes": 16 * 2**20,
    "data.seed": 9999,
    "data.shard_bytes": 256 * 2**20,
    "data.workers": TWICE_THE_CORES,
    "data.tokenizer_sample_bytes": 2**30,
    "filter.min_chars": 256,
    "filter.max_chars": 800_000,
    "filter.max_char_run": 800,
    "filter.ngram_max_period": 52,
    "filter.ngram_min_repeats": 128,
    "filter.dedup_num_perm": 512,
    "filter.dedup_shingle": 20,
    "filter.perplexity_sample_bytes": 256 * 2**20,
    "filter.poison_generated": 256,
    "filter.poison_max_bytes": 64 * 2**20,
    "spike.run_steps": 4800,
    "spike.origin_step": 2400,
    "spike.warm_steps": 512,
    "spike.workers": TWICE_THE_CORES,
    "spike.duration": 12,
    "spike.poison_ramp_batches": 256,
    "spike.param_block": 15,
    "spike.detect_window": 512,
    "spike.detect_warmup": 256,
    "spike.detect_lag": 128,
    "spike.detect_within": 400,
    "spike.min_origins_per_half": 8,
    "spike.sample_prompts": 16,
    "spike.sample_tokens": 128,
    "recovery.skip_batches": 800,
    "recovery.rollback_steps": 400,
    "recovery.max_retries": 8,
    "recovery.max_consecutive_vetoes": 16,
    "recovery.checkpoint_every": 40,
    "recovery.eval_steps": 2000,
    "recovery.recover_steps": 400,
    "recovery.smooth_steps": 40,
    "search.lr_points": 48,
    "search.refine_points": 8,
    "search.steps": 4800,
    "search.batch_size": 16,
    "search.eval_every": 400,
    "search.prune_startup_trials": 12,
    "search.prune_warmup_steps": 4799,
    "search.workers": TWICE_THE_CORES,
    "search.heartbeat_s": 40,
    "ablation.budget_seeds": 32,
    "ablation.d_model": 1024,
    "ablation.n_layer": 16,
    "ablation.n_head": 16,
    "ablation.seq_len": 1024,
    "ablation.batch_size": 128,
    "ablation.steps": 12_000,
    "ablation.xiong_depth": 48,
    "ablation.xiong_steps": 8000,
    "ablation.range_probe_every": 400,
    "ablation.beta2_steps": 16_000,
    "ablation.beta2_batch_size": 16,
    "ablation.wortsman_steps": 8000,
    "ablation.workers": TWICE_THE_CORES,
    "ablation.retries": 4,
    "sensitivity.seed": 9999,
    "sensitivity.workers": TWICE_THE_CORES,
}
"""The largest value a run from outside may set each whole number to, pinned: 4x the largest the
profiles set, seeds up to 9,999, workers and threads two per core, ``precision.loss_shift`` fp16's
40 binades, a key kept below another's bound one less than it."""
LIST_BOUNDS = {
    "checkpoint.milestones": (20_000, 24),
    "spike.seeds": (9999, 16),
    "spike.confirm_seeds": (9999, 32),
    "spike.poison_batches_range": (1600, 8),
    "spike.sizing_seeds": (9999, 16),
    "spike.sizing_zscores": (None, 40),
    "spike.sizing_ramps": (256, 28),
    "search.widths": (3072, 12),
    "search.seeds": (9999, 12),
    "search.confirm_seeds": (9999, 12),
    "ablation.seeds": (9999, 16),
    "ablation.confirm_seeds": (9999, 32),
    "ablation.rounds": (48, 12),
    "ablation.xiong_warmups": (None, 8),
    "ablation.xiong_lrs": (None, 8),
    "ablation.sizing_seeds": (9999, 16),
    "ablation.sizing_xiong_steps": (6400, 16),
    "ablation.probe_depths": (96, 28),
    "ablation.beta2s": (None, 8),
    "ablation.beta2_lr_mults": (None, 8),
    "ablation.lrs": (None, 28),
}
"""Each list's largest entry (None: a list of floats, its entries unbounded) and most entries, pinned."""


def from_the_ui(sets: dict[str, Any], project: Path) -> None:
    """What the pipeline flow does with a filled-in form: the form's own fields through
    ``Overrides``, any other key as a free-form override, then :func:`check_from_outside`."""
    form: dict[str, dict[str, Any]] = {}
    free_form = {}
    for key, value in sets.items():
        section, name = key.split(".", 1)
        if name in FORM_KEYS.get(section, []):
            form.setdefault(section, {})[name] = value
        else:
            free_form[key] = value
    check_from_outside(dotted(Overrides(**form), free_form), project)


def beyond(key: str, what: str) -> str:
    """The one-line refusal of ``key``: ``what`` names the value and the bound."""
    return rf"^{re.escape(key)}: refused from a run started in the Prefect UI or API \({re.escape(what)}: [^\n]*$"


def bounded_keys() -> set[str]:
    """Every whole number and list (of numbers) of the config that a run from outside may set."""
    keys = set()
    for key in flatten(dataclasses.asdict(Config())):
        hint = annotation(Config, key)
        listed = typing.get_origin(hint) is list
        if key == "profile" or key in LOADS_CACHED_CODE or carries_text(hint):
            continue
        if hint is int or (listed and typing.get_origin(typing.get_args(hint)[0]) is not Literal):
            keys.add(key)
    return keys


def test_every_whole_number_and_list_from_outside_has_a_bound_and_each_is_pinned():
    assert set(OUTSIDE_BOUNDS) == bounded_keys() == set(NUMBER_BOUNDS) | set(LIST_BOUNDS)


@pytest.mark.parametrize(("key", "most"), NUMBER_BOUNDS.items(), ids=list(NUMBER_BOUNDS))
def test_a_whole_number_from_outside_passes_at_its_bound_and_is_refused_one_beyond(tmp_path, key, most):
    from_the_ui({key: most}, tmp_path)
    with pytest.raises(ConfigError, match=beyond(key, f"{most + 1} is above its bound {most}")):
        from_the_ui({key: most + 1}, tmp_path)


@pytest.mark.parametrize(("key", "bounds"), LIST_BOUNDS.items(), ids=list(LIST_BOUNDS))
def test_a_list_from_outside_passes_at_its_bounds_and_is_refused_one_beyond(tmp_path, key, bounds):
    most, entries = bounds
    entry = 1.5 if most is None else most
    from_the_ui({key: [entry] * entries}, tmp_path)
    with pytest.raises(ConfigError, match=beyond(key, f"{entries + 1} entries, above its bound {entries}")):
        from_the_ui({key: [entry] * (entries + 1)}, tmp_path)
    if most is not None:
        with pytest.raises(ConfigError, match=beyond(key, f"entry {most + 1} is above its bound {most}")):
            from_the_ui({key: [1, most + 1]}, tmp_path)


CHOICE_LISTS = [
    key
    for key in flatten(dataclasses.asdict(Config()))
    if typing.get_origin(annotation(Config, key)) is list
    and typing.get_origin(typing.get_args(annotation(Config, key))[0]) is Literal
]


@pytest.mark.parametrize("key", CHOICE_LISTS)
def test_a_list_of_choices_from_outside_holds_at_most_one_entry_per_choice(tmp_path, key):
    (choice,) = typing.get_args(annotation(Config, key))
    choices = list(typing.get_args(choice))
    from_the_ui({key: choices}, tmp_path)
    with pytest.raises(ConfigError, match=beyond(key, f"{len(choices) + 1} entries, above its bound {len(choices)}")):
        from_the_ui({key: [*choices, choices[0]]}, tmp_path)


def test_a_hundred_thousand_workers_from_outside_are_refused_naming_the_key_the_value_and_the_bound(tmp_path):
    """Issue #55: ``ablation.workers=100000`` passed; given as text too, as the config reads it."""
    for value in (100_000, "100000"):
        with pytest.raises(ConfigError) as refused:
            from_the_ui({"ablation.workers": value}, tmp_path)
        assert str(refused.value) == (
            "ablation.workers: refused from a run started in the Prefect UI or API (100000 is above its bound "
            f"{TWICE_THE_CORES}: 2 per core this process may run on); only up to its bound, more set in "
            "params.yaml from a shell"
        )


def test_a_form_field_beyond_its_bound_is_refused_as_a_free_form_key_is(tmp_path):
    """``train.steps`` is one of the form's own fields: through ``Overrides`` it is bounded all the same."""
    assert "steps" in FORM_KEYS["train"]
    with pytest.raises(ConfigError, match=beyond("train.steps", "20001 is above its bound 20000")):
        check_from_outside(dotted(Overrides(train={"steps": 20_001})), Path("."))


def test_a_whole_number_with_no_bound_is_refused_from_outside(tmp_path, monkeypatch):
    """A key added to the config later is refused from outside until it is given a bound."""
    monkeypatch.delitem(OUTSIDE_BOUNDS, "ablation.retries")
    with pytest.raises(ConfigError, match=r"^ablation\.retries: refused .*no bound for a run from outside"):
        from_the_ui({"ablation.retries": 1}, tmp_path)


@pytest.mark.parametrize("profile", ["default", "extended", "gpu", "smoke"])
def test_every_number_a_profile_sets_fits_the_bounds(tmp_path, profile):
    """The bounds are generous multiples of what the profiles set: a run from outside may set any
    profile's value (workers aside: theirs depend on this machine's cores)."""
    values = flatten(dataclasses.asdict(load_config(ROOT / "params.yaml", profile=profile)))
    from_the_ui({k: v for k, v in values.items() if k in OUTSIDE_BOUNDS and k not in PER_CORE}, tmp_path)
