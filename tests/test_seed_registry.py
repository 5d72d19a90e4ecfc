"""Clean confirmation (issue #46, item 6; tasks/design/seed_registry.py): a study seed (``seeds`` or
``confirm_seeds`` of ablation, spike, search) that the seed registry lists, under any section, is
refused naming the key, the seed and its earlier use; only the profiles the registry exempts pass
unchecked; a malformed registry is refused naming its key; the committed registry parses, lists
every non-study seed the default profile uses, and every study profile's seeds pass it."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest

from model.typed_config import ConfigError, InputError
from tasks.config import Config, load_config
from tasks.design import seed_registry
from tasks.design.seed_registry import (
    STUDY_KEYS,
    STUDY_SECTIONS,
    Registry,
    check_stage,
    check_study_seeds,
    fresh_seeds,
    load_registry,
)

REPO = Path(__file__).resolve().parents[1]


def entry(seeds: str, used_by: str, what: str, read: str = "true") -> str:
    """One seed use as the registry writes it."""
    return (
        f"  - seeds: {seeds}\n"
        f"    used_by: {used_by}\n"
        f'    what: "{what}"\n'
        '    when: "2026-11-25, pre-registration v2"\n'
        f"    read_before_design_decision: {read}\n"
        '    source: "tasks/design/preregistration.yaml"\n'
    )


EXEMPT = 'exempt_profiles:\n  smoke: "the tests\' profile"\n'
REGISTRY = (
    EXEMPT
    + "ablation:\n"
    + entry("[0, 1, 2, 3]", "study", "version 1's study")
    + entry("[10, 11, 12, 13]", "check", "the held-out check")
    + "spike:\n"
    + entry("[4, 5, 6, 7]", "sizing_probe", "the detector's sizing run")
    + entry("[5]", "check", "a benchmark", read="false")
    + "search:\n"
    + entry("[0, 1]", "study", "the first search")
    + entry("[200]", "pilot", "a pilot")
)
"""A small registry: ablation 0-3 and 10-13, spike 4-7, search 0-1 and 200; smoke exempt."""


@pytest.fixture
def registry(tmp_path: Path) -> Registry:
    return load_registry(written(tmp_path, REGISTRY))


def written(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "seed_registry.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def study(profile: str = "default", **keys: list[int]) -> Config:
    """A config whose study seeds are fresh in :data:`REGISTRY` (30, 31 discovery; 32, 33
    confirmation, in every section) but for ``keys`` (``section__key``: its seeds)."""
    seeds = {f"{s}.{k}": [30, 31] if k == "seeds" else [32, 33] for s in STUDY_SECTIONS for k in STUDY_KEYS}
    return Config().replace(profile=profile, **seeds | {k.replace("__", "."): v for k, v in keys.items()})


# --- reuse refused, naming the key, the seed and its earlier use -------------------------------


def test_a_reused_confirmation_seed_is_refused_naming_the_key_the_seed_and_its_earlier_use(registry):
    with pytest.raises(ConfigError) as refused:
        check_study_seeds(study(ablation__confirm_seeds=[32, 33, 12]), registry=registry)
    message = str(refused.value)
    assert message.startswith(
        "ablation.confirm_seeds: seed 12 was used by the ablation check: the held-out check (2026-11-25"
    )
    # as many fresh seeds as the key lists, none a discovery seed of the section (30, 31)
    assert "\n" not in message and message.endswith("(tasks/design/seed_registry.yaml), e.g. [8, 9, 14]")


def test_a_reused_discovery_seed_is_refused_too(registry):
    with pytest.raises(ConfigError, match=r"^spike\.seeds: seed 0 was used by the ablation study: version 1's"):
        check_study_seeds(study(spike__seeds=[0, 31]), registry=registry)


def test_a_seed_listed_under_any_section_is_refused_for_every_section(registry):
    """A seed fixes the init and the data order whatever the stage: spike's sizing seed 4 is no
    search seed either, and search's pilot seed 200 no ablation seed."""
    with pytest.raises(ConfigError, match=r"^search\.confirm_seeds: seed 4 was used by the spike sizing probe: "):
        check_study_seeds(study(search__confirm_seeds=[4]), registry=registry)
    with pytest.raises(ConfigError, match=r"^ablation\.seeds: seed 200 was used by the search pilot: a pilot "):
        check_study_seeds(study(ablation__seeds=[200, 201]), registry=registry)


def test_the_highest_registered_seed_is_refused_and_the_first_seed_past_it_accepted(registry):
    with pytest.raises(ConfigError, match=r"^ablation\.confirm_seeds: seed 13 was used by the ablation check"):
        check_study_seeds(study(ablation__confirm_seeds=[13]), registry=registry)
    check_study_seeds(study(ablation__confirm_seeds=[14]), registry=registry)
    check_study_seeds(study(ablation__confirm_seeds=[8, 9, 14, 15, 199, 201]), registry=registry)


def test_every_reused_seed_is_named_the_lowest_first_with_the_use_that_was_read(registry):
    with pytest.raises(ConfigError) as refused:
        check_study_seeds(study(spike__confirm_seeds=[7, 5, 4, 40]), registry=registry)
    assert str(refused.value).startswith("spike.confirm_seeds: seed 4 was used by the spike sizing probe: ")
    assert "; so were 5, 7; " in str(refused.value)
    with pytest.raises(ConfigError) as refused:  # seed 5: the sizing run (read), not the benchmark
        check_study_seeds(study(spike__confirm_seeds=[5]), registry=registry)
    assert "seed 5 was used by the spike sizing probe: the detector's sizing run (2026-11-25, " in str(refused.value)
    assert "(and 1 other use)" in str(refused.value)


def test_the_uses_under_the_keys_own_section_are_named_first(registry):
    with pytest.raises(ConfigError, match=r"seed 0 was used by the search study: the first search .*other use\)"):
        check_study_seeds(study(search__seeds=[0, 31]), registry=registry)


def test_sizing_and_pretraining_seeds_are_not_checked(registry):
    check_study_seeds(study(**{"ablation__sizing_seeds": [0, 1], "train__seed": 0}), registry=registry)


def test_a_stage_without_confirmation_seeds_passes(registry):
    check_study_seeds(study(search__confirm_seeds=[]), registry=registry)


def test_the_suggested_seeds_are_fresh_for_every_section(registry):
    assert fresh_seeds(registry, 4) == [8, 9, 14, 15] and not set(fresh_seeds(registry, 4)) & registry.used
    assert fresh_seeds(registry, 3, avoid=[8, 14]) == [9, 15, 16]


# --- which profiles and stages -----------------------------------------------------------------


def test_only_a_profile_the_registry_exempts_passes_unchecked(registry):
    check_study_seeds(study("smoke", ablation__seeds=[0]), registry=registry)
    for profile in ("default", "extended", "gpu", "a_new_one"):
        with pytest.raises(ConfigError, match=r"^ablation\.seeds: seed 0 "):
            check_study_seeds(study(profile, ablation__seeds=[0]), registry=registry)


def test_a_stage_run_checks_only_the_section_it_trains(monkeypatch, registry):
    monkeypatch.setattr(seed_registry, "load_registry", lambda path=None: registry)
    reused = study(ablation__confirm_seeds=[0])
    for stage in ("prepare", "filter", "tokenize", "pretrain", "search", "spike", "report"):
        check_stage(stage, reused)
    with pytest.raises(ConfigError, match=r"^ablation\.confirm_seeds: seed 0 "):
        check_stage("ablate", reused)
    for stage, section in (("spike", "spike"), ("search", "search")):
        with pytest.raises(ConfigError, match=rf"^{section}\.seeds: seed 1 "):
            check_stage(stage, study(**{f"{section}__seeds": [1]}))


def test_an_unregistered_run_moves_its_fresh_seeds_out_of_reach_and_says_so_first(monkeypatch, capsys):
    """A reused seed is refused at registration (tests/test_registration.py); a run of a design no
    registration holds is exploratory: its fresh seeds move to the exploratory range, so no later
    registration can reuse them, and its used seeds stay, as its first line says."""
    import flows.stages
    import model.numerics
    from flows.__main__ import main

    def ran(*_: Any) -> None:
        raise ConfigError("stopped after the check")

    monkeypatch.chdir(REPO)  # the checkout's params.yaml: the default profile
    monkeypatch.setattr(flows.stages, "require_inputs", lambda *_: None)  # a checkout without data
    monkeypatch.setattr(model.numerics, "apply_numerics", ran)  # the first thing run_stage does after it
    assert main(["run", "ablate", "--set", "ablation.confirm_seeds=[32, 33, 34, 35, 36, 37, 38, 5]"]) == 2
    first, rest = capsys.readouterr().err.split("\n", 1)
    assert first.startswith("[spikelab] ablate: EXPLORATORY, never counted as a verdict: ")
    moved = "ablation.confirm_seeds=[1000032, 1000033, 1000034, 1000035, 1000036, 1000037, 1000038, 5]"
    assert moved in first and rest == "spikelab: error: stopped after the check\n"


# --- a malformed registry refused, naming its key ----------------------------------------------

GOOD = EXEMPT + "ablation:\n" + entry("[0, 1]", "study", "a study")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (GOOD.replace("ablation:", "ablate:"), "ablate: not a section; the registry's are ablation, spike"),
        (GOOD.replace("[0, 1]", "[0, -1]"), "ablation[0].seeds: -1 is not a seed (an integer >= 0)"),
        (GOOD.replace("[0, 1]", "[0, true]"), "ablation[0].seeds: True is not a seed"),
        (GOOD.replace("[0, 1]", "[0, 0]"), "ablation[0].seeds: [0, 0] names a seed twice"),
        (GOOD.replace("[0, 1]", "[]"), "ablation[0].seeds: must be a non-empty list of seeds"),
        (GOOD.replace("[0, 1]", "0-7"), "ablation[0].seeds: must be a non-empty list of seeds, got '0-7'"),
        (GOOD.replace("used_by: study", "used_by: probe"), "ablation[0].used_by: 'probe' is not one of design_step"),
        (GOOD.replace("    source:", "    sources:"), "ablation[0].source: missing"),
        (GOOD + "    date: 2026-11-25\n", "ablation[0].date: not a field of a seed use"),
        (GOOD.replace('what: "a study"', 'what: ""'), "ablation[0].what: must be non-empty text"),
        (GOOD.replace("decision: true", "decision: yes please"), "ablation[0].read_before_design_decision: must be"),
        (GOOD.replace("  - seeds", "  - seeds: [2]\n    seeds"), "ablation[0].seeds: duplicate key in"),
        (GOOD + GOOD.replace(EXEMPT, ""), "ablation: duplicate key in"),
        (EXEMPT + "ablation: []\n", "ablation: must be a non-empty list of seed uses"),
        (EXEMPT + "ablation:\n  - [0, 1]\n", "ablation[0]: must be a mapping"),
        (EXEMPT, "lists no seed use"),
        (GOOD.replace('  smoke: "the tests\' profile"', '  smoke: ""'), "exempt_profiles.smoke: must be a profile's"),
        (GOOD.replace('  smoke: "the tests\' profile"', "  smoke:"), "exempt_profiles.smoke: must be a profile's"),
        (GOOD.replace('  smoke: "the tests\' profile"', "  - smoke"), "exempt_profiles: must be a non-empty mapping"),
        ("- ablation\n", "must be a mapping of section to its seed uses"),
        ("", "must be a mapping of section to its seed uses"),
        ("ablation: [\n", "not valid YAML"),
    ],
)
def test_a_malformed_registry_is_refused_naming_the_file_and_its_key(tmp_path, text, message):
    path = written(tmp_path, text)
    with pytest.raises(InputError) as refused:
        load_registry(path)
    assert str(refused.value).startswith(f"{path}: ") and message in str(refused.value)


def test_a_registry_without_exemptions_checks_every_profile(tmp_path):
    registry = load_registry(written(tmp_path, GOOD.replace(EXEMPT, "")))
    with pytest.raises(ConfigError, match=r"^ablation\.seeds: seed 0 "):
        check_study_seeds(study("smoke", ablation__seeds=[0]), registry=registry)


def test_a_missing_registry_is_refused_naming_the_file(tmp_path):
    with pytest.raises(InputError, match="seed_registry.yaml: the seed registry is missing"):
        load_registry(tmp_path / "seed_registry.yaml")


def test_a_malformed_registry_stops_the_check_as_a_user_error(monkeypatch, tmp_path):
    monkeypatch.setattr(seed_registry, "REGISTRY", written(tmp_path, GOOD.replace("used_by: study", "used_by: x")))
    with pytest.raises(InputError, match=r"ablation\[0\]\.used_by"):
        check_study_seeds(study("smoke"))  # read before the profile's exemption


# --- the committed registry --------------------------------------------------------------------

REGISTERED_BY = {"ablation": "ablation", "spike": "spike", "search": "search", "train": "pretrain"}
"""Each config section with a non-study seed key -> the registry's section that records it."""
UNREGISTERED = {
    "data.seed": "the split and the BPE sample's seed: the same in every run, no unit of replication",
    "sensitivity.seed": "which training documents the sensitivity run drops: a data draw, no init or data order",
    "ablation.budget_seeds": "a count of seeds (the study's cap on arm-steps), no seed",
}
STUDY_PROFILES = ("default", "extended", "gpu")
"""The shipped profiles the check applies to (every one but smoke)."""


def seed_keys(cfg: Config) -> dict[str, list[int]]:
    """Every ``*seed`` and ``*seeds`` key of ``cfg`` and its seeds, found by name (a new key is found)."""
    keys = {}
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        if not dataclasses.is_dataclass(values):
            continue
        for key in dataclasses.fields(values):
            if key.name.endswith(("seed", "seeds")):
                value = getattr(values, key.name)
                keys[f"{section.name}.{key.name}"] = value if isinstance(value, list) else [value]
    return keys


def test_the_committed_registry_parses_and_lists_every_non_study_seed_the_default_profile_uses():
    registry = load_registry()
    keys = seed_keys(load_config(REPO / "params.yaml", "default"))
    study_keys = {f"{section}.{key}" for section in STUDY_SECTIONS for key in STUDY_KEYS}
    assert set(keys) - set(UNREGISTERED) == {
        *study_keys,
        "ablation.sizing_seeds",
        "spike.sizing_seeds",
        "train.seed",
    }, "a new seed key: say in REGISTERED_BY or UNREGISTERED how the registry covers it"
    for key, seeds in keys.items():
        if key in UNREGISTERED or key in study_keys:  # study seeds: the check's subject (below)
            continue
        stage = REGISTERED_BY[key.split(".")[0]]
        listed = {seed for use in registry.uses.get(stage, []) for seed in use.seeds}
        assert set(seeds) <= listed, f"{key}: {sorted(set(seeds) - listed)} used but not under {stage} in the registry"


def test_the_committed_registry_lists_versions_1_and_2_the_sizing_probes_and_the_pilots():
    registry = load_registry()
    assert set(range(16)) | {100, 101, 102, 103, 200, 201, 202} <= registry.used
    assert set(registry.exempt_profiles) == {"smoke"}


def test_the_committed_registry_refuses_the_reused_seeds_the_review_named():
    registry = load_registry()
    with pytest.raises(ConfigError, match=r"^spike\.confirm_seeds: seed 4 was used by the spike sizing probe: version"):
        check_study_seeds(study(spike__confirm_seeds=[4, 5, 6, 7]), ["spike"], registry)
    with pytest.raises(ConfigError, match=r"^ablation\.confirm_seeds: seed 12 was used by the ablation check: "):
        check_study_seeds(study(ablation__confirm_seeds=[12, 13, 14, 15]), ["ablation"], registry)


@pytest.mark.parametrize("profile", STUDY_PROFILES)
def test_every_study_profile_trains_on_fresh_seeds_only(profile):
    cfg = load_config(REPO / "params.yaml", profile)
    check_study_seeds(cfg)
    used = load_registry().used
    for section in STUDY_SECTIONS:
        for key in STUDY_KEYS:
            assert not set(getattr(getattr(cfg, section), key)) & used, f"{profile}: {section}.{key}"


def test_the_smoke_profile_reuses_registered_seeds_and_is_exempt():
    cfg = load_config(REPO / "params.yaml", "smoke")
    assert cfg.ablation.seeds == [0] and 0 in load_registry().used
    check_study_seeds(cfg)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
