"""The endpoints file: format, reload on change, and bad edits that keep the pool."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.net import async_wait_until

from smart_epp.epp.datastore import Datastore
from smart_epp.epp.discovery import (
    EndpointsFileError,
    EndpointsFileWatcher,
    endpoints_from_addresses,
    parse_endpoints_document,
)
from smart_epp.framework.types import Endpoint

FULL = """
endpoints:
  - address: 127.0.0.1:8001
    metrics: http://127.0.0.1:8001/metrics
    kv_events: tcp://127.0.0.1:5557
    kv_replay: tcp://127.0.0.1:5558
    labels: {role: decode}
  - address: 127.0.0.1:8002
"""


def test_document_format() -> None:
    first, second = parse_endpoints_document(FULL)
    assert first == Endpoint(
        "127.0.0.1:8001",
        "http://127.0.0.1:8001/metrics",
        "tcp://127.0.0.1:5557",
        "tcp://127.0.0.1:5558",
        (("role", "decode"),),
    )
    assert second.metrics_url == "http://127.0.0.1:8002/metrics" and second.kv_events is None
    assert parse_endpoints_document("") == []


@pytest.mark.parametrize(
    "text",
    [
        "endpoints: [{metrics: http://x}]",
        "endpoints: [{address: nohost}]",
        "endpoints: [{address: 'h:99999'}]",
        "endpoints: [{address: 'h:1', colour: red}]",
        "endpoints: {",
        "pods: []",
    ],
)
def test_bad_documents_are_refused_clearly(text: str) -> None:
    with pytest.raises(EndpointsFileError):
        parse_endpoints_document(text, "pool.yaml")


def test_flag_addresses() -> None:
    assert [e.address for e in endpoints_from_addresses(["h:1", "[::1]:2"])] == ["h:1", "[::1]:2"]
    with pytest.raises(ValueError):
        endpoints_from_addresses(["h"])


def write_atomically(path: Path, text: str) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


async def test_file_is_reloaded_on_change_and_bad_edits_keep_the_pool(tmp_path: Path) -> None:
    path = tmp_path / "pool.yaml"
    path.write_text(FULL)
    store = Datastore()
    errors: list[Exception] = []
    watcher = EndpointsFileWatcher(path, store, interval_s=0.02, on_error=errors.append)
    assert watcher.poll()
    pod = store.get("127.0.0.1:8001")
    assert len(store) == 2 and pod is not None

    import asyncio

    task = asyncio.create_task(watcher.run())
    try:
        write_atomically(
            path, "endpoints:\n  - address: 127.0.0.1:8001\n  - address: 10.0.0.9:80\n"
        )
        await async_wait_until(lambda: store.get("10.0.0.9:80") is not None, what="reload")
        assert store.get("127.0.0.1:8002") is None
        assert store.get("127.0.0.1:8001") is not None

        write_atomically(path, "endpoints: [{address: broken")
        await async_wait_until(lambda: len(errors) == 1, what="bad edit counted")
        assert len(store) == 2  # the previous pool stays

        path.unlink()
        await async_wait_until(lambda: len(errors) == 2, what="missing file counted")
        assert len(store) == 2

        write_atomically(path, "endpoints: []\n")
        await async_wait_until(lambda: len(store) == 0, what="emptied on purpose")
    finally:
        task.cancel()
