"""A gate fixed by construction is refused at registration (issue #58, item 2; tasks/register/gates.py):
a declared family's gate whose metric's range decides it, or read where the claim's two sides are
the same model (μP and SP at the base width), and μ-transfer's built-in gate at the base width; the
same gates one step away from construction (a bound inside the range, another width, μP with a
zero query) pass, and so do the built-in families."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tasks.ablate.grid import families
from tasks.config import Config, load_config
from tasks.design.studies import read_studies
from tasks.register.gates import builtin_refusals, family_refusals, same_by_construction

REPO = Path(__file__).resolve().parents[1]


def smoke(**overrides: Any) -> Config:
    return load_config(REPO / "params.yaml", "smoke", overrides or None)


def declared(tmp_path: Path, cfg: Config, claim: dict[str, Any], widths: tuple[int, ...] = (32, 64)) -> list[str]:
    """The refusals of a studies.yaml family of μP against SP at ``widths`` with ``claim`` (smoke's
    base width is 32; a single width is fixed, not crossed)."""
    width = {"model": {"d_model": list(widths)}} if len(widths) > 1 else {}
    family = {
        "question": "Does μP train better than SP?",
        "factors": {"mup": {"parametrization": ["sp", "mup"]}, **width},
        "fixed": {} if width else {"model.d_model": widths[0]},
        "claims": {"mup_better": {**claim, "justification": "a tenth of a nat"}},
    }
    (tmp_path / "studies.yaml").write_text(yaml.safe_dump({"families": {"mup_vs_sp": family}}))
    return family_refusals(cfg, read_studies(tmp_path, cfg))


CONTRAST = {"kind": "contrast", "metric": "capped_loss", "expected": -1, "sesoi": 0.1}
MUP, SP = {"mup.parametrization": "mup"}, {"mup.parametrization": "sp"}


def gate(**keys: Any) -> dict[str, Any]:
    return {"metric": "capped_loss", "at_most": 5.0, "justification": "it trains"} | keys  # ln V = 6.24


def test_a_gate_read_where_the_claims_sides_are_the_same_model_is_refused(tmp_path: Path) -> None:
    cfg = smoke()  # base width 32: μP is SP there
    claim = CONTRAST | {"a": MUP, "b": SP, "gate": gate(variant={"model.d_model": 32})}
    (found,) = declared(tmp_path, cfg, claim)
    assert found.startswith("mup_vs_sp.claims.mup_better.gate: reads {'model.d_model': 32}")
    assert "the same model by construction" in found


def test_the_same_gate_at_another_width_passes(tmp_path: Path) -> None:
    claim = CONTRAST | {"a": MUP, "b": SP, "gate": gate(variant={"model.d_model": 64})}
    assert declared(tmp_path, smoke(), claim) == []


def test_the_gate_at_the_base_width_passes_where_mup_differs_there(tmp_path: Path) -> None:
    claim = CONTRAST | {"a": MUP, "b": SP, "gate": gate(variant={"model.d_model": 32})}
    assert declared(tmp_path, smoke(**{"mup.zero_init_readout": True}), claim) == []


@pytest.mark.parametrize(
    ("bounds", "fixed"),
    [({"at_most": 1.0}, "always met"), ({"at_least": 0.0}, "always met"), ({"above": 1.0}, "never met")],
)
def test_a_gate_its_metrics_range_decides_is_refused(tmp_path: Path, bounds: dict[str, float], fixed: str) -> None:
    claim = CONTRAST | {"a": MUP, "b": SP, "gate": {"metric": "diverged", "justification": "x", **bounds}}
    (found,) = declared(tmp_path, smoke(), claim)
    assert found.endswith(f"is {fixed} by construction (its range)")


@pytest.mark.parametrize("bounds", [{"at_most": 0.99}, {"at_least": 0.01}, {"above": 0.99}])
def test_a_gate_inside_its_metrics_range_passes(tmp_path: Path, bounds: dict[str, float]) -> None:
    claim = CONTRAST | {"a": MUP, "b": SP, "gate": {"metric": "diverged", "justification": "x", **bounds}}
    assert declared(tmp_path, smoke(), claim) == []


def test_a_claim_comparing_a_model_with_itself_is_refused(tmp_path: Path) -> None:
    claim = CONTRAST | {"a": MUP, "b": SP}
    (found,) = declared(tmp_path, smoke(), claim, widths=(32,))
    assert "the same model by construction at every arm" in found
    assert declared(tmp_path, smoke(), claim, widths=(64,)) == []


def test_mu_transfers_gate_at_the_target_width_is_refused_only_where_the_target_is_the_base_width() -> None:
    (found,) = builtin_refusals(smoke())  # smoke's target width (model.d_model 32) is its base width
    assert found.startswith("findings.mu_transfer") and "gate where they differ" in found
    assert builtin_refusals(smoke(**{"mup.zero_init_query": True})) == []
    assert builtin_refusals(smoke(**{"model.d_model": 64})) == [], "a target above the base: μP is not SP there"
    default = load_config(REPO / "params.yaml", "default", None)
    assert default.model.d_model != default.mup.base_width and builtin_refusals(default) == []


def test_a_profile_whose_mu_transfer_point_cannot_be_built_is_refused_naming_the_finding() -> None:
    tied = smoke(**{"model.tie_embeddings": True, "mup.parametrization": "sp"})  # as the gpu profile: μP cannot tie
    (found,) = builtin_refusals(tied)
    assert found.startswith("findings.mu_transfer: its gate's μP point cannot be built under profile smoke")
    assert "model.tie_embeddings" in found
    assert builtin_refusals(smoke(**{"model.tie_embeddings": False, "model.d_model": 64})) == []


def test_the_builtin_families_have_no_gate_fixed_by_construction() -> None:
    cfg = smoke()
    assert family_refusals(cfg, list(families(cfg).values())) == []


def test_configs_that_differ_outside_mup_are_never_the_same_model() -> None:
    cfg = smoke()
    assert same_by_construction(cfg, cfg.replace(**{"mup.parametrization": "sp"}))  # at the base width
    assert not same_by_construction(cfg, cfg.replace(**{"optim.lr": cfg.optim.lr * 2}))
    wide = cfg.replace(**{"model.d_model": 64})
    assert not same_by_construction(wide, wide.replace(**{"mup.parametrization": "sp"}))
