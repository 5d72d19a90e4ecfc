"""The Prefect form is generated from the config: profiles as a choice, the ablation keys typed
with the config's own field docs, choices keeping params.yaml's value unless set."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
from pydantic import ValidationError

from flows.forms import (
    FORM_KEYS,
    KEEP,
    LOADS_CACHED_CODE,
    Overrides,
    ProfileChoice,
    carries_text,
    check_from_outside,
    dotted,
    field_docs,
)
from model.config import ModelConfig, OptimConfig
from model.typed_config import ConfigError, annotation
from tasks.config import Config


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
    ["http://127.0.0.1:1/x.jsonl", "simplecache::http://127.0.0.1:1/x.jsonl", "memory://x", "remote://storage/x.jsonl"],
)
def test_a_url_or_a_chain_of_file_systems_is_refused_before_anything_is_fetched(project, url):
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
