"""`epp serve --k8s-api` as a real subprocess: the pool comes from an InferencePool on a
fake Kubernetes API, its pods are simulated vLLM servers on their own loopback IPs (one
target port for all, as in a cluster), and their KV-event sockets come from annotations."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
from fake_kube_api import FakeKubeApi, make_pod, make_pool_v1
from support.net import async_wait_until, free_port, port_open

from smart_epp.benchmarks.sim.pool import PodHandle, SimPool, pool_configs
from smart_epp.benchmarks.sim.tokenizer import load_tokenizer
from smart_epp.epp import k8s_discovery as kd

EPP = [sys.executable, "-c", "from smart_epp.epp.cli import main; main()", "serve"]
POOL = "vllm-pool"
MODEL = "tiny"
APP = {"app": "vllm"}
POD_IPS = ("127.0.0.2", "127.0.0.3")


def sample(metrics: str, name: str, **labels: str) -> float:
    total = 0.0
    for match in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", metrics, re.M):
        if all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total


@contextlib.asynccontextmanager
async def pods_on_one_port() -> AsyncIterator[SimPool]:
    port = free_port()
    configs = [
        pool_configs(1, base_port=port, host=ip, model=MODEL, block_size=16)[0] for ip in POD_IPS
    ]
    pool = SimPool(configs, load_tokenizer(None, configs[0].engine.vocab_size))
    try:
        await pool.start()
        yield pool
    finally:
        await pool.stop()


def pod_object(name: str, handle: PodHandle, *, ready: bool = True) -> dict:
    ip = handle.http_address.rsplit(":", 1)[0]
    assert handle.kv_events_endpoint and handle.replay_endpoint
    annotations = {
        kd.KV_EVENTS_PORT_ANNOTATION: handle.kv_events_endpoint.rsplit(":", 1)[1],
        kd.KV_REPLAY_PORT_ANNOTATION: handle.replay_endpoint.rsplit(":", 1)[1],
    }
    return make_pod(name, ip, {**APP, "model": MODEL}, ready=ready, annotations=annotations)


@contextlib.contextmanager
def epp_serve(log_path: Path, *args: str) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    metrics_port = free_port()
    command = [*EPP, "--grpc-port", str(free_port()), "--health-port", str(free_port()),
               "--metrics-port", str(metrics_port), "--scrape-interval", "0.1",
               *args]  # fmt: skip
    with log_path.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield process, metrics_port
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


async def test_epp_serve_follows_the_inference_pool(tmp_path: Path) -> None:
    api = await FakeKubeApi().start()
    token_file = tmp_path / "token"
    token_file.write_text(api.token)
    log_path = tmp_path / "epp.log"
    try:
        async with pods_on_one_port() as pool, aiohttp.ClientSession() as http:
            target_port = int(pool.pods[0].http_address.rsplit(":", 1)[1])
            api.put_pool(make_pool_v1(POOL, APP, [target_port]))
            api.put_pod(pod_object("vllm-0", pool.pods[0]))
            api.put_pod(pod_object("vllm-1", pool.pods[1], ready=False))
            args = ("--k8s-api", api.url, "--k8s-token-file", str(token_file),
                    "--k8s-ca-file", str(api.write_ca(tmp_path)),
                    "--pool-name", POOL, "--pool-namespace", "default")  # fmt: skip
            with epp_serve(log_path, *args) as (process, metrics_port):

                async def metrics() -> str:
                    if process.poll() is not None:
                        raise RuntimeError(f"epp serve exited:\n{log_path.read_text()}")
                    if not port_open(metrics_port):
                        return ""
                    async with http.get(f"http://127.0.0.1:{metrics_port}/metrics") as resp:
                        return await resp.text()

                async def ready_pods(n: int) -> bool:
                    text = await metrics()
                    return f'inference_pool_ready_pods{{name="{POOL}"}} {float(n)}' in text

                await async_wait_until(lambda: ready_pods(1), 30, "one ready pod")
                api.put_pod(pod_object("vllm-1", pool.pods[1]))  # passes its readiness probe
                await async_wait_until(lambda: ready_pods(2), 10, "two ready pods")

                # The KV-event socket from the annotation is the one epp subscribed to.
                second = pool.pods[1]
                body = {"model": MODEL, "prompt": "route " * 80, "max_tokens": 2}
                async with http.post(f"{second.url}/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()

                async def stored_on_second() -> bool:
                    text = await metrics()
                    return (
                        sample(
                            text,
                            "smart_epp_kv_block_hashes_total",
                            pod=second.http_address,
                            action="stored",
                        )
                        > 0
                    )

                await async_wait_until(stored_on_second, 10, "KV events from the annotated port")

                api.delete("pods", "vllm-0")
                await async_wait_until(lambda: ready_pods(1), 10, "back to one pod")
                text = await metrics()
                assert sample(text, "smart_epp_k8s_discovery_updates_total") >= 3
                assert sample(text, "smart_epp_k8s_discovery_errors_total") == 0
            assert process.returncode == 0, log_path.read_text()
        assert "Traceback" not in log_path.read_text()
        assert api.unauthorized == 0
    finally:
        await api.stop()


def test_k8s_api_without_pool_name_is_refused() -> None:
    result = subprocess.run(
        [*EPP, "--k8s-api", "http://127.0.0.1:9"], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2
    assert "--k8s-api needs --pool-name" in result.stderr


def test_k8s_api_and_a_static_pool_are_exclusive() -> None:
    result = subprocess.run(
        [*EPP, "--k8s-api", "http://127.0.0.1:9", "--pool-name", POOL, "--endpoint", "1.2.3.4:80"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert "not allowed with argument --k8s-api" in result.stderr
