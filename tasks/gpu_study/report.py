"""The gpu study so far (``python -m flows.gpu_study report``: gpu_study/REPORT.md): the arms in
against the plan, what each window cost, and every finding that reads arms judged on the arms
that are in, by the engine that judges the CPU study (tasks/report/declared.py). A family not yet
whole is marked partial: its verdict is provisional, a claim whose pairs are missing has no
estimate, and a mechanism gate reads only the arms in.

Each arm's figures are read off its result as the ablate stage reads them (tasks/ablate/grid.py:
arm_metrics), with the arm's own config rebuilt from its planned command; the unigram baseline
is the plan's, measured on the gpu profile's data when the plan was made.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from model.flops import PEAK_BF16_FLOPS
from model.typed_config import parse_sets
from tasks.ablate.grid import arm_metrics, trained
from tasks.config import Config, load_config
from tasks.design.families import DeclaredFamily
from tasks.design.studies import builtin_families, read_studies
from tasks.gpu_study.plan import STUDY
from tasks.report.declared import declared_finding
from tasks.report.findings import FAMILY_OF, builtin_finding
from tasks.report.method import Finding, number

REPORT = STUDY / "REPORT.md"


def arm_config(project: Path, plan: dict[str, Any], arm: dict[str, Any]) -> Config:
    """The config the arm trained with: the plan's profile and the arm's ``--set`` keys."""
    sets = parse_sets([a.removeprefix("--set=") for a in arm["arguments"] if a.startswith("--set=")])
    return load_config(project / "params.yaml", plan["profile"], sets)


def arms_in(project: Path, plan: dict[str, Any], state: dict[str, Any]) -> list[dict[str, Any]]:
    """Every arm brought back, as metrics/ablate.json lists an arm: its first finished copy judged."""
    out = []
    for key, entry in state["arms"].items():
        record = entry["records"][0]
        metrics = arm_metrics(record["result"], arm_config(project, plan, entry))
        for arm in [entry, *entry.get("shared", [])]:  # the same run, for each family that asks for it
            out.append(
                {"name": arm["name"], "family": arm["family"], "seed": arm["seed"], "key": key}
                | {"factors": arm["factors"], "metrics": metrics, "window": record["window"], "gpu": record["gpu"]}
            )
    return out


def findings(project: Path, plan: dict[str, Any], arms: list[dict[str, Any]]) -> list[tuple[Finding, int, int]]:
    """Each finding that reads arms, judged on ``arms``, with its family's arms in and planned."""
    cfg = load_config(project / "params.yaml", plan["profile"])
    ablate = {"arms": arms, "conditions": {"loss_shift": plan["loss_shift"]}}
    unigram = plan.get("unigram_val_loss")
    every = [a for arm in plan["arms"] for a in [arm, *arm.get("shared", [])]]
    planned = {f: sum(a["family"] == f for a in every) for f in {a["family"] for a in every}}
    out = []
    families: dict[str, DeclaredFamily] = {f.name: f for f in builtin_families(cfg)}
    kept = trained(cfg)
    for key, name in FAMILY_OF.items():
        if name not in kept:  # a family the profile drops (ablation.families) has no arms to judge
            continue
        found = builtin_finding(key, families[name], cfg, ablate, unigram)
        out.append((found, sum(a["family"] == name for a in arms), planned.get(name, 0)))
    for family in read_studies(project, cfg):
        found = declared_finding(cfg, ablate, unigram, family)
        out.append((found, sum(a["family"] == family.name for a in arms), planned.get(family.name, 0)))
    return out


def labelled(plan: dict[str, Any]) -> str:
    """The plan's registration in words: confirmatory under its record, or EXPLORATORY and why."""
    label = plan.get("registration")
    if not label:
        return "unlabelled: planned before registrations"
    if label["state"] == "exploratory":
        return f"EXPLORATORY, never counted as a verdict: {label['why']}"
    return f"confirmatory under {label['record']}, design {label['hash']}"


def render(
    plan: dict[str, Any], state: dict[str, Any], arms: list[dict[str, Any]], judged: list[tuple[Finding, int, int]]
) -> str:
    unigram = plan.get("unigram_val_loss")
    lines = [
        "# The gpu study so far",
        "",
        f"Plan `{plan['plan']}` (profile `{plan['profile']}`): **{len(arms)} of {len(plan['arms'])} arms in**, "
        f"from {len(state['windows'])} windows. Unigram baseline {number(unigram, '{:.3f}')} nats. "
        "Made by `python -m flows.gpu_study report` from `gpu_study/results/`; how the study runs: docs/gpu-study.md.",
        "",
        f"Registration: {labelled(plan)}.",
        "",
        "| window | GPU | processes at once | window s | finished | arms per GPU-minute | MFU (bf16 dense) | TFLOP/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for w in state["windows"]:
        header, footer = w["header"], w["footer"] or {}
        gpu = ", ".join(header.get("machine", {}).get("gpus", [])) or "-"
        wall, done = footer.get("wall_s"), footer.get("finished")
        rate = f"{done / (wall / 60):.2f}" if wall and done is not None else "-"
        utilisation = w["peak_s"] / wall if wall and w.get("peak_s") is not None else None
        peak = next((p for key, p in PEAK_BF16_FLOPS if key in gpu), None)
        flops = utilisation * peak / 1e12 if utilisation is not None and peak else None
        lines.append(
            f"| {w['file']} | {gpu} | {header['workers']} | {header['window_s']:.0f} | {number(done, '{}')} | {rate} "
            f"| {number(utilisation, '{:.1%}')} | {number(flops, '{:.0f}')} |"
        )
    for finding, n_in, n_planned in judged:
        partial = "" if n_in == n_planned else f" (partial: {n_in} of {n_planned} arms in)"
        lines += ["", f"## {finding.key} — `{finding.verdict.upper()}`{partial}", ""]
        if finding.precondition_failed:
            lines.append(f"Not tested: {finding.precondition_failed}.")
        lines += ["", "| claim | n | estimate | 95 % interval | p |", "|---|---|---|---|---|"]
        for c in finding.claims:
            ci = "-" if not c.ci95 else f"{c.ci95[0]:+.3g} to {c.ci95[1]:+.3g}"
            n = (finding.details.get(c.what) or {}).get("n", 0)
            estimate = "-" if c.estimate is None else f"{c.estimate:+.3g}"
            lines.append(f"| {c.what} | {n} | {estimate} | {ci} | {number(c.p, '{:.3g}')} |")
        for gate, g in (finding.details.get("gates") or {}).items():
            measured = number(g["measured"], "{:.4g}")
            lines.append(f"\nGate of {gate}: {g['metric']} of {g['variant']} = {measured} (needs {g['needs']}).")
    lines += [
        "",
        "## Arms in",
        "",
        "| arm | window | train loss (last) | validation loss | status |",
        "|---|---|---|---|---|",
    ]
    for arm in sorted(arms, key=lambda a: a["name"]):
        m = arm["metrics"]
        lines.append(
            f"| {arm['name']} | {arm['window']} | {number(m['final_loss'], '{:.3f}')} | "
            f"{number(m['val_loss'], '{:.3f}')} | {m['status']} |"
        )
    return "\n".join(lines) + "\n"
