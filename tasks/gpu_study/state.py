"""What the gpu study has accumulated: the results files brought back from GPU windows
(``gpu_study/results/NN.jsonl.gz``, committed), read against the plan.

A results file names the plan and slice it trained; one from another plan is refused, and so is
an arm not in the plan. An arm that came back from two windows (two GPUs, or the same one twice)
is kept twice and compared (its final losses and weights digests side by side), never silently
replaced: the first to arrive is the one the study judges.
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
from pathlib import Path
from typing import Any

from model.typed_config import UserError
from tasks.gpu_study.plan import RESULTS, arm_steps

CHECKPOINT = re.compile(r"step_(\d+)\.pt$")
"""A checkpoint's file name: the step it holds."""

FINISHED = ("completed", "diverged")
"""An arm's statuses that are results (a diverged run is a result, never dropped)."""


def read_results(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any] | None]:
    """A results file's header, arm records and footer (None: the window was cut before it wrote one;
    a last record cut short is dropped, the ones before it stand)."""
    records: list[dict[str, Any]] = []
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                records.append(json.loads(line))
    except (EOFError, ValueError, gzip.BadGzipFile):
        pass
    except OSError as e:
        raise UserError(f"gpu study: cannot read {path}: {e}") from None
    if not records or "header" not in records[0]:
        raise UserError(f"gpu study: {path} has no header line; it is not a results file of tasks/gpu_study/window.py")
    footer = records[-1].get("footer") if len(records) > 1 else None
    return records[0]["header"], [r["arm"] for r in records if "arm" in r], footer


def check_results(path: Path, plan: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The file's header and records, or a :class:`UserError` naming why it is not this plan's."""
    header, arms, _ = read_results(path)
    if header.get("plan") != plan["plan"]:
        raise UserError(
            f"gpu study: {path} trained plan {header.get('plan')!r}, not this plan {plan['plan']!r} "
            f"(gpu_study/plan.json); its arms are other runs"
        )
    keys = {arm["key"] for arm in plan["arms"]}
    if stray := sorted({arm["key"] for arm in arms} - keys):
        raise UserError(f"gpu study: {path} holds arms not in plan {plan['plan']}: {stray[:3]}")
    return header, arms


def accept(path: Path, plan: dict[str, Any], project: Path) -> Path:
    """Copy a checked results file into the study as ``results/<slice>.jsonl.gz`` (never over
    another: a second file for one slice gets the next free suffix)."""
    header, _ = check_results(path, plan)
    folder = project / RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{int(header['slice']):02d}"
    target, n = folder / f"{stem}.jsonl.gz", 1
    while target.exists():
        n += 1
        target = folder / f"{stem}-{n}.jsonl.gz"
    tmp = target.with_suffix(".tmp")
    shutil.copyfile(path, tmp)
    tmp.replace(target)
    return target


def accumulated(plan: dict[str, Any], project: Path) -> dict[str, Any]:
    """Every arm brought back, by key: the first finished record is the one judged, every record
    is kept (``records``); per window its header, totals and :func:`peak_seconds`; and every arm's
    cost as measured (``measures``: finished arms, and cut arms up to the checkpoint they reached)."""
    families = {arm["key"]: arm for arm in plan["arms"]}
    arms: dict[str, dict[str, Any]] = {}
    windows, measures = [], []
    for path in sorted((project / RESULTS).glob("*.jsonl.gz"), key=arrival):
        header, records = check_results(path, plan)
        _, _, footer = read_results(path)
        windows.append({"file": path.name, "header": header, "footer": footer, "peak_s": peak_seconds(records)})
        for record in records:
            if measure := cost(record, families[record["key"]], header["workers"]):
                measures.append(measure)
            if record["status"] not in FINISHED:
                continue
            gpu = (record["result"].get("provenance") or {}).get("gpu", {}).get("name")
            entry = arms.setdefault(record["key"], {**families[record["key"]], "records": []})
            entry["records"].append(record | {"window": path.name, "gpu": gpu})
    return {"windows": windows, "arms": arms, "measures": measures}


def peak_seconds(records: list[dict[str, Any]]) -> float | None:
    """The seconds the GPU would need at its bf16 dense peak for the model FLOPs of a window's
    finished arms (each arm's MFU times its training seconds, model/flops.py): over the window's
    wall time, the window's MFU. None when no finished arm knows its GPU's peak."""
    summaries = [r["result"]["summary"] for r in records if r["status"] in FINISHED]
    known = [s for s in summaries if s.get("mfu") is not None]
    return sum(s["mfu"] * (s["wall_s"] - s["eval_s"]) for s in known) if known else None


def arrival(path: Path) -> tuple[int, int]:
    """A results file's place in arrival order: its slice, then its copy (``07-2``: slice 7's second)."""
    slice_, _, copy = path.name.removesuffix(".jsonl.gz").partition("-")
    return int(slice_), int(copy or 1)


def cost(record: dict[str, Any], arm: dict[str, Any], workers: int) -> dict[str, Any] | None:
    """What a window measured of an arm: wall seconds for the steps it did, ``workers`` groups of
    its group's size at once (the window's pool; None: it never started, or crashed before a
    checkpoint)."""
    total = arm_steps(arm)
    if record["status"] in FINISHED:
        done = int(record["result"]["summary"].get("steps") or total)
    else:
        reached = [int(m.group(1)) for f in record.get("saved", []) if (m := CHECKPOINT.search(f))]
        if not reached:
            return None
        done = max(reached)
    return {
        "family": arm["family"],
        "wall_s": record["wall_s"],
        "sharing": workers * record.get("fused", 1),  # results files before fused groups: one arm a process
        "steps_done": done,
        "steps_total": total,
    }


def duplicates(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Arms brought back more than once: each copy's GPU, final loss and weights digest."""
    out = []
    for key, entry in state["arms"].items():
        if len(entry["records"]) > 1:
            copies = [
                {
                    "window": r["window"],
                    "gpu": r["gpu"],
                    "final_loss": r["result"]["summary"].get("final_loss"),
                    "val_loss": r["result"]["summary"].get("val_loss"),
                    "weights_sha256": r["result"].get("weights_sha256"),
                }
                for r in entry["records"]
            ]
            bitwise = len({c["weights_sha256"] for c in copies}) == 1
            out.append({"key": key, "name": entry["name"], "bitwise_equal": bitwise, "copies": copies})
    return out
