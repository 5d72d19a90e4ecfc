"""What an ablation arm costs, per core: the step's matmul-bound limit, the previous arm path and
the new one, measured in one run on this machine's cores, for every family of the study's grid (a
family's arms share a shape), and what the whole grid costs on the new path.

  limit     the step's matrix products alone (forward and backward, recorded from one training
            step with the profiler), each timed by itself at its shape and compute dtype; the
            step can run no faster than their sum. Attention's fused kernel is not a matrix
            product here, so the limit is optimistic and the fraction below conservative.
  previous  one process per arm (``python -m tasks.ablate.arm``, one thread), as the stage ran
            arms before: an interpreter start, torch and model/ imports per arm, glibc's default
            allocator settings, and the arm at the previous default precision (``--previous-precision``,
            bf16: emulated in fp32 on a CPU without AVX512-BF16).
  previous at the new precision   the same process per arm at the arm's configured precision:
            how much of the speedup is the worker and how much the numeric path.
  new       the stage's path: one long-lived Dask worker process (tasks/runtime/workers.py) that
            trains arm after arm with ``flows.ablate.train_arm``'s body; the cluster's start-up,
            data, telemetry, detector and result files all inside the time.

Every path trains the same ``--arms`` arms of each family (seed 0, spread over its variants,
its base arm first), one after another on one thread: tokens per core-second = an arm's tokens / the CPU seconds its process
spent (CPU time, not wall time: on cores shared with other jobs wall time varies by +-20 % from run
to run, CPU time by a few per cent). The
new path's worker start-up (cluster, imports) and first arm (kernel and allocator warm-up) are
charged as the stage pays them: once per worker, whose share of the grid is its arms over the
workers; the worker's later arms at their measured mean. Reports the
new path's speedup over the previous path and its fraction of the limit, and writes them to JSON
(``speedup_vs_previous``, ``fraction_of_matmul_limit``), with per family its CPU seconds per arm
and the grid's budget (``budget``: each family's runs at that rate, the wall time at the
stage's workers). ``--new-only`` skips the process-per-arm paths (a before/after comparison of
the arm code). Needs the project's token shards
(``dvc repro tokenize``) and only its own processes (no servers, no tracking):

    python benchmarks/bench_arms.py --out benchmarks/out/arms.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from flows.ablate import plan  # noqa: E402
from model.gpt import GPT  # noqa: E402
from model.optim import build_adamw  # noqa: E402
from model.precision import resolve_precision  # noqa: E402
from model.private import run_private  # noqa: E402
from tasks.config import Config, load_config  # noqa: E402
from tasks.runtime.outputs import MANIFEST  # noqa: E402
from tasks.runtime.workers import WORKER_ENVIRONMENT, cluster_kwargs, configured_cluster, worker_count  # noqa: E402

MATMULS = ("aten::mm", "aten::addmm", "aten::bmm")


@dataclass(frozen=True)
class Shape:
    """What sets an arm's cost: its model and batch (a family's arms differ in factors, not size)."""

    n_layer: int
    d_model: int
    n_head: int
    seq_len: int
    batch_size: int
    steps: int

    @property
    def tokens(self) -> int:
        return self.steps * self.batch_size * self.seq_len

    def label(self) -> str:
        return f"L{self.n_layer} d{self.d_model} T{self.seq_len} B{self.batch_size} x{self.steps} steps"


def shape_of(row: dict[str, Any]) -> Shape:
    sets = dict(a.removeprefix("--set=").split("=", 1) for a in row["command"] if a.startswith("--set="))
    return Shape(
        *(int(sets[k]) for k in ("model.n_layer", "model.d_model", "model.n_head", "model.seq_len")),
        int(sets["train.batch_size"]),
        int(sets["train.steps"]),
    )


def arms_by_family(cfg: Config, arms: int) -> tuple[dict[str, list[dict[str, Any]]], dict[str, int]]:
    """Up to ``arms`` arms of each family, spread over its variants (seed 0: the seeds cost the
    same), and the runs each family trains over the whole grid. A run two families share (the
    overflow family's clean twins are precision arms) counts for the family that comes first."""
    picked: dict[str, list[dict[str, Any]]] = {}
    runs: dict[str, int] = {}
    seen: set[str] = set()
    for row in plan(cfg, ROOT, {}, 0):  # the loss shift's probe is not run here: the fp16 arms at k = 0
        if row["key"] in seen:
            continue
        seen.add(row["key"])
        runs[row["family"]] = runs.get(row["family"], 0) + 1
        if row["seed"] == cfg.ablation.seeds[0]:
            picked.setdefault(row["family"], []).append(row)
    return {family: _spread(rows, arms) for family, rows in picked.items()}, runs


def _spread(rows: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """``n`` of ``rows`` at even spacing, the first (the family's base arm) included."""
    return [rows[i * len(rows) // n] for i in range(min(n, len(rows)))]


# --------------------------------------------------------------------------------------------
# (a) the matmul-bound limit
# --------------------------------------------------------------------------------------------


def step_matmuls(cfg: Config) -> tuple[list[tuple[str, list[list[int]]]], torch.dtype]:
    """The matrix products of one training step of ``cfg`` (name, input shapes), recorded by the
    profiler after two warm-up steps, and the dtype they compute in."""
    torch.manual_seed(0)
    model = GPT(cfg.model, cfg.mup, cfg.tokenizer.vocab_size)
    optimizer = build_adamw(model, cfg.optim)
    precision = resolve_precision(cfg.precision, "cpu")
    x = torch.randint(0, cfg.tokenizer.vocab_size, (cfg.train.batch_size, cfg.model.seq_len))

    def step() -> None:
        with precision.autocast():
            _, ce, z = model(x, x)
        (ce + z).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(), step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    calls = [(e.name, [list(s) for s in e.input_shapes if s]) for e in prof.events() if e.name in MATMULS]
    real_low = not precision.emulated and cfg.precision.mode != "fp32"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[cfg.precision.mode] if real_low else torch.float32
    return calls, dtype


def time_matmul(name: str, shapes: list[list[int]], dtype: torch.dtype, repeats: int) -> float:
    """Best-of-``repeats`` seconds of one product at its shapes (addmm: bias + a @ b)."""
    tensors = [torch.randn(*s, dtype=dtype) for s in shapes]
    op = {"aten::mm": torch.mm, "aten::addmm": torch.addmm, "aten::bmm": torch.bmm}[name]
    op(*tensors)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        op(*tensors)
        best = min(best, time.perf_counter() - start)
    return best


def matmul_limit(cfg: Config, repeats: int) -> dict[str, Any]:
    calls, dtype = step_matmuls(cfg)
    seconds = sum(time_matmul(name, shapes, dtype, repeats) for name, shapes in calls)
    tokens = cfg.train.batch_size * cfg.model.seq_len
    flops = sum(2 * _prod(shapes[-2][:-1]) * shapes[-2][-1] * shapes[-1][-1] for _, shapes in calls)
    return {
        "matmuls_per_step": len(calls),
        "dtype": str(dtype).removeprefix("torch."),
        "matmul_s_per_step": seconds,
        "matmul_gflop_per_step": flops / 1e9,
        "matmul_gflops": flops / seconds / 1e9,
        "tokens_per_core_s": tokens / seconds,
    }


def _prod(values: list[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


# --------------------------------------------------------------------------------------------
# (b) the previous path: a process per arm
# --------------------------------------------------------------------------------------------


def previous_path(rows: list[dict[str, Any]], workdir: Path, precision: str | None) -> list[float]:
    """CPU seconds of each of ``rows`` trained in its own process on one thread, one after another."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    for key in WORKER_ENVIRONMENT:
        if key.startswith("MALLOC_"):
            env.pop(key, None)
    seconds = []
    for i, row in enumerate(rows):
        command = with_out(row["command"], workdir / f"previous-{precision}-{i}")
        if precision is not None:
            command = [*command, f"--set=precision.mode={precision}"]
        before = _children_cpu()
        subprocess.run(command, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
        seconds.append(_children_cpu() - before)
    return seconds


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def with_out(command: list[str], out: Path) -> list[str]:
    command = list(command)
    command[command.index("--out") + 1] = str(out)
    return command


# --------------------------------------------------------------------------------------------
# (c) the new path: one long-lived worker
# --------------------------------------------------------------------------------------------


def new_path(rows: list[dict[str, Any]], workdir: Path) -> dict[str, Any]:
    """A one-worker cluster with the stage's settings training ``rows`` one after another with
    the stage's task body (its Prefect bookkeeping aside: no server here): the worker's CPU
    seconds to start and import the arm code (paid once per worker), and each arm's."""
    from distributed import Client, LocalCluster

    from flows.ablate import train_arm

    with configured_cluster(), LocalCluster(**cluster_kwargs(1)) as cluster, Client(cluster) as client:
        startup = client.submit(_cpu_after_imports, pure=False).result()
        arms = [
            client.submit(
                _cpu_of, train_arm.fn, r["name"], with_out(r["command"], workdir / f"new-{i}"), ROOT, pure=False
            ).result()
            for i, r in enumerate(rows)
        ]
    return {"startup_s": startup, "arm_s": arms}


def _cpu_after_imports() -> float:
    """The worker's CPU seconds since it spawned, once it has imported what its first arm does."""
    import flows.ablate  # noqa: F401

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _cpu_of(fn: Any, *args: Any) -> float:
    """CPU seconds of ``fn(*args)`` in this process."""
    start = time.process_time()
    fn(*args)
    return time.process_time() - start


# --------------------------------------------------------------------------------------------


def bench_family(
    family: str, rows: list[dict[str, Any]], arms_per_worker: float, cfg: Config, args: argparse.Namespace
) -> dict[str, Any]:
    """The three paths on ``rows``, arms of one family (one shape); the new path alone with
    ``--new-only``. The new path's rate charges each arm its share of the worker's start-up as
    the stage pays it (``arms_per_worker``: the grid's arms over the workers)."""
    shape = shape_of(rows[0])
    arm_cfg = load_config(ROOT / "params.yaml", cfg.profile, _sets(rows[0]["command"]))
    workdir = Path(tempfile.mkdtemp(prefix="bench-arms-"))
    try:
        limit = matmul_limit(arm_cfg, args.repeats)
        previous = {}
        if not args.new_only:
            previous = {
                "previous": previous_path(rows, workdir, args.previous_precision),
                "previous_at_new_precision": previous_path(rows, workdir, None),
            }
        new = new_path(rows, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    per_arm = {
        **{path: sum(seconds) / len(rows) for path, seconds in previous.items()},
        "new": stage_arm_seconds(new["startup_s"], new["arm_s"], arms_per_worker),
    }
    rates = {k: shape.tokens / s for k, s in per_arm.items()}
    return {
        "family": family,
        "shape": shape.label(),
        "arms": [r["name"] for r in rows],
        "precision": {"previous": args.previous_precision, "new": arm_cfg.precision.mode},
        "limit": limit,
        "cpu_s_per_arm": per_arm,
        "previous_path": {f"{path}_arm_s": seconds for path, seconds in previous.items()},
        "new_path": {**new, "arms_per_worker": arms_per_worker},
        "tokens_per_core_s": {"limit": limit["tokens_per_core_s"], **rates},
        **{f"speedup_vs_{path}": rates["new"] / rates[path] for path in previous},
        "fraction_of_matmul_limit": rates["new"] / limit["tokens_per_core_s"],
    }


def stage_arm_seconds(startup: float, arms: list[float], arms_per_worker: float) -> float:
    """Seconds per arm as a stage worker pays them: its start-up and its first arm (which also
    warms torch's kernels and the allocator) once, then ``arms_per_worker - 1`` arms at the
    measured later arms' mean (the first arm's time when only one was measured)."""
    steady = sum(arms[1:]) / len(arms[1:]) if len(arms) > 1 else arms[0]
    n = max(arms_per_worker, 1.0)
    return (startup + arms[0] + (n - 1) * steady) / n


def _sets(command: list[str]) -> list[str]:
    from model.typed_config import parse_sets

    return parse_sets([a.removeprefix("--set=") for a in command if a.startswith("--set=")])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default=None, help="the study profile whose grid is measured (default: params.yaml's)")
    p.add_argument("--arms", type=int, default=3, help="arms per family and path (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=20, help="timings per matmul, best kept (default: %(default)s)")
    p.add_argument("--previous-precision", default="bf16", help="the previous default arm precision")
    p.add_argument("--new-only", action="store_true", help="measure the new path alone (no process per arm)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "arms.json")
    args = p.parse_args(argv)
    if not (ROOT / MANIFEST).is_file():
        print(f"bench_arms: {MANIFEST} is missing: run `dvc repro tokenize` first", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    cfg = load_config(ROOT / "params.yaml", args.profile)
    grid, runs = arms_by_family(cfg, args.arms)
    workers = worker_count(cfg.ablation.workers, 10**6)
    arms_per_worker = sum(runs.values()) / workers
    families = [bench_family(f, rows, arms_per_worker, cfg, args) for f, rows in grid.items()]
    result = {
        "machine": {"cpu": _cpu_name(), "capability": torch.backends.cpu.get_cpu_capability(), "cores": os.cpu_count()},
        "profile": cfg.profile,
        "families": families,
        "budget": budget(families, runs, len(cfg.ablation.seeds), workers),
        "fraction_of_matmul_limit": families[0]["fraction_of_matmul_limit"],
        **({} if args.new_only else {"speedup_vs_previous": families[0]["speedup_vs_previous"]}),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print_table(result)
    return 0


def budget(families: list[dict[str, Any]], runs: dict[str, int], seeds: int, workers: int) -> dict[str, Any]:
    """The grid's CPU seconds on the new path: each family's runs at its measured seconds per arm
    (the measured arms' mean: arms that diverge stop early, so the grid's mean may differ), and
    the wall time of ``workers`` workers that share the arms evenly."""
    rows = {f["family"]: {"runs": runs[f["family"]], "cpu_s_per_arm": f["cpu_s_per_arm"]["new"]} for f in families}
    for row in rows.values():
        row["cpu_s"] = row["runs"] * row["cpu_s_per_arm"]
    total = sum(row["cpu_s"] for row in rows.values())
    return {"seeds": seeds, "workers": workers, "families": rows, "cpu_s": total, "wall_s": total / workers}


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def print_table(result: dict[str, Any]) -> None:
    print(f"{result['machine']['cpu']} ({result['machine']['capability']}), one core per path")
    for s in result["families"]:
        r = s["tokens_per_core_s"]
        print(f"\n{s['family']}, {s['shape']}: {len(s['arms'])} arms per path ({', '.join(s['arms'])})")
        print(
            f"  matmul-bound limit        {r['limit']:>9,.0f} tokens/core-s  ({s['limit']['matmuls_per_step']} matmuls, "
            f"{s['limit']['matmul_s_per_step'] * 1e3:.2f} ms/step in {s['limit']['dtype']})"
        )
        if "previous" in r:
            print(f"  previous ({s['precision']['previous']}, process/arm) {r['previous']:>9,.0f}")
            print(f"  previous ({s['precision']['new']}, process/arm) {r['previous_at_new_precision']:>9,.0f}")
        print(
            f"  new ({s['precision']['new']}, worker)          {r['new']:>9,.0f}  ({s['cpu_s_per_arm']['new']:.2f} CPU-s/arm)"
        )
        if "previous" in r:
            print(
                f"  speedup vs previous {s['speedup_vs_previous']:.2f}x "
                f"(vs previous at the new precision {s['speedup_vs_previous_at_new_precision']:.2f}x)"
            )
        print(f"  fraction of the matmul limit {s['fraction_of_matmul_limit']:.0%}")
    b = result["budget"]
    print(f"\nthe grid ({b['seeds']} seeds) on the new path, {b['workers']} workers:")
    for family, row in b["families"].items():
        print(f"  {family:<10} {row['runs']:>4} runs x {row['cpu_s_per_arm']:6.2f} CPU-s = {row['cpu_s']:7.0f} CPU-s")
    print(f"  total {b['cpu_s']:.0f} CPU-s, {b['wall_s'] / 60:.1f} min wall at {b['workers']} workers")


if __name__ == "__main__":
    sys.exit(run_private(main))
