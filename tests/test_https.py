"""Beyond loopback the login crosses a network, so there every server serves HTTPS and every client
verifies it: the servers present a certificate naming ``SPIKELAB_HOST`` from a CA of their own
(tasks/runtime/tls.py), which the stages' Prefect and MLflow clients and spikelab's own checks
trust, and a server whose certificate does not verify is sent nothing, the login least of all. On
loopback nothing changes: plain HTTP.

127.0.0.2 stands for a head node's address: it is not one of ``paths.LOOPBACK``, yet no other
machine reaches it."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import json
import os
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

HEAD = "127.0.0.2"
PORTS = {"SPIKELAB_PREFECT_PORT": "47231", "SPIKELAB_MLFLOW_PORT": "47232", "SPIKELAB_DASHBOARD_PORT": "47233"}
IMPOSTOR_PORTS = range(47240, 47250)
SECRET = "spikelab:the-head-nodes-password"
CLIENT_ENVS = ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "PREFECT_HOME", "PREFECT_API_KEY")
CA_ENVS = ("PREFECT_API_SSL_CERT_FILE", "MLFLOW_TRACKING_SERVER_CERT_PATH", "SSL_CERT_FILE", "SPIKELAB_TLS_DIR")


def node_environment(state: Path, host: str = HEAD, **extra: str) -> dict[str, str]:
    """A process's environment on a node whose state directory is ``state``, whose servers listen
    on ``host``: no client settings, certificates or login of another test's servers."""
    from tasks.runtime import credentials

    logins = (*credentials.SECRET_ENVS, credentials.MLFLOW_USER_ENV, credentials.CREDENTIALS_ENV)
    env = {k: v for k, v in os.environ.items() if k not in (*CLIENT_ENVS, *CA_ENVS, *logins)}
    return {**env, **PORTS, "SPIKELAB_STATE": str(state), "SPIKELAB_HOST": host, **extra}


@pytest.fixture()
def head_node(tmp_path, monkeypatch) -> Path:
    """This process on a head node whose servers listen on :data:`HEAD` (not started)."""
    from tasks.runtime import paths

    state = tmp_path / "state"
    monkeypatch.setattr(os, "environ", node_environment(state))
    monkeypatch.setattr(paths, "HOST", HEAD)
    return state


def issued_names(cert: Path) -> list:
    """What the certificate's subjectAltName names: IP addresses and DNS names."""
    from cryptography import x509

    loaded = x509.load_pem_x509_certificate(cert.read_bytes())
    return [n.value for n in loaded.extensions.get_extension_for_class(x509.SubjectAlternativeName).value]


def test_urls_name_https_beyond_loopback_and_http_on_it(monkeypatch):
    from tasks.runtime import paths

    monkeypatch.setenv("SPIKELAB_MLFLOW_PORT", "5000")
    for host in paths.LOOPBACK[:2]:
        monkeypatch.setattr(paths, "HOST", host)
        assert paths.mlflow_url() == f"http://{host}:5000" and paths.exposed_warning() is None
    monkeypatch.setattr(paths, "HOST", "10.0.0.5")
    assert paths.mlflow_url() == "https://10.0.0.5:5000"
    assert paths.prefect_url().startswith("https://10.0.0.5:") and paths.dashboard_url().startswith("https://")
    assert "serve HTTPS" in paths.exposed_warning() and "unencrypted" not in paths.exposed_warning()


def test_on_loopback_the_servers_start_as_before_without_a_certificate(tmp_path, monkeypatch):
    from tasks.runtime import paths, services

    monkeypatch.setattr(os, "environ", node_environment(tmp_path / "state", host="127.0.0.1"))
    monkeypatch.setattr(paths, "HOST", "127.0.0.1")
    started = {svc.name: svc for svc in services.services()}
    assert started["prefect"].command[1:4] == ["server", "start", "--host"]
    for svc in started.values():
        assert not any("ssl" in arg or "certfile" in arg or ".pem" in arg for arg in svc.command), svc.command
        assert "MLFLOW_SERVER_ALLOWED_HOSTS" not in svc.env


def test_beyond_loopback_every_server_is_started_with_the_certificate(head_node):
    from tasks.runtime import services, tls

    cert, key = tls.server_certificate()
    started = {svc.name: svc for svc in services.services()}
    prefect = started["prefect"].command
    assert prefect[1:5] == ["-m", "uvicorn", "--factory", "prefect.server.api.server:create_app"]
    assert prefect[prefect.index("--ssl-certfile") + 1] == str(cert) and prefect[prefect.index("--host") + 1] == HEAD
    mlflow = started["mlflow"].command
    assert mlflow[mlflow.index("--uvicorn-opts") + 1] == f"--ssl-certfile {cert} --ssl-keyfile {key}"
    assert started["mlflow"].env["MLFLOW_SERVER_CORS_ALLOWED_ORIGINS"] == f"https://{HEAD}:47232"
    dashboard = started["dashboard"].command
    assert dashboard[dashboard.index("--keyfile") + 1] == str(key)


def test_the_servers_certificate_names_the_host_and_is_made_again_only_when_the_host_changes(head_node):
    from tasks.runtime import tls

    cert, key = tls.server_certificate()
    ca = head_node / "tls" / tls.SERVERS_CA
    assert tls.ensure_server_certificate(HEAD) and tls.servers_ca() == ca
    assert issued_names(cert) == [ipaddress.ip_address(HEAD)]
    assert key.stat().st_mode & 0o077 == 0 and (head_node / "tls").stat().st_mode & 0o077 == 0
    assert b"PRIVATE KEY" not in ca.read_bytes() and not any(b"PRIVATE" in f.read_bytes() for f in ca.parent.iterdir())
    first = ca.read_bytes()
    assert not tls.ensure_server_certificate(HEAD) and ca.read_bytes() == first  # kept: worker copies stay valid
    assert tls.ensure_server_certificate("head.cluster.internal") and ca.read_bytes() != first
    assert issued_names(cert) == ["head.cluster.internal"]


def test_the_servers_certificate_is_verified_against_their_ca_only(head_node):
    """A Python client with the servers' CA accepts it; with the cluster's CA (Dask's) or the system's, not."""
    from tasks.runtime import tls

    tls.ensure_server_certificate(HEAD)
    cert, key = tls.server_certificate()
    with https_server(cert, key) as (port, _):
        url = f"https://{HEAD}:{port}/api/health"
        assert urlopen_status(url, ssl.create_default_context(cafile=str(tls.servers_ca()))) == 200
        for other in (str(tls.ensure_certificates() / "ca.pem"), None):
            with pytest.raises(ssl.SSLCertVerificationError):
                urlopen_status(url, ssl.create_default_context(cafile=other))


# --------------------------------------------------------------------------------------------
# A server whose certificate does not verify is sent nothing
# --------------------------------------------------------------------------------------------


class Recorder(BaseHTTPRequestHandler):
    """Answers every request 200 and records its ``Authorization`` header: a login sent to it shows."""

    seen: list[str]

    def do_GET(self) -> None:
        self.seen.append(self.headers.get("Authorization", ""))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")

    do_POST = do_GET

    def log_message(self, *args) -> None:
        pass


def self_signed(host: str, folder: Path) -> tuple[Path, Path]:
    """A certificate naming ``host``, as ours does, but signed by its own key: not our CA's."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host))]), critical=False)
        .sign(key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    (folder / "impostor-cert.pem").write_bytes(cert.public_bytes(pem))
    (folder / "impostor-key.pem").write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return folder / "impostor-cert.pem", folder / "impostor-key.pem"


@contextlib.contextmanager
def https_server(cert: Path, key: Path) -> Iterator[tuple[int, list[str]]]:
    """An HTTPS server on :data:`HEAD` presenting ``cert``: its port, and the headers it was sent."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    handler = type("Handler", (Recorder,), {"seen": []})
    server = ThreadingHTTPServer((HEAD, free_port(IMPOSTOR_PORTS)), handler)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1], handler.seen
    finally:
        server.shutdown()
        server.server_close()


def free_port(candidates: range) -> int:
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind((HEAD, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {candidates} on {HEAD}")


def urlopen_status(url: str, context: ssl.SSLContext) -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=10, context=context) as response:
            return int(response.status)
    except urllib.error.URLError as e:  # the handshake's own error, for pytest.raises
        if isinstance(e.reason, ssl.SSLError):
            raise e.reason from None
        raise


@pytest.fixture()
def impostor(head_node, tmp_path) -> Iterator[tuple[str, list[str]]]:
    """A worker node's view: the head's servers' CA copied here, and at the head's address a server
    with a certificate that names it but comes from elsewhere (a machine that took the address)."""
    from tasks.runtime import credentials, tls

    tls.ensure_server_certificate(HEAD)
    os.environ["SPIKELAB_PASSWORD"] = SECRET.split(":", 1)[1]
    credentials.ensure()
    cert, key = self_signed(HEAD, tmp_path)
    with https_server(cert, key) as (port, seen):
        trusting = ssl.create_default_context(cafile=str(cert))  # it answers whoever trusts it, and shows what came
        assert urlopen_status(f"https://{HEAD}:{port}/", trusting) == 200 and seen == [""]
        seen.clear()
        yield f"https://{HEAD}:{port}", seen


def test_spikelabs_check_sends_no_request_to_a_server_it_cannot_verify(impostor):
    from tasks.runtime import services

    url, seen = impostor
    with pytest.raises(
        services.UntrustedServer,
        match=rf"{url}/api/admin/version: the server's certificate does not verify against .*servers-ca.pem",
    ):
        services.check_login("prefect", SECRET, f"{url}/api")
    assert services.http_status(f"{url}/health") is None  # a health check: not ours, not up
    assert seen == []


def test_a_stage_pointed_at_a_server_it_cannot_verify_stops_before_sending_the_login(impostor, tmp_path):
    """A worker node's stage, the head's servers' URLs in its environment: it stops with one line
    (exit 2) naming the server and the CA, and the impostor never sees a request."""
    url, seen = impostor
    env = {**os.environ, "PREFECT_API_URL": f"{url}/api", "MLFLOW_TRACKING_URI": url}
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "params.yaml").write_text("profile: default\n")
    done = subprocess.run(
        [str(Path(sys.executable).with_name("spikelab")), "run", "prepare"],
        cwd=tmp_path / "project",
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"{url}/api/admin/version: the server's certificate does not verify" in done.stderr
    assert "Traceback" not in done.stderr and SECRET not in done.stderr + done.stdout
    assert seen == []


ENGINE_CLIENTS = """
import json, os, sys
outcome = {}
try:
    from prefect.client.orchestration import get_client
    with get_client(sync_client=True) as client:
        client.hello()
    outcome["prefect"] = "answered"
except Exception as e:
    outcome["prefect"] = repr(e)
try:
    import mlflow
    mlflow.MlflowClient().search_experiments()
    outcome["mlflow"] = "answered"
except Exception as e:
    outcome["mlflow"] = repr(e)
print(json.dumps(outcome))
"""


def test_the_engines_clients_refuse_a_server_they_cannot_verify_and_send_it_no_login(impostor):
    """Prefect's and MLflow's own clients, given the login and the CA as a stage gives them
    (services.trust_servers_ca), fail the handshake: the impostor sees no request, no login."""
    from tasks.runtime import services

    url, seen = impostor
    os.environ.update({"PREFECT_API_URL": f"{url}/api", "MLFLOW_TRACKING_URI": url})
    services.trust_servers_ca({"prefect": f"{url}/api", "mlflow": url})
    user, password = SECRET.split(":", 1)
    env = {**os.environ, "PREFECT_API_AUTH_STRING": SECRET, "MLFLOW_TRACKING_USERNAME": user}
    env |= {
        "MLFLOW_TRACKING_PASSWORD": password,
        "PREFECT_CLIENT_MAX_RETRIES": "0",
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
    }
    done = subprocess.run([sys.executable, "-c", ENGINE_CLIENTS], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert "CERTIFICATE_VERIFY_FAILED" in outcome["prefect"] and "CERTIFICATE_VERIFY_FAILED" in outcome["mlflow"], (
        outcome
    )
    assert seen == []


# --------------------------------------------------------------------------------------------
# The real servers on a head node's address
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def head_servers(tmp_path_factory) -> Iterator[dict[str, str]]:
    """``spikelab services up`` on :data:`HEAD`, once for this module; the environment of a
    process on that node (no client settings: a stage chooses them)."""
    from tasks.runtime import paths, services

    env = node_environment(tmp_path_factory.mktemp("head") / "state")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "environ", dict(env))
        patch.setattr(paths, "HOST", HEAD)
        services.up(timeout=240)
        try:
            yield env
        finally:
            services.down()


STAGE = """
import json, os
from tasks.runtime import services
chosen = services.configure_environment()
import mlflow
from prefect import flow
from prefect.runtime import flow_run

@flow
def probe() -> dict:
    client = mlflow.MlflowClient()
    run = client.create_run(client.create_experiment("https-probe"))
    client.log_text(run.info.run_id, "through HTTPS", "notes.txt")  # artifacts go through the server too
    client.set_terminated(run.info.run_id)
    return {"mlflow_run": run.info.run_id, "flow_run": str(flow_run.id)}

trust = {k: os.environ.get(k) for k in services.CLIENT_CA_ENVS.values()}
print(json.dumps({"chosen": chosen, "trust": trust, **probe()}))
"""


@pytest.mark.e2e
def test_a_stage_on_the_head_node_verifies_the_servers_and_tracks_to_them(head_servers):
    from tasks.runtime import credentials, paths, services, tls

    logs = {name: paths.state().services / f"{name}.log" for name in ("prefect", "mlflow", "dashboard")}
    before = {name: log.stat().st_size for name, log in logs.items()}
    done = subprocess.run([sys.executable, "-c", STAGE], env=head_servers, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    ca = str(tls.servers_ca())
    assert result["chosen"] == {"prefect": f"https://{HEAD}:47231/api", "mlflow": f"https://{HEAD}:47232"}
    assert result["trust"] == dict.fromkeys(services.CLIENT_CA_ENVS.values(), ca)
    login = credentials.load().auth_string
    flow_run = services.verified_status(f"https://{HEAD}:47231/api/flow_runs/{result['flow_run']}", 30, login)
    artifact = f"https://{HEAD}:47232/get-artifact?run_id={result['mlflow_run']}&path=notes.txt"
    assert flow_run == 200 and services.verified_status(artifact, 30, login) == 200
    assert "CERTIFICATE_VERIFY_FAILED" not in done.stderr and "SSL" not in done.stderr
    for name, log in logs.items():
        written = log.read_bytes()[before[name] :].decode(errors="replace")
        assert "Traceback" not in written and "SSL" not in written, f"{name}: {written[-3000:]}"


@pytest.mark.e2e
def test_the_servers_on_the_head_nodes_address_speak_only_https(head_servers):
    from tasks.runtime import credentials, services

    login = credentials.load().auth_string
    for name in ("prefect", "mlflow", "dashboard"):
        url = services.base_url(name) + services.LOGIN_PROBES[name]
        assert url.startswith(f"https://{HEAD}:")
        assert services.verified_status(url, 30) == 401 and services.verified_status(url, 30, login) == 200
        assert services.http_status(url.replace("https://", "http://", 1), 5) is None, f"{name} answers plain HTTP"
