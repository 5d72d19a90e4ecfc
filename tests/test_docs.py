"""The README and docs/ against the project: generated numbers in step with the committed outputs,
every relative link reaching a file git keeps, no image git ignores, and a README that stays short.

Fast (no servers, no torch): reads files and asks git.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "doc_numbers.py"
README_WORD_BUDGET = 1500  # issue 45: a README a newcomer reads in five minutes; the rest goes to docs/


def doc_numbers():
    spec = importlib.util.spec_from_file_location("doc_numbers", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)


@pytest.fixture(scope="module")
def kept() -> set[str]:
    """Every file git tracks or would track (untracked but not ignored), and every folder above one."""
    if shutil.which("git") is None or git("rev-parse", "--is-inside-work-tree").stdout.strip() != "true":
        pytest.skip("not a git checkout: nothing to say what git keeps")
    listed = git("ls-files", "--cached", "--others", "--exclude-standard", "-z").stdout.split("\0")
    files = {f for f in listed if f and (ROOT / f).exists()}
    folders = {str(Path(f).parent) for f in files}
    return files | {str(p) for f in folders for p in [Path(f), *Path(f).parents] if str(p) != "."}


def unfenced(text: str) -> str:
    """The text without its fenced code blocks (a `# comment` in a shell block is no heading)."""
    return re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.S | re.M)


def prose(text: str) -> str:
    """The text without code, fenced or inline: links inside code are examples."""
    return re.sub(r"`[^`\n]*`", "", unfenced(text))


def links(text: str) -> list[str]:
    body = prose(text)
    found = re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", body)
    found += re.findall(r"""\b(?:src|href)\s*=\s*["']([^"']+)["']""", body)
    return found


def images(text: str) -> list[str]:
    body = prose(text)
    return re.findall(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)", body) + re.findall(
        r"""<img\b[^>]*\bsrc\s*=\s*["']([^"']+)["']""", body
    )


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text, lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    kept_chars = [c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM"]
    return "".join(kept_chars).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = path.read_text(encoding="utf-8")
    found: set[str] = set(re.findall(r"""<a\s+(?:id|name)=["']([^"']+)["']""", text))
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", unfenced(text), flags=re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def external(target: str) -> bool:
    return bool(re.match(r"^[a-z][a-z0-9+.-]*:", target, flags=re.I)) or target.startswith("//")


def test_generated_numbers_match_the_committed_outputs(capsys: pytest.CaptureFixture[str]) -> None:
    """`python scripts/doc_numbers.py --check`: a block out of step names its file and shows the diff."""
    rc = doc_numbers().main(["--check", "--root", str(ROOT)])
    assert rc == 0, capsys.readouterr().out


def test_the_readme_shows_the_generated_findings() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "<!-- doc-numbers:findings -->" in text, "the README's verdict table must come from scripts/doc_numbers.py"


def test_the_check_fails_when_an_output_changes(tmp_path: Path) -> None:
    """The same check on a copy whose report says one verdict differently: it must see the change."""
    for rel in ("README.md", "docs", "metrics", "reports/REPORT.md"):
        src, dst = ROOT / rel, tmp_path / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.png", "screenshots"))
        else:
            shutil.copy2(src, dst)
    module = doc_numbers()
    assert module.main(["--check", "--root", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "metrics" / "report.json").read_text(encoding="utf-8"))
    name, finding = next(iter(report["findings"].items()))
    finding["verdict"] = "contradicted" if finding["verdict"] != "contradicted" else "reproduced"
    (tmp_path / "metrics" / "report.json").write_text(json.dumps(report), encoding="utf-8")
    assert module.main(["--check", "--root", str(tmp_path)]) == 1
    assert module.main(["--root", str(tmp_path)]) == 0  # rewrite the blocks
    assert module.main(["--check", "--root", str(tmp_path)]) == 0
    assert f"| `{name}` |" in (tmp_path / "README.md").read_text(encoding="utf-8")


def act_on(
    tmp_path: Path,
    verdicts: dict[str, str],
    checks: dict[str, str],
    claims: list[dict] | None = None,
    reanalysis: str | None = None,
) -> str:
    """The act-on block of a report whose findings have ``verdicts`` (``checks``: checks of the
    machinery), each with ``claims`` (one held claim by default) and the report's ``reanalysis``."""
    claims = claims or [{"what": "fp16 − fp32, final loss", "estimate": 0.4, "unit": "nats"}]
    findings = {k: {"verdict": v, "claim": f"{k} published claim", "claims": claims} for k, v in verdicts.items()}
    counts = {v: sum(x == v for k, x in verdicts.items() if k not in checks) for v in set(verdicts.values())}
    (tmp_path / "metrics").mkdir()
    (tmp_path / "reports").mkdir()
    report = {"findings": findings, "checks": checks, "counts": counts, "reanalysis": reanalysis}
    (tmp_path / "metrics" / "report.json").write_text(json.dumps(report), encoding="utf-8")
    (tmp_path / "reports" / "REPORT.md").write_text("## Findings\n", encoding="utf-8")
    module = doc_numbers()
    block: str = module.act_on_block(module.Outputs(tmp_path))
    return block


def test_the_readme_acts_only_on_decided_findings_each_as_its_verdict_words_it(tmp_path: Path) -> None:
    block = act_on(
        tmp_path,
        {"init": "reproduced", "a": "reproduced", "b": "negligible", "c": "contradicted", "d": "inconclusive"},
        {"init": "check passed"},
    )
    assert "- `REPRODUCED` `a`. Holds here: a published claim (fp16 − fp32, final loss +0.4 nats)." in block
    assert "- `NEGLIGIBLE` `b`. Absent or too small to act on here" in block
    assert "- `CONTRADICTED` `c`. Shown the other way here, 0 of its 1 claims:  (0 held, 1 open: the report)." in block
    assert "`d`" not in block and "`init`" not in block  # open, and a check of the machinery


def test_the_readme_marks_a_fragile_claim_and_an_untested_one_and_labels_a_reanalysis_exploratory(
    tmp_path: Path,
) -> None:
    claims = [
        {"what": "held", "estimate": 0.4, "unit": "nats", "fragile": "under the registered data perturbation: ..."},
        {"what": "gated", "estimate": 0.1, "unit": "nats", "not_tested": "its gate failed"},
    ]
    block = act_on(tmp_path, {"a": "reproduced"}, {}, claims, reanalysis="Read under rules written after results.")
    assert block.startswith("Nothing here to act on yet. Read under rules written after results.")
    assert "(held +0.4 nats (`FRAGILE`: not replicated under the data perturbation); 1 not tested (a gate" in block


def test_the_readme_names_a_claim_by_the_reports_words_where_it_has_them(tmp_path: Path) -> None:
    claims = [{"what": "capped_loss: a higher than b", "words": "final loss higher for a than b", "estimate": 0.4}]
    assert "(final loss higher for a than b +0.4)" in act_on(tmp_path, {"a": "reproduced"}, {}, claims)


def test_a_contradicted_finding_is_told_claim_by_claim_never_by_its_whole_sentence(tmp_path: Path) -> None:
    claims = [
        {"what": "against", "estimate": 0.3, "contradicted": True},
        {"what": "held", "estimate": -0.2, "holds": True},
        {"what": "fragile", "estimate": -0.1, "holds": True, "fragile": "under the data perturbation"},
        {"what": "open", "estimate": 0.01},
    ]
    block = act_on(tmp_path, {"s": "contradicted"}, {}, claims)
    assert block.endswith(
        "- `CONTRADICTED` `s`. Shown the other way here, 1 of its 4 claims: against +0.3 (2 held, 1 open: the report).\n"
    )
    assert "s published claim" not in block


def test_the_readme_says_plainly_when_no_finding_is_decided(tmp_path: Path) -> None:
    block = act_on(tmp_path, {"init": "reproduced", "a": "inconclusive", "b": "not tested"}, {"init": "check passed"})
    assert block == (
        "What this study lets you act on: no finding is decided yet (1 `INCONCLUSIVE`, 1 `NOT TESTED`); "
        "the claims that held are listed in the report as held, not as findings.\n"
    )


def test_an_unknown_block_is_refused(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("<!-- doc-numbers:no-such-block -->\n<!-- /doc-numbers -->\n")
    with pytest.raises(SystemExit, match="unknown block"):
        doc_numbers().main(["--check", "--root", str(tmp_path)])


def test_the_script_runs_on_the_standard_library_alone() -> None:
    """It runs before `make setup`: a bare interpreter, no site packages."""
    out = subprocess.run(
        [sys.executable, "-S", "-I", str(SCRIPT), "--check"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("doc", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_a_file_git_keeps(doc: Path, kept: set[str]) -> None:
    broken = []
    for target in links(doc.read_text(encoding="utf-8")):
        if external(target):
            continue
        path, _, fragment = target.partition("#")
        dest = doc if not path else (doc.parent / path).resolve()
        try:
            rel = str(dest.relative_to(ROOT))
        except ValueError:
            broken.append(f"{target}: outside the project")
            continue
        if path and rel not in kept:
            broken.append(f"{target}: {rel} is not a file git keeps")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no heading or anchor #{fragment} in {rel}")
    assert not broken, f"{doc.relative_to(ROOT)}:\n  " + "\n  ".join(broken)


def test_the_readme_shows_no_image_git_ignores(kept: set[str]) -> None:
    readme = ROOT / "README.md"
    bad = []
    for src in images(readme.read_text(encoding="utf-8")):
        if external(src):
            bad.append(f"{src}: served from elsewhere; commit the image")
            continue
        rel = str((ROOT / src.partition("#")[0]).resolve().relative_to(ROOT))
        if git("check-ignore", "-q", "--no-index", rel).returncode == 0:
            bad.append(f"{src}: git ignores it, so a clone shows a broken image")
        elif rel not in kept:
            bad.append(f"{src}: not in git")
    assert not bad, "\n".join(bad)


def test_the_readme_stays_short() -> None:
    words = len((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert words <= README_WORD_BUDGET, (
        f"README.md has {words} words, over its budget of {README_WORD_BUDGET}: "
        "move detail to docs/ and link it (issue 45)"
    )


TRACED = ROOT / "docs" / "traced-commands.txt"
COMMAND = re.compile(
    r"^(?:\w+=\S+ )*(python3? -m [\w.]+|python3? [\w/.-]+\.py|make \w+|spikelab \w+|dvc \w+|torchrun|"
    r"bash [\w/.-]+\.sh|scripts/[\w.-]+\.sh|\.ci/run|mlflow server|prefect server|optuna-dashboard)"
)
"""A command a user types, as the docs show it (in a code span or a shell block), to its kind: the
program and its subcommand or module (``python -m model.train``, ``dvc exp``, ``make demo``)."""


def documented_commands() -> dict[str, str]:
    """Each kind of command README.md and docs/*.md show, with one document that shows it."""
    found: dict[str, str] = {}
    for doc in documents():
        text = doc.read_text(encoding="utf-8")
        blocks = re.findall(r"^```(?:bash|sh|console)\n(.*?)^```", text, flags=re.S | re.M)
        for line in re.findall(r"`([^`\n]+)`", unfenced(text)) + [x for b in blocks for x in b.splitlines()]:
            if match := COMMAND.match(line.strip().removeprefix("$ ")):
                found.setdefault(match.group(1), doc.name)
    return found


def test_every_command_the_docs_show_is_traced_or_says_why_not() -> None:
    """docs/traced-commands.txt (scripts/trace_shared_paths.py --commands) names each kind of
    command a user is shown, either as a line it traces or under "Not traced" with the reason."""
    listed = TRACED.read_text(encoding="utf-8")
    missing = {kind: doc for kind, doc in documented_commands().items() if kind not in listed}
    assert not missing, f"shown in the docs but neither traced nor said why not in {TRACED.name}: {missing}"
    assert {"python -m model.train", "torchrun", "make setup", "dvc checkout"} <= documented_commands().keys()
