"""optuna-dashboard behind the login: its WSGI app (``optuna_dashboard.wsgi``) behind a basic-auth
check (:func:`with_login`) and served by gunicorn, as the dashboard's own CLI serves it. The
dashboard has no authentication of its own and lets anyone who reaches it create, annotate and
delete studies and upload files, so it never answers without the login
(tasks/runtime/credentials.py), which it reads from the credentials file, never a command line.

``python -m tasks.runtime.dashboard --host H --port P --artifact-dir D [--certfile C --keyfile K]
STORAGE`` (started by ``spikelab services up``: tasks/runtime/services.py); STORAGE is
``journal:<path>`` or a database URL; with a certificate and key it serves HTTPS (a head node's
address: tasks/runtime/tls.py).
"""

from __future__ import annotations

import argparse
import hmac
from collections.abc import Callable, Iterable
from typing import Any

REALM = "spikelab optuna-dashboard"


def storage(url: str) -> Any:
    """The search's Optuna storage: a journal file (``journal:<path>``) or a database URL."""
    import optuna

    if url.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend

        return optuna.storages.JournalStorage(JournalFileBackend(url.removeprefix("journal:")))
    return optuna.storages.RDBStorage(url)


def with_login(app: Any, username: str, password: str) -> Callable[[dict, Callable], Iterable[bytes]]:
    """``app`` answering only requests that carry the login; any other, a malformed
    ``Authorization`` header included, gets 401. Not Paste's AuthBasicHandler, which this replaced:
    it raised on a malformed header (HTTP 500 and a traceback in the log), decoded the login as
    ASCII (a non-ASCII password could never log in) and let through any request whose environ
    already named a REMOTE_USER."""
    from tasks.runtime.credentials import basic_login

    def checked(environ: dict, start_response: Callable) -> Iterable[bytes]:
        given = basic_login(environ.get("HTTP_AUTHORIZATION", ""))
        if given is not None and is_the_login(given, username, password):
            response: Iterable[bytes] = app(environ, start_response)
            return response
        start_response(
            "401 Unauthorized",
            [("WWW-Authenticate", f'Basic realm="{REALM}", charset="UTF-8"'), ("Content-Type", "text/plain")],
        )
        return [b"login required\n"]

    return checked


def is_the_login(given: tuple[str, str], username: str, password: str) -> bool:
    """In constant time (both parts always compared), so the answer's timing says nothing of the password."""
    user, secret = given
    return hmac.compare_digest(user.encode(), username.encode()) & hmac.compare_digest(
        secret.encode(), password.encode()
    )


def serve(app: Any, host: str, port: int, certfile: str | None = None, keyfile: str | None = None) -> None:
    """gunicorn, one process with threads (the dashboard keeps its caches in memory); HTTPS with
    ``certfile`` and ``keyfile``."""
    from gunicorn.app.base import BaseApplication

    class Dashboard(BaseApplication):
        def load_config(self) -> None:
            self.cfg.set("bind", f"{host}:{port}")
            self.cfg.set("threads", 4)
            self.cfg.set("loglevel", "warning")
            if certfile and keyfile:
                self.cfg.set("certfile", certfile)
                self.cfg.set("keyfile", keyfile)

        def load(self) -> Any:
            return app

    Dashboard().run()


def main(argv: list[str] | None = None) -> None:
    from optuna.artifacts import FileSystemArtifactStore
    from optuna_dashboard import wsgi

    from tasks.runtime import credentials

    p = argparse.ArgumentParser(prog="python -m tasks.runtime.dashboard", description=__doc__.split("\n\n")[0])
    p.add_argument("storage", help="journal:<path> or a database URL (no password: refused)")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--artifact-dir", required=True)
    p.add_argument("--certfile", help="with --keyfile: serve HTTPS with this certificate")
    p.add_argument("--keyfile")
    args = p.parse_args(argv)
    login = credentials.load()
    app = wsgi(storage(args.storage), artifact_store=FileSystemArtifactStore(args.artifact_dir))
    serve(with_login(app, login.username, login.password), args.host, args.port, args.certfile, args.keyfile)


if __name__ == "__main__":
    main()
