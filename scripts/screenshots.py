"""Regenerate the docs' screenshots of the UIs (small palette PNGs in docs/screenshots/).

Needs this checkout's servers up with a pipeline run in them (``make demo``'s, which also
publishes the deployments, or a run of the ``spikelab-pipeline`` deployment) and Chromium
(scripts/setup.sh installs it where it can):

    python scripts/screenshots.py [--out docs/screenshots] [--report reports/report.html]

What it takes: the Prefect deployments, the pipeline's form and run; MLflow's runs, the
pretraining run and its charts, one LR-search trial (its params: LR, width, parametrization,
seed, steps) and its sweep's final validation loss against log2 LR (the compare page's scatter
plot); optuna-dashboard's study list and that sweep's study (the objective by name); and the
first screen of the report (``--report``: the committed study's, by default this checkout's
reports/report.html, opened as a file).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from model.private import run_private  # noqa: E402

MAX_BYTES = 200_000
TIDY = {
    "mlflow-runs": ['[data-component-id$="runnamecellrenderer.tsx_46"]'],  # unfold the newest pipeline run
    "mlflow-search-lr": ['[id$="-trigger-scatter-plot"]'],  # the compare page's scatter plot tab
}
"""CSS selectors clicked (first match) before a screenshot: by page-name prefix."""
CHOOSE = {"mlflow-search-lr": {"#x-axis-selector": "log2_lr", "#y-axis-selector": "loss/val"}}
"""Select boxes set (selector: option text) after TIDY's clicks, by page name."""
SCROLL_TO = {
    "mlflow-search-lr": '//*[contains(@id, "-trigger-scatter-plot")]',
    "mlflow-search-trial": '//*[starts-with(normalize-space(text()), "Parameters (")]',  # the trial's point
    "optuna-dashboard-study": '//*[normalize-space(text())="Hyperparameter Importance"]',  # log2_lr alone, no seed
}
"""The element (XPath) a page is scrolled to before its screenshot, by page name."""


def prefect_api(url: str, body: dict | None = None):
    from tasks.runtime.credentials import basic_auth

    headers = {"Content-Type": "application/json", **basic_auth(os.environ["PREFECT_API_AUTH_STRING"])}
    request = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


def newest_pipeline_run(api: str) -> dict:
    runs = prefect_api(
        f"{api}/flow_runs/filter",
        {
            "flows": {"name": {"any_": ["pipeline"]}},
            "sort": "START_TIME_DESC",
            "limit": 1,
            "flow_runs": {"state": {"type": {"any_": ["COMPLETED"]}}},
        },
    )
    if not runs:
        raise SystemExit("no completed pipeline run: run make demo (or the spikelab-pipeline deployment) first")
    return runs[0]


def pages(prefect_ui: str, mlflow_ui: str, flow_run: dict, deployment_id: str) -> dict[str, str]:
    """Screenshot name -> page, for the pipeline run ``flow_run`` and its MLflow runs."""
    import mlflow

    from tasks.runtime.paths import MLFLOW_TRAINING_VIEW

    client = mlflow.MlflowClient(mlflow_ui)
    stages = stage_runs(client, flow_run)
    if not stages:
        raise SystemExit(f"no MLflow stage run of pipeline run {flow_run['id']}: were MLflow and Prefect both up?")
    experiment = stages[0].info.experiment_id
    pretrain = [r for r in stages if r.data.tags["spikelab.stage"] == "pretrain"]
    found = {
        "prefect-deployments": f"{prefect_ui}/deployments",
        "prefect-pipeline-form": f"{prefect_ui}/deployments/deployment/{deployment_id}/run",
        "prefect-pipeline-run": f"{prefect_ui}/runs/flow-run/{flow_run['id']}",
        "mlflow-runs": f"{mlflow_ui}/#/experiments/{experiment}?{MLFLOW_TRAINING_VIEW}",
    }
    if pretrain:
        run_page = f"{mlflow_ui}/#/experiments/{experiment}/runs/{pretrain[0].info.run_id}"
        found["mlflow-pretrain-run"] = f"{run_page}?{MLFLOW_TRAINING_VIEW}"
        found["mlflow-pretrain-charts"] = f"{run_page}/model-metrics?{MLFLOW_TRAINING_VIEW}"
    trials = sweep_trials(client, stages)
    if trials:
        trial = trials[len(trials) // 2]
        found["mlflow-search-trial"] = (
            f"{mlflow_ui}/#/experiments/{experiment}/runs/{trial.info.run_id}?{MLFLOW_TRAINING_VIEW}"
        )
        runs = urllib.parse.quote(json.dumps([t.info.run_id for t in trials]))
        found["mlflow-search-lr"] = (
            f"{mlflow_ui}/#/compare-runs?runs={runs}&experiments={urllib.parse.quote(json.dumps([experiment]))}"
            f"&{MLFLOW_TRAINING_VIEW}"
        )
    return found


def stage_runs(client, flow_run: dict) -> list:
    """The MLflow runs of the pipeline run's stages (their own, not their children's): each carries the pipeline's flow run
    (``prefect.pipeline_run_id``, tasks/runtime/tracking.py), whether make demo's ``python -m
    flows.repro`` or the spikelab-pipeline deployment ran them."""
    experiments = [e.experiment_id for e in client.search_experiments()]
    tagged = client.search_runs(
        experiments, f"tags.`prefect.pipeline_run_id` = '{flow_run['id']}' and tags.`spikelab.stage` != ''"
    )
    return [r for r in tagged if "mlflow.parentRunId" not in r.data.tags]  # not their trials' and arms' runs


def sweep_trials(client, stages: list) -> list:
    """The completed trials of one LR sweep of the pipeline's search stage (μP where it ran, at its
    widest width), by LR: the trial child runs carry their point as params (tasks/search/trial.py)."""
    search = [r for r in stages if r.data.tags["spikelab.stage"] == "search"]
    if not search:
        return []
    trials = client.search_runs(
        [search[0].info.experiment_id],
        f"tags.`mlflow.parentRunId` = '{search[0].info.run_id}' and tags.`search.kind` = 'sweep' "
        "and tags.`search.status` = 'completed'",
    )
    groups: dict[tuple, list] = {}
    for t in trials:
        groups.setdefault((t.data.params["parametrization"] == "mup", int(t.data.params["width"])), []).append(t)
    if not groups:
        return []
    return sorted(groups[max(groups)], key=lambda t: float(t.data.params["log2_lr"]))


def study_page(mlflow_ui: str, dashboard_ui: str, flow_run: dict, auth: str) -> dict[str, str]:
    """optuna-dashboard's page of the study whose trials :func:`pages` shows (their ``optuna.study`` tag)."""
    import mlflow

    from tasks.runtime.credentials import basic_auth

    client = mlflow.MlflowClient(mlflow_ui)
    trials = sweep_trials(client, stage_runs(client, flow_run))
    if not trials:
        return {}
    name = trials[0].data.tags["optuna.study"]
    request = urllib.request.Request(f"{dashboard_ui}/api/studies", headers=basic_auth(auth))
    with urllib.request.urlopen(request, timeout=30) as response:
        studies = json.load(response)["study_summaries"]
    ids = [s["study_id"] for s in studies if s["study_name"] == name]
    return {"optuna-dashboard-study": f"{dashboard_ui}/dashboard/studies/{ids[0]}"} if ids else {}


def save_small(png: bytes, path: Path) -> int:
    """Downscale and quantize until the file is under MAX_BYTES."""
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    for width in (1100, 900, 700):
        scaled = image.resize((width, round(image.height * width / image.width)), Image.LANCZOS)
        buffer = io.BytesIO()
        scaled.quantize(colors=64).save(buffer, format="PNG", optimize=True)
        if buffer.tell() < MAX_BYTES:
            break
    path.write_bytes(buffer.getvalue())
    return buffer.tell()


def tidy(driver, name: str) -> None:
    from selenium.webdriver.common.by import By

    for prefix, selectors in TIDY.items():
        if name.startswith(prefix):
            for selector in selectors:
                for element in driver.find_elements(By.CSS_SELECTOR, selector)[:1]:
                    element.click()
                    time.sleep(1)
    for selector, option in CHOOSE.get(name, {}).items():
        for box in driver.find_elements(By.CSS_SELECTOR, selector)[:1]:
            box.click()
            time.sleep(1)
            for element in [o for o in driver.find_elements(By.CSS_SELECTOR, "[role=option]") if o.text == option][:1]:
                element.click()
                time.sleep(1)
    if path := SCROLL_TO.get(name):
        for element in driver.find_elements(By.XPATH, path)[:1]:
            driver.execute_script("arguments[0].scrollIntoView()", element)
            time.sleep(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs/screenshots")
    parser.add_argument("--settle", type=float, default=8.0, help="seconds a page gets to render")
    parser.add_argument("--height", type=int, default=1000, help="browser window height (pixels)")
    parser.add_argument(
        "--report", type=Path, default=ROOT / "reports/report.html", help="the report page whose first screen is taken"
    )
    args = parser.parse_args()
    from tasks.runtime import credentials, paths, services
    from tests import browser

    if reason := browser.missing():
        raise SystemExit(reason)
    down = [name for name, report in services.status().items() if not report.startswith("up")]
    if down:
        raise SystemExit(f"not up for this checkout: {', '.join(down)} (spikelab services up)")
    services.configure_environment()  # the login, into this process's environment
    flow_run = newest_pipeline_run(paths.prefect_url())
    deployment = prefect_api(f"{paths.prefect_url()}/deployments/name/pipeline/spikelab-pipeline")
    args.out.mkdir(parents=True, exist_ok=True)
    driver = browser.chrome(1280, args.height)
    login = credentials.load()
    try:
        browser.log_in_to_prefect(driver, paths.prefect_ui_url(), login.auth_string)
        browser.send_login(driver, login.username, login.password)
        shots = {
            **pages(paths.prefect_ui_url(), paths.mlflow_url(), flow_run, deployment["id"]),
            **study_page(paths.mlflow_url(), paths.dashboard_url(), flow_run, login.auth_string),
            "optuna-dashboard": paths.dashboard_url(),
        }
        if args.report.is_file():
            shots["report-first-screen"] = args.report.resolve().as_uri()
        else:
            print(f"{args.report}: not found; no report screenshot (run the report stage)")
        for name, url in shots.items():
            driver.get(url)
            time.sleep(args.settle)
            tidy(driver, name)
            size = save_small(driver.get_screenshot_as_png(), args.out / f"{name}.png")
            print(f"{args.out / name}.png  {size / 1000:.0f} KB  <- {url}")
    finally:
        driver.quit()


if __name__ == "__main__":
    sys.exit(run_private(main))
