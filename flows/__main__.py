"""spikelab: training-stability ablation studies (DVC stages run as Prefect flows, tracked in MLflow).

Heavy libraries (torch, prefect, mlflow, dvc) are imported only by the command that needs them,
so ``spikelab --help`` and ``spikelab ui`` answer at once.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from model.private import USER_ERROR_EXIT, keep_others_from_writing

if TYPE_CHECKING:
    from prefect.client.schemas.objects import State

    from model.stops import RunEnded

NEXT_STEP = {
    "preempted": "a checkpoint was saved; run the same command again to resume",
    "diverged": "no model was published; see the run's curves for where it went wrong",
    "stopped": "stopped before train.steps; no model was published",
}
"""What a user does next after a run that did not complete (the one-line message's tail)."""
RESUME = (
    "the stage's outputs are as they were and what it finished is kept (trials, arms, checkpoints): "
    "run it again to resume (make repro, dvc repro, or the same command)"
)
"""What a user does next after a stage was interrupted (SIGTERM, SIGINT)."""
INTERRUPTED_EXIT = 75
"""A stage stopped by SIGTERM or SIGINT exits as a preempted run does: EX_TEMPFAIL, run it again."""


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGINT while ``spikelab run`` ran a stage, raised in the main thread by the
    handler :func:`interrupts_raise` installs. Inside the flow Prefect raises its own
    TerminationSignal for SIGTERM first (its flow run and the MLflow runs end as interrupted) and
    then hands the signal on to that handler."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def interrupts_raise() -> Iterator[None]:
    """SIGTERM and SIGINT raise :class:`Interrupted` in the main thread (Python's default for
    SIGTERM ends the process at once, with no chance to put anything back)."""

    def interrupt(signum: int, _frame: Any) -> None:
        raise Interrupted(signum)

    previous = {}
    with contextlib.suppress(ValueError):  # signals are the main thread's only
        for s in (signal.SIGTERM, signal.SIGINT):
            previous[s] = signal.signal(s, interrupt)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGTERM and SIGINT ignored while outputs are put back: a second Ctrl-C must not leave
    them half moved."""
    previous = {}
    with contextlib.suppress(ValueError):
        for s in (signal.SIGTERM, signal.SIGINT):
            previous[s] = signal.signal(s, signal.SIG_IGN)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


EXAMPLES = """\
examples:
  make demo                               start here: every stage at tiny sizes in a copy (~4 min on 2 cores)
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
4 stopped by a callback, 75 preempted or interrupted (SIGTERM, Ctrl-C: run again to resume),
1 anything else. Under `dvc repro` DVC exits 255 when a stage fails (the stage's line says why),
`make repro` 2; stopped by Ctrl-C, make ends by the signal (130). `spikelab COMMAND --help`: what
a command does, its options and examples; `make help`: the make targets.
"""


def run_stage(
    stage: str, profile: str | None, sets: dict[str, Any], family: str | None = None, confirmatory: bool = False
) -> None:
    """Run ``stage``'s flow (the ablate stage's: ``family``'s arms alone, when given). Its
    versioned outputs (metrics, the LR, figures, the report) are set aside first and put back unless it completes (tasks/runtime/outputs.py: KeptOutputs), so an
    interrupt or an error leaves what git has; SIGTERM and SIGINT end it as interrupted (its
    Prefect flow run Cancelled, its MLflow runs KILLED) and raise :class:`Interrupted`. A stage
    that trains study seeds runs confirmatory or exploratory (:func:`registered`)."""
    from flows.stages import STAGES, require_inputs
    from model.numerics import apply_numerics
    from model.stops import RunEnded
    from tasks.config import project_config
    from tasks.design.registration import label_results, stage_seeds
    from tasks.design.seed_registry import TRAINED_BY
    from tasks.runtime import services
    from tasks.runtime.outputs import KeptOutputs
    from tasks.runtime.paths import REGISTRATION_ENV
    from tasks.runtime.startup import imports_without_gc
    from tasks.runtime.workers import scheduler

    started = time.perf_counter()
    cfg, project = project_config(profile, sets)  # fail fast, before any import cost
    if family is not None:
        check_family_stage(stage, family, cfg, project)
    require_inputs(project, stage)  # a fresh clone's: before any server starts
    if STAGES[stage].fans_out:
        scheduler(cfg.executor.scheduler)  # a malformed address is refused before anything is said
    label = None
    if stage in TRAINED_BY:  # the stages whose seeds are a study's
        cfg, sets, state = registered(stage, cfg, project, sets, confirmatory)
        label = state.label(stage_seeds(stage, cfg))
        os.environ[REGISTRATION_ENV] = state.state  # the spikelab.registration tag of its MLflow runs
    apply_numerics(cfg.precision.numerics)  # before torch loads, here and in the workers this starts
    where = services.configure_environment()  # before prefect is imported
    if STAGES[stage].fans_out:
        refuse_dask_without_prefect(cfg)
    with imports_without_gc():
        flow = STAGES[stage].load_flow()
    params = {"profile": cfg.profile, **({"overrides": sets} if sets else {}), **({"family": family} if family else {})}
    name = f"{stage} {cfg.profile}"
    from flows.pipeline import stage_task_run

    parent = stage_task_run(stage)  # under a pipeline run: make demo, make repro, the Prefect UI's
    crashed: list[Any] = []  # the flow run Prefect marked Crashed: a typed stop is a SystemExit
    flow = flow.with_options(on_crashed=[lambda _flow, flow_run, _state: crashed.append(flow_run.id)])
    kept = KeptOutputs(project, stage, STAGES[stage].versioned)
    try:
        kept.set_aside()
        if parent:
            run_under_task(flow, params, name, parent)
        else:
            flow.with_options(flow_run_name=name)(**params)
    except BaseException as e:
        with signals_held():
            # a diverged or stopped run published its metrics whole, saying so: they stay
            kept.put_back(keep_written=isinstance(e, RunEnded) and e.status in ("diverged", "stopped"))
        if isinstance(e, RunEnded):
            if crashed:
                mark_stopped(crashed[-1], stop_state(e))
            raise
        interrupt = interruption(e)
        if interrupt is None:
            raise
        if crashed:
            mark_stopped(crashed[-1], interrupted_state(interrupt))
        raise interrupt from None
    if label is not None:
        label_results(project, STAGES[stage].versioned, label)
    kept.discard()
    print(
        f"[spikelab] {stage} done in {time.perf_counter() - started:.1f} s "
        f"(prefect: {where['prefect']}, mlflow: {where['mlflow']})",
        file=sys.stderr,
    )


def registered(stage: str, cfg, project: Path, sets: dict[str, Any], confirmatory: bool):
    """The run's registration (tasks/design/registration.py): confirmatory when the profile's
    record holds this design and covers the stage (tasks/register/stages.py), its seeds checked
    against the registry; else refused under ``--confirmatory``, or run exploratory, saying so in
    its first line, its fresh seeds moved to the exploratory range. Returns the config and
    overrides to run with, and the state."""
    from model.typed_config import ConfigError
    from tasks.config import project_config
    from tasks.design.registration import EXPLORATORY, exploratory_seeds, refuse_fresh_declared_seeds
    from tasks.design.seed_registry import TRAINED_BY, check_stage, load_registry
    from tasks.design.studies import read_studies
    from tasks.register.stages import stage_state

    state = stage_state(stage, cfg, project)
    if state.state != EXPLORATORY:
        check_stage(stage, cfg)  # a study trains on seeds no earlier step used (tasks/design/seed_registry.yaml)
        print(
            f"[spikelab] {stage}: confirmatory under {state.record} (design {state.hashes['design_hash']})",
            file=sys.stderr,
        )
        return cfg, sets, state
    if confirmatory:
        raise ConfigError(
            f"--confirmatory: {state.why}; register the design first: spikelab register --profile {cfg.profile}, then commit"
        )
    registry = load_registry()
    exempt = cfg.profile in registry.exempt_profiles
    moved = exploratory_seeds(cfg, registry, [TRAINED_BY[stage]])
    if moved:
        sets = {**sets, **moved}
        cfg, _ = project_config(cfg.profile, sets)
    if stage == "ablate" and not exempt:
        refuse_fresh_declared_seeds(read_studies(project, cfg), registry)
    where = f"; fresh seeds run as {', '.join(f'{k}={v}' for k, v in moved.items())}" if moved else ""
    then = (
        "its profile is never registered"
        if exempt
        else f"to run it confirmatory: spikelab register --profile {cfg.profile}"
    )
    print(f"[spikelab] {stage}: EXPLORATORY, never counted as a verdict: {state.why}{where}; {then}", file=sys.stderr)
    return cfg, sets, state


def check_family_stage(stage: str, family: str, cfg, project: Path) -> None:
    """``--family`` names a family of the study, and the stage is the one that trains families."""
    from model.typed_config import ConfigError
    from tasks.ablate.grid import check_family
    from tasks.design.studies import read_studies

    if stage != "ablate":
        raise ConfigError(f"--family: only the ablate stage trains a family's arms, not {stage}")
    check_family(family, cfg, read_studies(project, cfg))


def refuse_dask_without_prefect(cfg) -> None:
    """On a Dask cluster, a Prefect server must answer before the flow starts: else the flow
    would start on a temporary server its workers cannot reach (tasks/runtime/workers.py)."""
    from tasks.runtime.config import LOCAL
    from tasks.runtime.workers import reporting_to, scheduler

    address = scheduler(cfg.executor.scheduler)
    if address != LOCAL:
        reporting_to(f"Dask scheduler {address}")


def interruption(exc: BaseException) -> Interrupted | None:
    """The signal behind ``exc`` as an :class:`Interrupted`: Prefect's TerminationSignal (SIGTERM
    inside a flow), Python's KeyboardInterrupt (SIGINT), or one already raised; else None."""
    from prefect.exceptions import TerminationSignal

    if isinstance(exc, Interrupted):
        return exc
    if isinstance(exc, TerminationSignal):
        return Interrupted(exc.signal)
    if isinstance(exc, KeyboardInterrupt):
        return Interrupted(signal.SIGINT)
    return None


def stop_state(stop: RunEnded) -> State[None]:
    """A typed stop as a Prefect state: preempted or stopped runs Cancelled, a divergence Failed,
    with the line the command prints (what to do next)."""
    from prefect.states import Cancelled, Failed

    return (Failed if stop.status == "diverged" else Cancelled)(message=f"{stop} ({NEXT_STEP[stop.status]})")


def interrupted_state(interrupt: Interrupted) -> State[None]:
    from prefect.states import Cancelled

    return Cancelled(message=f"stopped by {interrupt} ({RESUME})")


def mark_stopped(flow_run_id: Any, state: State[None]) -> None:
    """A stop in the Prefect UI as what it was (``state``: :func:`stop_state`, :func:`interrupted_state`),
    not "Crashed"."""
    from prefect import get_client

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
            url = services.service(name).url
            print(f"{name:8} {mlflow_experiment_page(url) if name == 'mlflow' else url}")
            found = True
    if not found:
        print("no UI is up for this checkout; start them with: spikelab services up")


def mlflow_experiment_page(home: str) -> str:
    """MLflow's page of the study's experiment (its runs, in the model-training view): of the
    experiments this project's profiles name (``tracking.experiment``), the one updated last;
    ``home`` before the first stage made one, or when the server does not answer."""
    import json
    import ssl
    import urllib.request

    from model.typed_config import PROFILES_DIR
    from tasks.config import project_config
    from tasks.runtime import credentials, paths, services

    cfg, project = project_config()
    profiles = [p.stem for p in (project / PROFILES_DIR).glob("*.yaml")]
    names = {cfg.tracking.experiment, *(project_config(p)[0].tracking.experiment for p in profiles)}
    base = paths.mlflow_url()
    try:
        request = urllib.request.Request(
            f"{base}/api/2.0/mlflow/experiments/search?max_results=1000&order_by=last_update_time+DESC",
            headers=credentials.basic_auth(credentials.load().auth_string),
        )
        context = ssl.create_default_context(cafile=services.trusted_ca("mlflow")) if base.startswith("https") else None
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            experiments = json.load(response).get("experiments", [])
    except (OSError, ValueError):  # no login file (a UserError), no answer, a refused login, no CA file: home
        return home
    ids = [e["experiment_id"] for e in experiments if e.get("name") in names]
    return f"{base}/#/experiments/{ids[0]}?{paths.MLFLOW_TRAINING_VIEW}" if ids else home


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


COMMANDS: dict[str, tuple[str, str, str]] = {
    "run": (
        "run one pipeline stage as a Prefect flow (what dvc.yaml calls)",
        "Run one stage of the study as a Prefect flow, tracked in MLflow: what each stage of dvc.yaml\n"
        "calls. Run this way nothing is cached or versioned; `dvc repro <stage>` runs it and what it\n"
        "needs, cached, and `dvc exp run -S key=value` records a variant as a DVC experiment.\n"
        "The stage's versioned outputs (metrics, the LR, figures, the report) are set aside while it\n"
        "runs and put back if it fails or is stopped: SIGTERM or Ctrl-C ends it with exit code 75, its\n"
        "MLflow runs KILLED; run it again to resume.",
        "  spikelab run prepare --profile smoke      the first stage at the smoke profile's sizes\n"
        "  spikelab run pretrain --set optim.lr=0.02 --set train.steps=100\n"
        "  dvc repro pretrain                        the same stage, cached, after what it needs",
    ),
    "register": (
        "freeze a design: its registration record, before any study seed runs (docs/registration.md)",
        "Freeze the profile's design (the design code's hash, the resolved config, studies.yaml) into\n"
        "tasks/design/registrations/<profile>.yaml with the commit it is made at, the UTC time and the\n"
        "seeds it registers. Refused, in one line, with uncommitted changes to what the design covers,\n"
        "an exploratory seed, a seed the registry lists, or a gate fixed by construction. The seeds of\n"
        "results that exist now go into the seed registry. Prints each family's looks and each\n"
        "claim's power. Then `spikelab run ablate|spike|search` runs confirmatory; any other design\n"
        "runs exploratory (or is refused with --confirmatory).",
        "  spikelab register --dry-run               the checks and the plan, nothing written\n"
        "  spikelab register --profile default && git add tasks/design && git commit -m 'register'",
    ),
    "status": (
        "stages up to date or not, servers and whose they are, newest MLflow runs",
        "Say where this checkout stands, starting nothing: each DVC stage up to date or changed (and\n"
        "what changed), each server up for this checkout, down, or another checkout's on its port, and\n"
        "the newest MLflow runs with their status. Takes no options.",
        "  spikelab status",
    ),
    "ui": (
        "print the address of every UI that is up for this checkout",
        "Print the address of each UI that is up for this checkout: the Prefect UI, the MLflow UI and\n"
        "optuna-dashboard. Never the login: `spikelab services info` says where it is. Takes no options.",
        "  spikelab ui\n  spikelab services up && spikelab ui       start the servers first if none is up",
    ),
    "serve": (
        "serve the pipeline and each stage as Prefect deployments (forms in the UI)",
        "Publish the pipeline and each stage as Prefect deployments and serve them in the foreground\n"
        "(Ctrl-C stops): from the Prefect UI a run of the study or of one stage starts with a\n"
        "parameter form (profile, arm keys, overrides), cached through DVC like `dvc repro`.\n"
        "Start the servers first. Takes no options.",
        "  spikelab services up\n  spikelab serve                            in the Prefect UI: spikelab-pipeline, Run",
    ),
    "services": (
        "this checkout's Prefect and MLflow servers and optuna-dashboard on 127.0.0.1 (info: where the login is)",
        "Start, stop or inspect this checkout's servers: Prefect (default port 4200), MLflow (5000) and\n"
        "optuna-dashboard on the search's studies (8080), on 127.0.0.1 unless SPIKELAB_HOST names\n"
        "another interface. Every stage started while they are up tracks to them and shows in their\n"
        "UIs; without them each stage starts a temporary Prefect server and MLflow writes to a local\n"
        "store. They ask for a login made at the first `up` into <state>/credentials.json (mode 0600);\n"
        "nothing prints the password. Other ports: SPIKELAB_PREFECT_PORT, SPIKELAB_MLFLOW_PORT,\n"
        "SPIKELAB_DASHBOARD_PORT.\n"
        "\n"
        "actions:\n"
        "  up      start whichever server is not running for this checkout; wait until each answers\n"
        "  down    stop the servers this checkout started (never another checkout's)\n"
        "  status  each server: up for this checkout, down, or another checkout's on its port\n"
        "  info    each UI's address and where the login is (the file, never the password)",
        "  spikelab services up\n"
        "  spikelab services info                    the addresses and the login file\n"
        "  SPIKELAB_MLFLOW_PORT=5100 spikelab services up   another port, when 5000 is taken",
    ),
    "prefect": (
        "the Prefect CLI against this checkout's server, logged in (never printing the login)",
        "Run Prefect's own CLI against this checkout's Prefect server: everything after `prefect` is\n"
        "its command line. The login reaches it through its environment, never its output; a plain\n"
        "`prefect` in a shell gets HTTP 401 from the server (docs/services.md).",
        "  spikelab prefect deployment ls\n"
        "  spikelab prefect deployment run pipeline/spikelab-pipeline   runs while `spikelab serve` runs",
    ),
    "check": (
        "verify a finished study: other arithmetic, unseen seeds, MLflow, another machine, labels",
        "Run one of the scripts in checks/ that verify a finished study (they benchmark nothing):\n"
        "everything after NAME is the script's own command line (`spikelab check NAME --help`).\n"
        "\n"
        "checks:\n"
        "{checks}",
        "  spikelab check arithmetic --stages ablate              the verdicts on the other numeric path\n"
        "  spikelab check arithmetic --stages ablate --seeds-from 8   ... on seeds the study never saw\n"
        "  spikelab check mlflow                                   every number recomputed from MLflow",
    ),
}
"""Each command's one-line help, its description and its examples (``spikelab <command> --help``)."""

CLUSTER_EXAMPLES = """\
  spikelab cluster up --workers 4          a scheduler and 4 workers here; prints the address
  SPIKELAB_SCHEDULER=tls://127.0.0.1:8786 dvc repro ablate
  spikelab cluster join tls://10.0.0.5:8786 --tls ~/head-tls --gpus 2   on a worker node
  spikelab cluster down"""


def command_parser(sub, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A subcommand whose ``--help`` says what it does, its options and an example."""
    short, description, examples = COMMANDS[name]
    if name == "check":
        from flows.checks import listing

        description = description.format(checks=listing())
    command: argparse.ArgumentParser = sub.add_parser(
        name,
        help=short,
        description=description,
        epilog=f"examples:\n{examples}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        **kwargs,
    )
    return command


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
    run = command_parser(sub, "run")
    run.add_argument("stage", choices=list(STAGES), help="the stage to run: %(choices)s (dvc.yaml's order)")
    add_config_arguments(run, params=False)
    run.add_argument("--family", help="ablate only: one family's arms alone (a built-in or a studies.yaml name)")
    run.add_argument(
        "--confirmatory",
        action="store_true",
        help="ablate, spike, search: refuse to run unless the profile's registration holds this design "
        "(default: an unregistered design runs exploratory)",
    )
    register = command_parser(sub, "register")
    register.add_argument("--profile", default=None, help="the profile to register (default: params.yaml's)")
    register.add_argument("--dry-run", action="store_true", help="check and print the plan; write nothing")
    register.add_argument(
        "--stages",
        nargs="+",
        metavar="STAGE",
        help="register only these stages' seeds and findings: ablate, spike, search (default: all three); "
        "a stage left out runs exploratory",
    )
    for name in ("status", "ui", "serve"):
        command_parser(sub, name)
    svc = command_parser(sub, "services")
    svc.add_argument("action", choices=["up", "down", "status", "info"], help="what to do (see actions above)")
    add_cluster_parser(sub)
    command_parser(sub, "prefect").add_argument(
        "arguments", nargs=argparse.REMAINDER, help="prefect's own command line"
    )
    from flows.checks import CHECKS

    check = command_parser(sub, "check")
    check.add_argument("name", choices=list(CHECKS), help="the check to run (see checks above)")
    check.add_argument("arguments", nargs=argparse.REMAINDER, help="the check's own options")
    return p


def add_cluster_parser(sub) -> None:
    cluster = sub.add_parser(
        "cluster",
        help="a Dask scheduler and workers for the ablate and search stages' units (docs/scaling.md)",
        description="Start, stop or show this checkout's Dask processes: a scheduler and single-threaded\n"
        "workers that train the ablate and search stages' units (arms, trials), talking mutual TLS.\n"
        "The stages use a cluster when executor.scheduler (params.yaml) or SPIKELAB_SCHEDULER names its\n"
        "address; by default each fan-out starts a local one of its own.\n"
        "`spikelab cluster ACTION --help` shows an action's options.",
        epilog=f"examples:\n{CLUSTER_EXAMPLES}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = cluster.add_subparsers(dest="action", required=True, metavar="ACTION")

    def action(name: str, short: str, description: str, example: str) -> argparse.ArgumentParser:
        one: argparse.ArgumentParser = actions.add_parser(
            name,
            help=short,
            description=description,
            epilog=f"example:\n  {example}",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        return one

    up = action(
        "up",
        "a scheduler and its workers on this machine; prints the address",
        "Start a Dask scheduler and its workers on this machine, recorded as this checkout's, and print\n"
        "the address the stages and other nodes use. Start the servers first (spikelab services up):\n"
        "the workers report their task runs to this checkout's Prefect server.",
        "spikelab cluster up --workers 4",
    )
    up.add_argument("--port", type=int, default=8786, help="the scheduler's port (default: %(default)s)")
    up.add_argument(
        "--host", default="127.0.0.1", help="the interface it listens on; another node's workers need one they reach"
    )
    join = action(
        "join",
        "workers on this machine for a scheduler elsewhere (a head node's)",
        "Start workers on this machine for a scheduler that runs elsewhere (a head node's `cluster up`),\n"
        "with a copy of the head node's TLS folder and credentials file (docs/scaling.md).",
        "spikelab cluster join tls://10.0.0.5:8786 --tls ~/head-tls --gpus 2",
    )
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
    for one in (up, join):
        one.add_argument("--workers", type=int, default=0, help="CPU workers, one thread each (0: one per core)")
        one.add_argument("--gpus", type=int, default=0, help="instead: one worker per GPU, with the resource GPU=1")
    action(
        "down",
        "stop the scheduler and workers this checkout started",
        "Stop the Dask scheduler and workers this checkout started (never another checkout's).\nTakes no options.",
        "spikelab cluster down",
    )
    action(
        "status",
        "what runs for this checkout, and the address to use",
        "Say which Dask processes run for this checkout and the address the stages use.\nTakes no options.",
        "spikelab cluster status",
    )


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
            with interrupts_raise():
                run_stage(args.stage, args.profile, parse_sets(args.sets), args.family, args.confirmatory)
        elif args.command == "register":
            from tasks.register.command import register
            from tasks.runtime.paths import project_dir

            print("\n".join(register(project_dir(), args.profile, args.dry_run, args.stages)))
        elif args.command == "status":
            show_status()
        elif args.command == "ui":
            show_ui()
        elif args.command == "serve":
            serve()
        elif args.command == "cluster":
            run_cluster(args)
        elif args.command == "prefect":
            from tasks.runtime import services

            return services.run_prefect_cli(args.arguments)
        elif args.command == "check":
            from flows.checks import run_check

            return run_check(args.name, args.arguments)
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
    except Interrupted as e:
        print(f"spikelab: {args.stage} stopped by {e}; {RESUME}", file=sys.stderr)
        return INTERRUPTED_EXIT
    except KeyboardInterrupt:
        print(f"spikelab: {args.command} interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
