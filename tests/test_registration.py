"""A registration the tool enforces (issue #58, items 1, 2, 4, 7; tasks/design/registration.py,
tasks/register/): `spikelab register` refuses a dirty tree, an exploratory seed, a used seed and a
gate fixed by construction; what it writes the stages read as confirmatory, and any other design
(one byte of the design code, one config value) as exploratory, whose fresh seeds move out of
every registration's reach; the seeds of results that exist go into the registry; a family's alpha
is spent over the looks its budget reaches. Real git, real files: nothing is mocked."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from flows.__main__ import main
from model.typed_config import ConfigError
from tasks.ablate.rounds import reachable_rounds
from tasks.config import load_config
from tasks.design.preregistration import DESIGN_CODE
from tasks.design.registration import (
    CONFIRMATORY,
    EXPLORATORY,
    EXPLORATORY_FROM,
    exploratory_seeds,
    label_results,
    load_records,
    record_path,
    refuse_exploratory_seeds,
    refuse_fresh_declared_seeds,
    state_of,
)
from tasks.design.seed_registry import load_registry
from tasks.design.studies import read_studies
from tasks.register.command import register
from tasks.register.stages import covered_by, stage_state
from tasks.report.sections.history import marked_exploratory, registrations_section, unregistered
from tasks.report.sections.section import Section
from tasks.report.sequential import SequentialDesign, boundaries

REPO = Path(__file__).resolve().parents[1]
TRIAL = {
    "mup": {"zero_init_query": True},  # μP differs from SP at the base width: μ-transfer's gate can fail
    "spike": {"seeds": [500], "confirm_seeds": [501]},
    "search": {"seeds": [500], "confirm_seeds": []},
    "ablation": {"seeds": [500], "confirm_seeds": [501]},
}
"""The trial profile: smoke's sizes on fresh seeds, not exempt from the registry."""


def git(project: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(project), "-c", "user.name=t", "-c", "user.email=t@example.org", *args],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


def commit(project: Path, message: str = "change") -> None:
    git(project, "add", "-A")
    git(project, "commit", "-q", "-m", message)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A git checkout of the design code, params.yaml, the profiles and a trial profile, committed."""
    root = tmp_path / "project"
    for name in [
        *DESIGN_CODE,
        "params.yaml",
        "studies.yaml",
        *(f"profiles/{p.name}" for p in (REPO / "profiles").glob("*.yaml")),
    ]:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / name, root / name)
    trial = yaml.safe_load((REPO / "profiles/smoke.yaml").read_text())
    for section, keys in TRIAL.items():
        trial.setdefault(section, {}).update(keys)
    (root / "profiles/trial.yaml").write_text(yaml.safe_dump(trial))
    git(root, "init", "-q")
    commit(root, "the design")
    return root


def registered(project: Path) -> Path:
    """The project with the trial profile registered and the record committed."""
    register(project, "trial")
    commit(project, "register trial")
    return project


def trial(project: Path, **overrides: Any):
    return load_config(project / "params.yaml", "trial", overrides or None)


def test_a_registered_and_committed_design_runs_confirmatory(project: Path) -> None:
    registered(project)
    record = yaml.safe_load((project / "tasks/design/registrations/trial.yaml").read_text())["registrations"][-1]
    assert record["commit"] == git(project, "rev-parse", "HEAD~1").strip()
    assert record["seeds"]["ablation.seeds"] == [500] and record["registered_at"].endswith("Z")
    assert state_of(trial(project), project).state == CONFIRMATORY


def test_a_one_byte_change_to_the_registered_design_runs_exploratory(project: Path) -> None:
    registered(project)
    with (project / "tasks/report/verdict.py").open("a") as f:
        f.write(" ")
    commit(project)
    state = state_of(trial(project), project)
    assert state.state == EXPLORATORY and "design_hash" in state.why


def test_a_changed_config_value_runs_exploratory(project: Path) -> None:
    registered(project)
    assert state_of(trial(project, **{"optim.lr": 0.0101}), project).state == EXPLORATORY
    assert state_of(trial(project, **{"tracking.experiment": "elsewhere"}), project).state == CONFIRMATORY


def test_an_uncommitted_record_is_not_confirmatory(project: Path) -> None:
    register(project, "trial")
    state = state_of(trial(project), project)
    assert state.state == EXPLORATORY and "not committed" in state.why


def test_a_registration_with_a_dirty_tree_is_refused(project: Path) -> None:
    (project / "params.yaml").write_text((project / "params.yaml").read_text() + "\n")
    with pytest.raises(ConfigError, match=r"^params.yaml: uncommitted change to the design"):
        register(project, "trial")


def test_a_deleted_design_file_is_a_dirty_tree(project: Path) -> None:
    (project / "studies.yaml").unlink()
    with pytest.raises(ConfigError, match="studies.yaml: uncommitted change"):
        register(project, "trial")


def test_an_untracked_studies_file_is_a_dirty_tree(project: Path) -> None:
    (project / "studies.yaml").unlink()
    commit(project)
    (project / "studies.yaml").write_text("families: {}\n")
    with pytest.raises(ConfigError, match="studies.yaml: uncommitted change"):
        register(project, "trial")


def test_an_exploratory_seed_in_a_registration_is_refused(project: Path) -> None:
    refuse_exploratory_seeds({"ablation.seeds": [EXPLORATORY_FROM - 1]})  # the last registrable seed
    profile = project / "profiles/trial.yaml"
    profile.write_text(profile.read_text().replace("- 500", f"- {EXPLORATORY_FROM}", 1))
    commit(project)
    with pytest.raises(ConfigError, match=f"seed {EXPLORATORY_FROM} is in the exploratory range"):
        register(project, "trial")


def test_the_seeds_of_existing_results_go_into_the_registry_and_are_then_refused(project: Path) -> None:
    (project / "metrics").mkdir()
    (project / "metrics/spike.json").write_text('{"discovery_seeds": [501], "confirm_seeds": [600]}')
    commit(project)
    with pytest.raises(ConfigError, match=r"^ablation.confirm_seeds: seed 501 was used by the spike study"):
        register(project, "trial", dry_run=True)
    assert 600 not in load_registry(project / "tasks/design/seed_registry.yaml").used  # a dry run writes nothing


def test_register_appends_result_seeds_it_reads_to_the_registry(project: Path) -> None:
    (project / "metrics").mkdir()
    (project / "metrics/search.json").write_text('{"sp": {"widths": {"16": {"per_seed": {"700": -9.0}}}}}')
    commit(project)
    register(project, "trial")
    assert 700 in load_registry(project / "tasks/design/seed_registry.yaml").used
    record = yaml.safe_load((project / "tasks/design/registrations/trial.yaml").read_text())["registrations"][-1]
    assert record["results_before"][0]["seeds"] == [700] and record["results_before"][0]["commit"]


def test_exploratory_work_moves_fresh_seeds_and_keeps_used_ones() -> None:
    registry = load_registry()
    cfg = load_config(REPO / "params.yaml", "default", {"ablation.seeds": [0, 1, 2, 900]})
    moved = exploratory_seeds(cfg, registry)
    assert moved["ablation.seeds"] == [0, 1, 2, EXPLORATORY_FROM + 900]
    assert exploratory_seeds(load_config(REPO / "params.yaml", "smoke", {"ablation.seeds": [900]}), registry) == {}


def test_the_label_is_written_where_the_report_reads_it(tmp_path: Path) -> None:
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics/ablate.json").write_text('{"arms": []}')
    label_results(tmp_path, [Path("metrics/ablate.json"), Path("metrics/absent.json")], {"state": EXPLORATORY})
    assert yaml.safe_load((tmp_path / "metrics/ablate.json").read_text())["registration"] == {"state": EXPLORATORY}


def test_an_exempt_profile_is_not_registered(project: Path) -> None:
    with pytest.raises(ConfigError, match="smoke is exempt"):
        register(project, "smoke")


def test_confirmatory_run_of_an_unregistered_design_is_refused_in_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import flows.stages

    monkeypatch.setattr(flows.stages, "require_inputs", lambda *_: None)  # a checkout without data
    assert main(["run", "ablate", "--profile", "smoke", "--confirmatory"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "has no registration" in err and "spikelab register --profile smoke" in err


def test_a_cap_that_reaches_2_of_3_looks_spends_all_alpha_by_look_2() -> None:
    assert reachable_rounds((4, 8, 12), 8) == (4, 8)
    assert reachable_rounds((4, 8, 12), 11) == (4, 8)
    assert reachable_rounds((4, 8, 12), 12) == (4, 8, 12)
    assert reachable_rounds((4, 8, 12), 0) == (4, 8, 12)
    levels = boundaries(SequentialDesign(reachable_rounds((4, 8, 12), 8)))
    assert len(levels) == 2 and sum(levels) == pytest.approx(0.025)
    assert sum(boundaries(SequentialDesign((4, 8, 12)))[:2]) < 0.01  # what version 3 spent by its cap


def test_the_report_marks_every_verdict_of_exploratory_results_and_no_confirmatory_one() -> None:
    verdict, plain = Section("xiong", ["a line"], verdict="REPRODUCED"), Section("Method", ["m"])
    confirmed = {"registration": {"state": CONFIRMATORY}}
    assert unregistered({"ablate": confirmed, "spike": None, "search": {}}) == {}
    assert marked_exploratory([verdict, plain], {}) == [verdict, plain]
    why = unregistered({"ablate": {"registration": {"state": EXPLORATORY, "why": "no record"}}, "spike": {"x": 1}})
    assert why == {"ablate": "no record", "spike": "made before registrations"}
    marked, same = marked_exploratory([verdict, plain], why)
    assert marked.lines[0].startswith("**EXPLORATORY**: ") and marked.lines[2:] == ["a line"] and same == plain


FAMILY = {
    "question": "Does qk-norm lower the loss?",
    "factors": {"model": {"qk_norm": [False, True]}},
    "claims": {
        "lower": {
            "kind": "contrast",
            "metric": "capped_loss",
            "a": {"model.qk_norm": True},
            "b": {"model.qk_norm": False},
            "expected": -1,
            "sesoi": 0.1,
            "justification": "a tenth of a nat",
        }
    },
}


def declare(project: Path, **keys: Any) -> None:
    (project / "studies.yaml").write_text(yaml.safe_dump({"families": {"mine": FAMILY | keys}}))


def test_a_declared_familys_used_seed_is_refused_at_registration(project: Path) -> None:
    declare(project, seeds=[0], confirm_seeds=[510])  # seed 0: version 1's ablation study
    commit(project)
    with pytest.raises(ConfigError, match=r"^studies.yaml: families.mine.seeds: seed 0 was used by the ablation"):
        register(project, "trial", dry_run=True)


def test_a_declared_family_is_registered_with_its_seeds_and_a_change_to_it_runs_exploratory(project: Path) -> None:
    declare(project, seeds=[510], confirm_seeds=[511])
    commit(project)
    registered(project)
    record = yaml.safe_load((project / "tasks/design/registrations/trial.yaml").read_text())["registrations"][-1]
    assert record["seeds"]["studies.yaml:mine.seeds"] == [510]
    declare(project, seeds=[510], confirm_seeds=[512])
    commit(project)
    state = state_of(trial(project), project)
    assert state.state == EXPLORATORY and "studies_hash" in state.why


def test_an_exploratory_run_refuses_to_spend_a_declared_familys_fresh_seed(project: Path) -> None:
    declare(project, seeds=[510], confirm_seeds=[EXPLORATORY_FROM])
    cfg = trial(project)
    with pytest.raises(ConfigError, match=r"families.mine.seeds: seed 510 is fresh and this run is exploratory"):
        refuse_fresh_declared_seeds(read_studies(project, cfg), load_registry())
    declare(project, seeds=[0], confirm_seeds=[EXPLORATORY_FROM])  # used, and exploratory: nothing spent
    refuse_fresh_declared_seeds(read_studies(project, cfg), load_registry())


def test_the_report_lists_each_registration_with_the_results_before_it(project: Path) -> None:
    (project / "metrics").mkdir()
    (project / "metrics/search.json").write_text('{"sp": {"widths": {"16": {"per_seed": {"700": -9.0}}}}}')
    commit(project)
    registered(project)
    section = registrations_section(project, "trial")
    assert section is not None and section.title == "Registrations"
    assert (
        "results that existed before it: metrics/search.json (unlabelled: made before registrations" in section.lines[2]
    )
    assert registrations_section(project, "default") is None


def test_the_study_simulation_keeps_each_familys_wrong_reproduce_rate_near_half_alpha() -> None:
    """scripts/sequential_oc.py --study: every family of the registered design on its reachable
    looks, Holm within each; 400 studies, so a family's rate at +SESOI (0.025 expected) is read
    loosely, and the study's, over 5 families, is above any one family's."""
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts/sequential_oc.py"), "--study", "default", "--sims", "400"],
        capture_output=True,
        text=True,
        check=True,
    )
    line = next(x for x in done.stdout.splitlines() if x.startswith("every effect at +SESOI"))
    study, family = (float(v) for v in re.findall(r"reproduced\) ([\d.]+) \(worst family ([\d.]+)\)", line)[0])
    assert family <= 0.06 and study >= family
    assert "xiong (2 claims, looks [4, 8])" in done.stdout  # version 4: one LR, its two claims


def test_a_project_without_the_design_code_is_hashed_by_the_code_it_runs(tmp_path):
    from tasks.config import load_config
    from tasks.design.preregistration import design_hash
    from tasks.design.registration import design_of

    (tmp_path / "params.yaml").write_text((REPO / "params.yaml").read_text())
    shutil.copytree(REPO / "profiles", tmp_path / "profiles")
    cfg = load_config(tmp_path / "params.yaml", "smoke")
    assert design_of(cfg, tmp_path)["design_hash"] == design_hash()  # params and data only: the installed code's


def retrial(project: Path, section: str, **keys: Any) -> None:
    """The trial profile with ``keys`` set in ``section``, committed."""
    path = project / "profiles/trial.yaml"
    profile = yaml.safe_load(path.read_text())
    profile.setdefault(section, {}).update(keys)
    path.write_text(yaml.safe_dump(profile))
    commit(project)


def test_a_stage_the_registration_leaves_out_runs_exploratory(project: Path) -> None:
    register(project, "trial", only=["ablate"])
    commit(project, "register trial's ablate stage")
    record = load_records(project, "trial")[-1]
    assert record["stages"] == ["ablate"]
    assert set(record["seeds"]) == {"ablation.seeds", "ablation.confirm_seeds"}  # no spike or search seed
    cfg = trial(project)
    assert stage_state("ablate", cfg, project).state == CONFIRMATORY
    spike = stage_state("spike", cfg, project)
    assert spike.state == EXPLORATORY and spike.why == f"{record_path('trial')} registers stage ablate, not spike"
    assert state_of(cfg, project).state == CONFIRMATORY, "the design itself is the registered one"


def test_the_default_registration_covers_every_stage_as_before(project: Path) -> None:
    registered(project)
    record = load_records(project, "trial")[-1]
    assert record["stages"] == ["ablate", "spike", "search"]
    assert {"spike.seeds", "search.seeds", "ablation.seeds"} <= set(record["seeds"])
    records = load_records(REPO, "default")
    first, last = records[0], records[-1]
    assert "stages" not in first and covered_by(first) == ["ablate", "spike", "search"]  # before stages were named
    assert covered_by(last) == ["ablate", "spike", "search"]


def test_a_gate_only_an_unregistered_stage_decides_is_not_checked(project: Path) -> None:
    retrial(project, "model", tie_embeddings=True)  # as the gpu profile: μP cannot tie, so no μ-transfer point
    retrial(project, "mup", parametrization="sp")
    with pytest.raises(ConfigError, match=r"^findings.mu_transfer: its gate's μP point cannot be built"):
        register(project, "trial", dry_run=True)
    lines = register(project, "trial", dry_run=True, only=["ablate", "spike"])
    assert lines[0].startswith("register: profile trial, stages ablate, spike, at ")
    assert lines[-1] == "register: --dry-run: nothing written"


def test_the_gpu_profile_registers_its_ablate_stage(project: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"^findings.mu_transfer: its gate's μP point cannot be built under profile gpu"
    ):
        register(project, "gpu", dry_run=True)  # every stage: search's gate, which the gpu study never reads
    lines = register(project, "gpu", dry_run=True, only=["ablate"])
    assert lines[0].startswith("register: profile gpu, stages ablate, at ") and "5 study seeds" in lines[0]
    assert {line.split(":")[0].strip() for line in lines[2:-1] if not line.startswith("    ")} == {
        "wortsman",
        "xiong",
        "beta2",
    }, "the families the profile trains, and no other"


def test_an_unknown_stage_is_refused_in_one_line_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["register", "--dry-run", "--stages", "ablate", "pretrain"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--stages: 'pretrain' is not a stage that trains study seeds" in err


def test_the_gpu_plan_is_labelled_as_the_ablate_stage_is(project: Path) -> None:
    from flows.gpu_study import registration
    from tasks.gpu_study.report import labelled

    cfg, moved, label = registration(trial(project), project)  # no registration: exploratory, seeds moved
    assert label["state"] == EXPLORATORY and cfg.ablation.seeds == [EXPLORATORY_FROM + 500]
    assert moved == {"ablation.seeds": [EXPLORATORY_FROM + 500], "ablation.confirm_seeds": [EXPLORATORY_FROM + 501]}
    assert labelled({"registration": label}).startswith("EXPLORATORY, never counted as a verdict: profile trial")
    register(project, "trial", only=["spike"])
    commit(project, "register trial's spike stage")
    assert registration(trial(project), project)[2]["state"] == EXPLORATORY, "ablate is not registered"
    register(project, "trial", only=["ablate"])
    commit(project, "register trial's ablate stage")
    cfg, moved, label = registration(trial(project), project)
    assert label["state"] == CONFIRMATORY and moved == {} and label["seeds"]["ablation.seeds"] == [500]
    assert labelled({"registration": label}) == f"confirmatory under {record_path('trial')}, design {label['hash']}"
