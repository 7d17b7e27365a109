"""Discovery over TLS, as in every cluster: the API server's certificate must chain to the
CA given (--k8s-ca-file, or the service account's ca.crt), and the bearer token goes only
over that verified connection."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from fake_kube_api import FakeKubeApi, make_pod, make_pool_v1
from prometheus_client import REGISTRY
from support.certificates import CertificateAuthority
from support.net import async_wait_until

from smart_epp.epp import k8s_discovery as kd
from smart_epp.epp.datastore import Datastore
from smart_epp.epp.k8s_discovery import KubernetesPoolWatcher

POOL = "vllm-pool"
APP = {"app": "vllm"}


@pytest.fixture
async def api() -> AsyncIterator[FakeKubeApi]:
    server = await FakeKubeApi().start()
    server.put_pool(make_pool_v1(POOL, APP, [8000]))
    server.put_pod(make_pod("vllm-0", "10.0.0.1", APP))
    try:
        yield server
    finally:
        await server.stop()


async def watch(
    options: kd.KubernetesDiscoveryOptions,
) -> tuple[Datastore, KubernetesPoolWatcher, asyncio.Task]:
    datastore = Datastore()
    watcher = KubernetesPoolWatcher(options, datastore)
    return datastore, watcher, asyncio.create_task(watcher.run())


async def stop(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def in_cluster_options(
    api: FakeKubeApi, account: Path, monkeypatch: pytest.MonkeyPatch
) -> kd.KubernetesDiscoveryOptions:
    """What `epp serve --pool-name vllm-pool` chooses in a pod: the service host and port
    from the environment, the token, CA and namespace from the mounted service account."""
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(api.port))
    monkeypatch.setattr(kd, "SERVICE_ACCOUNT_DIR", account)
    options = kd.kubernetes_discovery_options(
        pool_name=POOL, namespace=None, api_url=None, token_file=None, ca_file=None,
        static_pool=False, kv_events_port=5557, kv_replay_port=5558,
    )  # fmt: skip
    assert options is not None
    return options


async def test_in_cluster_discovery_verifies_the_api_server(
    api: FakeKubeApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    account = tmp_path / "serviceaccount"
    account.mkdir()
    api.write_ca(account)
    (account / "token").write_text(api.token)
    (account / "namespace").write_text("default")
    options = in_cluster_options(api, account, monkeypatch)
    assert options.api_url.startswith("https://") and options.ca_file == account / "ca.crt"
    datastore, watcher, task = await watch(options)
    try:
        await async_wait_until(lambda: len(datastore) == 1, 10, "the pool over HTTPS")
        api.put_pod(make_pod("vllm-1", "10.0.0.2", APP))  # the watch runs over TLS too
        await async_wait_until(lambda: len(datastore) == 2, 10, "a watched pod")
        assert api.unauthorized == 0 and watcher.errors == 0
    finally:
        await stop(task)


async def test_a_server_outside_the_trusted_ca_gets_no_token(
    api: FakeKubeApi, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="smart_epp.epp.k8s_discovery")
    token = tmp_path / "token"
    token.write_text(api.token)
    other = CertificateAuthority("someone else").write(tmp_path / "other-ca.crt")
    options = kd.KubernetesDiscoveryOptions(
        pool_name=POOL, namespace="default", api_url=api.url, token_file=token,
        ca_file=other, backoff_min_s=0.02, backoff_max_s=0.1,
    )  # fmt: skip
    datastore, watcher, task = await watch(options)
    try:
        await async_wait_until(lambda: watcher.errors >= 2, 10, "refused handshakes")
        assert len(datastore) == 0
        assert api.requests == []  # nothing, the token included, was sent
        assert "certificate verify failed" in caplog.text
        tls_errors = REGISTRY.get_sample_value(
            "smart_epp_k8s_discovery_errors_total", {"reason": "tls"}
        )
        assert tls_errors is not None and tls_errors >= 2
    finally:
        await stop(task)


async def test_a_wrong_token_over_tls_is_refused(api: FakeKubeApi, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("not-the-token")
    options = kd.KubernetesDiscoveryOptions(
        pool_name=POOL, namespace="default", api_url=api.url, token_file=token,
        ca_file=api.write_ca(tmp_path), backoff_min_s=0.02, backoff_max_s=0.1,
    )  # fmt: skip
    datastore, _, task = await watch(options)
    try:
        await async_wait_until(lambda: api.unauthorized >= 2, 10, "refused requests")
        assert len(datastore) == 0
        token.write_text(api.token)  # the projected token is rotated in place
        await async_wait_until(lambda: len(datastore) == 1, 10, "the pool with the new token")
    finally:
        await stop(task)
