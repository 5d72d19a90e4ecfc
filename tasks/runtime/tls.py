"""Mutual TLS for every Dask cluster the project starts or joins, through Dask's own
``distributed.Security``: a Dask scheduler runs whatever its clients send, so one that answers a
plain TCP connection runs code for anyone who reaches its port (another user of the machine).

Two kinds of cluster:
  a stage's own  ``LocalCluster(security=True)``: a certificate made in memory for that cluster
                 alone (``Security.temporary``), held by nobody else.
  ``cluster up`` a CA and one certificate it signs, made once into ``<state>/tls/`` (0700, key 0600;
                 the CA's key is never written, so no other certificate can join), shared by the
                 scheduler, its workers and the stages' clients. A worker node reads a copy of that
                 folder from the path :data:`TLS_DIR_ENV` names (``cluster join --tls DIR``).

Both sides verify the other against the CA (Dask's TLS contexts require a peer certificate), so a
client without the certificate is refused in the handshake, before any message is read.
"""

from __future__ import annotations

import datetime
import os
import stat
from pathlib import Path
from typing import Any

from model.typed_config import UserError
from tasks.runtime import paths

TLS_DIR_ENV = "SPIKELAB_TLS_DIR"
"""Where a node finds the cluster's ``ca.pem``, ``cert.pem`` and ``key.pem`` (default ``<state>/tls``)."""
FILES = ("ca.pem", "cert.pem", "key.pem")
VALID_DAYS = 3650


def tls_dir() -> Path:
    return Path(os.environ.get(TLS_DIR_ENV) or paths.state().tls)


def ensure_certificates(directory: Path | None = None) -> Path:
    """The cluster's CA and certificate in ``directory`` (default :func:`tls_dir`), made the first
    time and re-used after; the folder is made 0700, the key 0600."""
    directory = directory or tls_dir()
    if all((directory / name).exists() for name in FILES):
        return check_certificates(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory.chmod(0o700)  # a half-made folder keeps the mode it was made with
    ca_pem, cert_pem, key_pem = _generate()
    for name, content, mode in (("ca.pem", ca_pem, 0o644), ("cert.pem", cert_pem, 0o644), ("key.pem", key_pem, 0o600)):
        path = directory / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        os.fchmod(fd, mode)  # a file left by a half-made folder keeps its old mode through O_TRUNC
        with os.fdopen(fd, "wb") as f:
            f.write(content)
    return directory


def check_certificates(directory: Path | None = None) -> Path:
    """``directory`` holds the three files and its key is the owner's alone; else a UserError naming it."""
    directory = directory or tls_dir()
    missing = [name for name in FILES if not (directory / name).is_file()]
    if missing:
        raise UserError(
            f"cluster TLS: {', '.join(missing)} not found in {directory}; `spikelab cluster up` makes them on the "
            f"head node (<state>/tls); copy that folder here and set {TLS_DIR_ENV} (or `cluster join --tls DIR`)"
        )
    key = directory / "key.pem"
    if key.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UserError(f"cluster TLS: {key} is readable by other users; `chmod 600 {key}`")
    return directory


def security(directory: Path | None = None) -> Any:
    """The ``distributed.Security`` of the cluster whose files are in ``directory``: every role
    (scheduler, worker, client) presents the certificate and requires the CA's."""
    from distributed.security import Security

    d = check_certificates(directory)
    ca, cert, key = (str(d / name) for name in FILES)
    return Security(
        tls_ca_file=ca,
        tls_client_cert=cert,
        tls_client_key=key,
        tls_scheduler_cert=cert,
        tls_scheduler_key=key,
        tls_worker_cert=cert,
        tls_worker_key=key,
        require_encryption=True,
    )


def cli_arguments(directory: Path) -> list[str]:
    """The same files for ``dask scheduler`` and ``dask worker`` (paths only: no secret on a command line)."""
    ca, cert, key = (str(directory / name) for name in FILES)
    return ["--tls-ca-file", ca, "--tls-cert", cert, "--tls-key", key]


def _generate() -> tuple[bytes, bytes, bytes]:
    """A CA (its key discarded once it signed) and a certificate for every role of the cluster."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "spikelab cluster CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "spikelab-dask")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("spikelab-dask")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return ca.public_bytes(pem), cert.public_bytes(pem), key_pem
