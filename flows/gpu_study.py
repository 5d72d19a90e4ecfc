"""The gpu study's commands (docs/gpu-study.md): ``plan`` every arm of the gpu profile's ablation
(the ablate stage's own plan, flows/ablate.py), ``slice`` the next arms that fit a GPU window,
``accept`` a window's results file, ``status``. The window itself runs on the GPU box:
tasks/gpu_study/window.py.

    python -m flows.gpu_study plan | pack | slice --window-s S --workers N | accept FILE | status | report
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from model.private import run_private
from model.typed_config import UserError
from tasks.ablate.conditions import loss_shift_probe
from tasks.ablate.fused import fusion_key
from tasks.ablate.grid import families
from tasks.config import Config, load_config
from tasks.data.unigram import unigram_baseline
from tasks.design.registration import CONFIRMATORY, exploratory_seeds, refuse_fresh_declared_seeds, stage_seeds
from tasks.design.seed_registry import SHOWN, TRAINED_BY, check_study_seeds, load_registry
from tasks.design.studies import read_studies
from tasks.gpu_study import plan as planning
from tasks.gpu_study.carry import CarryError, pack
from tasks.gpu_study.report import REPORT, arms_in, findings, labelled, render
from tasks.gpu_study.state import accept, accumulated, duplicates
from tasks.register.stages import stage_state
from tasks.runtime.files import read_json
from tasks.runtime.outputs import MANIFEST
from tasks.runtime.paths import UnsafeFolder

COMMAND_HELP = {
    "plan": (
        "write gpu_study/plan.json: every arm of the gpu profile's study",
        "Write gpu_study/plan.json: every run the ablate stage would train under the gpu profile,\n"
        "seed by seed, with its run identity; the plan's id digests them (docs/gpu-study.md). It is\n"
        "confirmatory or exploratory as `spikelab run ablate` would be (docs/registration.md).",
        "python -m flows.gpu_study plan",
    ),
    "pack": (
        "write gpu_study/carry/tokens.tar.xz: the data a window carries",
        "Write gpu_study/carry/tokens.tar.xz: the token shards a GPU window takes with it (the GPU\n"
        "machine reaches no network).",
        "python -m flows.gpu_study pack",
    ),
    "slice": (
        "write the next slice that fits one GPU window",
        "Write gpu_study/slices/NN.json: the next arms, in plan order and whole fused groups, that fit\n"
        "one GPU window at --workers groups at once, each estimated from the slowest measured arm of its\n"
        "families (x 1.3); a family with no measured arm makes a calibration slice.",
        "python -m flows.gpu_study slice --window-s 420 --workers 5",
    ),
    "accept": (
        "check a results file against the plan and add it to the study",
        "Check a window's results file against the plan (another plan's file, or an arm not in it, is\n"
        "refused) and add it to gpu_study/results/.",
        "python -m flows.gpu_study accept 03.jsonl.gz",
    ),
    "status": (
        "arms in, windows run, the next slice's size",
        "Say how many arms are in, how many windows ran, which arms came back twice (their losses and\n"
        "weights digests compared) and the next slice's size.",
        "python -m flows.gpu_study status",
    ),
    "report": (
        "write gpu_study/REPORT.md: the findings judged on the arms in so far",
        "Write gpu_study/REPORT.md: every finding that reads arms, judged on the arms in so far by the\n"
        "engine that judges the CPU study.",
        "python -m flows.gpu_study report",
    ),
}
"""Each command's one-line help, its description and its example (``--help``)."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flows.gpu_study",
        description="The gpu study: the ablation's arms trained in short GPU windows, planned, sliced and\n"
        "accumulated here (docs/gpu-study.md).",
        epilog="examples:\n" + "\n".join(f"  {example}" for _, _, example in COMMAND_HELP.values()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--project", type=Path, default=Path.cwd(), help="the project (default: this folder)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands = {
        name: sub.add_parser(
            name,
            help=short,
            description=description,
            epilog=f"example:\n  {example}",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        for name, (short, description, example) in COMMAND_HELP.items()
    }
    commands["plan"].add_argument(
        "--profile", default=planning.PROFILE, help="the profile planned (default: %(default)s)"
    )
    sliced = commands["slice"]
    sliced.add_argument("--window-s", type=float, required=True, help="the window's length in seconds")
    sliced.add_argument("--workers", type=int, required=True, help="fused groups the window trains at once on its GPU")
    sliced.add_argument(
        "--group-size", type=int, default=planning.GROUP_SIZE, help="most arms per fused group (default: %(default)s)"
    )
    sliced.add_argument("--family", action="append", default=[], help="only this family's arms (repeatable)")
    commands["accept"].add_argument("file", type=Path, help="the results file a window wrote (.jsonl.gz)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    project = args.project.resolve()
    try:
        return COMMANDS[args.command](args, project)
    except (UserError, UnsafeFolder, CarryError) as e:
        print(f"spikelab: error: {e}", file=sys.stderr)
        return 2


SHARED = ("family", "name", "variant", "factors", "seed")
"""What the plan keeps of another family's arm that is the same run."""


def study_plan(project: Path, profile: str = planning.PROFILE) -> dict[str, Any]:
    """Every run of ``profile``'s ablation study, seed-major, and the plan's id (a digest of the
    runs' identities: the same study planned again, anywhere, has the same id)."""
    from flows.ablate import ARM_MODULE, plan, runs_to_train  # prefect and mlflow load for `plan` alone

    cfg = load_config(project / "params.yaml", profile)
    refuse_other_profiles_data(project, cfg.tokenizer.vocab_size, profile)
    cfg, moved, label = registration(cfg, project)
    # The precision family's loss shift from a one-step fp32 probe at init: made here, on the CPU
    # (the GPU box trains; the integer k it picks is in the plan, and in every arm's identity).
    # One step reads one batch: in process, unpinned (the GPU box's loader settings mean nothing here).
    on_cpu = {"train.device": "cpu", "train.compile": False, "train.num_workers": 0, "train.pin_memory": False}
    probe_cfg = load_config(project / "params.yaml", profile, on_cpu)
    shift = loss_shift_probe(probe_cfg, project)
    declared = read_studies(project, cfg)
    rows = plan(cfg, project, moved, shift["k"] or 0, declared)
    for row in rows:
        row["cached"] = False  # every arm trains on the GPU box, whatever is stored here
    seeds = cfg.ablation.all_seeds
    order = list(families(cfg, declared))
    runs = sorted(runs_to_train(rows), key=lambda row: (seeds.index(row["seed"]), order.index(row["family"])))
    by_key: dict[str, list[dict[str, Any]]] = {}
    for row in rows:  # an arm two families ask for trains once; the report reads it for both
        by_key.setdefault(row["key"], []).append(row)
    arms = [
        {
            "key": row["key"],
            "name": row["name"],
            "family": row["family"],
            "variant": row["variant"],
            "factors": row["factors"],
            "seed": row["seed"],
            "arguments": row["command"][1 + len(ARM_MODULE) :],
            "fuse": fusion_key(row["command"][1 + len(ARM_MODULE) :], project),
            "shared": [{k: twin[k] for k in SHARED} for twin in by_key[row["key"]] if twin is not row],
        }
        for row in runs
    ]
    digest = hashlib.sha256("\n".join(arm["key"] for arm in arms).encode()).hexdigest()[:16]
    unigram = unigram_baseline(project / MANIFEST, cfg.ablation.seq_len)["unigram_val_loss"]
    return {
        "plan": digest,
        "profile": profile,
        "loss_shift": shift,
        "unigram_val_loss": unigram,  # the report's plateau gate, on this profile's data
        "seeds": seeds,
        "registration": label,  # as `spikelab run ablate` labels metrics/ablate.json
        "arms": arms,
    }


def registration(cfg: Config, project: Path) -> tuple[Config, dict[str, Any], dict[str, Any]]:
    """The plan's registration, asked as ``spikelab run ablate`` asks it (flows/__main__.py:
    registered): confirmatory where the profile's last registration holds this design and covers
    the ablate stage (tasks/register/stages.py), its seeds checked against the registry; else
    exploratory, each fresh seed moved to the exploratory range, so that no window spends a seed a
    registration could use. The config to plan with, the overrides every arm's command carries,
    and the label."""
    state = stage_state("ablate", cfg, project)
    own = project / SHOWN  # the project's registry where it holds one (a checkout), else the code's
    registry = load_registry(own if own.is_file() else None)
    moved: dict[str, Any] = {}
    if state.state == CONFIRMATORY:
        check_study_seeds(cfg, [TRAINED_BY["ablate"]], registry)
    else:
        moved = exploratory_seeds(cfg, registry, [TRAINED_BY["ablate"]])
        if cfg.profile not in registry.exempt_profiles:
            refuse_fresh_declared_seeds(read_studies(project, cfg), registry)
        cfg = load_config(project / "params.yaml", cfg.profile, moved) if moved else cfg
    return cfg, moved, state.label(stage_seeds("ablate", cfg))


def refuse_other_profiles_data(project: Path, vocab_size: int, profile: str) -> None:
    """A plan is made on the profile's own data: tokens of another vocabulary (this checkout's
    default-profile data, say) would plan runs no window of this profile trains."""
    manifest = project / MANIFEST
    if not manifest.is_file():
        raise UserError(f"{manifest}: missing; build the {profile} profile's data first (docs/gpu-study.md)")
    found = read_json(manifest)["vocab_size"]
    if found != vocab_size:
        raise UserError(
            f"{manifest}: tokens of a {found}-entry vocabulary, but the {profile} profile's tokenizer.vocab_size is "
            f"{vocab_size}; build the {profile} profile's data in a checkout of its own (docs/gpu-study.md)"
        )


def make_plan(args, project: Path) -> int:
    plan = study_plan(project, args.profile)
    path = project / planning.PLAN
    if path.is_file():
        superseded = planning.supersede(project, plan["plan"])
        if superseded:
            print(f"the code, data or config changed: plan and results moved to {superseded.relative_to(project)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan, indent=1) + "\n")
    print(f"plan {plan['plan']}: {len(plan['arms'])} arms -> {planning.PLAN} ({labelled(plan)})")
    return 0


def pack_tokens(args, project: Path) -> int:
    target = pack(project)
    print(f"{target.relative_to(project)}: {target.stat().st_size / 2**20:.1f} MiB (carry it to the window)")
    return 0


def make_slice(args, project: Path) -> int:
    plan = planning.read_plan(project)
    fresh = study_plan(project, plan["profile"])
    now = fresh["plan"]
    if now != plan["plan"]:  # the window would train other runs than the planned ones, and refuse each
        raise UserError(
            f"gpu study: {planning.PLAN} is plan {plan['plan']}, but the code, data or config here now plan "
            f"{now}. If data/tokens here is not the gpu profile's, build it in a checkout of its own "
            "(`spikelab run prepare`, `filter`, `tokenize`, each with --profile gpu: docs/gpu-study.md); if the "
            "code or config changed, make the plan again (`python -m flows.gpu_study plan`; its results so far "
            "are kept aside)"
        )
    if registered_as(fresh) != registered_as(plan):  # the same arms, but not the registration they run under
        raise UserError(
            f"gpu study: {planning.PLAN} was planned {labelled(plan)}; it is now {labelled(fresh)}: make the "
            "plan again (`python -m flows.gpu_study plan`)"
        )
    state = accumulated(plan, project)
    number = len(state["windows"]) + 1
    done = set(state["arms"])
    if args.group_size < 1 or args.workers < 1:
        raise UserError(f"--group-size {args.group_size}, --workers {args.workers}: each must be at least 1")
    slice_ = planning.next_slice(
        plan, done, state["measures"], args.window_s, args.workers, number, args.family, args.group_size
    )
    path = project / planning.SLICES / f"{number:02d}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(slice_, indent=1) + "\n")
    kind = "calibration slice" if slice_["calibration"] else f"estimated {slice_['estimate_s']:.0f} s"
    groups = len({arm["group"] for arm in slice_["arms"]})
    print(f"slice {number}: {len(slice_['arms'])} arms in {groups} fused groups, {kind} -> {path.relative_to(project)}")
    return 0


def registered_as(plan: dict[str, Any]) -> tuple[Any, Any]:
    """The plan's registration state and design hashes (None for a plan made before labels)."""
    label = plan.get("registration") or {}
    return label.get("state"), label.get("hashes")


def accept_file(args, project: Path) -> int:
    target = accept(args.file, planning.read_plan(project), project)
    print(f"accepted -> {target.relative_to(project)}")
    return 0


def show_status(args, project: Path) -> int:
    plan = planning.read_plan(project)
    state = accumulated(plan, project)
    print(f"plan {plan['plan']}: {len(state['arms'])}/{len(plan['arms'])} arms in, {len(state['windows'])} windows")
    for copy in duplicates(state):
        print(f"  brought back twice: {copy['name']} (bitwise equal: {copy['bitwise_equal']})")
    return 0


def write_report(args, project: Path) -> int:
    plan = planning.read_plan(project)
    state = accumulated(plan, project)
    arms = arms_in(project, plan, state)
    (project / REPORT).write_text(render(plan, state, arms, findings(project, plan, arms)), encoding="utf-8")
    print(f"{len(arms)}/{len(plan['arms'])} arms judged -> {REPORT}")
    return 0


COMMANDS = {
    "plan": make_plan,
    "pack": pack_tokens,
    "slice": make_slice,
    "accept": accept_file,
    "status": show_status,
    "report": write_report,
}

if __name__ == "__main__":
    sys.exit(run_private(main))
