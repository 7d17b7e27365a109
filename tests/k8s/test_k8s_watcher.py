"""KubernetesPoolWatcher against a fake API server that speaks the real wire format:
LIST + WATCH of the InferencePool and its pods, 410 re-lists, reconnects, re-targeting."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fake_kube_api import FakeKubeApi, make_pod, make_pool_v1, make_pool_v1alpha2
from support.net import async_wait_until

from smart_epp.epp import k8s_discovery as kd
from smart_epp.epp.datastore import Datastore
from smart_epp.epp.k8s_discovery import KubernetesDiscoveryOptions, KubernetesPoolWatcher

POOL = "vllm-pool"
APP = {"app": "vllm"}
PODS = "/api/v1/namespaces/default/pods"
V1_POOLS = "/apis/inference.networking.k8s.io/v1/namespaces/default/inferencepools"
ALPHA = "inference.networking.x-k8s.io/v1alpha2"
ALPHA_POOLS = "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/default/inferencepools"


@dataclass
class Discovery:
    api: FakeKubeApi
    watcher: KubernetesPoolWatcher
    datastore: Datastore
    token_file: Path

    def addresses(self) -> set[str]:
        return {p.address for p in self.datastore.pods()}

    async def wait_for(self, expected: set[str], what: str = "") -> None:
        await async_wait_until(
            lambda: self.addresses() == expected, 5, what or f"pool == {sorted(expected)}"
        )


@contextlib.asynccontextmanager
async def running(
    api: FakeKubeApi, tmp_path: Path, token: str | None = None
) -> AsyncIterator[Discovery]:
    token_file = tmp_path / "token"
    token_file.write_text((token or api.token) + "\n")
    options = KubernetesDiscoveryOptions(
        pool_name=POOL,
        namespace="default",
        api_url=api.url,
        token_file=token_file,
        ca_file=api.write_ca(tmp_path) if api.ca is not None else None,
        kv_events_port=5557,
        kv_replay_port=5558,
        backoff_min_s=0.02,
        backoff_max_s=0.1,
    )
    datastore = Datastore()
    watcher = KubernetesPoolWatcher(options, datastore)
    task = asyncio.create_task(watcher.run())
    try:
        yield Discovery(api, watcher, datastore, token_file)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.fixture
async def fake_api() -> AsyncIterator[FakeKubeApi]:
    api = await FakeKubeApi(
        pool_versions=("inference.networking.k8s.io/v1", "inference.networking.x-k8s.io/v1alpha2")
    ).start()
    try:
        yield api
    finally:
        await api.stop()


async def test_pods_joining_getting_ready_and_leaving_update_the_datastore(
    fake_api: FakeKubeApi, tmp_path: Path
) -> None:
    fake_api.put_pool(make_pool_v1(POOL, APP, [8000]))
    fake_api.put_pod(make_pod("a", "10.0.0.1", {**APP, "model": "tiny"}))
    fake_api.put_pod(make_pod("other", "10.0.0.9", {"app": "web"}))
    async with running(fake_api, tmp_path) as d:
        assert await d.watcher.wait_synced(5)
        await d.wait_for({"10.0.0.1:8000"})
        [pod] = d.datastore.pods()
        assert pod.endpoint.label("model") == "tiny"
        assert pod.endpoint.kv_events == "tcp://10.0.0.1:5557"

        # Events arrive in order: once c shows up, b (not ready) was seen and left out.
        fake_api.put_pod(make_pod("b", "10.0.0.2", APP, ready=False))
        fake_api.put_pod(make_pod("c", "10.0.0.3", APP, phase="Pending"))
        fake_api.put_pod(make_pod("d", "10.0.0.4", APP))
        await d.wait_for({"10.0.0.1:8000", "10.0.0.4:8000"})

        fake_api.put_pod(make_pod("b", "10.0.0.2", APP))  # becomes ready
        await d.wait_for({"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.4:8000"})
        fake_api.put_pod(make_pod("a", "10.0.0.1", APP, ready=False))  # readiness fails
        await d.wait_for({"10.0.0.2:8000", "10.0.0.4:8000"})
        fake_api.put_pod(make_pod("b", "10.0.0.2", APP, deleting=True))  # terminating
        await d.wait_for({"10.0.0.4:8000"})
        fake_api.delete("pods", "d")
        await d.wait_for(set())
        # A pod relabelled out of the selector leaves like a deleted one.
        fake_api.put_pod(make_pod("e", "10.0.0.5", APP))
        await d.wait_for({"10.0.0.5:8000"})
        fake_api.put_pod(make_pod("e", "10.0.0.5", {"app": "web"}))
        await d.wait_for(set())

        # One LIST, then a single watch that carried every change, with bookmarks asked for.
        assert fake_api.lists(PODS) == 1
        [(_, query)] = [r for r in fake_api.requests if r[0] == PODS and "watch" in r[1]]
        assert query["labelSelector"] == "app=vllm"
        assert query["allowWatchBookmarks"] == "true"
        assert int(query["resourceVersion"]) > 0
        assert d.watcher.errors == 0
        assert fake_api.unauthorized == 0


async def test_bookmarks_advance_the_resume_point(fake_api: FakeKubeApi, tmp_path: Path) -> None:
    fake_api.put_pool(make_pool_v1(POOL, APP, [8000]))
    async with running(fake_api, tmp_path) as d:
        await async_wait_until(lambda: fake_api.open_watches("pods") == 1, 5, "pod watch open")
        fake_api.send_bookmark()
        bookmark_version = fake_api.version
        fake_api.put_pool(make_pool_v1("unrelated", {"x": "y"}, [1]))  # moves the version on
        # The server ends the watch cleanly (its timeout): it resumes from the bookmark.
        for watch in list(fake_api.watches):
            if watch.resource == "pods":
                watch.queue.put_nowait(None)
        await async_wait_until(lambda: fake_api.watch_requests(PODS) == 2, 5, "watch resumed")
        resumed = [q for p, q in fake_api.requests if p == PODS and "watch" in q][-1]
        assert int(resumed["resourceVersion"]) == bookmark_version
        assert fake_api.lists(PODS) == 1  # resumed, not re-listed
        fake_api.put_pod(make_pod("a", "10.0.0.1", APP))
        await d.wait_for({"10.0.0.1:8000"})


async def test_expired_resource_version_relists(fake_api: FakeKubeApi, tmp_path: Path) -> None:
    fake_api.put_pool(make_pool_v1(POOL, APP, [8000]))
    fake_api.put_pod(make_pod("a", "10.0.0.1", APP))
    async with running(fake_api, tmp_path) as d:
        await d.wait_for({"10.0.0.1:8000"})
        await async_wait_until(lambda: fake_api.open_watches("pods") == 1, 5, "pod watch open")
        fake_api.compact()  # open watches get ERROR 410
        await async_wait_until(lambda: fake_api.lists(PODS) == 2, 5, "pods listed again")
        fake_api.put_pod(make_pod("b", "10.0.0.2", APP))
        await d.wait_for({"10.0.0.1:8000", "10.0.0.2:8000"})
        assert d.watcher.errors == 0  # 410 is routine, not an error


async def test_dropped_watch_reconnects_and_keeps_the_pool_meanwhile(
    fake_api: FakeKubeApi, tmp_path: Path
) -> None:
    fake_api.put_pool(make_pool_v1(POOL, APP, [8000]))
    fake_api.put_pod(make_pod("a", "10.0.0.1", APP))
    async with running(fake_api, tmp_path) as d:
        await d.wait_for({"10.0.0.1:8000"})
        await async_wait_until(lambda: fake_api.open_watches("pods") == 1, 5, "pod watch open")
        fake_api.drop_watches()
        await async_wait_until(lambda: d.watcher.errors >= 1, 5, "the cut noticed")
        assert d.addresses() == {"10.0.0.1:8000"}  # the pool stays while reconnecting
        fake_api.delete("pods", "a")
        fake_api.put_pod(make_pod("b", "10.0.0.2", APP))
        await d.wait_for({"10.0.0.2:8000"}, "changes after the reconnect applied")
        # The re-list can bring the changes before the new watch is opened.
        await async_wait_until(lambda: fake_api.watch_requests(PODS) >= 2, 5, "pods re-watched")


async def test_api_server_down_then_up(tmp_path: Path) -> None:
    api = await FakeKubeApi().start()
    url = api.url
    api.put_pool(make_pool_v1(POOL, APP, [8000]))
    api.put_pod(make_pod("a", "10.0.0.1", APP))
    try:
        async with running(api, tmp_path) as d:
            await d.wait_for({"10.0.0.1:8000"})
            port = api.port
            await api.stop()  # connections refused from here on
            await async_wait_until(lambda: d.watcher.errors >= 2, 5, "refusals counted")
            assert d.addresses() == {"10.0.0.1:8000"}
            revived = FakeKubeApi(ca=api.ca)
            revived.objects = api.objects
            revived.version = api.version
            api = await revived.start(port)
            assert api.url == url
            api.put_pod(make_pod("b", "10.0.0.2", APP))
            await d.wait_for({"10.0.0.1:8000", "10.0.0.2:8000"}, "back after the outage")
    finally:
        await api.stop()


async def test_pool_selector_and_port_changes_retarget(
    fake_api: FakeKubeApi, tmp_path: Path
) -> None:
    fake_api.put_pool(make_pool_v1(POOL, APP, [8000]))
    fake_api.put_pod(make_pod("a", "10.0.0.1", APP))
    fake_api.put_pod(make_pod("b1", "10.0.1.1", {"app": "vllm-b"}))
    async with running(fake_api, tmp_path) as d:
        await d.wait_for({"10.0.0.1:8000"})
        fake_api.put_pool(make_pool_v1(POOL, {"app": "vllm-b"}, [8000]))
        await d.wait_for({"10.0.1.1:8000"}, "the new selector's pods")
        await async_wait_until(
            lambda: fake_api.open_watches("pods") == 1, 5, "old pod watch closed"
        )
        fake_api.put_pod(make_pod("a2", "10.0.0.2", APP))  # old selector: ignored now
        fake_api.put_pod(make_pod("b2", "10.0.1.2", {"app": "vllm-b"}))
        await d.wait_for({"10.0.1.1:8000", "10.0.1.2:8000"})

        fake_api.put_pool(make_pool_v1(POOL, {"app": "vllm-b"}, [9000, 9001]))
        await d.wait_for({"10.0.1.1:9000", "10.0.1.1:9001", "10.0.1.2:9000", "10.0.1.2:9001"})
        rank1 = d.datastore.get("10.0.1.2:9001")
        assert rank1 is not None and rank1.endpoint.kv_events == "tcp://10.0.1.2:5558"

        # A broken edit keeps the last good pool and is counted.
        fake_api.put_pool({"metadata": {"name": POOL}, "spec": {"selector": {}}})
        await async_wait_until(lambda: d.watcher.errors == 1, 5, "bad pool counted")
        assert len(d.addresses()) == 4

        fake_api.delete("inference.networking.k8s.io/v1/inferencepools", POOL)
        await d.wait_for(set(), "a deleted pool is empty")
        fake_api.put_pool(make_pool_v1(POOL, APP, [8000]))
        await d.wait_for({"10.0.0.1:8000", "10.0.0.2:8000"}, "the pool is back")


async def test_v1alpha2_pool_is_used_when_only_it_exists(tmp_path: Path) -> None:
    api = await FakeKubeApi(pool_versions=("inference.networking.x-k8s.io/v1alpha2",)).start()
    try:
        api.put_pool(make_pool_v1alpha2(POOL, APP, 8000), ALPHA)
        api.put_pod(make_pod("a", "10.0.0.1", APP))
        async with running(api, tmp_path) as d:
            await d.wait_for({"10.0.0.1:8000"})
            assert d.watcher.pool_path == ALPHA_POOLS
            assert api.lists(V1_POOLS) == 1  # asked, answered 404 (not installed)
            api.put_pool(make_pool_v1alpha2(POOL, APP, 8080), ALPHA)
            await d.wait_for({"10.0.0.1:8080"})
            assert d.watcher.errors == 0
    finally:
        await api.stop()


async def test_pool_in_the_alpha_group_wins_over_an_empty_v1(
    fake_api: FakeKubeApi, tmp_path: Path
) -> None:
    fake_api.put_pool(make_pool_v1alpha2(POOL, APP, 8000), ALPHA)
    fake_api.put_pod(make_pod("a", "10.0.0.1", APP))
    async with running(fake_api, tmp_path) as d:
        await d.wait_for({"10.0.0.1:8000"})
        assert d.watcher.pool_path == ALPHA_POOLS


async def test_missing_pool_is_awaited(fake_api: FakeKubeApi, tmp_path: Path) -> None:
    fake_api.put_pod(make_pod("a", "10.0.0.1", APP))
    async with running(fake_api, tmp_path) as d:
        assert await d.watcher.wait_synced(5)
        assert d.addresses() == set()
        assert d.watcher.pool_path == V1_POOLS
        fake_api.put_pool(make_pool_v1(POOL, APP, [8000]))
        await d.wait_for({"10.0.0.1:8000"}, "the pool created later")


async def test_annotations_give_the_kv_sockets_and_bad_ones_leave_the_pod_out(
    fake_api: FakeKubeApi, tmp_path: Path
) -> None:
    fake_api.put_pool(make_pool_v1(POOL, APP, [8000]))
    annotations = {kd.KV_EVENTS_PORT_ANNOTATION: "7001", kd.KV_REPLAY_PORT_ANNOTATION: "7002"}
    fake_api.put_pod(make_pod("a", "10.0.0.1", APP, annotations=annotations))
    bad = {kd.KV_EVENTS_PORT_ANNOTATION: "x"}
    fake_api.put_pod(make_pod("b", "10.0.0.2", APP, annotations=bad))
    async with running(fake_api, tmp_path) as d:
        await d.wait_for({"10.0.0.1:8000"})
        pod = d.datastore.get("10.0.0.1:8000")
        assert pod is not None
        assert (pod.endpoint.kv_events, pod.endpoint.kv_replay) == (
            "tcp://10.0.0.1:7001",
            "tcp://10.0.0.1:7002",
        )
        assert d.watcher.errors == 1  # pod b, counted once
        good = {kd.KV_EVENTS_PORT_ANNOTATION: "7003"}
        fake_api.put_pod(make_pod("b", "10.0.0.2", APP, annotations=good))
        await d.wait_for({"10.0.0.1:8000", "10.0.0.2:8000"}, "fixed annotation")
        fixed = d.datastore.get("10.0.0.2:8000")
        assert fixed is not None and fixed.endpoint.kv_events == "tcp://10.0.0.2:7003"


async def test_wrong_token_is_refused_until_the_token_file_is_fixed(
    fake_api: FakeKubeApi, tmp_path: Path
) -> None:
    fake_api.put_pool(make_pool_v1(POOL, APP, [8000]))
    fake_api.put_pod(make_pod("a", "10.0.0.1", APP))
    async with running(fake_api, tmp_path, token="stale") as d:
        await async_wait_until(lambda: fake_api.unauthorized >= 2, 5, "refused twice")
        assert d.addresses() == set()
        assert d.watcher.errors >= 2
        d.token_file.write_text(fake_api.token)  # a rotated service-account token
        await d.wait_for({"10.0.0.1:8000"}, "accepted with the new token")
