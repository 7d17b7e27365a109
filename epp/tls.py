"""TLS for the ext_proc port: a self-signed certificate made at start, or a certificate
and key from files that are re-read when they change (cert-manager rotates them in place).

Like the Inference Extension's picker (`--secure-serving`), the self-signed default
encrypts the Envoy-to-picker hop without giving clients anything to verify; a gateway that
must verify the picker mounts a certificate from a CA it trusts (`--tls-cert/--tls-key`).
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

log = logging.getLogger(__name__)

SELF_SIGNED_VALIDITY = datetime.timedelta(days=365)


@dataclass(frozen=True, slots=True)
class TlsOptions:
    """How the ext_proc port is served: None cert/key = a self-signed certificate."""

    cert_file: Path | None = None
    key_file: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("--tls-cert and --tls-key go together")


@dataclass(frozen=True, slots=True)
class KeyPair:
    cert_pem: bytes
    key_pem: bytes


def self_signed(hostnames: list[str] | None = None) -> KeyPair:
    """A fresh P-256 key and a certificate for it naming this host, localhost and the
    loopback addresses (what a client that does check names would dial)."""
    names = hostnames or [socket.gethostname(), "localhost"]
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])])
    alternative: list[x509.GeneralName] = [x509.DNSName(n) for n in dict.fromkeys(names)]
    alternative += [
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address("::1")),
    ]
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # tolerate clock skew
        .not_valid_after(now + SELF_SIGNED_VALIDITY)
        .add_extension(x509.SubjectAlternativeName(alternative), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return KeyPair(
        certificate.public_bytes(serialization.Encoding.PEM),
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )


class RotatingKeyPair:
    """A certificate and key read from files, re-read when either file changes.

    gRPC asks for the current pair at every TLS handshake; a stat of two files is cheap,
    and Envoy keeps its connection to the picker for long, so handshakes are rare. A
    half-written pair (a cert that does not match its key) is refused by gRPC, which then
    keeps serving the previous one; the next handshake tries again.
    """

    def __init__(self, cert_file: Path, key_file: Path) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int, int] | None = None
        self.current = self._read()  # a missing or unreadable file fails the start

    def _stat(self) -> tuple[int, int, int, int]:
        cert, key = os.stat(self.cert_file), os.stat(self.key_file)
        # Kubernetes swaps a mounted Secret through a symlink: the inode changes too.
        return (cert.st_mtime_ns, cert.st_ino, key.st_mtime_ns, key.st_ino)

    def _read(self) -> KeyPair:
        stamp = self._stat()
        pair = KeyPair(self.cert_file.read_bytes(), self.key_file.read_bytes())
        x509.load_pem_x509_certificate(pair.cert_pem)  # a clear error for a bad file
        serialization.load_pem_private_key(pair.key_pem, password=None)
        self._stamp = stamp
        return pair

    def changed(self) -> KeyPair | None:
        """The new pair when the files changed since the last read, else None."""
        with self._lock:
            try:
                if self._stat() == self._stamp:
                    return None
                self.current = self._read()
            except (OSError, ValueError) as exc:
                log.warning("TLS certificate files unreadable, keeping the previous pair: %s", exc)
                return None
        log.info("TLS certificate reloaded from %s", self.cert_file)
        return self.current


def _configuration(pair: KeyPair) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration([(pair.key_pem, pair.cert_pem)])


def server_credentials(options: TlsOptions) -> grpc.ServerCredentials:
    """Server credentials for the ext_proc port (client certificates are not asked for)."""
    if options.cert_file is None or options.key_file is None:
        log.info("ext_proc TLS: self-signed certificate generated at start")
        pair = self_signed()
        return grpc.ssl_server_credentials([(pair.key_pem, pair.cert_pem)])
    files = RotatingKeyPair(options.cert_file, options.key_file)
    log.info("ext_proc TLS: certificate %s, reloaded on change", options.cert_file)

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        pair = files.changed()
        return None if pair is None else _configuration(pair)

    return grpc.dynamic_ssl_server_credentials(
        _configuration(files.current), fetch, require_client_authentication=False
    )


__all__ = ["KeyPair", "RotatingKeyPair", "TlsOptions", "self_signed", "server_credentials"]
