"""Per-stage cost of orchestration and tracking: Prefect flow + task + MLflow stage run.

Each measurement is a fresh process (as DVC runs a stage) executing an empty stage through the
real code path (configure_environment -> Prefect flow -> task -> tracking.stage_run with its
lineage -> the stage's Prefect artifact), compared with a bare process that only loads the config.
Also times ``spikelab --help``. Run twice: with `spikelab services up` (servers
answering) and without (Prefect starts a temporary server per process; MLflow writes SQLite).

    python benchmarks/bench_overhead.py --repeats 3 --out benchmarks/out/overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BARE = "from tasks.config import load_config; load_config('params.yaml')"
IMPORTS = (
    BARE
    + """
from tasks.runtime.startup import imports_without_gc
with imports_without_gc():
    import prefect, mlflow, tasks.runtime.tracking, tasks.runtime.artifacts, flows.forms
"""
)
STAGE = """
from tasks.config import project_config
from tasks.runtime.services import configure_environment
from tasks.runtime.startup import imports_without_gc
configure_environment()
with imports_without_gc():  # as spikelab run loads a stage's flow
    from prefect import flow, task
    from tasks.runtime.artifacts import publish_summary
    from flows.forms import Profile
    from tasks.runtime.tracking import stage_run

@task
def noop() -> dict:
    return {"documents": 1}

@flow(name="overhead-probe")
def probe(profile: Profile | None = None) -> None:
    cfg, _ = project_config(profile)
    with stage_run(cfg, "overhead-probe") as run:
        publish_summary("overhead-probe", run, noop())

probe()
"""
"""A data stage with no work, on the path ``spikelab run`` takes (flows/__main__.py: run_stage):
config, services check, imports without the cyclic GC, flow + task, the MLflow stage run with
its lineage, the Prefect artifact. No torch, like the data stages."""
HELP = "from flows.__main__ import main; main(['--help'])"


def time_process(code: str, env: dict[str, str]) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system, the process and what it waited for)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def median_times(code: str, env: dict[str, str], repeats: int) -> tuple[float, float]:
    """Median wall and median CPU seconds of ``repeats`` fresh processes (wall is noisy on a
    shared machine; CPU much less so)."""
    runs = [time_process(code, env) for _ in range(repeats)]
    return statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--without-services",
        action="store_true",
        help="measure the fallback path even if servers are up (points the stage at closed ports)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/out/overhead.json")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))

    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    if args.without_services:
        os.environ.update(SPIKELAB_PREFECT_PORT="9", SPIKELAB_MLFLOW_PORT="9")  # discard port: nothing answers
        env.update(SPIKELAB_PREFECT_PORT="9", SPIKELAB_MLFLOW_PORT="9")
    from tasks.runtime.services import serves_this_checkout

    servers_up = serves_this_checkout("prefect") and serves_this_checkout("mlflow")
    mode = "services up" if servers_up else "no services (temporary Prefect server, SQLite MLflow)"
    (bare, bare_cpu), (imports, imports_cpu), (stage, stage_cpu), (cli_help, help_cpu) = (
        median_times(code, env, args.repeats) for code in (BARE, IMPORTS, STAGE, HELP)
    )
    load = os.getloadavg()
    result = {
        "mode": mode,
        "bare_s": bare,
        "imports_s": imports,
        "stage_s": stage,
        "overhead_s": stage - bare,
        "orchestration_s": stage - imports,
        "help_s": cli_help,
        "cpu": {
            "bare_s": bare_cpu,
            "imports_s": imports_cpu,
            "stage_s": stage_cpu,
            "overhead_s": stage_cpu - bare_cpu,
            "orchestration_s": stage_cpu - imports_cpu,
            "help_s": help_cpu,
        },
        "load_average": [round(x, 2) for x in load],
        "repeats": args.repeats,
    }
    print(
        f"{mode}: bare process {bare:.2f} s, with prefect+mlflow imported {imports:.2f} s, empty stage "
        f"{stage:.2f} s: overhead {stage - bare:.2f} s per stage, of which {stage - imports:.2f} s "
        f"flow + run beyond the imports; spikelab --help {cli_help:.2f} s (median of {args.repeats})"
    )
    print(
        f"  CPU (user+sys): bare {bare_cpu:.2f} s, imports {imports_cpu:.2f} s, empty stage {stage_cpu:.2f} s: "
        f"overhead {stage_cpu - bare_cpu:.2f} s, of which {stage_cpu - imports_cpu:.2f} s beyond the imports; "
        f"--help {help_cpu:.2f} s; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    key = "up" if servers_up else "down"
    existing = json.loads(args.out.read_text()) if args.out.is_file() else {}
    args.out.write_text(json.dumps({**existing, key: result}, indent=2))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from model.private import run_private

    sys.exit(run_private(main))
