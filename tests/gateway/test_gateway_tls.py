"""TLS between real Envoy and the picker: requests pass with TLS on (self-signed, or a
certificate Envoy verifies against a CA) and off; a certificate Envoy cannot verify fails
the request closed, or open to the fallback pool, as configured."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest
from conftest import TARGET_HEADER, Gateway, gateway
from support.certificates import CertificateAuthority
from support.net import async_wait_until

from smart_epp.epp.tls import TlsOptions, server_credentials

pytestmark = pytest.mark.envoy


async def completion(gw: Gateway, target: int) -> tuple[int, dict]:
    async with gw.http.post(
        f"{gw.url}/v1/completions",
        json={"model": "tiny", "prompt": "hello"},
        headers={TARGET_HEADER: gw.backends[target].address},
    ) as response:
        answer = await response.json(content_type=None)
        return response.status, answer


def handshakes(gw: Gateway) -> int:
    return gw.envoy.stats("cluster.epp.ssl.handshake").get("cluster.epp.ssl.handshake", 0)


async def test_self_signed_certificate_by_default(body_mode: str) -> None:
    async with gateway(body_mode, tls=server_credentials(TlsOptions())) as gw:
        for target in (1, 0):
            status, answer = await completion(gw, target)
            assert status == 200
            assert answer["backend"] == gw.backends[target].name
        assert handshakes(gw) >= 1  # the ext_proc stream ran over TLS


async def test_plaintext_when_secure_serving_is_off() -> None:
    async with gateway(tls=None) as gw:
        status, answer = await completion(gw, 1)
        assert status == 200 and answer["backend"] == gw.backends[1].name
        assert handshakes(gw) == 0


async def test_certificate_verified_against_the_ca(tmp_path: Path) -> None:
    ca = CertificateAuthority()
    files = ca.issue(tmp_path, ["127.0.0.1"])
    tls = server_credentials(TlsOptions(files.cert, files.key))
    async with gateway(tls=tls, epp_ca_file=ca.write(tmp_path / "ca.pem")) as gw:
        status, answer = await completion(gw, 0)
        assert status == 200 and answer["backend"] == gw.backends[0].name
        assert handshakes(gw) >= 1


def wrong_ca_gateway(tmp_path: Path, **overrides: object) -> AbstractAsyncContextManager[Gateway]:
    """The picker's certificate comes from one CA; Envoy trusts another."""
    files = CertificateAuthority("picker CA").issue(tmp_path, ["127.0.0.1"])
    trusted = CertificateAuthority("another CA").write(tmp_path / "trusted.pem")
    return gateway(
        tls=server_credentials(TlsOptions(files.cert, files.key)),
        epp_ca_file=trusted,
        wait_for_epp=False,
        **overrides,
    )


def assert_unknown_ca_logged(capfd: pytest.CaptureFixture[str]) -> None:
    """The picker's log names the cause: the gateway did not trust its certificate's CA
    (gRPC logs every failed handshake with the TLS alert the client sent)."""
    logged = capfd.readouterr().err
    assert "Handshake failed" in logged and "UNKNOWN_CA" in logged, logged[-2000:]


def verify_failures(gw: Gateway) -> int:
    return gw.envoy.stats("cluster.epp.ssl.fail_verify_error").get(
        "cluster.epp.ssl.fail_verify_error", 0
    )


async def test_wrong_ca_fails_closed(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    async with wrong_ca_gateway(tmp_path, failure_mode="close") as gw:
        await async_wait_until(lambda: verify_failures(gw) > 0, what="a refused handshake")
        status, _ = await completion(gw, 0)
        assert 500 <= status < 600
        assert all(b.received == [] for b in gw.backends)
        assert_unknown_ca_logged(capfd)


async def test_wrong_ca_fails_open_to_the_fallback_pool(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    async with wrong_ca_gateway(tmp_path, failure_mode="open", pool_backends=[1]) as gw:
        await async_wait_until(lambda: verify_failures(gw) > 0, what="a refused handshake")
        status, answer = await completion(gw, 0)
        assert status == 200 and answer["backend"] == gw.backends[1].name
        assert gw.scheduler.routed == []  # the picker never saw it
        assert_unknown_ca_logged(capfd)
