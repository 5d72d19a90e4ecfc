"""A check of the machinery (a finding registered with ``check``) says what it found only where its
test can decide: on fewer seeds than a t-test look needs it is "not run at this size" (the smoke
profile's 2 seeds), never "check failed"; with enough seeds a failing check still fails."""

from __future__ import annotations

import pytest

from tasks.ablate.config import MIN_FIRST_ROUND
from tasks.config import Config
from tasks.report.findings import xiong_init
from tasks.report.sections.checks import FAILED, NOT_RUN, PASSED, check_outcome, checks_lines


def depth_probe(cfg: Config, post_ln_larger: bool) -> dict:
    """The depth probe's last-layer gradient norms: Post-LN's growing like sqrt(depth) over Pre-LN's
    (Theorem 1), or shrinking below it (the check's claims shown the other way)."""
    power = 0.5 if post_ln_larger else -0.5
    return {
        "depth_probe": {
            "xavier": {
                "last_layer": {
                    block: {
                        str(d): {
                            str(s): (d ** (power + 0.01 * (s % 3 - 1)) if block == "post_ln" else 1 + 0.02 * s)
                            for s in cfg.ablation.all_seeds
                        }
                        for d in cfg.ablation.probe_depths
                    }
                    for block in ("pre_ln", "post_ln")
                }
            }
        }
    }


def seeds(n: int) -> Config:
    """The study config with ``n`` seeds, split into discovery and confirmation halves."""
    half = n // 2
    return Config().replace(
        **{
            "ablation.seeds": list(range(n - half)),
            "ablation.confirm_seeds": list(range(n - half, n)),
            "ablation.rounds": [],
        }
    )


def test_a_check_on_fewer_seeds_than_a_t_test_look_needs_is_not_run_at_this_size_saying_why():
    cfg = seeds(MIN_FIRST_ROUND - 1)
    for holds in (False, True):  # neither a failure nor a pass: 2 seeds decide nothing
        finding = xiong_init(cfg, depth_probe(cfg, holds))
        assert check_outcome(finding) == NOT_RUN
    [line] = [line for line in checks_lines([finding]) if line.startswith("- ")]
    assert line.startswith("- `NOT RUN AT THIS SIZE`")
    assert f"Not run at this size (2 seeds; its t-test needs {MIN_FIRST_ROUND} or more" in line


@pytest.mark.parametrize(("holds", "outcome"), [(False, FAILED), (True, PASSED)])
def test_a_check_on_enough_seeds_passes_or_fails_as_its_claims_say(holds, outcome):
    cfg = seeds(MIN_FIRST_ROUND)
    assert check_outcome(xiong_init(cfg, depth_probe(cfg, holds))) == outcome
