"""TLS serving options: flag spellings, certificate files re-read on rotation (through a
real gRPC TLS handshake), and the Envoy config matching `--secure-serving`."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.certificates import CertificateAuthority

from smart_epp.epp.cli import build_parser
from smart_epp.epp.datastore import Datastore
from smart_epp.epp.flow import RequestFlow
from smart_epp.epp.round_robin import RoundRobinScheduler
from smart_epp.epp.server import EppServer
from smart_epp.epp.tls import RotatingKeyPair, TlsOptions, server_credentials

EPP = [sys.executable, "-c", "from smart_epp.epp.cli import main; main()"]


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], True),
        (["--secure-serving"], True),
        (["--secure-serving=false"], False),
        (["--secure-serving", "false"], False),
        (["--secure-serving", "False"], False),
        (["--secure-serving=true"], True),
    ],
)
def test_secure_serving_spellings(flags: list[str], expected: bool) -> None:
    for command in ("serve", "envoy"):
        assert build_parser().parse_args([command, *flags]).secure_serving is expected


def test_serve_refuses_bad_tls_flags(tmp_path: Path) -> None:
    cases = [
        (["--secure-serving=maybe"], "expected true or false"),
        (["--tls-cert", str(tmp_path / "missing.pem"), "--tls-key", str(tmp_path / "k.pem")],
         "does not exist"),
        (["--tls-cert", str(tmp_path / "c.pem")], "go together"),
        (["--secure-serving=false", "--tls-cert", "c", "--tls-key", "k"], "need --secure-serving"),
    ]  # fmt: skip
    (tmp_path / "c.pem").write_text("x")
    for flags, message in cases:
        result = subprocess.run(
            [*EPP, "serve", "--endpoint", "127.0.0.1:1", *flags],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert result.returncode == 2, (flags, result.stderr)
        assert message in result.stderr, (flags, result.stderr)


async def health_over_tls(port: int, ca_pem: bytes) -> int:
    """One health check on a fresh TLS connection that trusts only `ca_pem`."""
    credentials = grpc.ssl_channel_credentials(ca_pem)
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="liveness")
        return (await stub.Check(request, timeout=10)).status


async def test_rotated_certificate_is_served_to_new_connections(tmp_path: Path) -> None:
    old_ca, new_ca = CertificateAuthority("old"), CertificateAuthority("new")
    live = old_ca.issue(tmp_path, ["127.0.0.1"], stem="tls")
    server = EppServer(RequestFlow(RoundRobinScheduler(), Datastore()))
    await server.start(
        0, None, None, host="127.0.0.1", tls=server_credentials(TlsOptions(live.cert, live.key))
    )
    try:
        serving = health_pb2.HealthCheckResponse.SERVING
        assert await health_over_tls(server.grpc_port, old_ca.pem) == serving
        # cert-manager (and a mounted Secret) replace the files in place.
        rotated = new_ca.issue(tmp_path, ["127.0.0.1"], stem="next")
        os.replace(rotated.cert, live.cert)
        os.replace(rotated.key, live.key)
        assert await health_over_tls(server.grpc_port, new_ca.pem) == serving
        with pytest.raises(grpc.aio.AioRpcError):
            await health_over_tls(server.grpc_port, old_ca.pem)
    finally:
        await server.stop(0)


def test_half_written_pair_keeps_the_previous_one(tmp_path: Path) -> None:
    files = CertificateAuthority().issue(tmp_path, ["localhost"])
    pair = RotatingKeyPair(files.cert, files.key)
    assert pair.changed() is None  # nothing changed since the first read
    files.cert.write_text("-----BEGIN CERTIFICATE-----\ntruncated")
    assert pair.changed() is None
    assert pair.current.cert_pem.startswith(b"-----BEGIN CERTIFICATE-----\nMII")


def epp_cluster(*flags: str) -> dict:
    out = subprocess.run(
        [*EPP, "envoy", "--print-config", *flags], capture_output=True, text=True, check=True
    ).stdout
    clusters = yaml.safe_load(out)["static_resources"]["clusters"]
    return next(c for c in clusters if c["name"] == "epp")


def test_envoy_config_follows_secure_serving(tmp_path: Path) -> None:
    assert "transport_socket" not in epp_cluster("--secure-serving=false")
    unverified = epp_cluster()["transport_socket"]["typed_config"]
    assert unverified["common_tls_context"] == {"alpn_protocols": ["h2"]}
    ca = CertificateAuthority().write(tmp_path / "ca.pem")
    verified = epp_cluster("--epp-host", "smart-epp.ns.svc", "--epp-ca-file", str(ca))
    tls = verified["transport_socket"]["typed_config"]
    assert tls["sni"] == "smart-epp.ns.svc"
    validation = tls["common_tls_context"]["validation_context"]
    assert validation["trusted_ca"] == {"filename": str(ca)}
    assert validation["match_typed_subject_alt_names"] == [
        {"san_type": "DNS", "matcher": {"exact": "smart-epp.ns.svc"}}
    ]


def reachable(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        return probe.connect_ex((host, port)) == 0


@pytest.mark.parametrize(("host", "elsewhere"), [("127.0.0.2", "127.0.0.1"), ("::1", "127.0.0.1")])
async def test_host_is_the_bind_address_of_every_port(host: str, elsewhere: str) -> None:
    server = EppServer(RequestFlow(RoundRobinScheduler(), Datastore()))
    await server.start(0, 0, 0, host=host, tls=server_credentials(TlsOptions()))
    try:
        for port in (server.grpc_port, server.health_port, server.metrics_port):
            assert reachable(host, port)
            assert not reachable(elsewhere, port)
    finally:
        await server.stop(0)
