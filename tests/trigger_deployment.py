"""Trigger a served deployment through the Prefect API and wait for it, as the UI's Run button
does: ``python tests/trigger_deployment.py NAME PARAMETERS_JSON``. Prints the flow run as JSON
(id, state, message). A script, so the test process never imports Prefect's settings."""

import json
import sys
import time

from prefect import get_client
from prefect.deployments import run_deployment


def main() -> None:
    name, parameters = sys.argv[1], json.loads(sys.argv[2])
    with get_client(sync_client=True) as client:  # `spikelab serve` registers the deployments first
        for _ in range(480):
            try:
                client.read_deployment_by_name(name)
                break
            except Exception:
                time.sleep(0.5)
    flow_run = run_deployment(name, parameters=parameters, timeout=1500)  # a hang, not a slow machine (idle: 2-3 min)
    print(json.dumps({"id": str(flow_run.id), "state": flow_run.state.name, "message": flow_run.state.message}))


if __name__ == "__main__":
    main()
