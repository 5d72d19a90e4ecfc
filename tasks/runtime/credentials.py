"""The login to this checkout's servers: one user name and one password for the Prefect API and UI,
the MLflow server and optuna-dashboard, generated at the first ``spikelab services up`` into
``<state>/credentials.json`` (mode 0600, in the 0700 state directory) and re-used after.

Another local user is an attacker: loopback is shared by every user of a machine, so every server
asks for this login, and nothing prints or logs it. Processes get it through their environment
(``/proc/<pid>/environ`` is readable by its owner only), never a command line, which ``ps`` shows to
everyone. A worker node takes the head node's file, copied to a path of its own
(:data:`CREDENTIALS_ENV`), or the engines' own variables (``PREFECT_API_AUTH_STRING``,
``MLFLOW_TRACKING_USERNAME``/``MLFLOW_TRACKING_PASSWORD``) set from a secret store.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from model.typed_config import UserError
from tasks.runtime import paths

CREDENTIALS_ENV = "SPIKELAB_CREDENTIALS"
"""The credentials file to use instead of ``<state>/credentials.json`` (a worker node's copy)."""
PASSWORD_ENV = "SPIKELAB_PASSWORD"
"""At the first ``services up`` only: the password to store instead of a generated one."""
USERNAME = "spikelab"

PREFECT_CLIENT_ENV = "PREFECT_API_AUTH_STRING"
PREFECT_SERVER_ENV = "PREFECT_SERVER_API_AUTH_STRING"
MLFLOW_USER_ENV = "MLFLOW_TRACKING_USERNAME"
MLFLOW_PASSWORD_ENV = "MLFLOW_TRACKING_PASSWORD"
SECRET_ENVS = (
    PREFECT_CLIENT_ENV,
    PREFECT_SERVER_ENV,
    MLFLOW_PASSWORD_ENV,
    "MLFLOW_AUTH_ADMIN_PASSWORD",
    "MLFLOW_FLASK_SERVER_SECRET_KEY",
    PASSWORD_ENV,
)
"""The variables that carry the login into a process (a client's, a server's): a process started
for another login must not inherit them."""


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str
    session_key: str
    """MLflow's Flask secret key (its CSRF tokens), shared by its workers."""

    def __repr__(self) -> str:  # a traceback or a debug print never shows the secrets
        return f"Credentials(username={self.username!r}, password=<hidden>)"

    @property
    def auth_string(self) -> str:
        """Prefect's form: ``user:password``."""
        return f"{self.username}:{self.password}"

    def client_env(self) -> dict[str, str]:
        """What a client of the servers needs in its environment."""
        return {
            PREFECT_CLIENT_ENV: self.auth_string,
            MLFLOW_USER_ENV: self.username,
            MLFLOW_PASSWORD_ENV: self.password,
        }


def credentials_file() -> Path:
    return Path(os.environ.get(CREDENTIALS_ENV) or paths.state().credentials)


def ensure() -> Credentials:
    """The stored credentials, generated (or taken from :data:`PASSWORD_ENV`) and written 0600 the
    first time; the file is created exclusively, so two ``services up`` never write two logins."""
    path = credentials_file()
    if path.exists():
        return load()
    creds = Credentials(USERNAME, os.environ.get(PASSWORD_ENV) or secrets.token_urlsafe(24), secrets.token_hex(32))
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another `services up` won the race: use its login
        return load()
    with os.fdopen(fd, "w") as f:
        json.dump({"username": creds.username, "password": creds.password, "session_key": creds.session_key}, f)
    return creds


def load() -> Credentials:
    """The stored credentials; a UserError naming the file when it is missing, unreadable, readable
    by others or malformed (its content is never repeated)."""
    path = credentials_file()
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise UserError(
            f"credentials {path}: not found; `spikelab services up` creates it on the head node, "
            f"copy it to a worker node and point {CREDENTIALS_ENV} at the copy"
        ) from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UserError(
            f"credentials {path}: other users can read it (mode {stat.S_IMODE(mode):o}); "
            f"`chmod 600 {path}` and change the password (services down, delete the file, services up)"
        )
    try:
        raw = json.loads(path.read_text())
        return Credentials(raw["username"], raw["password"], raw["session_key"])
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"credentials {path}: unreadable or not spikelab's credentials file") from None


def client_env() -> dict[str, str]:
    """The login a client uses: the engines' own variables where the user set them (a secret
    store), else the credentials file's."""
    if all(os.environ.get(k) for k in (PREFECT_CLIENT_ENV, MLFLOW_USER_ENV, MLFLOW_PASSWORD_ENV)):
        return {k: os.environ[k] for k in (PREFECT_CLIENT_ENV, MLFLOW_USER_ENV, MLFLOW_PASSWORD_ENV)}
    return load().client_env()


def basic_auth(auth: str) -> dict[str, str]:
    """The HTTP header that carries ``auth`` (``user:password``) as basic authentication."""
    import base64

    return {"Authorization": f"Basic {base64.b64encode(auth.encode()).decode()}"}


def basic_login(header: str) -> tuple[str, str] | None:
    """The user name and password an ``Authorization`` header carries as basic authentication, or
    None when it carries none well-formed (another scheme, not base64, not UTF-8, no colon). A
    server answers None like a wrong login, 401: a parser that raises on such a header answers
    anyone who sends one 500, with a traceback in the server's log."""
    import base64

    scheme, _, token = header.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:  # binascii.Error, UnicodeDecodeError and a non-ASCII token are all ValueErrors
        user, colon, password = base64.b64decode(token.strip(), validate=True).decode().partition(":")
    except ValueError:
        return None
    return (user, password) if colon else None


def where() -> str:
    """Where the login is, in words, with no secret in them (``spikelab services info``)."""
    return f"user {USERNAME}; password in {credentials_file()} (mode 600; `python -m json.tool` shows it)"
