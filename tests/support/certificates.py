"""A certificate authority made in the test: server certificates it signs, written as PEM
files, for TLS between real processes (Envoy to epp, epp to the Kubernetes API)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DAY = datetime.timedelta(days=1)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


@dataclass(frozen=True)
class ServerFiles:
    cert: Path
    key: Path


class CertificateAuthority:
    def __init__(self, name: str = "smart-epp test CA") -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(_name(name))
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - DAY)
            .not_valid_after(now + DAY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(self.key, hashes.SHA256())
        )

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def write(self, path: Path) -> Path:
        path.write_bytes(self.pem)
        return path

    def issue(self, directory: Path, names: list[str], stem: str = "server") -> ServerFiles:
        """A server certificate for `names` (DNS names or IP addresses) and its key."""
        key = ec.generate_private_key(ec.SECP256R1())
        alternative: list[x509.GeneralName] = []
        for name in names:
            try:
                alternative.append(x509.IPAddress(ipaddress.ip_address(name)))
            except ValueError:
                alternative.append(x509.DNSName(name))
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(names[0]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - DAY)
            .not_valid_after(now + DAY)
            .add_extension(x509.SubjectAlternativeName(alternative), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        files = ServerFiles(directory / f"{stem}.pem", directory / f"{stem}-key.pem")
        files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        files.key.write_bytes(_pem_key(key))
        return files
