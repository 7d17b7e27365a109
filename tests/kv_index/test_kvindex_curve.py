"""Central mode with CURVE: only publishers holding an allowed key reach the index."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq.asyncio
import zmq.auth
from kvindex_publisher import VllmKvPublisher
from support.net import async_wait_until, free_port
from test_kvindex_subscriber import Pod, stored_batch

from smart_epp.framework.types import Endpoint
from smart_epp.kv_index.curve import CurveServerConfig
from smart_epp.kv_index.manager import KVEventManager
from smart_epp.kv_index.memory import MemoryBlockIndex


def keypair(folder: Path, name: str) -> tuple[bytes, bytes]:
    _public_file, secret_file = zmq.auth.create_certificates(folder, name)
    public, secret = zmq.auth.load_certificate(secret_file)
    assert secret is not None
    return public, secret


async def test_only_allowed_keys_can_publish(tmp_path: Path) -> None:
    server_dir, clients, others = tmp_path / "server", tmp_path / "clients", tmp_path / "others"
    for folder in (server_dir, clients, others):
        folder.mkdir()
    server_public, _ = keypair(server_dir, "epp")
    allowed = keypair(clients, "pod")
    stranger = keypair(others, "stranger")
    config = CurveServerConfig(server_dir / "epp.key_secret", clients)

    ctx = zmq.asyncio.Context()
    index = MemoryBlockIndex()
    manager = KVEventManager(
        index, mode="central", bind=f"tcp://127.0.0.1:{free_port()}", context=ctx, curve=config
    )
    await manager.start()
    bound = manager.central_endpoint
    assert bound is not None
    pod = Pod()
    await manager.add_endpoint(Endpoint(address=pod.address))
    topic = f"kv@{pod.address}@m"
    good = await VllmKvPublisher(
        topic, bound, None, connect=True, curve=(*allowed, server_public)
    ).start()
    # A key the picker does not know, and a publisher without CURVE at all.
    forged = await VllmKvPublisher(
        topic, bound, None, connect=True, curve=(*stranger, server_public)
    ).start()
    plain = await VllmKvPublisher(topic, bound, None, connect=True).start()
    try:
        forged_tokens, plain_tokens, good_tokens = [7] * 4, [8] * 4, [1, 2, 3, 4]

        async def good_seen() -> bool:
            # The refused publishers keep sending first, every round.
            await forged.publish(stored_batch(forged_tokens, [70 + forged.seq]))
            await plain.publish(stored_batch(plain_tokens, [80 + plain.seq]))
            if index.lookup_sync(pod.keys(good_tokens)):
                return True
            await good.publish(stored_batch(good_tokens, [101]))
            return False

        await async_wait_until(good_seen, timeout=10, what="the allowed publisher's batch")
        assert index.lookup_sync(pod.keys(forged_tokens)) == {}
        assert index.lookup_sync(pod.keys(plain_tokens)) == {}
        assert forged.seq > 1 and plain.seq > 1
    finally:
        await manager.stop()
        for publisher in (good, forged, plain):
            await publisher.close()
        ctx.term()


def test_config_is_checked_up_front(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="secret key file"):
        CurveServerConfig(tmp_path / "missing.key_secret", tmp_path)
    with pytest.raises(ValueError, match="central"):
        KVEventManager(
            MemoryBlockIndex(),
            mode="dial",
            curve=CurveServerConfig.__new__(CurveServerConfig),
        )
