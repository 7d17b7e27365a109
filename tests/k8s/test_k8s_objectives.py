"""InferenceObjective objects watched over the Kubernetes API (HTTPS, bearer token) into
the objective table flow control reads."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from fake_kube_api import FakeKubeApi
from support.net import async_wait_until

from smart_epp.epp.flowcontrol.k8s_objectives import KubernetesObjectivesWatcher
from smart_epp.epp.flowcontrol.objectives import ObjectiveTable
from smart_epp.epp.k8s_discovery import KubernetesDiscoveryOptions

POOL = "my-pool"


def objective(name: str, priority: object, pool: str | None = POOL) -> dict[str, object]:
    spec: dict[str, object] = {"priority": priority}
    if pool is not None:
        spec["poolRef"] = {"name": pool}
    return {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
        "kind": "InferenceObjective",
        "metadata": {"name": name, "namespace": "default"},
        "spec": spec,
    }


@pytest.fixture
async def fake_api() -> AsyncIterator[FakeKubeApi]:
    api = await FakeKubeApi().start()
    try:
        yield api
    finally:
        await api.stop()


async def test_objectives_follow_the_api(fake_api: FakeKubeApi, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(fake_api.token)
    options = KubernetesDiscoveryOptions(
        pool_name=POOL,
        namespace="default",
        api_url=fake_api.url,
        token_file=token_file,
        ca_file=fake_api.write_ca(tmp_path),
        backoff_min_s=0.02,
        backoff_max_s=0.1,
    )
    fake_api.put_objective(objective("critical", 2))
    fake_api.put_objective(objective("batch", -1))
    fake_api.put_objective(objective("elsewhere", 5, pool="another-pool"))
    fake_api.put_objective(objective("broken", "high"))
    table = ObjectiveTable()
    watcher = KubernetesObjectivesWatcher(options, table)
    task = asyncio.create_task(watcher.run())
    try:
        await async_wait_until(lambda: table.priority("critical") == 2, what="the first list")
        assert table.priority("batch") == -1
        assert table.priority("elsewhere") == 0  # another pool's objective is not ours
        assert table.priority("broken") == 0 and watcher.errors >= 1  # left out, counted
        fake_api.put_objective(objective("batch", 1))  # a change arrives over the watch
        await async_wait_until(lambda: table.priority("batch") == 1, what="the update")
        fake_api.delete("inference.networking.x-k8s.io/v1alpha2/inferenceobjectives", "critical")
        await async_wait_until(lambda: table.priority("critical") == 0, what="the delete")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
