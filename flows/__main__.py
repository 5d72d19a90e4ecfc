"""The ``spikelab`` command: the whole CLI surface.

  spikelab run STAGE [--profile NAME]   run one pipeline stage as a Prefect flow (what dvc.yaml calls)
  spikelab serve                        serve every flow as a deployment (trigger from the Prefect UI)
  spikelab services up|down|status      local Prefect + MLflow servers on 127.0.0.1

Exit codes: 0 done, 2 bad config or input (the message names the key or file), 75 preempted
(a checkpoint was saved; run again to resume), 1 anything else.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

from model.config import UserError, load_config
from model.stops import RunEnded
from tasks import paths

STAGES = {
    "prepare": "flows.data:prepare_flow",
    "filter": "flows.data:filter_flow",
    "tokenize": "flows.data:tokenize_flow",
    "search": "flows.search:search_flow",
    "pretrain": "flows.pretrain:pretrain_flow",
}
"""Stage name -> the flow that runs it. dvc.yaml calls ``spikelab run <stage>`` for each."""

USER_ERROR_EXIT = 2


def load_flow(stage: str):
    module, name = STAGES[stage].split(":")
    return getattr(importlib.import_module(module), name)


def run_stage(stage: str, profile: str | None) -> None:
    started = time.perf_counter()
    load_config(paths.project_dir() / "params.yaml", profile)  # fail fast, before any import cost
    where = paths.configure_environment()  # before prefect is imported
    flow = load_flow(stage)
    flow(profile=profile)
    print(f"[spikelab] {stage} done in {time.perf_counter() - started:.1f} s "
          f"(prefect: {where['prefect']}, mlflow: {where['mlflow']})", file=sys.stderr)


def serve() -> None:
    paths.configure_environment()
    from flows.deployments import serve_all
    serve_all()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spikelab", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one pipeline stage")
    run.add_argument("stage", choices=sorted(STAGES))
    run.add_argument("--profile", default=None, help="profile overlay (default: params.yaml's `profile`)")
    sub.add_parser("serve", help="serve all flows as Prefect deployments")
    svc = sub.add_parser("services", help="local Prefect and MLflow servers")
    svc.add_argument("action", choices=["up", "down", "status"])
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            run_stage(args.stage, args.profile)
        elif args.command == "serve":
            serve()
        else:
            from tasks import services
            if args.action == "status":
                for name, up in services.status().items():
                    print(f"{name}: {'up' if up else 'down'}")
            else:
                getattr(services, args.action)()
    except UserError as e:
        print(f"spikelab: error: {e}", file=sys.stderr)
        return USER_ERROR_EXIT
    except RunEnded as e:
        hint = "; checkpoint saved, run again to resume" if e.status == "preempted" else ""
        print(f"spikelab: {args.command} {getattr(args, 'stage', '')}: {e}{hint}", file=sys.stderr)
        return e.code
    return 0


if __name__ == "__main__":
    sys.exit(main())
