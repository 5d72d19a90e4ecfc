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

The HTTPS servers (Prefect, MLflow, optuna-dashboard on a head node's address: paths.serves_https)
present a certificate whose subjectAltName names that address (:func:`ensure_server_certificate`),
signed by a CA of their own made with it, its key discarded too: ``servers-ca.pem`` beside the
cluster's files, so a worker node's copy of the folder carries it, and every client verifies the
servers against it. Not the cluster's CA: its key is gone, so it can sign nothing more, and a key
kept to sign server certificates would also sign Dask client certificates. The servers' own key
stays on the head node, in ``<state>/services`` (:func:`server_certificate`), out of that copy.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from model.typed_config import UserError
from tasks.runtime import paths

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

TLS_DIR_ENV = "SPIKELAB_TLS_DIR"
"""Where a node finds the cluster's ``ca.pem``, ``cert.pem`` and ``key.pem`` (default ``<state>/tls``)."""
FILES = ("ca.pem", "cert.pem", "key.pem")
SERVERS_CA = "servers-ca.pem"
"""In :func:`tls_dir`: the CA the HTTPS servers' certificate comes from, that their clients verify it with."""
VALID_DAYS = 3650
FOLDER_REMEDY = f"remove it, or set {TLS_DIR_ENV} to a folder of your own"


def tls_dir() -> Path:
    return Path(os.environ.get(TLS_DIR_ENV) or paths.state().tls)


def ensure_certificates(directory: Path | None = None) -> Path:
    """The cluster's CA and certificate in ``directory`` (default :func:`tls_dir`), made the first
    time and re-used after; the folder is made 0700, the key 0600."""
    directory = directory or tls_dir()
    if all((directory / name).exists() for name in FILES):
        return check_certificates(directory)
    paths.private_folder(directory, "cluster TLS folder", FOLDER_REMEDY, secret=True)
    ca_pem, cert_pem, key_pem = _generate()
    for name, content, mode in (("ca.pem", ca_pem, 0o644), ("cert.pem", cert_pem, 0o644), ("key.pem", key_pem, 0o600)):
        _write(directory / name, content, mode)
    return directory


def _write(path: Path, content: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    os.fchmod(fd, mode)  # a file left by a half-made folder keeps its old mode through O_TRUNC
    with os.fdopen(fd, "wb") as f:
        f.write(content)


def server_certificate() -> tuple[Path, Path]:
    """The certificate and key the HTTPS servers present: beside their logs, never in the folder a
    worker node copies (it needs only the CA)."""
    folder = paths.state().services
    return folder / "https-cert.pem", folder / "https-key.pem"


def servers_ca() -> Path | None:
    """The servers' CA on this node (the head's, or a worker node's copy), or None where it has none."""
    path = tls_dir() / SERVERS_CA
    return path if path.is_file() else None


def ensure_server_certificate(host: str) -> bool:
    """A certificate for the servers on ``host`` and its CA, kept while they name ``host`` and match,
    made anew otherwise (a new address, a first start). True when made: a worker node's copy of
    the CA no longer verifies the servers, and must be copied again."""
    cert_path, key_path = server_certificate()
    ca_path = tls_dir() / SERVERS_CA
    if key_path.is_file() and cert_path.is_file() and ca_path.is_file() and _issued_for(host, cert_path, ca_path):
        return False
    ca_pem, cert_pem, key_pem = _generate_server(host)
    paths.private_folder(ca_path.parent, "cluster TLS folder", FOLDER_REMEDY, secret=True)
    key_path.parent.mkdir(parents=True, exist_ok=True)  # in the state directory, 0700
    _write(cert_path, cert_pem, 0o644)
    _write(key_path, key_pem, 0o600)
    _write(ca_path, ca_pem, 0o644)
    return True


def _issued_for(host: str, cert_path: Path, ca_path: Path) -> bool:
    """The certificate in ``cert_path`` names ``host`` and the CA in ``ca_path`` signed it."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature

    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    try:
        cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca_path.read_bytes()))
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, TypeError, x509.ExtensionNotFound, InvalidSignature):
        return False
    return _alt_name(host) in names


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

    return _signed_by_a_new_ca("spikelab cluster CA", "spikelab-dask", x509.DNSName("spikelab-dask"))


def _generate_server(host: str) -> tuple[bytes, bytes, bytes]:
    """A CA of the servers' own (its key discarded once it signed) and their certificate for ``host``,
    good for a TLS server only (extended key usage: a client presenting it is refused)."""
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    server_only = x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH])
    return _signed_by_a_new_ca("spikelab servers CA", host, _alt_name(host), server_only)


def _alt_name(host: str) -> x509.GeneralName:
    """How a certificate names ``host``: as an IP address when it is one (what a client that
    connects to an address checks), else as a DNS name."""
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _signed_by_a_new_ca(
    ca_common_name: str, common_name: str, alt_name: x509.GeneralName, *extensions: x509.ExtensionType
) -> tuple[bytes, bytes, bytes]:
    """A new CA's certificate, and a certificate (with ``extensions``) and key it signed for
    ``alt_name``, as PEM; the CA's key is discarded when this returns. The key identifiers and the
    CA's key usage are what strict verification (Python 3.13's default) asks of a chain."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    ca_key, key = _new_key(), _new_key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_common_name)])
    ca = (
        _valid_from_now(x509.CertificateBuilder())
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    builder = (
        _valid_from_now(x509.CertificateBuilder())
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .add_extension(x509.SubjectAlternativeName([alt_name]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    for extension in extensions:
        builder = builder.add_extension(extension, critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return ca.public_bytes(pem), cert.public_bytes(pem), key_pem


def _new_key() -> ec.EllipticCurvePrivateKey:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _valid_from_now(builder: x509.CertificateBuilder) -> x509.CertificateBuilder:
    from cryptography import x509

    now = datetime.datetime.now(datetime.UTC)
    return (
        builder.serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
    )
