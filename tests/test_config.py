"""The typed config: every bad key or value is refused with a ConfigError naming the dotted key.

Broken ``params.yaml`` files are written into ``tmp_path`` and loaded with :func:`load_config`,
the same entry point the CLI and the DVC stages use.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from params_kit import dvc_set

from model.typed_config import ConfigError, flatten
from tasks.config import Config, check_runtime, config_from_dict, load_config, resolve_study

REPO = Path(__file__).resolve().parents[1]
SHIPPED_PARAMS = REPO / "params.yaml"
SHIPPED_PROFILES = sorted(p.stem for p in (REPO / "profiles").glob("*.yaml"))


def write_params(tmp_path: Path, text: str, name: str = "params.yaml") -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def config_error(path: Path, profile: str | None = None, overrides: dict | None = None) -> str:
    """Load ``path`` expecting a ConfigError; return its message."""
    with pytest.raises(ConfigError) as info:
        load_config(path, profile=profile, overrides=overrides)
    return str(info.value)


def copy_shipped(tmp_path: Path) -> Path:
    """The shipped params.yaml and profiles/ in ``tmp_path``; returns the params file."""
    for profile in (REPO / "profiles").glob("*.yaml"):
        write_params(tmp_path, profile.read_text(encoding="utf-8"), f"profiles/{profile.name}")
    return write_params(tmp_path, SHIPPED_PARAMS.read_text(encoding="utf-8"))


# --------------------------------------------------------------------------------------------
# Accepted input
# --------------------------------------------------------------------------------------------


def test_a_partial_params_file_takes_the_documented_defaults_for_the_rest(tmp_path):
    cfg = load_config(write_params(tmp_path, "train:\n  steps: 300\n"))
    assert cfg == Config()
    assert cfg.profile == "default"


def test_defaults_pass_their_own_validation():
    assert config_from_dict({}) == Config().validate()


def test_numeric_strings_are_accepted_as_floats(tmp_path):
    text = """\
        optim:
          lr: 3e-4
          eps: 1e-8
        ablation:
          beta2s: [95e-2, 0.999]
        """
    raw = yaml.safe_load(textwrap.dedent(text))
    assert raw["optim"]["lr"] == "3e-4"  # PyYAML (YAML 1.1) really hands us a string
    assert raw["ablation"]["beta2s"][0] == "95e-2"
    cfg = load_config(write_params(tmp_path, text))
    assert cfg.optim.lr == 3e-4 and type(cfg.optim.lr) is float
    assert cfg.optim.eps == 1e-8 and type(cfg.optim.eps) is float
    assert cfg.ablation.beta2s == [0.95, 0.999]
    assert all(type(b) is float for b in cfg.ablation.beta2s)


def test_int_is_accepted_where_a_float_is_declared(tmp_path):
    cfg = load_config(write_params(tmp_path, "optim:\n  lr: 1\n"))
    assert cfg.optim.lr == 1.0 and type(cfg.optim.lr) is float


def test_warmup_equal_to_train_steps_is_allowed(tmp_path):
    cfg = load_config(write_params(tmp_path, "schedule:\n  warmup_steps: 300\ntrain:\n  steps: 300\n"))
    assert cfg.schedule.warmup_steps == cfg.train.steps == 300


# --------------------------------------------------------------------------------------------
# Unknown keys and wrong types
# --------------------------------------------------------------------------------------------


def test_unknown_top_level_section_is_rejected_by_name(tmp_path):
    msg = config_error(write_params(tmp_path, "modle:\n  n_layer: 2\n"))
    assert msg.startswith("modle:")
    assert "unknown key" in msg and "model" in msg  # the allowed sections are listed


def test_unknown_key_inside_a_section_is_rejected_with_its_dotted_key(tmp_path):
    msg = config_error(write_params(tmp_path, "model:\n  n_layers: 2\n"))
    assert msg.startswith("model.n_layers:")
    assert "unknown key" in msg and "n_layer" in msg


def test_scalar_given_for_a_section_is_rejected(tmp_path):
    msg = config_error(write_params(tmp_path, "optim: 0.1\n"))
    assert msg.startswith("optim:") and "mapping" in msg


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("model:\n  n_layer: four\n", "model.n_layer"),  # string for int
        ("model:\n  n_layer: 2.5\n", "model.n_layer"),  # float for int
        ("train:\n  steps: true\n", "train.steps"),  # bool for int
        ("model:\n  qk_norm: 1\n", "model.qk_norm"),  # int for bool
        ("model:\n  qk_norm: 'yes please'\n", "model.qk_norm"),  # string for bool
        ("optim:\n  lr: fast\n", "optim.lr"),  # non-numeric string for float
        ("optim:\n  lr: true\n", "optim.lr"),  # bool for float
        ("optim:\n  lr: .nan\n", "optim.lr"),  # non-finite float
        ("search:\n  widths: 64\n", "search.widths"),  # scalar where a list is expected
        ("search:\n  widths: [64, wide]\n", "search.widths[1]"),  # wrong item type
        ("tracking:\n  experiment: 3\n", "tracking.experiment"),  # int for str
    ],
    ids=[
        "str-for-int",
        "float-for-int",
        "bool-for-int",
        "int-for-bool",
        "str-for-bool",
        "str-for-float",
        "bool-for-float",
        "nan-for-float",
        "scalar-for-list",
        "list-item",
        "int-for-str",
    ],
)
def test_wrong_type_is_rejected_naming_the_dotted_key(tmp_path, text, key):
    msg = config_error(write_params(tmp_path, text))
    assert msg.startswith(f"{key}:"), msg


# --------------------------------------------------------------------------------------------
# Value constraints and cross-field invariants
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lr", ["0", "0.0", "-1.0e-3"])
def test_non_positive_learning_rate_is_rejected(tmp_path, lr):
    msg = config_error(write_params(tmp_path, f"optim:\n  lr: {lr}\n"))
    assert msg.startswith("optim.lr:") and "> 0" in msg


def test_a_poison_pool_budget_of_zero_is_allowed_and_one_below_is_rejected(tmp_path):
    assert load_config(write_params(tmp_path, "filter:\n  poison_max_bytes: 0\n")).filter.poison_max_bytes == 0
    msg = config_error(write_params(tmp_path, "filter:\n  poison_max_bytes: -1\n"))
    assert msg.startswith("filter.poison_max_bytes:"), msg


def test_a_perplexity_sample_of_one_byte_is_allowed_and_zero_is_rejected(tmp_path):
    assert (
        load_config(write_params(tmp_path, "filter:\n  perplexity_sample_bytes: 1\n")).filter.perplexity_sample_bytes
        == 1
    )
    msg = config_error(write_params(tmp_path, "filter:\n  perplexity_sample_bytes: 0\n"))
    assert msg.startswith("filter.perplexity_sample_bytes:"), msg


@pytest.mark.parametrize("beta2", ["0", "1", "1.5", "-0.5"])
def test_beta2_outside_the_open_unit_interval_is_rejected(tmp_path, beta2):
    msg = config_error(write_params(tmp_path, f"optim:\n  beta2: {beta2}\n"))
    assert msg.startswith("optim.beta2:") and "(0, 1)" in msg


def test_warmup_longer_than_training_is_rejected(tmp_path):
    msg = config_error(write_params(tmp_path, "schedule:\n  warmup_steps: 301\ntrain:\n  steps: 300\n"))
    assert msg.startswith("schedule.warmup_steps:")
    assert "train.steps=300" in msg


def test_d_model_not_divisible_by_n_head_is_rejected(tmp_path):
    msg = config_error(write_params(tmp_path, "model:\n  d_model: 30\n  n_head: 4\n"))
    assert msg.startswith("model.d_model:")
    assert "model.n_head=4" in msg


def test_odd_head_dim_is_rejected(tmp_path):
    msg = config_error(write_params(tmp_path, "model:\n  d_model: 36\n  n_head: 4\n"))
    assert msg.startswith("model.n_head:") and "even" in msg


@pytest.mark.parametrize(
    ("section", "key", "bad", "allowed"),
    [
        ("model", "block", "pre_norm", ["pre_ln", "post_ln"]),
        ("model", "norm", "batchnorm", ["layernorm", "rmsnorm"]),
        ("model", "mlp", "relu", ["gelu", "swiglu"]),
        ("precision", "mode", "fp8", ["fp32", "bf16", "fp16"]),
        ("mup", "parametrization", "ntk", ["sp", "mup"]),
    ],
)
def test_unknown_variant_name_is_rejected_listing_the_allowed_ones(tmp_path, section, key, bad, allowed):
    msg = config_error(write_params(tmp_path, f"{section}:\n  {key}: {bad}\n"))
    assert msg.startswith(f"{section}.{key}:")
    assert repr(bad) in msg
    for name in allowed:
        assert repr(name) in msg


def test_wrong_variant_inside_a_list_is_rejected_with_its_index(tmp_path):
    msg = config_error(write_params(tmp_path, "ablation:\n  precisions: [fp32, fp8]\n"))
    assert msg.startswith("ablation.precisions[1]:")
    assert "'fp8'" in msg
    for name in ("fp32", "bf16", "fp16"):
        assert repr(name) in msg


def test_mup_with_tied_embeddings_is_rejected(tmp_path):
    text = "model:\n  tie_embeddings: true\nmup:\n  parametrization: mup\n"
    msg = config_error(write_params(tmp_path, text))
    assert msg.startswith("model.tie_embeddings:") and "mup" in msg


def test_tied_embeddings_are_fine_under_sp(tmp_path):
    text = "model:\n  tie_embeddings: true\nmup:\n  parametrization: sp\n"
    assert load_config(write_params(tmp_path, text)).model.tie_embeddings is True


@pytest.mark.parametrize("eps", ["1e-50", "1e-46"])
def test_eps_that_rounds_to_zero_in_fp32_is_rejected(tmp_path, eps):
    msg = config_error(write_params(tmp_path, f"optim:\n  eps: {eps}\n"))
    assert msg.startswith("optim.eps:") and "rounds to 0.0" in msg and "fp32" in msg


def test_eps_that_is_subnormal_in_fp32_is_rejected(tmp_path):
    msg = config_error(write_params(tmp_path, "optim:\n  eps: 1e-40\n"))
    assert msg.startswith("optim.eps:") and "subnormal" in msg


def test_eps_at_the_smallest_normal_fp32_is_accepted(tmp_path):
    assert load_config(write_params(tmp_path, "optim:\n  eps: 1.1754944e-38\n")).optim.eps == 1.1754944e-38


def test_cuda_device_where_cuda_is_unavailable_is_rejected_naming_the_key(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^train.device: 'cuda' is not available here"):
        check_runtime(Config().replace(**{"train.device": "cuda"}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check_runtime(Config().replace(**{"train.device": "cuda"}))


def test_config_and_its_runtime_check_stay_torch_free_unless_cuda_is_asked_for():
    code = (
        "import sys; from tasks.config import Config, check_runtime; check_runtime(Config()); "
        "check_runtime(Config().replace(**{'train.device': 'cpu'})); assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


# --------------------------------------------------------------------------------------------
# Files that are not what they seem: empty, duplicate keys
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "# only a comment\n", "{}\n"], ids=["empty", "comments", "empty-mapping"])
def test_an_empty_params_file_is_an_error_naming_the_file(tmp_path, text):
    params = write_params(tmp_path, text)
    msg = config_error(params)
    assert msg.startswith(f"{params}: empty")


def test_an_empty_profile_is_an_error_naming_the_file(tmp_path):
    profile = write_params(tmp_path, "# nothing yet\n", "profiles/blank.yaml")
    assert config_error(write_params(tmp_path, "profile: blank\n")).startswith(f"{profile}: empty")


def test_a_profile_may_not_choose_a_profile(tmp_path):
    profile = write_params(tmp_path, "profile: smoke\n", "profiles/loop.yaml")
    msg = config_error(write_params(tmp_path, "profile: loop\n"))
    assert msg.startswith("profile:") and str(profile) in msg


@pytest.mark.parametrize(
    ("text", "key", "lines"),
    [
        ("train:\n  steps: 100\n  seed: 1\n  steps: 200\n", "train.steps", "lines 2 and 4"),
        ("optim:\n  lr: 0.1\ntrain:\n  steps: 5\noptim:\n  beta2: 0.99\n", "optim", "lines 1 and 5"),
    ],
    ids=["key", "section"],
)
def test_a_duplicate_key_in_params_is_rejected_naming_file_key_and_lines(tmp_path, text, key, lines):
    params = write_params(tmp_path, text)
    msg = config_error(params)
    assert msg.startswith(f"{key}: duplicate key in {params}") and lines in msg


def test_a_duplicate_key_in_a_profile_is_rejected_naming_the_profile(tmp_path):
    profile = write_params(tmp_path, "model:\n  n_layer: 1\n  n_layer: 2\n", "profiles/dup.yaml")
    msg = config_error(write_params(tmp_path, "profile: dup\n"))
    assert msg.startswith(f"model.n_layer: duplicate key in {profile}")


# --------------------------------------------------------------------------------------------
# Profiles
# --------------------------------------------------------------------------------------------


def test_unknown_profile_in_params_is_rejected_listing_known_profiles(tmp_path):
    write_params(tmp_path, "model:\n  n_layer: 1\n", "profiles/tiny.yaml")
    msg = config_error(write_params(tmp_path, "profile: nope\n"))
    assert msg.startswith("profile:")
    assert "'nope'" in msg and "default" in msg and "tiny" in msg


def test_unknown_profile_given_as_argument_is_rejected(tmp_path):
    msg = config_error(write_params(tmp_path, "profile: default\n"), profile="nope")
    assert msg.startswith("profile:") and "'nope'" in msg


def test_profile_overlay_with_unknown_key_names_the_key_and_the_overlay_file(tmp_path):
    overlay = write_params(tmp_path, "model:\n  n_layerz: 1\n", "profiles/broken.yaml")
    msg = config_error(write_params(tmp_path, "profile: broken\n"))
    assert msg.startswith("model.n_layerz:")
    assert str(overlay) in msg


def test_profile_overlay_with_bad_variant_names_the_overlay_file(tmp_path):
    overlay = write_params(tmp_path, "model:\n  norm: groupnorm\n", "profiles/broken.yaml")
    msg = config_error(write_params(tmp_path, "profile: default\n"), profile="broken")
    assert msg.startswith("model.norm:") and str(overlay) in msg


def test_profile_overlay_sets_what_params_leaves_at_the_default_and_keeps_the_rest(tmp_path):
    write_params(tmp_path, "model:\n  n_layer: 1\noptim:\n  lr: 1e-3\n", "profiles/tiny.yaml")
    params = write_params(tmp_path, "profile: tiny\nmodel:\n  n_layer: 4\n  n_head: 2\n")
    cfg = load_config(params)
    assert cfg.profile == "tiny"
    assert cfg.model.n_layer == 1  # params.yaml holds the default 4: the overlay applies
    assert cfg.model.n_head == 2  # an explicit key of the same section survives
    assert cfg.optim.lr == 1e-3
    # The argument overrides the file's own profile key.
    assert load_config(params, profile="default").model.n_layer == 4


def test_overlay_result_is_validated_as_a_whole(tmp_path):
    # Each file is valid alone; together warmup exceeds steps.
    write_params(tmp_path, "train:\n  steps: 250\n", "profiles/short.yaml")
    params = write_params(tmp_path, "schedule:\n  warmup_steps: 260\ncheckpoint:\n  milestones: [100]\n")
    load_config(params)
    msg = config_error(params, profile="short")
    assert msg.startswith("schedule.warmup_steps:")


@pytest.mark.parametrize("profile", SHIPPED_PROFILES)
def test_shipped_params_load_with_every_profile(profile):
    cfg = load_config(SHIPPED_PARAMS, profile=profile)
    assert cfg.profile == profile
    # Every value the overlay sets is what the resolved config holds.
    overlay = yaml.safe_load((REPO / "profiles" / f"{profile}.yaml").read_text(encoding="utf-8"))
    flat = cfg.to_flat_dict()
    for key, want in flatten(overlay).items():
        got = flat[key]
        if isinstance(got, float):
            want = float(want)
        elif isinstance(got, list) and got and isinstance(got[0], float):
            want = [float(w) for w in want]
        assert got == want, key


def test_shipped_params_lists_every_key_at_the_default_profiles_value():
    # `dvc exp run -S key=value` can only set keys params.yaml has; and a value equal to the
    # default profile's is what tells "not set by the user" apart from "set".
    listed = flatten(yaml.safe_load(SHIPPED_PARAMS.read_text(encoding="utf-8")))
    default_overlay = yaml.safe_load((REPO / "profiles/default.yaml").read_text(encoding="utf-8"))
    assert listed == config_from_dict(default_overlay).to_flat_dict()


# --------------------------------------------------------------------------------------------
# Precedence: overrides > explicit params.yaml values > profile > default profile
# --------------------------------------------------------------------------------------------


def test_an_explicit_value_wins_over_the_profile_as_with_dvc_set_profile_smoke_and_train_steps(tmp_path):
    params = dvc_set(copy_shipped(tmp_path), profile="smoke", **{"train.steps": 100})
    cfg = load_config(params)
    assert cfg.train.steps == 100
    assert cfg.model.d_model == 32  # the rest of the smoke profile still applies


def test_a_value_set_back_to_the_default_profiles_gives_way_to_the_profile_and_is_named(tmp_path):
    params = dvc_set(copy_shipped(tmp_path), profile="smoke", **{"train.steps": 500})
    resolved = resolve_study(params)
    assert resolved.config.train.steps == 30
    assert resolved.from_profile["train.steps"] == 30
    assert "profile 'smoke' set" in resolved.notice() and "train.steps=30" in resolved.notice()


def test_the_default_profile_names_no_keys(tmp_path):
    assert resolve_study(copy_shipped(tmp_path)).notice() == ""


def test_explicit_means_different_from_the_default_profile_not_from_the_declared_default(tmp_path):
    write_params(tmp_path, "train:\n  steps: 500\n", "profiles/default.yaml")
    write_params(
        tmp_path,
        "train:\n  steps: 30\ncheckpoint:\n  milestones: [20]\n",
        "profiles/smoke.yaml",
    )
    # 300 is the declared default but not the default profile's value: the user set it.
    assert load_config(write_params(tmp_path, "profile: smoke\ntrain:\n  steps: 300\n")).train.steps == 300
    assert load_config(write_params(tmp_path, "profile: smoke\ntrain:\n  steps: 500\n")).train.steps == 30
    assert load_config(write_params(tmp_path, "profile: default\n")).train.steps == 500


def test_overrides_win_over_params_and_profile(tmp_path):
    params = dvc_set(copy_shipped(tmp_path), profile="smoke", **{"train.steps": 100})
    cfg = load_config(params, overrides={"train.steps": 25, "model.d_model": 64})
    assert (cfg.train.steps, cfg.model.d_model) == (25, 64)
    assert "train.steps" not in resolve_study(params, overrides={"train.steps": 25}).from_profile


def test_override_strings_are_read_like_dvc_set_except_for_string_keys(tmp_path):
    params = write_params(tmp_path, "profile: default\n")
    cfg = load_config(
        params,
        overrides={
            "train.steps": "100",
            "search.widths": "[16, 32]",
            "optim.lr": "3e-4",
            "tracking.experiment": "3",
            "model.block": "post_ln",
            "spike.seeds": "[9]",
            "checkpoint.milestones": "[50]",
        },
    )
    assert cfg.train.steps == 100 and cfg.search.widths == [16, 32] and cfg.optim.lr == 3e-4
    assert cfg.tracking.experiment == "3" and cfg.model.block == "post_ln" and cfg.spike.seeds == [9]


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ({"optim.lrr": 1e-3}, "optim.lrr"),
        ({"train.steps": "many"}, "train.steps"),
        ({"optim.beta2": 1.5}, "optim.beta2"),
    ],
)
def test_a_bad_override_is_rejected_naming_its_key(tmp_path, override, key):
    msg = config_error(write_params(tmp_path, "profile: default\n"), overrides=override)
    assert msg.startswith(f"{key}:")


def test_a_profile_override_selects_the_overlay_and_may_not_contradict_the_argument(tmp_path):
    write_params(
        tmp_path,
        "train:\n  steps: 30\ncheckpoint:\n  milestones: [20]\n",
        "profiles/smoke.yaml",
    )
    params = write_params(tmp_path, "profile: default\n")
    assert load_config(params, overrides={"profile": "smoke"}).train.steps == 30
    msg = config_error(params, profile="default", overrides={"profile": "smoke"})
    assert msg.startswith("profile:") and "'smoke'" in msg


# --------------------------------------------------------------------------------------------
# to_flat_dict and replace
# --------------------------------------------------------------------------------------------


def test_to_flat_dict_gives_dotted_keys_with_scalar_or_list_values():
    cfg = Config()
    flat = cfg.to_flat_dict()
    sections = [getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "profile"]
    n_fields = sum(len(dataclasses.fields(section)) for section in sections)
    assert len(flat) == n_fields + 1  # + the top-level "profile"
    assert flat["profile"] == "default"
    assert flat["optim.lr"] == cfg.optim.lr
    assert flat["model.d_model"] == cfg.model.d_model
    assert flat["ablation.precisions"] == ["fp32", "bf16", "fp16", "fp16_unscaled"]
    for key, value in flat.items():
        assert key == "profile" or key.count(".") == 1, key
        if isinstance(value, list):
            assert all(isinstance(v, (str, int, float, bool)) for v in value), key
        else:
            assert isinstance(value, (str, int, float, bool)), key


def test_replace_with_the_flat_dict_round_trips():
    cfg = Config().replace(**{"model.block": "post_ln", "optim.lr": 1e-3})
    assert cfg.replace(**cfg.to_flat_dict()) == cfg


def test_replace_returns_a_revalidated_copy_and_leaves_the_original_alone():
    cfg = Config()
    new = cfg.replace(**{"optim.lr": 1e-3, "model.norm": "layernorm"})
    assert (new.optim.lr, new.model.norm) == (1e-3, "layernorm")
    assert (cfg.optim.lr, cfg.model.norm) == (Config().optim.lr, Config().model.norm)
    assert new.optim.beta2 == cfg.optim.beta2


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ({"optim.lr": 0.0}, "optim.lr"),
        ({"optim.beta2": 1.0}, "optim.beta2"),
        ({"model.block": "sandwich"}, "model.block"),
        ({"optim.lrr": 1e-3}, "optim.lrr"),
        ({"model.n_layer": "2"}, "model.n_layer"),
        ({"schedule.warmup_steps": 10_000}, "schedule.warmup_steps"),
        ({"model.tie_embeddings": True, "mup.parametrization": "mup"}, "model.tie_embeddings"),
    ],
    ids=["lr", "beta2", "variant", "unknown-key", "type", "warmup", "mup-tied"],
)
def test_replace_revalidates(override, key):
    with pytest.raises(ConfigError) as info:
        Config().replace(**override)
    assert str(info.value).startswith(f"{key}:")
