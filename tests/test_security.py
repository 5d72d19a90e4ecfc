"""No way in for another local user: the login is generated once, kept from other users and never
echoed; passwords never ride in a URL; a plain-TCP Dask scheduler is refused; MLflow serves
artifacts only from its root, never through a symlink; and, acting as ``nobody`` against the real
servers and a stage's own Dask cluster, every request without the login or the certificate is
refused while the same request with them succeeds."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from model.typed_config import ConfigError, UserError, no_password
from tasks.runtime.config import check_scheduler
from tasks.runtime.paths import UnsafeFolder
from tests.other_user import (
    DASK_HTTP_ROUTES,
    DASK_PROBES,
    OTHER,
    PORT_SQUATTER,
    dask_http_expected,
    dask_http_seen_by_other_user,
    other_user_has_distributed,
    run_as_other_user,
    skip_reason,
    start_as_other_user,
)


@pytest.fixture()
def state(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SPIKELAB_STATE", str(tmp_path / "state"))
    for key in ("SPIKELAB_CREDENTIALS", "SPIKELAB_PASSWORD", "SPIKELAB_TLS_DIR"):
        monkeypatch.delenv(key, raising=False)
    return tmp_path / "state"


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# --------------------------------------------------------------------------------------------
# The login and the state directory
# --------------------------------------------------------------------------------------------


def test_the_login_is_generated_once_into_a_file_only_its_owner_reads(state, capsys):
    from tasks.runtime import credentials, services

    first = credentials.ensure()
    path = state / "credentials.json"
    assert mode(path) == 0o600 and mode(state) == 0o700
    assert credentials.ensure() == first and len(first.password) >= 32  # re-used, not regenerated
    assert first.password not in repr(first) and first.session_key not in repr(first)
    print("\n".join(services.info()))
    said = capsys.readouterr().out
    assert str(path) in said and "user spikelab" in said and first.password not in said


def test_the_password_is_taken_from_the_environment_at_the_first_up_only(state, monkeypatch):
    from tasks.runtime import credentials

    monkeypatch.setenv("SPIKELAB_PASSWORD", "from-a-secret-store")
    assert credentials.ensure().password == "from-a-secret-store"
    monkeypatch.setenv("SPIKELAB_PASSWORD", "another")
    assert credentials.ensure().password == "from-a-secret-store"


@pytest.mark.parametrize("bad_mode", [0o640, 0o604])
def test_a_credentials_file_other_users_can_read_is_refused_naming_it_never_its_content(state, bad_mode):
    from tasks.runtime import credentials

    login = credentials.ensure()
    (state / "credentials.json").chmod(bad_mode)
    with pytest.raises(UserError, match=f"credentials {state / 'credentials.json'}: other users can read it") as e:
        credentials.load()
    assert login.password not in str(e.value)


def test_a_missing_credentials_file_says_where_it_comes_from(state, monkeypatch):
    from tasks.runtime import credentials

    monkeypatch.setenv("SPIKELAB_CREDENTIALS", str(state / "copied.json"))
    with pytest.raises(UserError, match="copied.json: not found; `spikelab services up` creates it"):
        credentials.load()


def test_the_state_directory_is_made_private_even_when_it_existed_open(state):
    from tasks.runtime import paths

    state.mkdir(mode=0o755)
    state.chmod(0o755)
    assert paths.state_dir() == state and mode(state) == 0o700


def test_a_state_directory_another_user_made_is_refused_and_left_as_it_was(state):
    from tasks.runtime import paths

    if reason := skip_reason():
        pytest.skip(reason)
    import pwd

    state.mkdir(mode=0o777)
    state.chmod(0o777)
    os.chown(state, pwd.getpwnam(OTHER).pw_uid, -1)
    with pytest.raises(UnsafeFolder, match=f"state directory {state}: owned by another user"):
        paths.state_dir()
    assert mode(state) == 0o777 and not any(state.iterdir())


# --------------------------------------------------------------------------------------------
# Passwords in URLs, schedulers without TLS
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u:hunter2@h/db",
        "postgresql://u:@h/db",  # an empty password is still a password field
        "postgresql://u:hunter2/x@h/db",  # SQLAlchemy reads up to the "@": urlsplit sees a host end at "/"
        "postgresql://u:hunter2?x@h/db",
        "postgresql+psycopg://u:hunter2#x@h:5432/db",
        "postgresql://u@h/db?password=hunter2",
        "postgresql://u@h/db?sslmode=require&PASSWORD=hunter2",
        "postgresql://u@h/db?passfile=/home/u/.pgpass-hunter2",
        "postgresql://u@h/db?sslpassword=hunter2",
    ],
)
def test_a_password_anywhere_in_a_url_is_refused_without_echoing_it(url):
    with pytest.raises(ConfigError, match="search.storage: the URL carries a password") as e:
        no_password("search.storage", url)
    assert "hunter2" not in str(e.value)


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u@h:5432/db",
        "postgresql://h:5432/db",
        "postgresql://u@h/db?sslmode=require&application_name=password",
    ],
)
def test_a_url_without_a_password_passes(url):
    no_password("search.storage", url)


def test_a_plain_tcp_scheduler_is_refused_saying_why_and_what_to_use():
    with pytest.raises(ConfigError, match="SPIKELAB_SCHEDULER: 'tcp://127.0.0.1:8786' is a plain-TCP scheduler") as e:
        check_scheduler("SPIKELAB_SCHEDULER", "tcp://127.0.0.1:8786")
    assert "runs code as its owner" in str(e.value) and "tls://" in str(e.value)


@pytest.mark.parametrize(("address", "ok"), [("tls://h:65535", True), ("tls://h:65536", False), ("tls://h:0", False)])
def test_a_tls_scheduler_address_is_taken_up_to_the_last_valid_port(address, ok):
    if ok:
        check_scheduler("executor.scheduler", address)
    else:
        with pytest.raises(ConfigError, match="executor.scheduler: .* neither 'local' nor"):
            check_scheduler("executor.scheduler", address)


# --------------------------------------------------------------------------------------------
# The cluster's certificates
# --------------------------------------------------------------------------------------------


def test_cluster_certificates_are_made_once_with_the_key_private(state):
    from tasks.runtime import tls

    folder = tls.ensure_certificates()
    assert folder == state / "tls" and mode(folder) == 0o700 and mode(folder / "key.pem") == 0o600
    before = (folder / "cert.pem").read_bytes()
    assert tls.ensure_certificates() == folder and (folder / "cert.pem").read_bytes() == before
    assert tls.security().require_encryption


def test_a_half_made_certificate_folder_is_made_again_with_the_key_private(state):
    from tasks.runtime import tls

    folder = state / "tls"
    folder.mkdir(parents=True, mode=0o755)
    folder.chmod(0o755)
    (folder / "key.pem").write_text("left by an interrupted run")
    (folder / "key.pem").chmod(0o644)
    tls.ensure_certificates()
    assert mode(folder) == 0o700 and mode(folder / "key.pem") == 0o600
    assert b"PRIVATE KEY" in (folder / "key.pem").read_bytes()


@pytest.mark.parametrize("folder_mode", [0o775, 0o757])
def test_a_certificate_folder_others_may_write_is_refused_not_adopted(state, folder_mode):
    """What another user left in it (a key.pem linked elsewhere) would be written through: the
    folder is refused as it is, where 0755 (the half-made case above) is closed and used."""
    from tasks.runtime import tls

    folder = state / "tls"
    folder.mkdir(parents=True)
    folder.chmod(folder_mode)
    with pytest.raises(UnsafeFolder, match=f"cluster TLS folder {folder}: other users may write it.*SPIKELAB_TLS_DIR"):
        tls.ensure_certificates()
    assert mode(folder) == folder_mode and not any(folder.iterdir())


def test_a_node_without_the_certificates_or_with_an_open_key_is_told_what_to_copy(state, tmp_path, monkeypatch):
    from tasks.runtime import tls

    monkeypatch.setenv("SPIKELAB_TLS_DIR", str(tmp_path / "copy"))
    with pytest.raises(UserError, match=r"ca.pem, cert.pem, key.pem not found in .*copy; `spikelab cluster up`"):
        tls.security()
    folder = tls.ensure_certificates()
    (folder / "key.pem").chmod(0o644)
    with pytest.raises(UserError, match="key.pem is readable by other users"):
        tls.security()


# --------------------------------------------------------------------------------------------
# MLflow's artifact reads
# --------------------------------------------------------------------------------------------


MLFLOW_ADMIN_AFTER_A_NEW_LOGIN = """
import os
from mlflow.server.auth import auth_config, store
store.init_db(auth_config.database_uri)
store.create_user("spikelab", "the-old-password-1234", is_admin=True)  # the admin of an earlier login
from tasks.runtime.mlflow_app import admin_takes_the_login
admin_takes_the_login()
print(store.authenticate_user("spikelab", os.environ["MLFLOW_AUTH_ADMIN_PASSWORD"]),
      store.authenticate_user("spikelab", "the-old-password-1234"))
"""


def test_a_login_made_again_becomes_the_mlflow_admins_password(tmp_path):
    """MLflow sets the admin's password only when it creates the admin: after the credentials file
    is deleted and ``services up`` makes a new login, the server must take the new one."""
    import subprocess

    (tmp_path / "auth.ini").write_text(
        f"[mlflow]\ndefault_permission = NO_PERMISSIONS\ndatabase_uri = sqlite:///{tmp_path}/auth.db\n"
        "admin_username = spikelab\nauthorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
    )
    env = {**os.environ, "MLFLOW_AUTH_CONFIG_PATH": str(tmp_path / "auth.ini")}
    env["MLFLOW_AUTH_ADMIN_PASSWORD"] = "the-new-password-5678"
    done = subprocess.run(
        [sys.executable, "-c", MLFLOW_ADMIN_AFTER_A_NEW_LOGIN], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "False"]


def test_mlflow_reads_artifacts_only_below_its_root_and_never_through_a_symlink(tmp_path, monkeypatch):
    from mlflow.exceptions import MlflowException

    from tasks.runtime.mlflow_app import ROOTS_ENV, confined

    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    (root / "1" / "run" / "artifacts").mkdir(parents=True)
    elsewhere.mkdir()
    (root / "1" / "run" / "artifacts" / "link").symlink_to(elsewhere)
    monkeypatch.setenv(ROOTS_ENV, str(root))
    assert confined(str(root)) == str(root)
    assert confined(str(root / "1" / "run" / "artifacts" / "f.png"))
    for path, why in [
        (elsewhere / "f.png", "outside the server's artifact root"),
        (f"{root}-sibling/f.png", "outside the server's artifact root"),  # a prefix of the root is not inside it
        (root / "1" / "run" / "artifacts" / "link" / "f.png", "through a symlink"),
    ]:
        with pytest.raises(MlflowException, match=why) as e:
            confined(str(path))
        assert e.value.get_http_status_code() == 403


# --------------------------------------------------------------------------------------------
# As another user, against the real servers and a stage's own Dask cluster
# --------------------------------------------------------------------------------------------

HTTP_PROBES = """
import json, sys, urllib.request, urllib.error
auth = sys.stdin.read().strip()  # empty: no login
probes = json.loads(sys.argv[1])
results = {}
for name, (method, url, body) in probes.items():
    request = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode())
    request.add_header("Content-Type", "application/json")
    if auth:
        import base64
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            results[name] = response.status
    except urllib.error.HTTPError as e:
        results[name] = e.code
print(json.dumps(results))
"""


def server_probes() -> dict[str, tuple[str, str, dict | None]]:
    """What another user tried: read every flow run and log, start a deployment's run, read and
    create MLflow experiments, read and delete studies, reach MLflow's assistant."""
    from tasks.runtime import paths

    prefect, mlflow, dashboard = paths.prefect_url(), paths.mlflow_url(), paths.dashboard_url()
    return {
        "prefect: flow runs": ("POST", f"{prefect}/flow_runs/filter", {"limit": 1}),
        "prefect: logs": ("POST", f"{prefect}/logs/filter", {"limit": 1}),
        "prefect: deployments": ("POST", f"{prefect}/deployments/filter", {"limit": 1}),
        "mlflow: experiments": ("GET", f"{mlflow}/api/2.0/mlflow/experiments/search?max_results=1", None),
        "mlflow: create": ("POST", f"{mlflow}/api/2.0/mlflow/experiments/create", {"name": f"probe-{os.getpid()}"}),
        "dashboard: studies": ("GET", f"{dashboard}/api/studies", None),
        "dashboard: page": ("GET", f"{dashboard}/dashboard", None),
    }


@pytest.mark.e2e
def test_every_server_refuses_another_user_without_the_login_and_answers_with_it(live_services):
    from tasks.runtime import credentials, paths

    probes = server_probes()
    without = run_as_other_user(HTTP_PROBES, json.dumps(probes))
    assert without.returncode == 0, without.stderr[-2000:]
    assert json.loads(without.stdout) == dict.fromkeys(probes, 401)
    login = credentials.load()
    with_login = run_as_other_user(HTTP_PROBES, json.dumps(probes), stdin=login.auth_string)
    assert with_login.returncode == 0, with_login.stderr[-2000:]
    assert json.loads(with_login.stdout) == dict.fromkeys(probes, 200)  # the login, nothing else, lets one in
    assistant = {"mlflow: assistant": ("GET", f"{paths.mlflow_url()}/ajax-api/3.0/mlflow/assistant/config", None)}
    done = run_as_other_user(HTTP_PROBES, json.dumps(assistant), stdin=login.auth_string)
    assert json.loads(done.stdout) == {"mlflow: assistant": 404}, "the assistant's routes are off, even with the login"


@pytest.mark.e2e
def test_the_stores_and_the_login_are_out_of_another_users_reach(live_services):
    from tasks.runtime import paths

    state = paths.state_dir()
    reads = {
        "credentials": state / "credentials.json",
        "mlflow store": state / "mlflow.db",
        "optuna journal": state / "optuna.journal",
        "service log": state / "services" / "mlflow.log",
    }
    code = "import sys, json\nout = {}\nfor name, path in json.loads(sys.argv[1]).items():\n"
    code += "    try:\n        open(path).read(1); out[name] = 'read'\n    except OSError as e:\n"
    code += "        out[name] = type(e).__name__\nprint(json.dumps(out))"
    done = run_as_other_user(code, json.dumps({k: str(v) for k, v in reads.items()}))
    assert json.loads(done.stdout) == dict.fromkeys(reads, "PermissionError"), done.stderr


@pytest.mark.e2e
def test_an_artifact_folder_another_user_symlinked_to_the_owners_files_is_not_served(live_services, tmp_path):
    """The review's probe: an experiment whose artifact location is the other user's folder, the
    run's ``artifacts`` a symlink to a folder only the owner reads. Even with the login (a leaked
    one), MLflow refuses it; a run's own artifact is served."""
    if reason := skip_reason():
        pytest.skip(reason)
    import pwd
    import urllib.error
    import urllib.request

    import mlflow

    from tasks.runtime import credentials, paths

    owners = tmp_path / "owners"
    owners.mkdir(mode=0o700)
    (owners / "secret.txt").write_text("the owner's")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, pwd.getpwnam(OTHER).pw_uid, -1)
    client = mlflow.MlflowClient(paths.mlflow_url())
    run = client.create_run(client.create_experiment(f"probe-{tmp_path.name}", artifact_location=str(theirs)))
    (theirs / run.info.run_id).mkdir()
    (theirs / run.info.run_id / "artifacts").symlink_to(owners)
    own = client.create_run(client.get_experiment_by_name("Default").experiment_id)
    client.log_text(own.info.run_id, "served", "notes.txt")
    auth = credentials.basic_auth(credentials.load().auth_string)

    def status(path: str) -> int:
        try:
            with urllib.request.urlopen(urllib.request.Request(paths.mlflow_url() + path, headers=auth)) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    assert status(f"/get-artifact?run_id={run.info.run_id}&path=secret.txt") == 403
    assert status(f"/ajax-api/2.0/mlflow/artifacts/list?run_id={run.info.run_id}") == 403
    assert status(f"/get-artifact?run_id={own.info.run_id}&path=notes.txt") == 200


@pytest.fixture()
def port_taken_first(tmp_path, monkeypatch):
    """This checkout's Prefect and MLflow servers as ``up`` recorded them, alive but holding no port
    (they failed to bind it), and another user's impostor (``PORT_SQUATTER``) holding the port."""
    import subprocess

    import psutil

    impostor = start_as_other_user(PORT_SQUATTER)
    port = int(impostor.stdout.readline())
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "PREFECT_HOME")}
    env |= {
        "SPIKELAB_STATE": str(tmp_path / "state"),
        "SPIKELAB_PREFECT_PORT": str(port),
        "SPIKELAB_MLFLOW_PORT": str(port),
    }
    (tmp_path / "state" / "services").mkdir(parents=True)
    ours = []
    for name in ("prefect", "mlflow"):
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", str(port)], env=env)
        record = {"pid": proc.pid, "create_time": psutil.Process(proc.pid).create_time(), "port": port}
        (tmp_path / "state" / "services" / f"{name}.json").write_text(json.dumps(record))
        ours.append(proc)
    monkeypatch.setattr(os, "environ", env)
    from tasks.runtime import credentials

    credentials.ensure()  # the login `up` made: what the impostor is after
    yield port, ours, impostor
    for proc in [*ours, impostor]:
        proc.kill()
        proc.wait(timeout=10)


def test_a_port_another_user_took_first_is_never_sent_the_login(port_taken_first, capsys):
    """The impostor answers the health check as ours would; what tells them apart is who holds the
    port. A stage falls back to the local stores and ``up`` stops with the holder named."""
    from tasks.runtime import services

    port, ours, impostor = port_taken_first
    chosen = services.configure_environment()
    assert chosen["mlflow"].startswith("sqlite:///") and chosen["prefect"] == "temporary server"
    assert f"server (pid {ours[1].pid}) did not answer on port {port}" in capsys.readouterr().err
    assert not services.serves_this_checkout("prefect")
    assert (
        services.status()["prefect"]
        == f"started for this checkout (pid {ours[0].pid}) but not answering on port {port}"
    )
    with pytest.raises(SystemExit, match="prefect did not answer within 1 s"):
        services.wait_until_up(services.service("prefect"), timeout=1)
    ours[0].kill()
    ours[0].wait()
    with pytest.raises(
        SystemExit, match=rf"prefect exited before answering \(port {port} is held by pid {impostor.pid}"
    ):
        services.wait_until_up(services.service("prefect"), timeout=30)
    impostor.kill()
    assert "sent a login" not in impostor.communicate(timeout=10)[0]


def test_a_stages_own_dask_cluster_refuses_another_user_and_runs_the_owners_code(tmp_path):
    """The review's probe: ``Client(addr).run_on_scheduler(fn)`` from another user ran ``fn`` as the
    owner. Now every way in is refused before a message is read, and nothing it sent ran."""
    other_user_has_distributed()
    from distributed import Client, LocalCluster

    from tasks.runtime.workers import cluster_kwargs, configured_cluster

    marker = tmp_path / "planted"  # a function that got in would write it as the scheduler's owner
    with configured_cluster(), LocalCluster(**cluster_kwargs(1)) as cluster:
        address = cluster.scheduler_address
        assert address.startswith("tls://127.0.0.1:")
        done = run_as_other_user(DASK_PROBES, address, str(marker))
        assert done.returncode == 0, done.stderr[-2000:]
        results = json.loads(done.stdout)
        assert all(r.startswith("refused") for r in results.values()), results
        assert not marker.exists()
        with Client(cluster, set_as_default=False) as owner:  # the same request with the certificate
            assert owner.run_on_scheduler(os.getuid) == os.getuid()
            seen = dask_http_seen_by_other_user(owner)  # and the servers' HTTP ports say only "alive"
            assert seen == dask_http_expected(seen) and len(seen) == 2 * len(DASK_HTTP_ROUTES)


@pytest.mark.e2e
@pytest.mark.parametrize("server", ["prefect", "mlflow"])
def test_a_wrong_login_stops_a_stage_naming_the_server_and_where_the_login_lives(live_services, tmp_path, server):
    import subprocess

    wrong = {"PREFECT_API_AUTH_STRING": "spikelab:wrong-guess"} if server == "prefect" else {}
    wrong |= {"MLFLOW_TRACKING_PASSWORD": "wrong-guess"} if server == "mlflow" else {}
    env = {**live_services, **wrong}
    if server == "mlflow":  # the Prefect check passes with the right login, so MLflow's is the one refused
        env["PREFECT_API_AUTH_STRING"] = live_services["PREFECT_API_AUTH_STRING"]
    (tmp_path / "params.yaml").write_text("profile: default\n")  # the login is checked before the stage reads more
    done = subprocess.run(
        [str(Path(sys.executable).with_name("spikelab")), "run", "prepare"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"spikelab: error: {server} server at http://127.0.0.1:" in done.stderr
    assert "refused the login (HTTP 401)" in done.stderr and "credentials.json" in done.stderr
    assert "wrong-guess" not in done.stderr + done.stdout and not (tmp_path / "data").exists()
