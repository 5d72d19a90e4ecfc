"""Malformed credentials get 401, never 500: an ``Authorization`` header that carries no
well-formed basic login (another scheme, not base64, not UTF-8, no colon, raw non-ASCII bytes) is
answered like a wrong login by every server ``spikelab services up`` starts, and leaves no
traceback in its log. optuna-dashboard's check is ours (tasks/runtime/dashboard.py), MLflow's is
MLflow's behind a hook of ours (tasks/runtime/mlflow_app.py), Prefect's is Prefect's own."""

from __future__ import annotations

import base64
import http.client
import wsgiref.util

import pytest

from tasks.runtime import credentials, dashboard

MALFORMED = {
    "not base64": b"Basic !!!notbase64",
    "bad padding": b"Basic abc",
    "no colon": b"Basic " + base64.b64encode(b"spikelab-and-no-colon"),
    "not UTF-8": b"Basic " + base64.b64encode(b"spikelab:\xff\xfe\xfa"),
    "raw non-ASCII bytes": b"Basic \xff\xfe",
    "another scheme": b"Bearer x",
    "a scheme alone": b"Basic",
    "a scheme and a space": b"Basic ",
    "empty": b"",
}
"""Header values as they cross the wire (an HTTP header is bytes; WSGI reads them as Latin-1)."""


def wsgi_status(app, authorization: bytes | None, **environ: str) -> tuple[str, dict[str, str]]:
    """What ``app`` answers a GET carrying ``authorization``: its status line and headers."""
    seen: dict = {}

    def start_response(status: str, headers: list[tuple[str, str]], exc_info=None) -> None:
        seen.update(status=status, headers=dict(headers))

    env = {"PATH_INFO": "/api/meta", **environ}
    if authorization is not None:
        env["HTTP_AUTHORIZATION"] = authorization.decode("latin-1")
    wsgiref.util.setup_testing_defaults(env)
    b"".join(app(env, start_response))
    return seen["status"], seen["headers"]


def behind_the_login(password: str = "s3cret-pass"):
    """A stand-in for the dashboard's WSGI app behind :func:`dashboard.with_login`, and the calls it got."""
    calls = []

    def app(environ, start_response):
        calls.append(environ)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"studies"]

    return dashboard.with_login(app, "spikelab", password), calls


@pytest.mark.parametrize("header", MALFORMED.values(), ids=MALFORMED.keys())
def test_the_dashboard_answers_a_malformed_login_401_without_calling_the_app(header):
    checked, calls = behind_the_login()
    status, headers = wsgi_status(checked, header)
    assert status.startswith("401") and headers["WWW-Authenticate"].startswith('Basic realm="spikelab')
    assert calls == []


@pytest.mark.parametrize("password", ["s3cret-pass", "pässwörd-ünïcode"])
def test_the_dashboard_takes_the_login_only(password):
    checked, calls = behind_the_login(password)
    right = b"Basic " + base64.b64encode(f"spikelab:{password}".encode())
    assert wsgi_status(checked, right)[0] == "200 OK" and len(calls) == 1
    for wrong in ("spikelab:guess", f"other:{password}", f"spikelab:{password}x", "spikelab:"):
        assert wsgi_status(checked, b"Basic " + base64.b64encode(wrong.encode()))[0].startswith("401")
    assert wsgi_status(checked, None)[0].startswith("401") and len(calls) == 1


def test_a_remote_user_already_in_the_environ_does_not_let_a_request_in():
    """Paste's middleware let such a request through unchecked."""
    checked, calls = behind_the_login()
    assert wsgi_status(checked, None, REMOTE_USER="spikelab")[0].startswith("401") and calls == []


@pytest.mark.parametrize(
    "header, login",
    [
        ("Basic " + base64.b64encode(b"u:p:with:colons").decode(), ("u", "p:with:colons")),
        ("basic  " + base64.b64encode(b"u:").decode(), ("u", "")),
        ("Basic " + base64.b64encode("ü:ß".encode()).decode(), ("ü", "ß")),
        *((value.decode("latin-1"), None) for value in MALFORMED.values()),
    ],
)
def test_a_basic_login_is_read_only_when_well_formed(header, login):
    assert credentials.basic_login(header) == login


# --------------------------------------------------------------------------------------------
# The real servers
# --------------------------------------------------------------------------------------------


def raw_status(url: str, authorization: bytes) -> int:
    """The status ``url`` answers a GET whose ``Authorization`` header is these exact bytes."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    assert parts.hostname and parts.port
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        connection.putrequest("GET", f"{parts.path}?{parts.query}" if parts.query else parts.path)
        connection.putheader("Authorization", authorization)
        connection.endheaders()
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


@pytest.mark.e2e
@pytest.mark.parametrize("server", ["prefect", "mlflow", "dashboard"])
def test_every_server_answers_a_malformed_login_401_and_logs_no_traceback(live_services, server):
    from tasks.runtime import paths, services

    log = paths.state().services / f"{server}.log"
    before = log.stat().st_size
    url = services.base_url(server) + services.LOGIN_PROBES[server]
    answered = {name: raw_status(url, value) for name, value in MALFORMED.items()}
    assert answered == dict.fromkeys(MALFORMED, 401)
    with open(log, "rb") as f:
        f.seek(before)
        written = f.read().decode(errors="replace")
    assert "Traceback" not in written and "500 Internal Server Error" not in written, written[-3000:]
