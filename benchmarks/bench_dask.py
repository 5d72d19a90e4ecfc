"""Throughput of the ablate stage's arms on a Dask cluster against the local runner, same cores:

  local   ``spikelab run ablate`` with ``ablation.workers=N``: the stage starts a LocalCluster of N
          single-threaded workers, trains the arms and stops it (the default executor);
  dask    the same command with ``SPIKELAB_SCHEDULER`` at a cluster of N workers that
          ``spikelab cluster up --workers N`` started beforehand (started once, outside the time).

Each path trains the same arms from scratch, in a scratch copy of the project (params.yaml,
profiles/, a link to data/tokens) so that no stored arm is reused. The time is the stage's own
``wall_s`` (metrics/ablate.json: planning, the arms, their tracking, the figures; the local path
includes starting and stopping its cluster, which is what a stage pays each time). The arms' metrics
of the two paths are compared too (identical but for each arm's own wall time). Prints both times and the ratio
Dask/local of arms per second (the target: >= 0.9).

``--baseline REF`` measures both paths again with the code at git ref REF (a temporary worktree
put first on ``PYTHONPATH``, the same environment and servers) before this code's runs, and prints this code's throughput over REF's for each path: the price of a change to the clusters
(e.g. mutual TLS against the plain-TCP clusters before it).

The arms: the project's grid under ``--profile`` (default: ``default``, the study's grid) with
``--set`` overrides on top, e.g. one seed of the default grid, a seed no study uses (the seed
registry refuses a used one; the fixed design, so one seed is a whole design). Needs the token shards
(``dvc repro tokenize``) and this checkout's servers (``spikelab services up``: a Dask cluster is
refused without a Prefect server). On a machine with other jobs, wall times vary by +-20 %:

    python benchmarks/bench_dask.py --workers 4 --out benchmarks/out/dask.json
    python benchmarks/bench_dask.py --workers 2 --profile smoke --set ablation.seeds=[0]   # a quick check
    python benchmarks/bench_dask.py --workers 2 --set 'ablation.seeds=[900]' --set 'ablation.confirm_seeds=[]' \
        --set 'ablation.rounds=[]' --set ablation.budget_seeds=0                              # one seed, default grid

``--baseline REF`` passes the same ``--set`` keys to REF's code, so REF must know them (the seed
registry and rounds came after the TLS measurement's baseline 2290824; its command as run is in
docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.chdir(ROOT)

from model.private import run_private  # noqa: E402
from tasks.runtime import credentials  # noqa: E402
from tasks.runtime.paths import state_dir  # noqa: E402
from tasks.runtime.services import STATE_ENV  # noqa: E402

BIN = Path(sys.executable).parent
STAGE_TIMEOUT_S = 6 * 3600


def scratch_project(root: Path) -> Path:
    """params.yaml, profiles/ and a link to the token shards: what the ablate stage reads."""
    root.mkdir()
    shutil.copy(ROOT / "params.yaml", root / "params.yaml")
    shutil.copytree(ROOT / "profiles", root / "profiles")
    (root / "data").mkdir()
    (root / "data" / "tokens").symlink_to((ROOT / "data" / "tokens").resolve())
    return root


def environment(code: Path) -> dict[str, str]:
    """This process's environment with ``code`` first on the path and the servers' login (the
    stages would read it from the credentials file; code older than the login reads only this)."""
    return {
        **os.environ,
        **credentials.client_env(),
        "PYTHONPATH": os.pathsep.join([str(code), os.environ.get("PYTHONPATH", "")]),
        STATE_ENV: str(state_dir()),
    }


def run_ablate(project: Path, code: Path, workers: int, profile: str, sets: list[str], scheduler: str | None) -> dict:
    """One stage run of the code in ``code``; its metrics/ablate.json."""
    env = environment(code)
    env.pop("SPIKELAB_SCHEDULER", None)
    if scheduler:
        env["SPIKELAB_SCHEDULER"] = scheduler
    args = ["--profile", profile, "--set", f"ablation.workers={workers}", *(f"--set={s}" for s in sets)]
    done = subprocess.run(
        [str(BIN / "spikelab"), "run", "ablate", *args], cwd=project, env=env, timeout=STAGE_TIMEOUT_S, text=True
    )
    if done.returncode:
        raise SystemExit(f"ablate stage failed ({'dask' if scheduler else 'local'}), exit {done.returncode}")
    return json.loads((project / "metrics" / "ablate.json").read_text())


def cluster(code: Path, *args: str) -> str:
    done = subprocess.run(
        [str(BIN / "spikelab"), "cluster", *args], env=environment(code), capture_output=True, text=True, timeout=600
    )
    if done.returncode:
        raise SystemExit(f"spikelab cluster {args[0]} failed: {done.stderr.strip()}")
    return done.stdout


def both_paths(code: Path, tmp: Path, args: argparse.Namespace) -> tuple[dict, dict]:
    """The stage on the local runner, then on a ``cluster up`` cluster, with the code in ``code``."""
    local = run_ablate(scratch_project(tmp / "local"), code, args.workers, args.profile, args.sets, None)
    said = cluster(code, "up", "--workers", str(args.workers), "--port", str(args.port))
    try:
        address = said.split("cluster: up at ", 1)[1].split(";", 1)[0]
        on_dask = run_ablate(scratch_project(tmp / "dask"), code, args.workers, args.profile, args.sets, address)
    finally:
        cluster(code, "down")
    return local, on_dask


@contextmanager
def worktree(ref: str):
    """The code at git ref ``ref``, checked out in a temporary worktree."""
    with tempfile.TemporaryDirectory(prefix="bench-baseline-") as tmp:
        path = Path(tmp) / "code"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(path), ref], cwd=ROOT, check=True)
        # git leaves .dvc/config.local behind: a dvc run there keeps its site cache private too
        site_cache = ["dvc", "config", "--local", "core.site_cache_dir", os.environ["DVC_SITE_CACHE_DIR"]]
        subprocess.run(site_cache, cwd=path, check=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, check=False)


def metrics_of(run: dict) -> dict:
    return {a["name"]: {k: v for k, v in a["metrics"].items() if k != "wall_s"} for a in run["arms"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)), help="N (default: the cores)")
    p.add_argument("--profile", default="default")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--port", type=int, default=8786, help="the benchmark cluster's scheduler port")
    p.add_argument("--baseline", metavar="REF", help="also measure the code at this git ref, and the ratio")
    p.add_argument("--out", type=Path, help="write the numbers as JSON here")
    args = p.parse_args()

    baseline = None
    with tempfile.TemporaryDirectory(prefix="bench-dask-") as tmp:
        if args.baseline:
            with worktree(args.baseline) as code:
                (Path(tmp) / "baseline").mkdir()
                baseline = both_paths(code, Path(tmp) / "baseline", args)
        (Path(tmp) / "this").mkdir()
        local, on_dask = both_paths(ROOT, Path(tmp) / "this", args)

    mine, theirs = metrics_of(on_dask), metrics_of(local)
    arms = len(local["arms"])
    ratio = local["wall_s"] / on_dask["wall_s"]  # arms per second, Dask over local
    result = {
        "workers": args.workers,
        "profile": args.profile,
        "sets": args.sets,
        "arms": arms,
        "local_wall_s": round(local["wall_s"], 2),
        "dask_wall_s": round(on_dask["wall_s"], 2),
        "throughput_ratio_dask_over_local": round(ratio, 3),
        "per_arm_metrics_identical": mine == theirs,
        "failed": {"local": local["counts"]["failed"], "dask": on_dask["counts"]["failed"]},
    }
    if baseline is not None:
        base_local, base_dask = baseline
        result["baseline"] = {
            "ref": args.baseline,
            "local_wall_s": round(base_local["wall_s"], 2),
            "dask_wall_s": round(base_dask["wall_s"], 2),
            "throughput_local_over_baseline": round(base_local["wall_s"] / local["wall_s"], 3),
            "throughput_dask_over_baseline": round(base_dask["wall_s"] / on_dask["wall_s"], 3),
            "per_arm_metrics_identical_to_baseline": mine == metrics_of(base_dask) == metrics_of(base_local),
        }
        print(
            f"against {args.baseline}: local {base_local['wall_s']:.1f} s, dask {base_dask['wall_s']:.1f} s; "
            f"throughput this/baseline: local {result['baseline']['throughput_local_over_baseline']:.3f}, "
            f"dask {result['baseline']['throughput_dask_over_baseline']:.3f}; per-arm metrics identical: "
            f"{result['baseline']['per_arm_metrics_identical_to_baseline']}"
        )
    print(
        f"{arms} arms on {args.workers} workers: local {local['wall_s']:.1f} s, "
        f"dask {on_dask['wall_s']:.1f} s; throughput dask/local = {ratio:.2f} (target >= 0.9); "
        f"per-arm metrics identical: {mine == theirs}"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(run_private(main))
