"""How the report shows the study to a reader: it opens with what was learned (a line per finding,
with the number that decided it) before the method and the provenance; each claim is badged by its
own outcome, not its finding's verdict; a claim that falls short says which test of the rule it
failed; findings are named in words; the arms' 300-odd commands live on their own page; figures git
ignores are named, not embedded; MLflow runs are given by run ID and the machine that held them.
The findings themselves (numbers, verdicts) are tests/test_findings.py's."""

from __future__ import annotations

import html
import json
import re
import subprocess
from pathlib import Path

import pytest

from tasks.config import project_config
from tasks.design.families import DeclaredClaim, DeclaredFamily, default_statement
from tasks.design.studies import builtin_families
from tasks.report.arithmetic import committed_outputs
from tasks.report.figures import _layout
from tasks.report.findings import evaluate
from tasks.report.method import decide
from tasks.report.render import render_html, render_markdown, report_sections
from tasks.report.sections.checks import shown_verdict
from tasks.report.sections.findings import forest_rows
from tasks.report.sections.history import reanalysis
from tasks.report.sections.method import provenance_section, stage_times
from tasks.report.sections.runs import ARMS_PAGE, render_arms, runs_section
from tasks.report.sections.section import Figures, Section
from tasks.report.sections.summary import summary_section
from tasks.report.sections.words import (
    HOLDS,
    LABELS,
    NOT_SHOWN,
    claim_outcome,
    claim_words,
    in_words,
    what_was_found,
    why,
)
from tasks.report.verdict import (
    CONTRADICTED,
    EQUIVALENCE,
    INCONCLUSIVE,
    NEGLIGIBLE,
    NOT_TESTED,
    REPRODUCED,
    Claim,
)

REPO = Path(__file__).resolve().parents[1]
STUDY_RUN = "http://127.0.0.1:5320/#/experiments/1/runs/b1e9df4018ad4a2c8126527ab8b1387d?workflowType=machine_learning"


def claim(what: str, estimate: float, ci: tuple[float, float], p: float, halves=(1.0, 1.0), **kw) -> Claim:
    return Claim(
        what,
        estimate,
        p,
        kw.pop("expected", 1),
        sesoi=kw.pop("sesoi", 0.05),
        ci95=list(ci),
        halves=dict(zip(("discovery", "confirmation"), halves)),
        unit="nats",
        **kw,
    )


HOLDING = claim("unscaled − scaled fp16, final loss", 1.72, (1.68, 1.77), 6e-12, halves=(1.71, 1.73))
SHORT = claim(
    "scaled fp16 ≡ fp32", -0.017, (-0.064, 0.030), 0.44, (-0.008, -0.026), expected=0, kind=EQUIVALENCE, sesoi=0.02
)


@pytest.fixture(scope="module")
def committed() -> dict:
    """The committed study's findings and the report rendered from them (metrics/*.json)."""
    cfg, project = project_config()
    read = lambda name: json.loads((REPO / "metrics" / f"{name}.json").read_text())  # noqa: E731
    ablate, search, spike, pretrain = read("ablate"), read("search"), read("spike"), read("pretrain")
    findings = evaluate(cfg, ablate, search, spike, ablate.get("unigram_val_loss"))
    arithmetic = read("report")["provenance"]
    origin = {"commit": "0" * 40, "config_hash": "c" * 16, "built": "today", "trained": {}}
    origin["reanalysis"] = reanalysis({"search": search, "spike": spike, "ablate": ablate})  # None: registered results
    sections = report_sections(cfg, project, findings, ablate, search, spike, pretrain, origin, {}, arithmetic)
    text = render_markdown(sections, project)
    return {"findings": findings, "sections": sections, "text": text, "ablate": ablate, "project": project}


def test_a_claim_that_holds_is_badged_holds_inside_an_inconclusive_finding():
    finding = decide("fp16", [HOLDING, SHORT], "numbers", [])
    assert finding.verdict == INCONCLUSIVE
    rows = forest_rows([finding])
    assert [r["outcome"] for r in rows] == [HOLDS, NOT_SHOWN]  # each row's badge: its own claim's
    assert {r["verdict"] for r in rows} == {INCONCLUSIVE}  # the finding's, on its header
    header = _layout(rows)[0]
    assert header == f"{LABELS['fp16']} — finding INCONCLUSIVE"


def test_the_opening_line_names_the_claims_that_did_not_hold_apart_from_those_that_held_at_most_most_of_each():
    other = claim("bf16 − fp32, final loss", 0.9, (0.8, 1.0), 1e-9, halves=(0.9, 0.9))
    finding = decide("fp16", [HOLDING, SHORT, other], "numbers", [])
    said = what_was_found(finding, most=1)
    assert said.startswith("Of 3 claims, 1 not shown, 2 held. Not shown: scaled fp16 ≡ fp32: ")
    assert ". Held: unscaled − scaled fp16, final loss: +1.72 nats" in said
    assert said.endswith("; and 1 more (below)") and "bf16" not in said
    unlimited = what_was_found(finding)
    assert "more (below)" not in unlimited and all(c.what in unlimited for c in (HOLDING, SHORT, other))


TINY = claim("bf16 − fp32, final loss", 0.001, (-0.01, 0.012), 0.8, halves=(0.002, -0.001), tost_p=1e-4)
REVERSED = claim("warmup − none, final loss", -0.3, (-0.4, -0.2), 1e-4, halves=(-0.3, -0.3))


@pytest.mark.parametrize(
    "claims, precondition, verdict, opens",
    [
        ([HOLDING], None, REPRODUCED, "Every claim held: unscaled − scaled fp16, final loss: +1.72 nats"),
        (
            [TINY],
            None,
            NEGLIGIBLE,
            "Every claim shown smaller than its smallest effect of interest (SESOI): bf16 − fp32, final loss: "
            "+0.001 nats (95 % CI -0.01 to +0.012, p = 0.8), TOST p = 1e-04 against ±0.05",
        ),
        (
            [HOLDING, REVERSED],
            None,
            CONTRADICTED,
            "Of 2 claims, 1 shown the other way, 1 held. Shown the other way: warmup − none, final loss: -0.3 nats",
        ),
        ([HOLDING, TINY], None, INCONCLUSIVE, "Of 2 claims, 1 shown smaller than its sesoi, 1 held."),
        ([HOLDING], "no gradient underflows", NOT_TESTED, "not tested: no gradient underflows"),
    ],
)
def test_the_opening_line_is_worded_by_what_the_verdict_found(claims, precondition, verdict, opens):
    finding = decide("fp16", claims, "numbers", [], precondition_failed=precondition)
    assert finding.verdict == verdict
    said = what_was_found(finding)
    assert said.startswith(opens)
    if verdict != REPRODUCED:
        assert "Every claim held" not in said and "claims held" not in said and "Did not hold" not in said


def declared(kind: str, a: dict, b: dict, expected: int = 1, across=None, over=None, statement=None) -> DeclaredClaim:
    across = across or {}
    return DeclaredClaim(
        "c",
        kind,
        "capped_loss",
        a,
        b,
        over,
        across,
        False,
        expected,
        0.1,
        "why",
        [],
        None,
        statement or default_statement(kind, "capped_loss", a, b, over, across, expected),
    )


@pytest.mark.parametrize(
    "c, words",
    [
        (
            declared(
                "contrast",
                {"block": "post_ln", "warmup": 0.0, "lr": 0.001},
                {"block": "post_ln", "warmup": 0.1, "lr": 0.001},
            ),
            "final loss higher for Post-LN without warmup at LR 1e-3 than with 10 % warmup",
        ),
        (
            declared("interaction", {"warmup": 0.0}, {"warmup": 0.1}, across={"block": ["post_ln", "pre_ln"]}),
            "final loss without warmup − with 10 % warmup higher for Post-LN than for Pre-LN",
        ),
        (
            declared("equivalence", {"precision": "fp16"}, {"precision": "fp32"}, expected=0),
            "final loss the same for fp16 with loss scaling as fp32",
        ),
        (
            declared("sensitivity", {"stabilizer": "qk_norm"}, {"stabilizer": "none"}, expected=-1, over="lr"),
            "final loss's sensitivity to the LR lower with qk-layernorm than with no stabiliser",
        ),
        (
            declared(
                "contrast",
                {"model.n_layer": 4, "precision": "fp16_unscaled"},
                {"model.n_layer": 4, "precision": "bf16"},
            ),
            "final loss higher for model.n_layer=4 unscaled fp16 than bf16",
        ),
    ],
)
def test_a_claim_with_no_statement_is_named_from_its_factor_values_an_unknown_factor_as_key_value(c, words):
    assert claim_words(c) == words


def test_a_declared_statement_is_kept_and_metrics_keep_every_claims_declared_name(committed):
    own = declared("contrast", {"precision": "fp16"}, {"precision": "fp32"}, statement="scaled beats fp32")
    family = DeclaredFamily("fam", "q", {"precision": ["fp16", "fp32"]}, {}, 10, [0], [1], 0.0, [own])
    finding = decide("fam", [claim("scaled beats fp32", 0.2, (0.1, 0.3), 1e-3)], "numbers", [])
    assert in_words([finding], [family])[0].claims[0].what == "scaled beats fp32"
    xiong = next(f for f in committed["findings"] if f.key == "xiong")
    worded = next(f for f in in_words(committed["findings"], builtin_families(project_config()[0])) if f.key == "xiong")
    # the findings as tested keep the declared names: metrics/report.json's keys
    assert all(c.what.startswith("capped_loss: ") for c in xiong.claims)
    assert [c.estimate for c in worded.claims] == [c.estimate for c in xiong.claims]
    assert set(worded.halves) == {c.what for c in worded.claims} and "capped_loss" not in " ".join(worded.halves)


def test_stage_times_read_each_stages_wall_seconds_and_none_where_a_stage_recorded_none():
    times = stage_times(
        {
            "search": {"time": {"wall_s": 120.0}},
            "pretrain": {"wall_s": 60},
            "spike": {"cpu_seconds": 5.0},
            "ablate": None,
        }
    )
    assert times == {"search": 120.0, "pretrain": 60.0, "spike": None, "ablate": None}
    lines = provenance_section(
        project_config()[0], {"commit": "c", "config_hash": "h", "built": "b", "trained": {}}, {"inputs": {}}, times
    ).lines
    assert (
        "- wall time per stage, as each stage's metrics record it: search 2.0 min, pretrain 1.0 min, spike not recorded, ablate not recorded"
        in lines
    )


def test_every_claim_of_a_finding_whose_precondition_failed_is_badged_not_tested():
    finding = decide("fp16", [HOLDING], "numbers", [], precondition_failed="no gradient underflows")
    assert claim_outcome(finding, HOLDING) == NOT_TESTED


@pytest.mark.parametrize(
    "c, says",
    [
        (
            claim("small", 0.064, (0.049, 0.079), 2e-5, sesoi=0.1),
            "maybe too small to matter: the 95 % interval reaches +0.049",
        ),
        (claim("noisy", -0.0002, (-0.024, 0.024), 0.98, (0.009, -0.009), expected=-1), "not significant (p = 0.98"),
        (claim("reversed", 0.008, (0.004, 0.013), 0.003, expected=-1), "went the other way, significantly"),
        (
            claim("split", 0.3, (0.2, 0.4), 1e-4, halves=(0.5, -0.1)),
            "a half of the seeds points the other way (confirmation -0.1)",
        ),
        (SHORT, "equivalence not shown (TOST p = 0.44"),
        (HOLDING, "holds: p = 6e-12 < 0.05, the 95 % interval clears +0.05"),
    ],
)
def test_a_claim_says_which_test_of_the_rule_it_passed_or_failed(c, says):
    assert says in why(c)
    assert "does not hold" not in why(c)


WARNING = "> **Arithmetic warning:** "


def test_the_committed_report_opens_with_a_line_per_finding_saying_what_was_tested_and_found(committed):
    lines = committed["text"].splitlines()
    method = lines.index("## How a verdict is reached")
    opening = lines[:method]
    for f in committed["findings"]:
        (line,) = [x for x in opening if f"(#{f.key})" in x]
        assert line.startswith(f"- `{shown_verdict(f).upper()}` **[{LABELS[f.key]}]")
        assert ("*Why a check:*" if f.check else "*Tested:*") in line
        assert "*Found:*" in line or f.check
        if f.precondition_failed:  # the number that decided it: the gate's measured value, or the plateau's
            assert f.precondition_failed in line
        else:
            assert any(f"{c.estimate:+.3g}" in line for c in f.claims)
    # provenance comes after the method; an arithmetic warning (the numeric path against git HEAD's) is for the top
    assert not any(("hash" in x or "numeric path" in x) and not x.startswith(WARNING) for x in opening)
    assert lines.index("## Where the numbers come from") > method


def test_the_arms_commands_are_on_their_own_page_and_the_report_stays_readable(committed):
    text, ablate = committed["text"], committed["ablate"]
    assert "python -m tasks.ablate.arm" not in text
    assert f"]({ARMS_PAGE.as_posix()})" in text
    page = render_arms(ablate)
    assert all(f"`{a['command']}`" in page for a in ablate["arms"])
    assert len(text.encode()) < 100_000 < len(page.encode())


def test_no_mlflow_link_points_at_another_machines_server(committed):
    assert "](http://127.0.0.1" not in committed["text"]
    assert "](http://127.0.0.1" not in render_arms(committed["ablate"])
    lines = runs_section({"search": STUDY_RUN}).lines
    assert "- search: run `b1e9df4018ad4a2c8126527ab8b1387d`" in lines
    assert any("the machine that ran it" in x and "/#/experiments/1/runs/<run ID>" in x for x in lines)
    assert not any("](http" in x for x in lines)


def test_figures_git_ignores_are_named_not_embedded(tmp_path):
    reports = tmp_path / "reports"
    for figure in ("search/mu_transfer.png", "ablate/xiong.png"):
        (reports / figure).parent.mkdir(parents=True, exist_ok=True)
        (reports / figure).write_bytes(b"\x89PNG\r\n\x1a\n")
    (reports / ".gitignore").write_text("/search\n")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    lines = figures_markdown(tmp_path, "ablate/*.png", "search/*.png")
    assert "![xiong](ablate/xiong.png)" in lines
    assert not any("](search/" in x for x in lines)
    assert any("not in git" in x and "`reports/search/mu_transfer.png`" in x for x in lines)
    (reports / "search/mu_transfer.png").unlink()  # a checkout without the DVC outputs still says where they go
    assert any("not in git" in x and "`reports/search/*.png`" in x for x in figures_markdown(tmp_path, "search/*.png"))
    assert "data:image/png;base64," in render_html([Section("Figures", [Figures(("ablate/*.png",))])], tmp_path)


def demo_copy(tmp_path: Path) -> Path:
    """A git checkout that ignores .spikelab/, with make demo's copy inside it (no git repository of
    its own), a figure in the copy's reports/ and metrics/ablate.json committed in the checkout."""
    checkout = tmp_path / "checkout"
    project = checkout / ".spikelab/demo/project"
    (project / "reports/ablate").mkdir(parents=True)
    (project / "reports/ablate/xiong.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (project / "params.yaml").write_text("profile: smoke\n")
    (checkout / "metrics").mkdir()
    (checkout / "metrics/ablate.json").write_text('{"arms": []}')
    (checkout / "params.yaml").write_text("profile: default\n")
    (checkout / ".gitignore").write_text("/.spikelab/\n")
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(checkout)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "outputs"], check=True)
    return project


def test_a_copy_inside_a_checkouts_ignored_folder_embeds_its_figures_and_reads_no_committed_outputs(
    tmp_path, monkeypatch
):
    project = demo_copy(tmp_path)
    lines = figures_markdown(project, "ablate/*.png")
    assert "![xiong](ablate/xiong.png)" in lines and not any("not in git" in x for x in lines)
    assert "data:image/png;base64," in render_html([Section("Figures", [Figures(("ablate/*.png",))])], project)
    monkeypatch.chdir(project)
    assert committed_outputs()["ablate"] is None  # the checkout's HEAD is not the copy's: no warning from it
    monkeypatch.chdir(project.parents[2])  # control: the checkout itself reads its HEAD
    assert committed_outputs()["ablate"] == {"arms": []}


def figures_markdown(project: Path, *patterns: str) -> list[str]:
    """The Markdown lines of a section that shows the figures matching ``patterns``."""
    return render_markdown([Section("Figures", [Figures(patterns)])], project).splitlines()


def test_the_markdown_and_the_html_are_rendered_from_the_same_sections_in_the_same_order(committed):
    sections, project = committed["sections"], committed["project"]
    markdown = [line for line in render_markdown(sections, project).splitlines() if line.startswith("#")]
    page = render_html(sections, project)
    html_headings = [re.sub(r"<[^>]+>", "", h) for h in re.findall(r"<h[12]>(.*?)</h[12]>", page)]
    assert len(sections) > 10 and len(markdown) == len(html_headings) == len(sections)
    for section, md, h in zip(sections, markdown, html_headings):
        assert md.startswith(f"{'#' * section.level} {section.title}")
        assert html.unescape(h).startswith(section.title)
    assert [s.anchor for s in sections if s.anchor] == [f.key for f in committed["findings"]]
    assert all(f'<a id="{f.key}"></a>' in page for f in committed["findings"])


def test_a_report_read_under_rules_written_after_its_results_says_so_first():
    """The design's ``reanalysis`` (results made before registrations, read under later rules) heads
    the first screen; results a registration labels have none."""
    from tasks.design.preregistration import design

    cfg, note = project_config()[0], design()["reanalysis"]
    origin = {"commit": "0" * 40, "trained": {}, "reanalysis": note}
    first = summary_section(cfg, [], {"warnings": []}, origin).lines
    assert first[2] == f"> **Exploratory: a re-analysis after results.** {note}"
    assert not any(
        "re-analysis" in str(x) for x in summary_section(cfg, [], {"warnings": []}, origin | {"reanalysis": None}).lines
    )


def test_a_reanalysis_note_reads_only_on_results_made_before_registrations():
    from tasks.design.preregistration import design

    note = design()["reanalysis"]
    assert reanalysis({"ablate": {"arms": []}, "spike": None}) == note  # no label: made before registrations
    for state in ("exploratory", "confirmatory"):
        assert reanalysis({"ablate": {"registration": {"state": state}}, "spike": None}) is None


def test_the_history_lists_every_change_by_its_opening_cut_at_a_word_past_the_brief():
    from tasks.design.preregistration import design
    from tasks.report.sections.history import BRIEF, brief, changes_section

    kept = "word " * (BRIEF // 5)  # exactly BRIEF characters: shown whole
    assert len(kept) == BRIEF and brief(kept) == kept
    longer = kept + "x"
    assert brief(longer) == kept.rstrip() + " …"
    numbered = [line for line in changes_section().lines if line[:1].isdigit()]
    assert len(numbered) == len(design()["changes_after_results"])
