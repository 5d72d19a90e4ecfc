"""Which arithmetic produced the numbers a report is built from, and whether it is the committed
outputs' (issue 28). Each stage's ``metrics/*.json`` carries the record of the process that computed
it (``provenance``, model/provenance.py) and metrics/ablate.json one per numeric path its arms took
(``arm_numerics``); the committed outputs are those files at git HEAD. Another numeric path changes
per-arm losses by 1e-3 to 1e-1 nats, enough to move a verdict near its threshold, so the report
says so before its findings when the inputs mix paths or differ from the committed outputs' of the
same registered design.
"""

from __future__ import annotations

import json
from typing import Any

from tasks.runtime.outputs import ABLATE_METRICS, PRETRAIN_METRICS, SEARCH_METRICS, SPIKE_METRICS
from tasks.runtime.tracking import git_output

STAGE_METRICS = {
    "search": SEARCH_METRICS,
    "pretrain": PRETRAIN_METRICS,
    "spike": SPIKE_METRICS,
    "ablate": ABLATE_METRICS,
}
"""The outputs whose numbers the report uses, by stage."""
UNRECORDED = "unrecorded"
"""The numeric path of outputs written before provenance was recorded."""


def numeric_paths(outputs: dict[str, dict[str, Any] | None]) -> dict[str, dict[str, Any]]:
    """Each numeric path in the stages' ``outputs`` (stage -> metrics): the machine it describes
    and what was computed on it (stages; the ablate stage's arms counted)."""
    paths: dict[str, dict[str, Any]] = {}

    def add(record: dict[str, Any] | None, what: str) -> None:
        path = record["numeric_path"] if record else UNRECORDED
        entry = paths.setdefault(path, {"machine": describe(record), "produced": []})
        entry["produced"].append(what)

    for stage, metrics in outputs.items():
        if metrics is None:
            continue
        add(metrics.get("provenance"), stage if stage != "ablate" else "ablate (depth probe)")
        if stage == "ablate":
            for record in metrics.get("arm_numerics", {}).values():
                add(record, f"ablate: {record['arms']} arms")
            unrecorded = sum(1 for arm in metrics["arms"] if arm.get("numeric_path") is None)
            if unrecorded:
                add(None, f"ablate: {unrecorded} arms")
    return paths


def committed_outputs() -> dict[str, dict[str, Any] | None]:
    """The stages' metrics as committed at git HEAD of the project (None for a file not there, and
    for every file where the project is no git checkout of its own: make demo's copy)."""
    committed = {}
    for stage, path in STAGE_METRICS.items():
        text = git_output("show", f"HEAD:{path.as_posix()}", own_checkout=True)
        committed[stage] = json.loads(text) if text else None
    return committed


def of_the_same_design(
    outputs: dict[str, dict[str, Any] | None], committed: dict[str, dict[str, Any] | None]
) -> dict[str, dict[str, Any] | None]:
    """The committed outputs of each stage whose registered design (``registration.hash``) is its
    input's: another design's outputs are another study, not a reference for this one's arithmetic
    (a new version's report, built beside the version it replaces, would warn of that version's
    machine)."""

    def design(metrics: dict[str, Any] | None) -> str | None:
        return ((metrics or {}).get("registration") or {}).get("hash")

    return {
        stage: metrics if metrics is not None and design(metrics) == design(outputs.get(stage)) else None
        for stage, metrics in committed.items()
    }


def warnings(used: dict[str, dict[str, Any]], committed: dict[str, dict[str, Any]]) -> list[str]:
    """What a reader must know before the findings: inputs computed on more than one numeric path,
    or on other paths than the committed outputs (empty when neither)."""
    found = []
    if len(used) > 1:
        found.append(
            f"the results mix {len(used)} numeric paths ({', '.join(f'`{p}`' for p in used)}): "
            "runs compared with each other may have been computed with different arithmetic"
        )
    if committed and set(used) != set(committed):
        found.append(
            f"computed on numeric path(s) {', '.join(f'`{p}`' for p in used)}, while the committed outputs "
            f"(git HEAD) were computed on {', '.join(f'`{p}`' for p in committed)}: per-arm losses can differ "
            "from theirs by 1e-3 to 1e-1 nats, and a verdict near its threshold can differ with them"
        )
    return found


def describe(record: dict[str, Any] | None) -> str:
    """One line for a reader: the CPU, the libraries and the paths they took."""
    if record is None:
        return "not recorded (outputs written before provenance was)"
    cpu, mkl, onednn = record["cpu"], record["mkl"], record["onednn"]
    settings = ", ".join(f"{k}={v}" for k, v in record["env"].items()) or "none"
    return (
        f"{cpu['name']} ({cpu['vendor']} family {cpu['family']} model {cpu['model']}; {', '.join(cpu['isa'])}), "
        f"torch {record['torch']}, ATen {record['aten_capability']}, MKL {mkl['version']}, "
        f"oneDNN {onednn['version']} (ISA {onednn['max_isa']}), bf16 at emulate: auto "
        f"{'on ' + record['autocast']['bf16'] if record['autocast']['bf16'] else 'emulated'}; "
        f"numerics settings: {settings}"
    )
