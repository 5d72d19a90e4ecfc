"""The Prefect form is generated from the config: profiles as a choice, the ablation keys typed
with the config's own field docs, choices keeping params.yaml's value unless set."""

from __future__ import annotations

import typing

import pytest
from pydantic import ValidationError

from flows.forms import KEEP, Overrides, ProfileChoice, dotted, field_docs
from model.config import ModelConfig, OptimConfig


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
