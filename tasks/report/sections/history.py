"""The change history of the study's design: every change to the design, the arms, sizes, seeds,
thresholds or tests made after any of its results was seen, as the pre-registration records it
(tasks/design/preregistration.yaml, ``changes_after_results``), under the design's hash."""

from __future__ import annotations

from tasks.design.preregistration import design, design_hash
from tasks.report.sections.section import Section


def changes_section() -> Section:
    changes = design().get("changes_after_results") or []
    lines = [
        f"Design hash `{design_hash()}`. Every change to the design, the arms, sizes, seeds, thresholds or tests "
        "made after any of its results was seen (tasks/design/preregistration.yaml, `changes_after_results`):",
        "",
        *([f"{i}. {c}" for i, c in enumerate(changes, 1)] or ["None."]),
        "",
    ]
    return Section("Changes made after a result was seen", lines)
