"""Portable numerics, measured: does pinning the arithmetic make an arm bitwise identical whatever
the CPU, and what does it cost in tokens/s? (issue 28, item 2)

Each variant trains the same arms (the default profile's first fp32 arm, and its first bf16 arm at
``emulate: auto``, pretrain's path; ``python -m tasks.ablate.arm``, one thread, ``--steps`` steps)
in a fresh process, since MKL, oneDNN and ATen read their settings when torch loads:

  native                      ``precision.numerics: native`` (MKL_CBWR=AUTO,STRICT,
                              ``precision.emulate: auto``: real bf16 autocast on AVX512-BF16)
  native, ATen avx2           one lever alone: ATen's vectorised kernels at AVX2 instead of AVX-512
  native, 2 threads           another lever: the intra-op thread count (pretrain picks 1 or 2 by load)
  native as an AVX2-only CPU  what a CPU without AVX-512 (an AMD EPYC before Zen 4) runs by
                              default: every library capped at AVX2, bf16 emulated (``auto`` there)
  portable                    ``precision.numerics: portable`` (model/numerics.py: MKL_CBWR=COMPATIBLE,
                              ONEDNN_MAX_CPU_ISA=AVX2, ATEN_CPU_CAPABILITY=avx2, bf16 emulated)
  portable as an AVX2-only CPU / with MKL strict AVX2 / on 2 threads
                              the pinned result again with this CPU's wider paths also switched
                              off, MKL's strict AVX2 branch (the mode's previous pin: bitwise on
                              one CPU, not across an AMD EPYC and an Intel Xeon), another thread count

On one machine, a pinned result that stays bitwise the same when this CPU is made to look like a
lesser one is evidence (not proof) of portability; one that changes is proof that the pin does
not hold. Across machines, ``--write-arms`` saves the arms' commands and ``--arms`` trains them
where the study's orchestration is not installed (only torch, numpy and pyyaml: a GPU box's host
CPU); ``--against`` compares the weights' digests, arm by arm and variant by variant, with
another machine's ``--out``. The torch build must be the same on both: it is part of the path. The cost is tokens per CPU-second of the arm (its command's
work after the imports; one thread, so contention from other jobs on shared cores barely moves
it, while the trainer's wall-time tokens/s, also shown, varied 2-4x between repeats); variants run
interleaved, repeat after repeat, and the ratio to native is of medians.

    python benchmarks/bench_numerics.py --steps 200 --repeats 3 --out benchmarks/out/numerics.json
    python benchmarks/bench_numerics.py --write-arms arms.json     # then, on each machine:
    python benchmarks/bench_numerics.py --arms arms.json --repeats 1 --only portable --out here.json
    python benchmarks/bench_numerics.py --arms arms.json --repeats 1 --only portable --against here.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from model.numerics import MODE_ENV, MODES  # noqa: E402
from model.private import run_private  # noqa: E402
from model.provenance import cpu_record  # noqa: E402
from tasks.config import load_config  # noqa: E402
from tasks.runtime.outputs import MANIFEST  # noqa: E402

NATIVE = {MODE_ENV: "native"}
PORTABLE = {MODE_ENV: "portable"}
AVX2_ONLY_CPU = {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
"""What a CPU without AVX-512 lets each library use."""
IN_NATIVE = {"precision.numerics": "native"}
IN_PORTABLE = {"precision.numerics": "portable"}
EMULATED = {**IN_NATIVE, "precision.emulate": "always"}


@dataclass(frozen=True)
class Variant:
    name: str
    env: dict[str, str] = field(default_factory=dict)
    sets: dict[str, str] = field(default_factory=dict)


VARIANTS = (
    Variant("native", NATIVE, IN_NATIVE),
    Variant("native, ATen avx2", {**NATIVE, "ATEN_CPU_CAPABILITY": "avx2"}, IN_NATIVE),
    Variant("native, 2 threads", NATIVE, {**IN_NATIVE, "train.cpu_threads": "2"}),
    Variant("native as an AVX2-only CPU", {**NATIVE, **AVX2_ONLY_CPU}, EMULATED),
    Variant("portable", PORTABLE, IN_PORTABLE),
    Variant("portable as an AVX2-only CPU", {**PORTABLE, **AVX2_ONLY_CPU}, IN_PORTABLE),
    Variant("portable, MKL strict AVX2", {**PORTABLE, "MKL_CBWR": "AVX2,STRICT"}, IN_PORTABLE),
    Variant("portable, 2 threads", PORTABLE, {**IN_PORTABLE, "train.cpu_threads": "2"}),
)


def study_arms(profile: str | None, steps: int) -> dict[str, list[str]]:
    """The profile's first fp32 arm as the study trains it, and its first bf16 arm at
    ``precision.emulate: auto`` (what pretrain, search and spike run: real autocast where the CPU
    has bf16), each cut to ``steps`` steps, as arm-command arguments."""
    from flows.ablate import plan  # here: prefect is not installed where --arms trains saved arms

    cfg = load_config(ROOT / "params.yaml", profile)
    first = {}
    for row in plan(cfg, ROOT, {}, 0):
        first.setdefault(row["config"].precision.mode, row)
    # on the CPU even where a GPU is (a GPU box's host CPU is another CPU to compare)
    shorter = [f"--set=train.steps={steps}", f"--set=train.eval_every={steps}", "--set=train.device=cpu"]
    return {
        f"{first['fp32']['name']} (fp32)": [*first["fp32"]["command"][1:], *shorter],
        f"{first['bf16']['name']} (bf16, emulate: auto)": [
            *first["bf16"]["command"][1:],
            *shorter,
            "--set=precision.emulate=auto",
        ],
    }


TIMED_ARM = """
import json, sys, time
from tasks.ablate.arm import run_command
start = time.process_time()
run_command(sys.argv[1:])
print(json.dumps({"cpu_s": time.process_time() - start}))
"""
"""The arm's command in this process, timed by CPU seconds from after the imports to its result."""


def train_once(arguments: list[str], variant: Variant, workdir: Path) -> dict[str, Any]:
    """One arm under ``variant`` in a fresh process and a fresh directory; its result."""
    out = Path(tempfile.mkdtemp(dir=workdir))
    command = [*_with_out(arguments, out), *(f"--set={k}={v}" for k, v in variant.sets.items())]
    settings = {MODE_ENV, *AVX2_ONLY_CPU, *(key for mode in MODES.values() for key in mode)}
    env = {k: v for k, v in os.environ.items() if k not in settings}
    done = subprocess.run(
        [sys.executable, "-c", TIMED_ARM, *command[2:]],
        cwd=ROOT,
        env={**env, **variant.env},
        check=True,
        capture_output=True,
        text=True,
    )
    result = json.loads((out / "result.json").read_text())
    summary = result["summary"]
    tokens = summary["tokens_per_s"] * (summary["wall_s"] - summary["eval_s"])
    return {
        "tokens_per_cpu_s": tokens / json.loads(done.stdout.splitlines()[-1])["cpu_s"],
        "tokens_per_s": summary["tokens_per_s"],
        "final_loss": summary["final_loss"],
        "val_loss": summary["val_loss"],
        "weights_sha256": result["weights_sha256"],
        "numeric_path": result["provenance"]["numeric_path"],
        "precision": summary["precision"],
    }


def _with_out(arguments: list[str], out: Path) -> list[str]:
    at = arguments.index("--out")
    return [*arguments[: at + 1], str(out), *arguments[at + 2 :]]


def measure(
    arms: dict[str, list[str]], variants: list[Variant], repeats: int, workdir: Path
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Every arm under every variant, ``repeats`` times, interleaved (the order rotates per repeat)."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {arm: {v.name: [] for v in variants} for arm in arms}
    for repeat in range(repeats):
        order = variants[repeat % len(variants) :] + variants[: repeat % len(variants)]
        for arm, arguments in arms.items():
            for variant in order:
                runs[arm][variant.name].append(train_once(arguments, variant, workdir))
                print(f"  repeat {repeat + 1}/{repeats} · {arm} · {variant.name}", file=sys.stderr)
    return runs


def summarise(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per variant: median tokens per CPU-second (the cost: on cores shared with other jobs, wall
    time varied 2-4x from run to run, CPU time little) and its ratio to native, median tokens/s of
    wall time, the loss and weights digest (the same on every repeat, else ``reproducible`` is
    false), and which variants are bitwise equal."""
    native = statistics.median(r["tokens_per_cpu_s"] for r in runs["native"])
    rows = []
    for name, repeats in runs.items():
        first = repeats[0]
        rows.append(
            {
                "variant": name,
                "tokens_per_cpu_s": statistics.median(r["tokens_per_cpu_s"] for r in repeats),
                "tokens_per_cpu_s_runs": [r["tokens_per_cpu_s"] for r in repeats],
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in repeats),
                "reproducible": len({r["weights_sha256"] for r in repeats}) == 1,
                **{k: first[k] for k in ("final_loss", "val_loss", "weights_sha256", "numeric_path", "precision")},
            }
        )
    for row in rows:
        row["ratio_to_native"] = row["tokens_per_cpu_s"] / native
        row["bitwise_equal_to"] = [
            other["variant"] for other in rows if other is not row and other["weights_sha256"] == row["weights_sha256"]
        ]
    return rows


def print_table(arm: str, rows: list[dict[str, Any]]) -> None:
    groups = {sha: chr(ord("A") + i) for i, sha in enumerate(dict.fromkeys(r["weights_sha256"] for r in rows))}
    print(f"\n{arm}")
    print(
        f"{'variant':<30} {'tok/CPU-s':>9} {'ratio':>6} {'tok/s':>7}  {'final loss':<19} {'val loss':<19} "
        "weights sha256  group path"
    )
    for r in rows:
        print(
            f"{r['variant']:<30} {r['tokens_per_cpu_s']:>9,.0f} {r['ratio_to_native']:>6.3f} {r['tokens_per_s']:>7,.0f}  "
            f"{r['final_loss']!r:<19} {r['val_loss']!r:<19} {r['weights_sha256'][:14]}  {groups[r['weights_sha256']]}"
            f"{'' if r['reproducible'] else '!'}    {r['numeric_path']}"
        )


def compare_machines(result: dict[str, Any], other: dict[str, Any]) -> bool:
    """Print, per arm and variant run on both machines, whether the final weights are bitwise
    equal; true when every shared pair is."""
    print(f"\nagainst {other['cpu']['name']!r} (here: {result['cpu']['name']!r})")
    equal = True
    for arm, rows in result["arms"].items():
        theirs = {row["variant"]: row for row in other["arms"].get(arm, [])}
        for row in rows:
            if row["variant"] in theirs:
                same = row["weights_sha256"] == theirs[row["variant"]]["weights_sha256"]
                equal &= same
                verdict = "bitwise equal" if same else f"differ (val loss {theirs[row['variant']]['val_loss']!r} there)"
                print(f"  {arm} · {row['variant']}: {verdict}")
    return equal


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default=None, help="the study profile whose arms are trained (default: params.yaml's)")
    p.add_argument("--steps", type=int, default=200, help="training steps per arm (default: %(default)s)")
    p.add_argument(
        "--repeats", type=int, default=3, help="runs per arm and variant, interleaved (default: %(default)s)"
    )
    p.add_argument(
        "--only", action="append", default=[], help="a variant to run beside native (repeatable; default: all)"
    )
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "numerics.json")
    p.add_argument("--write-arms", type=Path, help="write the profile's arm commands here and stop")
    p.add_argument("--arms", type=Path, help="train the arm commands saved by --write-arms (no orchestration needed)")
    p.add_argument("--against", type=Path, help="another machine's --out: compare the weights, exit 1 if any differ")
    args = p.parse_args(argv)
    variants = [v for v in VARIANTS if not args.only or v.name in ("native", *args.only)]
    if not (ROOT / MANIFEST).is_file():
        print(f"bench_numerics: {MANIFEST} is missing: run `dvc repro tokenize` first", file=sys.stderr)
        return 2
    if args.write_arms:
        args.write_arms.write_text(json.dumps(study_arms(args.profile, args.steps), indent=1) + "\n")
        return 0
    arms = json.loads(args.arms.read_text()) if args.arms else study_arms(args.profile, args.steps)
    with tempfile.TemporaryDirectory(prefix="bench_numerics-") as workdir:
        runs = measure(arms, variants, args.repeats, Path(workdir))
    result = {arm: summarise(by_variant) for arm, by_variant in runs.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "cpu": cpu_record(),
        "torch": torch.__version__,
        "variants": [v.__dict__ for v in variants],
        "arms": result,
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print("group: variants with the same letter have bitwise-equal final weights ('!': repeats differed)")
    for arm, rows in result.items():
        print_table(arm, rows)
    if args.against:
        return 0 if compare_machines(record, json.loads(args.against.read_text())) else 1
    return 0


if __name__ == "__main__":
    sys.exit(run_private(main))
