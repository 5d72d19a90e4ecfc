"""How a run ends: the one list of stop kinds, their exit codes, their MLflow status, and the
exceptions that carry them out of a stage. Torch-free, so the CLI can import it cheaply.

    completed   every step of ``train.steps`` ran                            exit 0   FINISHED
    stopped     a callback asked to stop (a reason says why: a pruned trial,  exit 4   FINISHED
                a recovery policy that gave up, ...)
    diverged    the divergence rule fired (``train.diverge_after`` non-      exit 3   FAILED
                finite steps in a row, or the loss above ``train.diverge_loss``)
    preempted   SIGTERM/SIGINT: the current step finished and was            exit 75  KILLED
                checkpointed; rerunning the same command resumes

A search trial or an ablation arm records ``diverged`` and ``stopped`` as results; a stage that
expects a trained model (pretrain) raises :class:`Diverged` / :class:`Stopped` instead of
publishing weights.
"""

from __future__ import annotations

from typing import Literal, get_args

RunStatus = Literal["completed", "stopped", "diverged", "preempted"]
STATUSES: tuple[str, ...] = get_args(RunStatus)

EXIT_CODES: dict[str, int] = {"completed": 0, "diverged": 3, "stopped": 4, "preempted": 75}
"""Process exit status per stop kind. 75 is EX_TEMPFAIL (sysexits.h): "try again"."""

MLFLOW_STATUS: dict[str, str] = {
    "completed": "FINISHED",
    "stopped": "FINISHED",
    "diverged": "FAILED",
    "preempted": "KILLED",
}
"""The MLflow run status a run of each kind ends with."""


class RunEnded(SystemExit):
    """A run ended other than by completing; left uncaught, the process exits with the kind's code."""

    status: RunStatus
    code: int  # SystemExit's, always EXIT_CODES[status] here

    def __init__(self, step: int, reason: str = ""):
        super().__init__(EXIT_CODES[self.status])
        self.step, self.reason = step, reason

    def __str__(self) -> str:
        return f"{self.status} at step {self.step}" + (f": {self.reason}" if self.reason else "")


class Preempted(RunEnded):
    """SIGTERM/SIGINT: raised once the checkpoint of the current step is written."""

    status = "preempted"


class Diverged(RunEnded):
    """The divergence rule fired; nothing is published as a trained model."""

    status = "diverged"


class Stopped(RunEnded):
    """A callback stopped the run before ``train.steps``; the reason names the callback and why."""

    status = "stopped"


def raise_for_status(summary: dict) -> None:
    """For a stage that expects a completed run: raise the summary's stop as an exception."""
    status = summary["status"]
    if status == "completed":
        return
    cls = {"diverged": Diverged, "stopped": Stopped, "preempted": Preempted}[status]
    raise cls(summary["steps"], summary.get("stop_reason") or "")
