"""The study's verdicts under a second arithmetic: the verdict-deciding stages rerun on the other
numeric path (``precision.numerics``: portable <-> native, i.e. MKL, oneDNN and ATen at AVX2 or at
this CPU's own ISA), on the same data and design, and every finding's verdict compared with the
project's own (issue 28: the same decisions on any CPU).

    python checks/arithmetic.py                       # the default study, after make repro
    python checks/arithmetic.py --profile smoke --stages ablate --rerun-first
    python checks/arithmetic.py --arms-from arms.jsonl.gz   # the arms another machine trained
    python checks/arithmetic.py --stages ablate --seeds-from 28  # on seeds no step used (past version 3's 16-27)
    python checks/arithmetic.py --against ../clone-on-intel    # a whole study run elsewhere

The project's outputs are the first arithmetic (or, with ``--rerun-first``, a copy rerun on the
project's own numeric path). The second runs in a copy of the code and params under ``--work``
with the project's data (data/tokens, the poison pool) and params, each stage of ``--stages`` run by
``spikelab run <stage> --set precision.numerics=<other>``; a stage not rerun lends the copy the
project's own output, so its numbers are the same on both sides. The copy uses the project's
servers (its ``SPIKELAB_STATE``) when they are up, and logs to its own MLflow experiment
(``tracking.experiment`` + ``-check``), so the study's experiment holds only the study's runs.
With ``--arms-from``, the second arithmetic is another machine's CPU: the ablate stage runs in the
copy on the arm results that machine trained (checks/arms_elsewhere.py), every arm stored, so
its findings are decided on those numbers.
With ``--seeds-from N``, the second side is the same stages on seeds the study never saw (issue 28's
held-out check): each rerun stage's discovery and confirmation seeds renumbered from N, as many of
each, on the project's numeric path unless ``--numerics`` names the other.
With ``--against DIR``, nothing is rerun: the second side is another checkout's finished study
(``make repro`` on another machine, its ``metrics/`` are all it needs), each side's findings decided
under its own params, and the CPU that computed each side's arms is printed.
Writes ``--out`` (JSON) and prints one line per finding; exits 1 when a verdict differs, 2 on a bad
argument or a missing input.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from checks.arms_elsewhere import stored_results  # noqa: E402
from model.private import run_private  # noqa: E402
from model.typed_config import ConfigError, parse_sets  # noqa: E402
from tasks.ablate.grid import read_result  # noqa: E402
from tasks.config import Config, load_config  # noqa: E402
from tasks.report.robustness import STAGE_METRICS, compare, findings_of  # noqa: E402
from tasks.runtime.files import read_json  # noqa: E402
from tasks.runtime.outputs import ABLATE_ARMS, ABLATE_METRICS, MANIFEST  # noqa: E402

PARAMS = ["profiles", "params", "params.yaml", "studies.yaml"]
"""What a copy needs besides the data: the params and profiles (the code is this checkout's)."""
DATA = ["data/tokens", "data/poison", "search/lr.yaml"]
"""The inputs the verdict-deciding stages read (a missing optional one is skipped)."""
OTHER = {"portable": "native", "native": "portable"}
SEED_SECTIONS = {"ablate": "ablation", "spike": "spike", "search": "search"}
"""Each rerunnable stage's config section, whose ``seeds`` and ``confirm_seeds`` it trains."""


def unseen_seed_sets(cfg: Config, stages: list[str], start: int) -> list[str]:
    """``--set`` pairs that move each stage's discovery and confirmation seeds to ``start``,
    ``start + 1``, ... (as many of each as the study has). A renumbered seed that the study
    already uses is refused: the check would not be on unseen seeds."""
    sets = []
    for stage in stages:
        name = SEED_SECTIONS[stage]
        section = getattr(cfg, name)
        study = section.all_seeds
        unseen = list(range(start, start + len(study)))
        if shared := sorted(set(unseen) & set(study)):
            raise ConfigError(
                f"--seeds-from {start}: {shared} are {name}.seeds or {name}.confirm_seeds already; start past {max(study)}"
            )
        split = len(section.seeds)
        sets += [f"{name}.seeds={unseen[:split]}", f"{name}.confirm_seeds={unseen[split:]}"]
    return sets


def copy_project(project: Path, dest: Path, resume: bool = False) -> Path:
    """The project's params and data in ``dest`` (replaced if it exists). With ``resume``, the arms
    a cut-short check stored there are kept: an arm's key covers its config, code and data, so
    the ablate stage reuses only a result of the very run it would train."""
    kept = dest.parent / f".{dest.name}.arms"
    shutil.rmtree(kept, ignore_errors=True)
    if resume and (dest / ABLATE_ARMS).is_dir():
        (dest / ABLATE_ARMS).rename(kept)
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    if kept.is_dir():
        (dest / ABLATE_ARMS).parent.mkdir(parents=True)
        kept.rename(dest / ABLATE_ARMS)
    for name in PARAMS + DATA:
        src = project / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def first_side_missing(project: Path, stages: list[str]) -> tuple[str, Path] | None:
    """The first of ``stages`` whose output the project lacks, and its path: without
    ``--rerun-first`` the project's own outputs are the first side."""
    for stage in stages:
        if not (project / STAGE_METRICS[stage]).is_file():
            return stage, project / STAGE_METRICS[stage]
    return None


def lend_arms(results: Path, copy: Path, project: Path, rest_from_project: bool) -> dict[str, Any]:
    """Each result in ``results`` (checks/arms_elsewhere.py) as the copy's stored result of
    its arm (with ``rest_from_project``, the first side's own results for the arms it lacks: a run
    elsewhere cut short); how each compares with the first side's result of the same arm.
    ``project`` is the first side: the project, or with ``--rerun-first`` its rerun copy."""
    if rest_from_project:
        for path in (project / ABLATE_ARMS).glob("*/result.json"):
            (copy / path.parent.relative_to(project)).mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, copy / path.relative_to(project))
    lent = stored_results(results)
    deltas, equal, status_differs = [], 0, 0
    for result in lent:
        (copy / ABLATE_ARMS / result["key"]).mkdir(parents=True, exist_ok=True)
        (copy / ABLATE_ARMS / result["key"] / "result.json").write_text(json.dumps(result))
        own = read_result(project / ABLATE_ARMS / result["key"])
        if own is not None:
            equal += own["weights_sha256"] == result["weights_sha256"]
            status_differs += own["summary"]["status"] != result["summary"]["status"]
            if own["summary"]["val_loss"] is not None and result["summary"]["val_loss"] is not None:  # both finite
                deltas.append(abs(own["summary"]["val_loss"] - result["summary"]["val_loss"]))
    return {
        "lent": len(lent),
        "cpu": lent[0]["provenance"]["cpu"] if lent else None,
        "compared_with_the_projects": len(deltas),
        "bitwise_equal": equal,
        "status_differs": status_differs,
        "val_loss_abs_difference": {"median": statistics.median(deltas), "max": max(deltas)} if deltas else None,
    }


def check_experiment(cfg: Config) -> str:
    """The MLflow experiment a check's stages log to: the study's own lists only the study's runs."""
    return f"{cfg.tracking.experiment}-check"


def run_stages(copy: Path, project: Path, stages: list[str], profile: str, sets: list[str], experiment: str) -> None:
    """Each of ``stages`` in ``copy`` by the CLI, on the project's servers, logging to the MLflow
    ``experiment``; the other stages' outputs lent from ``project``."""
    for stage, path in STAGE_METRICS.items():
        if stage not in stages and (project / path).is_file():
            (copy / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(project / path, copy / path)
    env = {**os.environ, "SPIKELAB_STATE": os.environ.get("SPIKELAB_STATE") or str(project / ".spikelab")}
    for stage in stages:
        sets_here = [*sets, f"tracking.experiment={experiment}"]  # the last --set of a key wins
        command = ["spikelab", "run", stage, "--profile", profile, *(f"--set={s}" for s in sets_here)]
        print(f"[check_arithmetic] {copy.name}: {' '.join(command)}", flush=True)
        subprocess.run(command, cwd=copy, env=env, check=True)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spikelab check arithmetic",
        description="Rerun the verdict-deciding stages on a second arithmetic and compare every finding's\n"
        "verdict with the project's own: the other numeric path (precision.numerics: portable or\n"
        "native), seeds the study never saw (--seeds-from), another machine's arms (--arms-from), or\n"
        "another checkout's finished study (--against). The reruns happen in a copy under --work; the\n"
        "project's outputs are not touched. Writes --out (JSON), prints one line per finding; exits 1\n"
        "when a verdict differs, 2 on a bad argument or a missing input (run the data stages first).",
        epilog="examples:\n"
        "  spikelab check arithmetic                                 the default study, after make repro\n"
        "  spikelab check arithmetic --profile smoke --stages ablate --rerun-first\n"
        "  spikelab check arithmetic --stages ablate --seeds-from 28   on seeds no step used\n"
        "  spikelab check arithmetic --arms-from arms.jsonl.gz         the arms another machine trained\n"
        "  spikelab check arithmetic --against ../clone-on-intel       a whole study run elsewhere",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--project", type=Path, default=ROOT, help="the project whose outputs are checked")
    p.add_argument("--profile", default="default", help="the profile both sides run (default: %(default)s)")
    p.add_argument(
        "--stages",
        nargs="+",
        default=["ablate", "spike"],
        choices=list(STAGE_METRICS),
        help="the stages rerun on the second side (default: %(default)s)",
    )
    p.add_argument("--numerics", choices=list(OTHER), help="the second arithmetic (default: the other one)")
    p.add_argument("--set", dest="sets", action="append", default=[], help="KEY=VALUE for both sides")
    p.add_argument(
        "--arms-from",
        type=Path,
        help="another machine's arm results (checks/arms_elsewhere.py train): the ablate stage decides on them",
    )
    p.add_argument(
        "--rest-from-project",
        action="store_true",
        help="with --arms-from: the arms the file lacks are the project's own (not trained in the copy)",
    )
    p.add_argument(
        "--seeds-from",
        type=int,
        help="the second side on unseen seeds: each stage's seeds renumbered from this one (project's numerics)",
    )
    p.add_argument(
        "--against", type=Path, help="another checkout's finished study (its metrics/): compare, rerun nothing"
    )
    p.add_argument("--rerun-first", action="store_true", help="rerun the first side too, in a copy")
    p.add_argument(
        "--resume", action="store_true", help="keep the arms a cut-short check trained under --work (same keys only)"
    )
    p.add_argument("--work", type=Path, default=ROOT / "checks/out/arithmetic", help="the copy the second side runs in")
    p.add_argument("--out", type=Path, default=ROOT / "checks/out/arithmetic.json", help="the comparison, as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    project = args.project.resolve()
    if args.against is not None:
        return against(project, args.against.resolve(), args.profile, args.out)
    if not (project / MANIFEST).is_file():
        print(f"check_arithmetic: {project / MANIFEST}: missing; run the data stages first", file=sys.stderr)
        return 2
    try:
        cfg = load_config(project / "params.yaml", args.profile, parse_sets(args.sets))
        first_numerics = cfg.precision.numerics
        second_numerics = args.numerics or (first_numerics if args.seeds_from is not None else OTHER[first_numerics])
        second_sets = [*args.sets, f"precision.numerics={second_numerics}"]
        if args.seeds_from is not None:
            second_sets += unseen_seed_sets(cfg, args.stages, args.seeds_from)
        second_cfg = load_config(project / "params.yaml", args.profile, parse_sets(second_sets))
    except ConfigError as e:
        print(f"check_arithmetic: {e}", file=sys.stderr)
        return 2
    first_label, second_label = first_numerics, second_numerics
    if args.seeds_from is not None:
        first_label, second_label = "study seeds", f"seeds from {args.seeds_from} ({second_numerics})"
    experiment = check_experiment(cfg)
    first = project
    stages = ["ablate"] if args.arms_from else args.stages  # another machine's arms are the ablate stage's
    if not args.rerun_first and (missing := first_side_missing(project, stages)):
        stage, path = missing
        print(
            f"check_arithmetic: {path}: missing (the first side: the project's own {stage} stage); "
            f"run `spikelab run {stage}` in the project first, or pass --rerun-first",
            file=sys.stderr,
        )
        return 2
    if args.rerun_first:
        first = copy_project(project, args.work / first_numerics, args.resume)
        run_stages(first, project, stages, args.profile, args.sets, experiment)
    if args.arms_from:  # the second arithmetic is another machine's: its arms, this stage's code
        second_label = second_numerics = f"arms from {args.arms_from.name}"
        second = copy_project(project, args.work / "elsewhere", args.resume)
        lent = lend_arms(args.arms_from, second, first, args.rest_from_project)
        print(f"[check_arithmetic] {lent['lent']} arms' results lent from {args.arms_from}: {lent}", flush=True)
        run_stages(second, project, stages, args.profile, args.sets, experiment)
        second_cfg = cfg
    else:
        work = f"seeds-from-{args.seeds_from}" if args.seeds_from is not None else second_numerics
        second = copy_project(project, args.work / work, args.resume)
        run_stages(second, project, stages, args.profile, second_sets, experiment)
    result = compare(findings_of(cfg, first), findings_of(second_cfg, second))
    result |= {"numerics": [first_numerics, second_numerics], "stages": stages, "profile": args.profile}
    result["seeds"] = {
        side: {SEED_SECTIONS[s]: getattr(c, SEED_SECTIONS[s]).all_seeds for s in stages}
        for side, c in (("first", cfg), ("second", second_cfg))
    }
    if args.arms_from:
        result["lent_arms"] = lent
    return publish(result, args.out, first_label, second_label)


def against(project: Path, other: Path, profile: str, out: Path) -> int:
    """``--against``: the project's verdicts beside those of ``other``'s finished study, each
    decided under its own params; exit 2 naming the file one side lacks."""
    try:
        sides = [(load_config(p / "params.yaml", profile), p) for p in (project, other)]
        result = compare(*(findings_of(cfg, p) for cfg, p in sides))
        cpus = [arms_cpu(p) for _, p in sides]
    except (ConfigError, OSError) as e:
        print(f"check_arithmetic: {e}", file=sys.stderr)
        return 2
    result |= {"against": str(other), "profile": profile, "cpu": cpus}
    print(f"here: {project} (arms on {cpus[0]}); there: {other} (arms on {cpus[1]})")
    return publish(result, out, "here", "there")


def arms_cpu(project: Path) -> str:
    """The CPU that trained a study's ablation arms, as its ablate metrics record it."""
    cpu = read_json(project / ABLATE_METRICS).get("provenance", {}).get("cpu") or {}
    return f"{cpu.get('name', 'unrecorded CPU')} {cpu.get('family', '?')}/{cpu.get('model', '?')}"


def publish(result: dict[str, Any], out: Path, first_label: str, second_label: str) -> int:
    """Write ``result`` to ``out``, print one line per finding; 0 when every verdict agrees, else 1."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    for key, row in result["findings"].items():
        mark = "agree" if row["agree"] else "DIFFER"
        print(f"{key:12s} {first_label}: {row['first']:13s} {second_label}: {row['second']:13s} {mark}")
    print(f"verdicts {'all agree' if result['agree'] else 'DIFFER'} ({out})")
    return 0 if result["agree"] else 1


if __name__ == "__main__":
    sys.exit(run_private(main))
