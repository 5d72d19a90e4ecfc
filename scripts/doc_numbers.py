"""Write the study's numbers into README.md and docs/*.md from the committed outputs.

A block in a Markdown file looks like this:

    <!-- doc-numbers:findings -->
    (generated text)
    <!-- /doc-numbers -->

Everything between the two comments is generated from `metrics/*.json` and `reports/REPORT.md`;
nothing in it is typed by hand. Blocks:

- `findings`: the verdict count and one row per finding (README).
- `study`: what the committed study trained, in one sentence.
- `act-on`: what a reader can act on: only the findings decided (reproduced, negligible,
  contradicted), each as its verdict says it and never stronger; else that none is.
- `claims`: every pre-registered claim with its estimate, interval, SESOI, MDE and state.
- `stage-times`: the stages' own wall times, as the committed metrics recorded them.
- `repro-prints`: what `make repro` prints as it goes and at its end (flows/report.py's line).

    python scripts/doc_numbers.py            # rewrite the blocks
    python scripts/doc_numbers.py --check    # exit 1, with a diff, if a block is out of step

Standard library only, so it runs before `make setup`. tests/test_docs.py runs `--check`.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(
    r"(?P<open><!-- doc-numbers:(?P<name>[a-z0-9-]+) -->\n)(?P<body>.*?)(?P<close><!-- /doc-numbers -->)",
    re.S,
)
VERDICT_ORDER = ("reproduced", "negligible", "contradicted", "inconclusive", "not tested")


class Outputs:
    """The committed outputs a block reads, loaded once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._cache: dict[str, Any] = {}

    def metrics(self, name: str) -> Any:
        if name not in self._cache:
            path = self.root / "metrics" / f"{name}.json"
            self._cache[name] = json.loads(path.read_text(encoding="utf-8"))
        return self._cache[name]

    def report_md(self) -> str:
        return (self.root / "reports" / "REPORT.md").read_text(encoding="utf-8")

    def header(self) -> dict[str, str]:
        """Profile, code commit and build date from REPORT.md's first lines."""
        text = self.report_md()
        found = {
            "profile": re.search(r"Profile \*\*([^*]+)\*\*", text),
            "commit": re.search(r"code `([0-9a-f]{7,40})`", text),
            "built": re.search(r"built (\d{4}-\d{2}-\d{2})", text),
        }
        return {k: m.group(1) for k, m in found.items() if m}

    def finding_order(self) -> list[str]:
        """The findings in the order the report's table lists them; any others after."""
        findings = self.metrics("report")["findings"]
        table = self.report_md().split("## Findings", 1)[-1].split("\n<a id=", 1)[0]
        order = [f for f in re.findall(r"\]\(#([a-z0-9_]+)\)", table) if f in findings]
        return order + [f for f in findings if f not in order]


def num(x: float | None, sign: bool = True) -> str:
    """Three significant digits, as the report prints them."""
    if x is None:
        return "-"
    return f"{x:+.3g}" if sign else f"{x:.3g}"


def pvalue(p: float | None) -> str:
    return "-" if p is None else f"{p:.2g}"


def badge(verdict: str) -> str:
    return f"`{verdict.upper()}`"


def shown_verdict(out: Outputs, key: str) -> str:
    """A finding's verdict, or a check of the machinery's outcome (``check passed``)."""
    report = out.metrics("report")
    verdict: str = (report.get("checks") or {}).get(key, report["findings"][key]["verdict"])
    return verdict


def counts_line(out: Outputs) -> str:
    counts = out.metrics("report")["counts"]
    total = sum(counts.values())
    parts = ", ".join(f"{counts.get(v, 0)} {v}" for v in VERDICT_ORDER)
    checks = out.metrics("report").get("checks") or {}
    passed = sum(outcome == "check passed" for outcome in checks.values())
    beside = f" Beside them, {len(checks)} checks of the machinery ({passed} passed)." if checks else ""
    return f"**{total} findings: {parts}.**{beside}"


def provenance_line(out: Outputs) -> str:
    head = out.header()
    design = out.metrics("report")["design_hash"]
    bits = []
    if "profile" in head:
        bits.append(f"{head['profile']} profile")
    if "commit" in head:
        bits.append(f"code {head['commit'][:7]}")
    if "built" in head:
        bits.append(f"built {head['built']}")
    bits.append(f"design hash `{design}`")
    return "From `reports/REPORT.md` and `metrics/report.json` (" + ", ".join(bits) + ")."


def findings_block(out: Outputs) -> str:
    findings = out.metrics("report")["findings"]
    rows = [
        counts_line(out) + " " + provenance_line(out),
        "",
        "| finding | the published claim | verdict | claims that hold |",
        "|---|---|---|---|",
    ]
    for key in out.finding_order():
        f = findings[key]
        claims = f.get("claims") or []
        held = sum(1 for c in claims if c.get("holds"))
        rows.append(f"| `{key}` | {f['claim']} | {badge(shown_verdict(out, key))} | {held} of {len(claims)} |")
    return "\n".join(rows) + "\n"


DECIDED = {
    "reproduced": "Holds here",
    "negligible": "Absent or too small to act on here (every claim shown smaller than its SESOI)",
    "contradicted": "Shown the other way here",
}
"""The verdicts a reader can act on, each in the words that say no more than it found."""


def act_on_block(out: Outputs) -> str:
    """The findings decided, each as its verdict words it with its claims' estimates; when none is,
    the count of each open verdict, so no held claim reads as a finding."""
    report = out.metrics("report")
    checks = report.get("checks") or {}
    decided = [k for k in out.finding_order() if k not in checks and report["findings"][k]["verdict"] in DECIDED]
    if not decided:
        open_ = ", ".join(f"{n} {badge(v)}" for v in VERDICT_ORDER if (n := report["counts"].get(v)))
        return (
            f"What this study lets you act on: no finding is decided yet ({open_}); the claims that held "
            "are listed in the report as held, not as findings.\n"
        )
    rows = ["What this study lets you act on (the findings it decided; the others are open):"]
    if report.get("reanalysis"):  # rules written after the results were read: nothing here to act on
        rows[0] = (
            f"Nothing here to act on yet. {report['reanalysis']} What it decided, to be tested on fresh "
            "seeds under a registration made before the run:"
        )
    for key in decided:
        f = report["findings"][key]
        if f["verdict"] == "contradicted":
            rows.append(f"- {badge(f['verdict'])} `{key}`. {contradicted_words(f['claims'])}.")
            continue
        untested = sum(bool(c.get("not_tested")) for c in f["claims"])
        claims = "; ".join(
            [claim_words(c) for c in f["claims"] if not c.get("not_tested")]
            + ([f"{untested} not tested (a gate of its own failed)"] if untested else [])
        )
        rows.append(f"- {badge(f['verdict'])} `{key}`. {DECIDED[f['verdict']]}: {f['claim']} ({claims}).")
    return "\n".join(rows) + "\n"


def contradicted_words(claims: list[dict[str, Any]]) -> str:
    """A contradicted finding by the claims shown the other way: one such claim contradicts it, so
    the finding's whole sentence would say more than was shown, and a claim that held beside them
    may hold by how its cell is built (the report says which): counted here, read there."""
    against = [claim_words(c) for c in claims if c.get("contradicted")]
    held = sum(bool(c.get("holds")) for c in claims)
    said = f"{DECIDED['contradicted']}, {len(against)} of its {len(claims)} claims: " + "; ".join(against)
    return said + f" ({held} held, {len(claims) - len(against) - held} open: the report)"


def claim_words(c: dict[str, Any]) -> str:
    """A decided finding's tested claim in the act-on block: its estimate; one that held but not
    under the data perturbation says FRAGILE."""
    what = c.get("words") or c["what"]  # the report's words for a reader (metrics/report.json)
    said = f"{what} {num(c.get('estimate'))} {c.get('unit', '')}".rstrip()
    return said + (" (`FRAGILE`: not replicated under the data perturbation)" if c.get("fragile") else "")


def claim_power(out: Outputs) -> tuple[int, int]:
    """How many claims the findings make, and how many of them the design is powered for."""
    total = powered = 0
    for f in out.metrics("report")["findings"].values():
        for c in f.get("claims") or []:
            total += 1
            powered += bool((f.get("powered") or {}).get(c["what"]))
    return total, powered


def study_block(out: Outputs) -> str:
    ablate = out.metrics("ablate")
    counts = ablate["counts"]
    search = out.metrics("search")["trials"]
    spike = out.metrics("spike")
    seeds = len(spike["discovery_seeds"]) + len(spike["confirm_seeds"])
    kept = out.metrics("filter")["documents_kept"]
    pretrain = out.metrics("pretrain")
    others = ", ".join(f"{n} {k}" for k, n in counts.items() if k != "completed" and n)
    total, powered = claim_power(out)
    return (
        f"The committed study trained {len(ablate['arms']):,} ablation arms "
        f"({counts['completed']:,} completed{', ' + others if others else ''}) "
        f"and {search['run']:,} search trials. "
        f"Its spike study crossed {len(spike['causes'])} causes with {len(spike['policies'])} "
        f"recovery policies over {seeds} origin seeds. "
        f"The filter kept {kept:,} documents, and pretraining ended at a validation loss of "
        f"{pretrain['val_loss']:.2f} nats. "
        f"Of the {total} pre-registered claims, {powered} are powered.\n"
    )


def claims_block(out: Outputs) -> str:
    report = out.metrics("report")
    rows = [
        "| finding | claim | estimate [95 % interval] | p | SESOI | MDE (powered?) | state | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    total, powered = claim_power(out)
    for key in out.finding_order():
        f = report["findings"][key]
        for c in f.get("claims") or []:
            ok = bool((f.get("powered") or {}).get(c["what"]))
            lo, hi = c.get("ci95") or (None, None)
            state = "holds" if c.get("holds") else ("contradicted" if c.get("contradicted") else "does not hold")
            state = "negligible" if state == "does not hold" and c.get("negligible") else state
            state = "not tested" if c.get("not_tested") else "FRAGILE" if c.get("fragile") else state
            mde = f"{num(c.get('mde'), sign=False)} ({'yes' if ok else 'no'})"
            rows.append(
                f"| `{key}` | {c['what']} | {num(c.get('estimate'))} [{num(lo)}, {num(hi)}] "
                f"| {pvalue(c.get('p'))} | {num(c['sesoi'], sign=False)} {c.get('unit', '')} | {mde} | {state} "
                f"| {badge(shown_verdict(out, key))} |"
            )
    lead = (
        f"{counts_line(out)} {total} claims; {powered} of them are powered "
        f"(MDE ≤ SESOI / 2), {total - powered} are not. {provenance_line(out)}"
    )
    return lead + "\n\n" + "\n".join(rows) + "\n"


PIPELINE_ORDER = ("search", "pretrain", "spike", "ablate", "sensitivity")


def stage_times_block(out: Outputs) -> str:
    times = out.metrics("report")["stage_times"]  # the report's reading of each stage's metrics
    spike_cpu = out.metrics("spike")["cpu_seconds"]
    shown = [
        f"{stage} {seconds / 60:.1f} min"
        if seconds is not None
        else f"{stage} not recorded" + (f" ({spike_cpu / 60:.1f} CPU-minutes)" if stage == "spike" else "")
        for stage, seconds in sorted(times.items(), key=lambda item: PIPELINE_ORDER.index(item[0]))
    ]
    return (
        f"Wall time as the committed metrics record it (`stage_times` in `metrics/report.json`): {', '.join(shown)}.\n"
    )


def repro_prints_block(out: Outputs) -> str:
    counts = out.metrics("report")["counts"]
    tally = ", ".join(f"{n} {verdict}" for verdict, n in counts.items())
    return (
        "```\n"
        "arm <family>/<variant>/s<seed>: completed · ablate: <done>/<total> arms done "
        "(<n> completed, <n> diverged) · elapsed <m:ss> · ETA <m:ss>\n"
        f"[spikelab] report: <project>/reports/REPORT.md and <project>/reports/report.html ({tally})\n"
        "```\n"
    )


BLOCKS: dict[str, Callable[[Outputs], str]] = {
    "findings": findings_block,
    "study": study_block,
    "act-on": act_on_block,
    "claims": claims_block,
    "stage-times": stage_times_block,
    "repro-prints": repro_prints_block,
}


def documents(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def render(text: str, out: Outputs, where: str) -> str:
    def fill(m: re.Match[str]) -> str:
        name = m.group("name")
        if name not in BLOCKS:
            raise SystemExit(f"{where}: unknown block doc-numbers:{name} (known: {', '.join(BLOCKS)})")
        return m.group("open") + BLOCKS[name](out) + m.group("close")

    return BLOCK.sub(fill, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block is stale")
    parser.add_argument("--root", type=Path, default=ROOT, help="the project (default: this checkout)")
    args = parser.parse_args(argv)
    out = Outputs(args.root)
    stale = []
    for path in documents(args.root):
        if not path.exists():
            continue
        text = path.read_text(encoding="utf-8")
        rel = str(path.relative_to(args.root))
        new = render(text, out, rel)
        if new == text:
            continue
        stale.append(rel)
        if args.check:
            diff = difflib.unified_diff(text.splitlines(True), new.splitlines(True), rel, f"{rel} (from outputs)")
            sys.stdout.writelines(diff)
        else:
            path.write_text(new, encoding="utf-8")
    if args.check and stale:
        print(f"\nout of step with the committed outputs: {', '.join(stale)}; run: python scripts/doc_numbers.py")
        return 1
    for rel in stale:
        print(f"rewrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
