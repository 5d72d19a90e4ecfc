"""``make repro`` and ``make demo``'s entry: ``python -m flows.repro [dvc repro's arguments]``
publishes the Prefect deployments (flows/deployments.py), then runs ``dvc repro`` under one
``pipeline`` flow run that each stage's flow run is a child of (flows/pipeline.py:
stage_task_run), so the UI shows one run per pipeline, not one per stage."""

from __future__ import annotations

import os
import subprocess
import sys

from model.private import run_private


def repro_in_one_run(arguments: list[str]) -> int:
    """``dvc repro ARGUMENTS`` (its output on this terminal) under one ``pipeline`` flow run that
    each stage's flow run is a child of (:func:`stage_task_run`), after the deployments are
    published; plain ``dvc repro`` when no Prefect server serves this checkout (each stage then
    starts a temporary one: nothing would show the parent run). dvc's exit code."""
    from flows.pipeline import dvc_bin
    from tasks.runtime import services

    command = [dvc_bin(), "repro", *arguments]
    if not services.configure_environment()["prefect"].startswith(("http://", "https://")):
        return subprocess.run(command, check=False).returncode
    from prefect.context import SettingsContext, get_settings_context
    from prefect.settings import Settings

    # this module imported Prefect, which read its settings then, before the server was chosen
    with SettingsContext(profile=get_settings_context().profile, settings=Settings()):
        return repro_under_pipeline_run(command, arguments)


def repro_under_pipeline_run(command: list[str], arguments: list[str]) -> int:
    """``command`` run as a child of a new ``pipeline`` flow run, whose state is dvc's outcome."""
    from prefect import get_client
    from prefect.states import Cancelled, Completed, Failed, Pending, Running

    from flows.deployments import publish
    from flows.pipeline import pipeline_flow
    from flows.stages import STAGES
    from tasks.config import project_config
    from tasks.runtime import paths
    from tasks.runtime.paths import PIPELINE_RUN_ENV

    print(f"[spikelab] published {len(publish())} Prefect deployments (runs start while `spikelab serve` runs)")
    cfg, _ = project_config(None, {})
    target = arguments[0] if len(arguments) == 1 and arguments[0] in STAGES else "all"
    with get_client(sync_client=True) as client:
        run = client.create_flow_run(
            pipeline_flow, name=f"dvc repro {cfg.profile}", parameters={"target": target}, state=Pending()
        )
        client.set_flow_run_state(run.id, Running())
        print(f"[spikelab] this run and its stages in the Prefect UI: {paths.prefect_ui_url()}/runs/flow-run/{run.id}")
        proc = subprocess.Popen(command, env={**os.environ, PIPELINE_RUN_ENV: str(run.id)})
        code = wait_passing_signals(proc)
        ended = Completed if code == 0 else Cancelled if code < 0 else Failed  # < 0: killed by a signal
        client.set_flow_run_state(run.id, ended(message=f"dvc repro exited {code}"))  # its output says why
    return code


def wait_passing_signals(proc: subprocess.Popen) -> int:
    """Wait for ``proc``; SIGTERM is passed on to it, SIGINT ignored here (a terminal's Ctrl-C
    reaches dvc and its stage itself, and they stop as they do under plain ``dvc repro``)."""
    import signal

    previous = {
        signal.SIGTERM: signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGTERM)),
        signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
    }
    try:
        return proc.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def main() -> int:
    """``python -m flows.repro [dvc repro's arguments]``: :func:`repro_in_one_run`; a bad config or
    declaration: one line, exit 2."""
    from model.typed_config import UserError

    try:
        return repro_in_one_run(sys.argv[1:])
    except UserError as e:
        print(f"spikelab: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(run_private(main))  # as every spikelab command: the umask, the engines' scratch private
