"""optuna-dashboard behind the login: its WSGI app (``optuna_dashboard.wsgi``) wrapped in Paste's
HTTP basic-auth middleware and served by gunicorn, as the dashboard's own CLI serves it. The
dashboard has no authentication of its own and lets anyone who reaches it create, annotate and
delete studies and upload files, so it never answers without the login
(tasks/runtime/credentials.py), which it reads from the credentials file, never a command line.

``python -m tasks.runtime.dashboard --host H --port P --artifact-dir D STORAGE`` (started by
``spikelab services up``: tasks/runtime/services.py); STORAGE is ``journal:<path>`` or a database URL.
"""

from __future__ import annotations

import argparse
import hmac
from typing import Any

REALM = "spikelab optuna-dashboard"


def storage(url: str) -> Any:
    """The search's Optuna storage: a journal file (``journal:<path>``) or a database URL."""
    import optuna

    if url.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend

        return optuna.storages.JournalStorage(JournalFileBackend(url.removeprefix("journal:")))
    return optuna.storages.RDBStorage(url)


def with_login(app: Any, username: str, password: str) -> Any:
    """``app`` answering only requests that carry the login (HTTP 401 otherwise)."""
    from paste.auth.basic import AuthBasicHandler

    def check(_environ: dict, user: str, given: str) -> bool:
        return hmac.compare_digest(user.encode(), username.encode()) & hmac.compare_digest(
            given.encode(), password.encode()
        )

    return AuthBasicHandler(app, REALM, check)


def serve(app: Any, host: str, port: int) -> None:
    """gunicorn, one process with threads (the dashboard keeps its caches in memory)."""
    from gunicorn.app.base import BaseApplication

    class Dashboard(BaseApplication):
        def load_config(self) -> None:
            self.cfg.set("bind", f"{host}:{port}")
            self.cfg.set("threads", 4)
            self.cfg.set("loglevel", "warning")

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
    args = p.parse_args(argv)
    login = credentials.load()
    app = wsgi(storage(args.storage), artifact_store=FileSystemArtifactStore(args.artifact_dir))
    serve(with_login(app, login.username, login.password), args.host, args.port)


if __name__ == "__main__":
    main()
