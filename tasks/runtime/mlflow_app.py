"""The MLflow server spikelab runs (``mlflow server --app-name spikelab``, registered in
pyproject.toml's ``mlflow.app`` entry points): MLflow's own basic-auth app, with two changes.

- **Artifacts are read only from under the server's artifact roots, never through a symlink.**
  The server reads a run's local artifacts as its owner from wherever the run's artifact URI
  points, and a run's location is chosen by whoever creates its experiment; a folder the caller
  owns, with a symlink to a folder of the owner's, would serve the owner's files. MLflow's artifact
  repository registry is the one place every route (get-artifact, list, model versions, logged
  models, traces) builds its repository, so the local repository is replaced there.
- **The assistant is off**: its routes answer 404 (they change the server's assistant
  configuration and install skills, and spikelab has no use for them), and its panel and buttons
  are hidden (:func:`index_without_assistant`).
- **The admin's password is the login's at every start** (:func:`admin_takes_the_login`): MLflow
  sets it only when it creates the admin, so a login made again would leave the old one in force.
- **A malformed login gets 401, not 500** (:func:`refuse_malformed_login`): MLflow's check of the
  routes its Flask app serves raised on an ``Authorization`` header of another scheme
  (``Bearer x``) or with non-ASCII bytes, answering 500 with a traceback in the server's log.

The roots come from :data:`ROOTS_ENV` (set by tasks/runtime/services.py). Imported only by the
server process: nothing else needs MLflow's server modules. ``python -m tasks.runtime.mlflow_app
ARGS`` is ``mlflow server ARGS`` that becomes its own uvicorn server (:func:`serve_in_place`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import PERMISSION_DENIED
from mlflow.store.artifact.local_artifact_repo import LocalArtifactRepository

from tasks.runtime.credentials import basic_login
from tasks.runtime.paths import MLFLOW_ARTIFACT_ROOTS_ENV as ROOTS_ENV


def artifact_roots() -> list[str]:
    return [os.path.abspath(r) for r in os.environ.get(ROOTS_ENV, "").split(os.pathsep) if r]


def confined(path: str) -> str:
    """``path`` when it lies under an artifact root with no symlink below the root; else an
    MlflowException (HTTP 403) that names neither the path nor the roots."""
    path = os.path.abspath(path)
    for root in artifact_roots():
        if path == root or path.startswith(root + os.sep):
            below = Path(root)
            for part in Path(path).relative_to(root).parts:
                below = below / part
                if below.is_symlink():
                    raise MlflowException("artifact path goes through a symlink: refused", PERMISSION_DENIED)
            return path
    raise MlflowException("artifact location outside the server's artifact root: refused", PERMISSION_DENIED)


class ConfinedArtifactRepository(LocalArtifactRepository):
    """Local artifacts, each read confined (:func:`confined`)."""

    def __init__(self, artifact_uri: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(artifact_uri, *args, **kwargs)
        confined(self.artifact_dir)

    def get_local_path(self, artifact_path: str) -> str:
        return confined(super().get_local_path(artifact_path))

    def list_artifacts(self, path: str | None = None) -> list[Any]:
        confined(os.path.join(self.artifact_dir, os.path.normpath(path)) if path else self.artifact_dir)
        listing: list[Any] = super().list_artifacts(path)
        return listing

    def _download_file(self, remote_file_path: str, local_path: str) -> None:
        confined(os.path.join(self.artifact_dir, os.path.normpath(remote_file_path)))
        super()._download_file(remote_file_path, local_path)


class WithoutAssistant:
    """ASGI middleware: the assistant's routes answer 404, before routing, whoever asks. Routing
    matches the same decoded ``scope["path"]``, so no spelling of the path reaches them."""

    def __init__(self, app: Any) -> None:
        from mlflow.server.assistant.api import assistant_router

        self.app, self.prefix = app, assistant_router.prefix

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.prefix):
            from starlette.responses import PlainTextResponse

            await PlainTextResponse("Not Found", status_code=404)(scope, receive, send)
            return
        await self.app(scope, receive, send)


HIDDEN_ASSISTANT = "<style>[data-assistant-ui]{display:none!important}</style>"
"""The page's rule that hides every element MLflow's UI marks as the assistant's (its panel, its
floating button, its buttons in the trace view)."""


def index_without_assistant() -> Any:
    """MLflow's page (index.html) with the assistant hidden. Its UI opens the assistant's panel, a
    third of the page, at the first visit from a loopback address whatever the server says (MLflow
    3.17 has no setting for it), and the panel could only show errors: its routes answer 404 here."""
    from flask import Response, current_app

    index = Path(current_app.static_folder or "", "index.html").read_text()
    return Response(index.replace("</head>", HIDDEN_ASSISTANT + "</head>", 1), mimetype="text/html")


def admin_takes_the_login() -> None:
    """Give the admin the password the server was started with (``MLFLOW_AUTH_ADMIN_PASSWORD``:
    the credentials file's) when the auth database holds another: after ``services down``, a
    deleted credentials file and ``services up``, every stage would be refused otherwise."""
    from mlflow.server.auth import auth_config, store

    user, password = auth_config.admin_username, auth_config.admin_password
    if not password:
        return
    assert user is not None, "the auth config services.py writes names the admin beside the password"
    if not store.authenticate_user(user, password, use_primary=True):
        store.update_user(user, password=password)


def refuse_malformed_login() -> Any:
    """Flask's before-request hook, run ahead of MLflow's login check: MLflow's 401 for an
    ``Authorization`` header that carries no well-formed basic login (credentials.basic_login) on a
    route that asks for the login; None (go on) otherwise. MLflow's own check raised on such a
    header (its FastAPI routes check the header themselves, and answer 401)."""
    from flask import request
    from mlflow.server.auth import is_unprotected_route, make_basic_auth_response

    header = request.headers.get("Authorization")
    if header is None or basic_login(header) is not None or is_unprotected_route(request.path):
        return None
    return make_basic_auth_response()


def create_app() -> Any:
    """MLflow's basic-auth app with local artifacts confined, the assistant off, the admin's
    password the login's and a malformed login refused before MLflow reads it."""
    from mlflow.server import app as flask_app
    from mlflow.server.auth import create_app as with_basic_auth
    from mlflow.store.artifact.artifact_repository_registry import _artifact_repository_registry

    for scheme in ("", "file"):  # plain paths and file:// URIs
        _artifact_repository_registry.register(scheme, ConfinedArtifactRepository)
    app = with_basic_auth(flask_app)
    flask_app.before_request_funcs.setdefault(None, []).insert(0, refuse_malformed_login)  # before MLflow's check
    flask_app.view_functions["serve"] = index_without_assistant  # the route of "/" (MLflow's `serve`)
    admin_takes_the_login()
    if hasattr(app, "add_middleware"):  # FastAPI under uvicorn (MLflow's default); its Flask app has no assistant
        app.add_middleware(WithoutAssistant)
    return app


def serve_in_place(argv: list[str]) -> None:
    """``mlflow server ARGV``, this process then replaced by the uvicorn server MLflow's CLI starts
    (exec, same pid, its environment given whole). The CLI would otherwise wait beside its server
    only to forward signals, holding a copy of MLflow's imports: about 250 MB of the 1 GB MLflow
    took on 2 cores."""
    import mlflow.server
    from mlflow.cli import cli

    def exec_server(command: list[str], *, extra_env: dict[str, str] | None = None, **_: Any) -> None:
        sys.stdout.flush()
        os.execve(command[0], command, {**os.environ, **(extra_env or {})})

    mlflow.server._exec_cmd = exec_server  # type: ignore[assignment]  # the one call that starts the server (MLflow 3.17's _run_server)
    cli.main(["server", *argv], prog_name="mlflow")


if __name__ == "__main__":
    serve_in_place(sys.argv[1:])
