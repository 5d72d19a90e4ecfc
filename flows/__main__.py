"""spikelab: training-stability ablation studies (DVC stages run as Prefect flows, tracked in MLflow).

Heavy libraries (torch, prefect, mlflow, dvc) are imported only by the command that needs them,
so ``spikelab --help`` and ``spikelab ui`` answer at once.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefect.client.schemas.objects import State

    from model.stops import RunEnded

USER_ERROR_EXIT = 2
NEXT_STEP = {
    "preempted": "a checkpoint was saved; run the same command again to resume",
    "diverged": "no model was published; see the run's curves for where it went wrong",
    "stopped": "stopped before train.steps; no model was published",
}
"""What a user does next after a run that did not complete (the one-line message's tail)."""

EXAMPLES = """\
examples:
  spikelab services up                    start this checkout's servers (Prefect, MLflow, optuna-dashboard)
  spikelab services info                  where each UI is and where its login is (never the password itself)
  spikelab ui                             print the address of every UI that is up
  dvc repro                               run the whole study, cached (each stage calls spikelab run)
  spikelab run pretrain --profile smoke   run one stage directly, outside DVC's cache
  spikelab run pretrain --set optim.lr=0.02 --set train.steps=100
  spikelab status                         stages up to date?, servers, newest MLflow runs
  spikelab serve                          publish the deployments: trigger runs from the Prefect UI
  spikelab cluster up --workers 4         a Dask scheduler and 4 workers; then SPIKELAB_SCHEDULER=<address>

exit codes: 0 done, 2 bad config or input (the message names the key or file), 3 diverged,
4 stopped by a callback, 75 preempted (checkpoint saved: run again to resume), 1 anything else.
"""


def run_stage(stage: str, profile: str | None, sets: dict[str, Any]) -> None:
    from flows.stages import STAGES
    from model.numerics import apply_numerics
    from model.stops import RunEnded
    from tasks.config import project_config
    from tasks.runtime import paths, services
    from tasks.runtime.startup import imports_without_gc

    started = time.perf_counter()
    cfg, _ = project_config(profile, sets)  # fail fast, before any import cost
    apply_numerics(cfg.precision.numerics)  # before torch loads, here and in the workers this starts
    where = services.configure_environment()  # before prefect is imported
    if STAGES[stage].fans_out:
        refuse_dask_without_prefect(cfg)
    with imports_without_gc():
        flow = STAGES[stage].load_flow()
    params = {"profile": cfg.profile, **({"overrides": sets} if sets else {})}
    name = f"{stage} {cfg.profile}"
    parent = os.environ.get(paths.PARENT_TASK_RUN_ENV)
    crashed: list[Any] = []  # the flow run Prefect marked Crashed: a typed stop is a SystemExit
    flow = flow.with_options(on_crashed=[lambda _flow, flow_run, _state: crashed.append(flow_run.id)])
    try:
        if parent:
            run_under_task(flow, params, name, parent)
        else:
            flow.with_options(flow_run_name=name)(**params)
    except RunEnded as stop:
        if crashed:
            mark_stopped(crashed[-1], stop)
        raise
    print(
        f"[spikelab] {stage} done in {time.perf_counter() - started:.1f} s "
        f"(prefect: {where['prefect']}, mlflow: {where['mlflow']})",
        file=sys.stderr,
    )


def refuse_dask_without_prefect(cfg) -> None:
    """On a Dask cluster, a Prefect server must answer before the flow starts: else the flow
    would start on a temporary server its workers cannot reach (tasks/runtime/workers.py)."""
    from tasks.runtime.config import LOCAL
    from tasks.runtime.workers import reporting_to, scheduler

    address = scheduler(cfg.executor.scheduler)
    if address != LOCAL:
        reporting_to(f"Dask scheduler {address}")


def mark_stopped(flow_run_id: Any, stop: RunEnded) -> None:
    """A typed stop in the Prefect UI as what it was, not "Crashed": preempted or stopped runs
    are Cancelled, a divergence Failed, with the line the command prints (what to do next)."""
    from prefect import get_client
    from prefect.states import Cancelled, Failed

    state: State[None] = (Failed if stop.status == "diverged" else Cancelled)(
        message=f"{stop} ({NEXT_STEP[stop.status]})"
    )
    try:
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(flow_run_id, state, force=True)
    except Exception as e:  # the stop and its exit code matter more than the label
        print(f"spikelab: could not mark flow run {flow_run_id} {state.name}: {e}", file=sys.stderr)


def run_under_task(flow, params: dict[str, Any], name: str, task_run_id: str) -> None:
    """Run ``flow`` as a child of a pipeline's task run (another process), so the Prefect UI
    shows it under the pipeline run that caused it."""
    from uuid import UUID

    from prefect import get_client
    from prefect.flow_engine import run_flow
    from prefect.states import Pending

    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run(
            flow,
            name=name,
            parameters=flow.serialize_parameters(params),
            parent_task_run_id=UUID(task_run_id),
            state=Pending(),
            tags=["pipeline"],
        )
    run_flow(flow, flow_run=flow_run, parameters=params)


def services_up() -> None:
    """The servers, optuna-dashboard on ``search.storage``. A database there gets Optuna's tables
    first: the dashboard opens a schema but never creates one."""
    from tasks.config import project_config
    from tasks.runtime import services

    storage = project_config()[0].search.storage
    if storage and not storage.startswith("journal:"):
        from tasks.search.queue import open_storage

        open_storage(storage)
    services.up(search_storage=storage)


def serve() -> None:
    from tasks.runtime import services

    services.configure_environment()
    from flows.deployments import serve_all

    serve_all()


def show_ui() -> None:
    from tasks.runtime import services

    found = False
    for name, report in services.status().items():
        if report.startswith("up"):
            print(f"{name:8} {services.service(name).url}")
            found = True
    if not found:
        print("no UI is up for this checkout; start them with: spikelab services up")


def show_status() -> None:
    from tasks.runtime import services

    print("stages (dvc status):")
    for line in stage_status():
        print(f"  {line}")
    print("servers:")
    for name, report in services.status().items():
        print(f"  {name:8} {report}")
    services.configure_environment()
    print(f"newest MLflow runs ({os.environ['MLFLOW_TRACKING_URI']}):")
    for line in newest_runs():
        print(f"  {line}")


def stage_status() -> list[str]:
    import json
    import subprocess

    done = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "dvc"), "status", "--json"], capture_output=True, text=True
    )
    if done.returncode:
        return [f"dvc status failed: {(done.stderr or done.stdout).strip()[-200:]}"]
    changed = json.loads(done.stdout or "{}")
    return [
        f"{stage:9} {'changed: ' + _changes(changed[stage]) if stage in changed else 'up to date'}"
        for stage in pipeline_stages()
    ]


def pipeline_stages() -> list[str]:
    """Every stage of the project's dvc.yaml in its order (``params`` first: it has no flow, so
    it is not in STAGES), or ``params`` and the flows when there is no dvc.yaml."""
    import yaml

    from flows.stages import PARAMS_STAGE, STAGES
    from tasks.runtime.paths import project_dir

    path = project_dir() / "dvc.yaml"
    stages = (yaml.safe_load(path.read_text()) or {}).get("stages") if path.is_file() else None
    return list(stages) if stages else [PARAMS_STAGE, *STAGES]


def _changes(entries: list) -> str:
    kinds = []
    for entry in entries:
        for kind, what in entry.items() if isinstance(entry, dict) else [(entry, {})]:
            kinds.append(f"{kind} ({', '.join(what)})" if isinstance(what, dict) and what else str(kind))
    return "; ".join(kinds)


def newest_runs(limit: int = 5) -> list[str]:
    uri = os.environ["MLFLOW_TRACKING_URI"]
    if uri.startswith("sqlite:///") and not os.path.exists(uri.removeprefix("sqlite:///")):
        return ["(none: no MLflow store yet)"]  # opening one would create it
    import mlflow

    client = mlflow.MlflowClient()
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments, order_by=["attributes.start_time DESC"], max_results=limit)
    return [
        f"{time.strftime('%m-%d %H:%M', time.localtime(r.info.start_time / 1000))}  {r.info.status:8} {r.info.run_name}"
        for r in runs
    ] or ["(none)"]


def parser() -> argparse.ArgumentParser:
    from flows.stages import STAGES
    from model.typed_config import add_config_arguments

    p = argparse.ArgumentParser(
        prog="spikelab",
        description=__doc__.split("\n\n")[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser(
        "run",
        help="run one pipeline stage as a Prefect flow (what dvc.yaml calls)",
        description="Run one stage directly. For a cached, versioned run use dvc repro or dvc exp run -S key=value.",
    )
    run.add_argument("stage", choices=list(STAGES))
    add_config_arguments(run, params=False)
    sub.add_parser("status", help="stages up to date or not, servers and whose they are, newest MLflow runs")
    sub.add_parser("ui", help="print the address of every UI that is up for this checkout")
    sub.add_parser("serve", help="serve the pipeline and each stage as Prefect deployments (forms in the UI)")
    svc = sub.add_parser(
        "services",
        help="this checkout's Prefect and MLflow servers and optuna-dashboard on 127.0.0.1 (info: where the login is)",
    )
    svc.add_argument("action", choices=["up", "down", "status", "info"])
    add_cluster_parser(sub)
    return p


def add_cluster_parser(sub) -> None:
    cluster = sub.add_parser(
        "cluster",
        help="a Dask scheduler and workers for the ablate and search stages' units (docs/scaling.md)",
        description="Start, stop or show this checkout's Dask processes. The stages use a cluster when "
        "executor.scheduler (params.yaml) or SPIKELAB_SCHEDULER names its address.",
    )
    actions = cluster.add_subparsers(dest="action", required=True, metavar="ACTION")
    up = actions.add_parser("up", help="a scheduler and its workers on this machine; prints the address")
    up.add_argument("--port", type=int, default=8786, help="the scheduler's port (default: %(default)s)")
    up.add_argument(
        "--host", default="127.0.0.1", help="the interface it listens on; another node's workers need one they reach"
    )
    join = actions.add_parser("join", help="workers on this machine for a scheduler elsewhere (a head node's)")
    join.add_argument("address", help="the scheduler's address, tls://host:port")
    join.add_argument(
        "--host", default=None, help="the interface the workers listen on (default: the scheduler's route)"
    )
    join.add_argument(
        "--tls",
        default=None,
        metavar="DIR",
        help="a copy of the head node's <state>/tls (ca.pem, cert.pem, key.pem; default: $SPIKELAB_TLS_DIR or <state>/tls)",
    )
    for action in (up, join):
        action.add_argument("--workers", type=int, default=0, help="CPU workers, one thread each (0: one per core)")
        action.add_argument("--gpus", type=int, default=0, help="instead: one worker per GPU, with the resource GPU=1")
    actions.add_parser("down", help="stop the scheduler and workers this checkout started")
    actions.add_parser("status", help="what runs for this checkout, and the address to use")


def run_cluster(args: argparse.Namespace) -> None:
    from tasks.runtime import cluster

    if args.action == "up":
        address = cluster.up(args.workers, args.gpus, args.port, args.host)
        print(f"cluster: up at {address}; run the stages on it with SPIKELAB_SCHEDULER={address}")
    elif args.action == "join":
        from pathlib import Path

        cluster.join(args.address, args.workers, args.gpus, args.host, Path(args.tls) if args.tls else None)
        print(f"cluster: workers started for {args.address}")
    elif args.action == "down":
        print("\n".join(f"cluster: stopped {what}" for what in cluster.down()) or "cluster: nothing to stop")
    else:
        print("\n".join(cluster.status()))


def keep_others_from_writing() -> None:
    """Nothing this process or its children create (data, runs/, checkpoints, stores, logs) is
    writable by other users, whatever umask the user's shell had (002 and 000 are common on shared
    machines): the files are read back as the project's owner."""
    os.umask(os.umask(0) | 0o022)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    keep_others_from_writing()
    from model.stops import RunEnded
    from model.typed_config import UserError, parse_sets
    from tasks.runtime.paths import UnsafeFolder
    from tasks.runtime.private_env import use_private_env

    try:
        use_private_env()  # before anything this command starts: scratch private, no telemetry
        if args.command == "run":
            run_stage(args.stage, args.profile, parse_sets(args.sets))
        elif args.command == "status":
            show_status()
        elif args.command == "ui":
            show_ui()
        elif args.command == "serve":
            serve()
        elif args.command == "cluster":
            run_cluster(args)
        else:
            from tasks.runtime import services

            if args.action == "status":
                for name, report in services.status().items():
                    print(f"{name}: {report}")
            elif args.action == "info":
                print("\n".join(services.info()))
            elif args.action == "up":
                services_up()
            else:
                services.down()
    except (UserError, UnsafeFolder) as e:
        print(f"spikelab: error: {e}", file=sys.stderr)
        return USER_ERROR_EXIT
    except RunEnded as e:
        print(f"spikelab: {e} ({NEXT_STEP[e.status]})", file=sys.stderr)
        return e.code
    return 0


if __name__ == "__main__":
    sys.exit(main())
