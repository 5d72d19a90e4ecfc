"""The study as a user meets it in the UIs, against real servers: the pipeline deployment triggered
through the Prefect API with a typed override, then a failing one, then ones that try to reach
outside the project; no secret anywhere the run wrote; the Prefect UI, the MLflow UI and
optuna-dashboard logged in to, and every figure opened, in a real (headless) browser."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml

from flows.stages import STAGES
from tests.smoke_study import pipeline_mlflow_runs, prefect, run, trigger

pytestmark = pytest.mark.e2e
FAILING_OVERRIDE = {"extra_overrides": {"data.source": "jsonl", "data.path": "corpus/missing.jsonl"}}


@pytest.fixture(scope="module")
def mlflow_client(live_services):
    import mlflow

    return mlflow.MlflowClient(live_services["MLFLOW_TRACKING_URI"])


def test_the_pipeline_shows_one_task_per_stage_with_live_logs_and_each_stage_flow_run_linked_to_it(
    served, pipeline_run
):
    _, env = served
    tasks = prefect(env, "task_runs/filter", {"flow_runs": {"id": {"any_": [pipeline_run["id"]]}}})
    assert sorted(t["name"] for t in tasks) == sorted(["params", *STAGES])  # params: DVC only, no flow
    children = prefect(
        env,
        "flow_runs/filter",
        {"flow_runs": {"parent_flow_run_id": {"operator": "and_", "any_": [pipeline_run["id"]]}}},
    )
    assert sorted(c["name"] for c in children) == sorted(f"{s} smoke" for s in STAGES)
    by_task = {t["id"]: t["name"] for t in tasks}
    assert all(by_task[c["parent_task_run_id"]] == c["name"].split()[0] for c in children)
    assert all(c["parameters"]["profile"] == "smoke" for c in children)
    pretrain = next(t["id"] for t in tasks if t["name"] == "pretrain")
    logs = prefect(env, "logs/filter", {"logs": {"task_run_id": {"any_": [pretrain]}}, "sort": "TIMESTAMP_ASC"})
    assert any("Running stage 'pretrain'" in log["message"] for log in logs)
    stamps = sorted({log["timestamp"] for log in logs})
    assert len(stamps) > len(logs) // 2, "lines are logged as they arrive, not all at the end"


def test_every_stage_publishes_a_summary_linking_its_mlflow_runs_and_fan_out_stages_their_progress(
    served, pipeline_run
):
    _, env = served
    children = prefect(
        env,
        "flow_runs/filter",
        {"flow_runs": {"parent_flow_run_id": {"operator": "and_", "any_": [pipeline_run["id"]]}}},
    )
    ids = [pipeline_run["id"], *(c["id"] for c in children)]
    artifacts = prefect(env, "artifacts/filter", {"artifacts": {"flow_run_id": {"any_": ids}}})
    progress = [a for a in artifacts if a["type"] == "progress"]
    summaries = [a for a in artifacts if a["type"] != "progress"]
    assert sorted(a["key"] for a in summaries) == sorted(["pipeline-summary", *(f"{s}-summary" for s in STAGES)])
    # the fan-out stages count their units: the search (two rounds: sweeps, then the transfer), the
    # spike study, the arms, and each pass of the data stages over their shards
    data_passes = {
        "filter-screen",
        "filter-count",
        "filter-score",
        "filter-write",
        "tokenize-sample",
        "tokenize-encode",
    }
    assert {a["key"] for a in progress} == {
        "search-progress",
        "spike-progress",
        "ablate-progress",
        *(f"{p}-progress" for p in data_passes),
    }
    assert all(float(a["data"]) == 100.0 and " done" in a["description"] for a in progress)
    mlflow_ui = env["MLFLOW_TRACKING_URI"]
    unlinked = [
        a["key"] for a in summaries if f"]({mlflow_ui}/#/experiments/" not in a["data"] or a["type"] != "markdown"
    ]
    assert not unlinked, f"artifacts without an MLflow link: {unlinked}"
    pretrain = next(a["data"] for a in artifacts if a["key"] == "pretrain-summary")
    assert "| final_loss |" in pretrain and "loss.png" in pretrain and "/artifacts/figures/loss.png" in pretrain


def test_mlflow_nests_each_stage_run_under_the_pipeline_run_with_its_lineage(served, pipeline_run, mlflow_client):
    project, env = served
    parent, children = pipeline_mlflow_runs(mlflow_client, pipeline_run["id"])
    assert sorted(children) == sorted(STAGES)
    commit = run(["git", "rev-parse", "HEAD"], project, env).stdout.strip()
    experiment = parent.data.tags["spikelab.dvc_exp"]
    assert experiment.startswith("ui-")
    for stage, child in children.items():
        tags = child.data.tags
        assert child.info.status == "FINISHED" and child.info.run_name.startswith(f"{stage} smoke ")
        assert tags["mlflow.source.git.commit"] == commit and "spikelab.code_changed" not in tags
        assert tags["spikelab.dvc_exp"] == experiment and tags["spikelab.profile"] == "smoke"
        assert tags["prefect.pipeline_run_id"] == pipeline_run["id"]
        assert tags["prefect.flow_run_url"].startswith(env["PREFECT_API_URL"].removesuffix("/api") + "/runs/flow-run/")
        assert len(tags["spikelab.dvc_inputs"]) == 16
    assert children["pretrain"].data.params["optim.beta2"] == "0.98", "the typed form value reached the stage"
    assert experiment in run(["dvc", "exp", "list", "--names-only"], project, env).stdout


def tree_digest(project: Path, *paths: str) -> dict[str, str]:
    files = sorted(
        f
        for p in paths
        for f in ([project / p] if (project / p).is_file() else (project / p).rglob("*"))
        if f.is_file()
    )
    return {str(f.relative_to(project)): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"data.source": "text", "data.path": "/root/.ssh"}, "data.path"),
        ({"search.storage": "journal:/etc/cron.d/spikelab-probe"}, "search.storage"),
        ({"executor.scheduler": "tls://127.0.0.1:8786"}, "executor.scheduler"),
    ],
)
def test_a_run_from_outside_that_reaches_past_the_project_is_refused_naming_the_key_and_writes_nothing(
    served, pipeline_run, overrides, key
):
    project, _ = served
    before = tree_digest(project, "params.yaml", "dvc.lock", "data")
    flow_run = trigger(served, "pipeline/spikelab-pipeline", {"extra_overrides": overrides})
    assert (
        flow_run["state"] == "Failed"
        and f"{key}: refused from a run started in the Prefect UI or API" in (flow_run["message"])
    ), flow_run["message"]
    assert tree_digest(project, "params.yaml", "dvc.lock", "data") == before
    assert not Path("/etc/cron.d/spikelab-probe").exists()


def test_a_declared_family_runs_from_its_deployment_with_the_forms_factor_values(served, pipeline_run):
    project, _ = served
    parameters = {"family": "qk_rescue", "factors": {"optim.lr": [0.003, 0.03]}}
    flow_run = trigger(served, "study/spikelab-study-qk_rescue", parameters)
    assert flow_run["state"] == "Completed", flow_run
    written = yaml.safe_load((project / "studies.yaml").read_text())["families"]["qk_rescue"]["factors"]
    assert written["optim"]["lr"] == [0.003, 0.03] and written["model"]["qk_norm"] == [False, True]
    arms = json.loads((project / "metrics/ablate.json").read_text())["arms"]
    assert {a["factors"]["optim.lr"] for a in arms if a["family"] == "qk_rescue"} == {0.003, 0.03}
    assert "qk_rescue" in json.loads((project / "metrics/report.json").read_text())["findings"]


@pytest.mark.parametrize(
    "factors, message",
    [
        ({"optim.beta2": [0.9]}, "factors.optim.beta2: not a factor of qk_rescue"),
        ({"optim.lr": ["fast"]}, "families.qk_rescue.factors.optim.lr"),
    ],
)
def test_a_bad_value_for_a_declared_family_fails_naming_the_key_and_writes_nothing(
    served, pipeline_run, factors, message
):
    project, _ = served
    before = tree_digest(project, "params.yaml", "studies.yaml", "dvc.lock", "metrics")
    flow_run = trigger(served, "study/spikelab-study-qk_rescue", {"family": "qk_rescue", "factors": factors})
    assert flow_run["state"] == "Failed" and message in flow_run["message"], flow_run["message"]
    assert tree_digest(project, "params.yaml", "studies.yaml", "dvc.lock", "metrics") == before


def secrets_of(env: dict[str, str]) -> list[bytes]:
    """The login as it could leak: the password, MLflow's session key, the Authorization header."""
    from tasks.runtime import credentials

    login = credentials.load()
    header = credentials.basic_auth(login.auth_string)["Authorization"].split()[1]
    return [login.password.encode(), login.session_key.encode(), header.encode()]


def test_no_secret_in_any_file_log_command_line_mlflow_record_or_prefect_run(
    served, pipeline_run, mlflow_client, live_services
):
    """A study run with the generated login: grep every file the run wrote (project and state
    directory: stores, logs, artifacts), every server's command line, every MLflow param and tag,
    and every Prefect flow run's parameters and logs."""
    import psutil

    from tasks.runtime import credentials, paths

    project, env = served
    secrets = secrets_of(env)
    keeps_it = {credentials.credentials_file()}  # the one file that holds it, 0600
    files = [f for root in (project, paths.state_dir()) for f in root.rglob("*") if f.is_file() and f not in keeps_it]
    assert len(files) > 100 and any(f.suffix == ".log" for f in files)
    leaked = [str(f) for f in files if any(s in f.read_bytes() for s in secrets)]
    assert not leaked, leaked
    assert not [str(f) for f in files if f.stat().st_mode & 0o002], "a file any user may write"
    assert paths.state_dir().stat().st_mode & 0o077 == 0, "the state directory is its owner's alone"
    for proc in psutil.process_iter(["cmdline"]):
        assert not any(s.decode() in " ".join(proc.info["cmdline"] or []) for s in secrets), proc.pid
    experiments = [e.experiment_id for e in mlflow_client.search_experiments()]
    for run_ in mlflow_client.search_runs(experiments, max_results=5000):
        recorded = repr(run_.data.params) + repr(run_.data.tags)
        assert not any(s.decode() in recorded for s in secrets), run_.info.run_id
    flow_runs = prefect(env, "flow_runs/filter", {"limit": 200})
    logs = prefect(env, "logs/filter", {"limit": 200, "logs": {"flow_run_id": {"any_": [pipeline_run["id"]]}}})
    assert flow_runs and logs
    text = json.dumps(flow_runs) + json.dumps(logs)
    assert not any(s.decode() in text for s in secrets)


def test_a_failing_override_fails_with_the_stages_error_and_leaves_the_workspace_byte_identical(served, pipeline_run):
    project, env = served
    watched = ("params.yaml", "dvc.lock", "models", "metrics", "data/raw", "reports")
    before = tree_digest(project, *watched)
    flow_run = trigger(served, "pipeline/spikelab-pipeline", FAILING_OVERRIDE)
    assert flow_run["state"] == "Failed"
    assert (
        "stage prepare failed" in flow_run["message"]
        and "data.path:" in flow_run["message"]
        and "corpus/missing.jsonl does not exist" in flow_run["message"]
    ), flow_run["message"]
    assert tree_digest(project, *watched) == before
    assert "up to date" in run(["dvc", "status"], project, env).stdout


# --------------------------------------------------------------------------------------------
# In a real browser
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser_kit():
    try:
        from tests import browser as kit
    except ImportError as e:
        pytest.skip(f"selenium is not installed ({e})")
    if reason := kit.missing():
        pytest.skip(reason)
    return kit


@pytest.fixture(scope="module")
def browser(browser_kit, live_services):
    """A browser that gives MLflow and optuna-dashboard the login, as a person does at their prompt."""
    driver = browser_kit.chrome()
    try:
        browser_kit.send_login(
            driver, live_services["MLFLOW_TRACKING_USERNAME"], live_services["MLFLOW_TRACKING_PASSWORD"]
        )
        yield driver
    finally:
        driver.quit()


@pytest.fixture()
def fresh_browser(browser_kit):
    """A browser that has given no login yet."""
    driver = browser_kit.chrome()
    try:
        yield driver
    finally:
        driver.quit()


def test_without_the_login_the_uis_show_a_login_and_nothing_else(served, pipeline_run, browser_kit, fresh_browser):
    from selenium.webdriver.common.by import By

    from tasks.runtime import paths

    fresh_browser.get(f"{paths.prefect_ui_url()}/deployments")
    browser_kit.wait_for_text(fresh_browser, "Login")
    assert fresh_browser.find_elements(By.CSS_SELECTOR, "input[type=password]")
    assert "spikelab-pipeline" not in browser_kit.page_text(fresh_browser)
    for ui in (paths.mlflow_url(), f"{paths.dashboard_url()}/dashboard"):
        fresh_browser.get(ui)  # the browser's own login prompt is not a page: nothing of the study shows
        assert "pipeline" not in fresh_browser.page_source and "Model training" not in fresh_browser.page_source


def test_the_prefect_ui_lists_the_deployments_and_shows_a_pipeline_run_with_its_stages(
    served, pipeline_run, browser_kit, fresh_browser
):
    from tests.browser import wait_for_text

    ui = served[1]["PREFECT_API_URL"].removesuffix("/api")
    browser_kit.log_in_to_prefect(fresh_browser, ui, served[1]["PREFECT_API_AUTH_STRING"])  # its login page
    deployments = {d["name"]: d["id"] for d in prefect(served[1], "deployments/filter", {})}
    ours = ["spikelab-pipeline", *(f"spikelab-{s}" for s in STAGES)]
    assert set(ours) <= set(deployments)
    fresh_browser.get(f"{ui}/deployments")  # a page of ten: the count says every one is listed
    wait_for_text(fresh_browser, f"{len(deployments)} Deployments", "spikelab-pipeline")
    for name in ours:  # each one's own page
        fresh_browser.get(f"{ui}/deployments/deployment/{deployments[name]}")
        wait_for_text(fresh_browser, name)
    fresh_browser.get(f"{ui}/runs/flow-run/{pipeline_run['id']}")
    text = wait_for_text(fresh_browser, "spikelab-pipeline", "Completed", "$ dvc repro --single-item prepare")
    assert "Can't connect to Server API" not in text


def test_optuna_dashboard_lists_the_searchs_studies(served, pipeline_run, browser):
    import optuna

    from tasks.runtime import paths
    from tests.browser import wait_for_text

    journal = optuna.storages.journal.JournalFileBackend(str(paths.state().optuna_journal))
    names = optuna.get_all_study_names(optuna.storages.JournalStorage(journal))
    assert names, "the search wrote no study"
    browser.get(f"{paths.dashboard_url()}/dashboard")
    wait_for_text(browser, *names[:3])


def test_the_mlflow_ui_opens_the_experiment_for_model_training_with_stage_runs_nested(
    served, pipeline_run, browser, mlflow_client
):
    from tests.browser import wait_for_text

    parent, children = pipeline_mlflow_runs(mlflow_client, pipeline_run["id"])
    ui = served[1]["MLFLOW_TRACKING_URI"]
    browser.get(f"{ui}/#/experiments/{parent.info.experiment_id}?workflowType=machine_learning")
    text = wait_for_text(browser, "Model training", parent.info.run_name)
    assert "Token Usage" not in text, "the GenAI overview opened instead of the runs"
    child = children["pretrain"]
    browser.get(f"{ui}/#/experiments/{child.info.experiment_id}/runs/{child.info.run_id}?workflowType=machine_learning")
    wait_for_text(browser, child.info.run_name, "Parent run", parent.info.run_name, "tokens")


def test_every_figure_under_reports_opens_offline(served, pipeline_run, browser):
    from tests.browser import image_loads

    figures = sorted((served[0] / "reports").rglob("*.png"))
    assert {"pretrain/loss.png", "pretrain/optimizer.png", "pretrain/stability.png", "search/mu_transfer.png"} <= {
        f.relative_to(served[0] / "reports").as_posix() for f in figures
    }
    assert all(image_loads(browser, f.as_uri()) for f in figures)
