#!/usr/bin/env bash
# `make demo`: the five-minute path. Starts this checkout's servers once (every stage reports to
# them instead of starting a temporary Prefect server of its own), copies the checkout's code into
# .spikelab/demo/project with the smoke profile, runs `dvc repro` there (every stage end to end,
# tiny sizes), and says where the report is, what it found, and where to look. The checkout's own
# outputs (metrics/, reports/, search/lr.yaml, params/resolved.yaml, dvc.lock) are not touched.
# A second `make demo` keeps the copy's outputs and DVC cache: only what changed runs again.
set -euo pipefail
cd "$(dirname "$0")/.."
checkout=$PWD
# The copy shares the checkout's state (servers, MLflow store, Optuna journal, login): a stage
# uses a server only when it serves its state directory (tasks/runtime/services.py).
export SPIKELAB_STATE=${SPIKELAB_STATE:-$checkout/.spikelab}
source scripts/private-env.sh
export PATH="$checkout/.venv/bin:$PATH"
demo=$SPIKELAB_STATE/demo
project=$demo/project
started=$SECONDS
say() { echo "demo: $*"; }

say "1/4 this checkout's servers (Prefect, MLflow, optuna-dashboard), started once for every stage"
spikelab services up

say "2/4 a copy of the checkout's code in $project, profile smoke"
scripts/demo-copy.sh "$project"  # its .dvc/config.local keeps DVC's site cache private, as setup's does
cd "$project"
copied=$SECONDS

say "3/4 dvc repro: every stage at the smoke profile's sizes (a rerun: seconds)"
python -m flows.repro  # dvc repro as one Prefect flow run with the stages below it; deployments published
ran=$SECONDS

say "4/4 what it made"
python - "$project" <<'EOF'
"""The demo's results in a few lines, from the stages' DVC metrics."""

import json
import sys
from collections import Counter
from pathlib import Path

import yaml

from tasks.ablate.config import MIN_FIRST_ROUND
from tasks.report.sections.checks import NOT_RUN

project = Path(sys.argv[1])


def read(name):
    path = project / "metrics" / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else {}


report, search, pretrain, spike, ablate = (read(n) for n in ("report", "search", "pretrain", "spike", "ablate"))
findings = report.get("findings", {})
machinery = report.get("checks", {})  # checks of the machinery: not findings, and not counted among them
demo = yaml.safe_load((project / "studies.yaml").read_text()).get("families") or {}  # scripts/demo-studies.yaml
order = ("reproduced", "contradicted", "negligible", "inconclusive", "not tested")
counts = Counter(f["verdict"] for k, f in findings.items() if k not in machinery and k not in demo)
shown = sorted(counts, key=lambda k: order.index(k) if k in order else len(order))
print(f"  report   {project / 'reports/REPORT.md'} (report.html beside it opens offline)")
for key in demo:
    print(f"  decided  {key}: a demonstration run of the registered rule on demo-sized arms (exploratory;")
    print("           it does not count toward the study's verdicts; why this claim, size and seeds: scripts/demo-studies.yaml)")
    found = findings.get(key)
    if not found:
        print("           not judged: the report has no such finding")
        continue
    for c in found["claims"]:
        seeds = sum((h.get("n") or 0) for h in found["halves"].get(c["what"], {}).values())
        ci = "[{:+.3f}, {:+.3f}]".format(*c["ci95"]) if c.get("ci95") else "no interval"
        estimate = "no estimate" if c.get("estimate") is None else f"{c['estimate']:+.3f} {c.get('unit', '')}"
        p = "no p" if c.get("p") is None else f"p={c['p']:.2g}"
        if c.get("kind") == "divergence rate":  # a variant diverged in most seeds: read as a rate, no SESOI
            print(f"           {c['what']}, read as the share of seeds diverged: {estimate} (exact McNemar {p}), {seeds} seeds")
        else:
            print(f"           {c['what']}: {estimate} {ci}, {p}, {seeds} seeds, SESOI {c['sesoi']:g}")
    print(f"           verdict  {found['verdict'].upper()}" + (f": {found['precondition_failed']}" if found.get("precondition_failed") else ""))
    figure = project / "reports/ablate" / f"{key}.png"
    if figure.is_file():
        print(f"           figure   {figure}")
print(f"  verdicts {sum(counts.values())} findings: " + ", ".join(f"{counts[k]} {k.upper()}" for k in shown))
print("           (smoke's models are far too small for any claim; make repro judges)")
checks = []
if pretrain:
    checks.append((
        pretrain.get("status") == "completed",
        f"pretrain  {pretrain.get('status')} after {pretrain.get('steps')} steps, validation loss {pretrain.get('val_loss') or float('nan'):.3f}",
    ))
if search:
    lr, trials = search.get("transfer", {}).get("lr"), search.get("trials", {})
    checks.append((
        lr is not None and trials.get("completed") == trials.get("run"),
        f"search    {trials.get('completed', 0)} of {trials.get('run', 0)} trials completed; LR {lr or float('nan'):.3g} transferred to the target width",
    ))
if spike:
    matrix, policies = spike.get("matrix", {}), spike.get("policies", [])
    continues = [e[k]["continue"] for e in spike.get("seeds", {}).values() for k in spike.get("causes", []) if k in e]
    flagged = sum(c.get("detected_at") is not None for c in continues)
    checks.append((
        bool(matrix) and all(sorted(v) == sorted(policies) for v in matrix.values()),
        f"spike     {len(spike.get('seeds', {}))} seeds x {len(matrix)} causes x {len(policies)} recovery policies scored; "
        f"the detector flagged {flagged} of {len(continues)} injected spikes",
    ))
if ablate:
    c = ablate.get("counts", {})
    checks.append((
        bool(ablate.get("arms")) and not c.get("failed"),
        f"ablate    {c.get('completed', 0)} of {len(ablate.get('arms', []))} arms completed"
        + "".join(f", {v} {k}" for k, v in c.items() if v and k != "completed"),
    ))
judged_all = bool(findings) and all(f.get("verdict") for f in findings.values())
checks.append((judged_all, f"report    {len(findings) - len(machinery)} findings and {len(machinery)} checks judged by the pre-registered rule"))
print("  machinery checks:")
for ok, line in checks:
    print(f"    {'passed' if ok else 'FAILED'}  {line}")
probes = {"xiong_init": "init probe", "overflow": "fp16 overflow probe"}
judged = [f"{what} {machinery[key].upper()}" for key, what in probes.items() if key in machinery]
if judged:
    a = yaml.safe_load((project / "params/resolved.yaml").read_text())["ablation"]
    seeds = len(a["seeds"]) + len(a["confirm_seeds"])
    small = f" (a check's t-test needs {MIN_FIRST_ROUND} seeds or more; this profile has {seeds})" if NOT_RUN in machinery.values() else ""
    print(f"  checks of the machinery: {', '.join(judged)}{small}")
figure = project / "reports/report/forest.png"
if figure.is_file():
    print(f"  figure   {figure} (each claim's effect and its interval)")
EOF
cd "$checkout"
echo "  UIs (log in as the file below says; \`spikelab ui\` prints them again):"
spikelab ui | awk '{printf "    %-10s %s\n", $1, $2}'
spikelab services info | grep '^login:' | sed 's/^login: /  login    /'
say "done in $((SECONDS - started)) s (servers and copy $((copied - started)) s, dvc repro $((ran - copied)) s)"
say "next: make repro runs the default profile in this checkout (its own metrics/, reports/, dvc.lock):"
say "  every finding judged at small scale, seeds in rounds of 4 and 8, about 72 min on 2 cores; stop it any time, run it again to resume"
