"""Routing through real Envoy and `epp serve` in front of the two real vLLM pods.

Which pod served a request is read from the pods themselves (their finished-request
counters), never from the gateway, so a gateway that merely claims to route well fails.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from support.envoy import EnvoyProcess, running_envoy
from support.net import free_port, wait_until
from vllm_pods import (
    BLOCK_SIZE,
    SERVED_MODEL,
    VllmPod,
    completion_body,
    die_with_parent,
    stop_process_group,
    unique_prompt,
    wait_healthy,
)

from smart_epp.epp.audit_cmd import parse_audit

pytestmark = [pytest.mark.real_vllm, pytest.mark.envoy]

EPP = [sys.executable, "-c", "from smart_epp.epp.cli import main; main()"]


def metric_sum(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def finished_requests(pod: VllmPod) -> float:
    return metric_sum(pod.get_text("/metrics"), "vllm:request_success_total")


@dataclass(frozen=True)
class Decision:
    """One debug decision line: the pods in the order tried, and each candidate's prefix hit."""

    picked: tuple[str, ...]
    hit_tokens: dict[str, int]

    @classmethod
    def parse(cls, line: str) -> Decision:
        head, _, candidates = line.partition(" | ")
        picked = tuple(head.rpartition("picked=")[2].split(","))
        hits = {
            address: int(fields.split("hit_tokens=")[1].split()[0])
            for address, fields in re.findall(r"(\S+?)\[([^\]]*)\]", candidates)
        }
        return cls(picked, hits)


@dataclass
class Gateway:
    envoy: EnvoyProcess
    metrics_url: str
    pods: tuple[VllmPod, ...]
    log_path: Path

    def log_tail(self, chars: int = 3000) -> str:
        return "epp log:\n" + self.log_path.read_text(errors="replace")[-chars:]

    def last_decision(self) -> Decision:
        """The last routing decision in the epp log (epp serves at --log-level debug)."""
        lines = [line for line in self.log_path.read_text().splitlines() if " decision " in line]
        assert lines, self.log_tail()
        return Decision.parse(lines[-1])

    def metrics(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=5) as resp:
            return resp.read().decode()

    def stored_blocks(self, *pods: VllmPod) -> float:
        page = self.metrics()
        return sum(
            metric_sum(
                page, "smart_epp_kv_block_hashes_total", pod=p.config.address, action="stored"
            )
            for p in pods
        )

    def restarts(self, pod: VllmPod) -> float:
        """Restarts of `pod` the gateway noticed, from its /metrics page (a new process
        start time) or from its KV events (the sequence numbering starting again)."""
        page = self.metrics()
        return sum(
            metric_sum(page, name, pod=pod.config.address)
            for name in ("smart_epp_pod_restarts_total", "smart_epp_kv_pod_restarts_total")
        )

    def in_flight(self) -> float:
        """Requests the gateway routed and has not yet seen the outcome of (the response
        path reports an outcome after the client has its answer)."""
        return metric_sum(self.metrics(), "inference_objective_running_requests")

    def index_entries(self) -> float:
        """(block, pod) entries in the gateway's block index."""
        return metric_sum(self.metrics(), "smart_epp_kv_index_entries")

    def wait_learned(self, pods: tuple[VllmPod, ...], before: float, blocks: int) -> None:
        wait_until(
            lambda: self.stored_blocks(*pods) >= before + blocks,
            timeout=30,
            what=f"the gateway to learn {blocks} new blocks",
        )

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        request = urllib.request.Request(
            f"{self.envoy.url}{path}",
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, {"error": exc.read()[:2000].decode(errors="replace")}

    def post_and_find_pod(self, path: str, body: dict) -> VllmPod:
        """Sends through Envoy; returns the pod whose finished-request count rose."""
        before = [finished_requests(p) for p in self.pods]
        status, response = self.post(path, body)
        assert status == 200, response
        after: list[float] = []

        def counted() -> bool:
            after[:] = [finished_requests(p) for p in self.pods]
            return sum(after) > sum(before)

        wait_until(counted, timeout=30, what="the request to be counted by a pod")
        (served,) = [p for p, b, a in zip(self.pods, before, after, strict=True) if a > b]
        return served

    def send_direct_and_wait_learned(self, pod: VllmPod, body: dict) -> dict:
        """Sends straight to `pod`, then waits until the gateway ingested the new blocks."""
        before = self.stored_blocks(pod)
        response = pod.post_json("/v1/completions", body)
        self.wait_learned((pod,), before, new_full_blocks(response))
        return response


def new_full_blocks(response: dict) -> int:
    """Full prompt blocks the pod computed (and so published) for this response."""
    usage = response["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"] or 0
    return usage["prompt_tokens"] // BLOCK_SIZE - cached // BLOCK_SIZE


@pytest.fixture(scope="module")
def gateway(vllm_pods, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    workdir = tmp_path_factory.mktemp("gateway")
    endpoints = workdir / "endpoints.yaml"
    entries = [
        {
            "address": pod.config.address,
            "kv_events": pod.config.kv_endpoint,
            "kv_replay": pod.config.replay_endpoint,
            "labels": {"model": SERVED_MODEL},
        }
        for pod in vllm_pods
    ]
    endpoints.write_text(yaml.safe_dump({"endpoints": entries}))
    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    log_path = workdir / "epp.log"
    command = [
        *die_with_parent(), *EPP, "serve",
        "--grpc-port", str(grpc_port),
        "--health-port", str(health_port),
        "--metrics-port", str(metrics_port),
        "--endpoints-file", str(endpoints),
        "--log-level", "debug",
    ]  # fmt: skip
    with log_path.open("wb") as log:
        epp = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"

    def epp_up() -> bool:
        assert epp.poll() is None, log_path.read_text(errors="replace")[-4000:]
        try:
            urllib.request.urlopen(metrics_url, timeout=1).close()
        except OSError:
            return False
        return True

    try:
        wait_until(epp_up, timeout=30, what="epp serve to answer on its metrics port")
        # The ext-proc response path: the picker reads each response's usage (the audit).
        with running_envoy(
            epp_port=grpc_port, body_mode="buffered", response_path="ext-proc"
        ) as envoy:
            wait_until(envoy.epp_healthy, timeout=30, what="Envoy to see epp healthy")
            yield Gateway(envoy, metrics_url, tuple(vllm_pods), log_path)
    finally:
        stop_process_group(epp, grace_s=10)


def shared_prefix_pair(tag: str) -> tuple[str, str]:
    prefix = unique_prompt(tag, words=300)
    return prefix + " direct tail", prefix + " routed tail"


@pytest.mark.parametrize("holder", ["plain", "lora"])
def test_request_sharing_a_prefix_goes_to_the_pod_holding_it(
    gateway: Gateway, vllm_pods, holder: str
) -> None:
    pod: VllmPod = getattr(vllm_pods, holder)
    direct, routed = shared_prefix_pair(f"route-{holder}")
    gateway.send_direct_and_wait_learned(pod, completion_body(direct, max_tokens=4))
    served = gateway.post_and_find_pod("/v1/completions", completion_body(routed, 4))
    assert served is pod, gateway.log_tail()


def test_lora_request_goes_to_the_pod_serving_the_adapter(gateway: Gateway, pod_b: VllmPod) -> None:
    for adapter in ("lora-a", "lora-b", "lora-a"):
        body = completion_body(unique_prompt("lora-route"), max_tokens=2, model=adapter)
        assert gateway.post_and_find_pod("/v1/completions", body) is pod_b, gateway.log_tail()


def test_chat_follow_up_reuses_the_cache_its_first_turn_left(gateway: Gateway) -> None:
    system = unique_prompt("chat-route", words=300)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "one"}]
    first = {"model": SERVED_MODEL, "messages": messages, "max_tokens": 4, "temperature": 0}
    before = gateway.stored_blocks(*gateway.pods)
    status, response = gateway.post("/v1/chat/completions", first)
    assert status == 200, response
    gateway.wait_learned(gateway.pods, before, new_full_blocks(response))
    second = {**first, "messages": [messages[0], {"role": "user", "content": "two"}]}
    status, response = gateway.post("/v1/chat/completions", second)
    assert status == 200, response
    # Only the pod that served the first turn holds the system prompt: a follow-up sent
    # anywhere else would report nothing reused.
    shared_blocks = len(system) // 8 // BLOCK_SIZE  # a safe lower bound on the tokens
    assert response["usage"]["prompt_tokens_details"]["cached_tokens"] >= shared_blocks * BLOCK_SIZE


def test_restarted_pod_is_forgotten_and_routing_continues(
    gateway: Gateway, pod_a: VllmPod, pod_b: VllmPod
) -> None:
    prefix = unique_prompt("restart", words=300)
    before = gateway.send_direct_and_wait_learned(pod_b, completion_body(prefix + " before", 4))
    entries = gateway.index_entries()
    restarts = gateway.restarts(pod_b)

    pod_b.stop()
    pod_b.start()
    wait_healthy([pod_b])
    # vLLM says nothing at shutdown: the gateway has to notice by itself, from the new
    # process start time on /metrics or from the KV-event numbering starting again at 0.
    fresh = pod_b.post_json("/v1/completions", completion_body(unique_prompt("fresh"), 2))
    wait_until(lambda: gateway.restarts(pod_b) > restarts, timeout=30, what="restart detected")
    # Everything the old process published is gone from the index; at most the fresh
    # request's blocks (prompt, plus one completed while decoding) are back.
    held_before = before["usage"]["prompt_tokens"] // BLOCK_SIZE
    limit = entries - held_before + fresh["usage"]["prompt_tokens"] // BLOCK_SIZE + 1
    wait_until(lambda: gateway.index_entries() <= limit, timeout=30, what="the pod's purge")

    # Pod A now holds most of the prefix; the restarted pod B, which held all of it before
    # the restart, holds none. A stale index would credit pod B with the whole prefix.
    held = gateway.send_direct_and_wait_learned(
        pod_a, completion_body(prefix[: len(prefix) * 9 // 10], 2)
    )
    served = gateway.post_and_find_pod("/v1/completions", completion_body(prefix, 4))
    decision = gateway.last_decision()
    assert decision.hit_tokens[pod_b.config.address] == 0, decision
    a_blocks = held["usage"]["prompt_tokens"] // BLOCK_SIZE
    assert decision.hit_tokens[pod_a.config.address] >= (a_blocks - 1) * BLOCK_SIZE, decision
    # Which pod answers also weighs each pod's learned speed, which this shared machine's
    # load moves; what must hold is that the request went where the picker sent it.
    assert served.config.address == decision.picked[0], gateway.log_tail()
    for _ in range(4):
        code, body = gateway.post("/v1/completions", completion_body(unique_prompt("after"), 2))
        assert code == 200, body


def audit_totals(gateway: Gateway) -> dict[str, int]:
    pods = parse_audit(gateway.metrics())
    return {
        result: sum(getattr(a, result) for a in pods.values())
        for result in ("exact", "over", "under")
    }


def test_live_audit_agrees_with_vllm_and_counts_an_induced_miss(gateway: Gateway) -> None:
    # Earlier tests' last responses are audited when their outcomes arrive, which can be
    # after their clients were answered: count from when none is outstanding.
    wait_until(lambda: gateway.in_flight() == 0, timeout=30, what="earlier requests' outcomes")
    before = audit_totals(gateway)
    # 200 words is 500-670 tokens: the tool chat renders this system prompt and the tool's
    # description (up to ~240 tokens) together, below the pods' 1,024-token context.
    system = unique_prompt("audit-chat", words=200)
    cases = [
        ("/v1/completions", completion_body(unique_prompt("audit-completion", words=300))),
        ("/v1/completions", {**completion_body(unique_prompt("audit-lora", words=300)),
                             "model": "lora-a"}),
        ("/v1/chat/completions", {"model": SERVED_MODEL, "max_tokens": 4, "temperature": 0,
                                  "messages": [{"role": "system", "content": system},
                                               {"role": "user", "content": "one"}]}),
        # A tool-using chat: tokenized through a pod's /tokenize with its tools.
        ("/v1/chat/completions", {"model": SERVED_MODEL, "max_tokens": 4, "temperature": 0,
                                  "tool_choice": "none",
                                  "tools": [{"type": "function", "function": {
                                      "name": "lookup",
                                      "description": unique_prompt("audit-tool", words=60)}}],
                                  "messages": [{"role": "system", "content": system},
                                               {"role": "user", "content": "two"}]}),
    ]  # fmt: skip
    reused = 0
    for path, body in cases:
        for _ in range(2):  # the second time from the cache the first one left
            learned = gateway.stored_blocks(*gateway.pods)
            status, response = gateway.post(path, body)
            assert status == 200, response
            reused += response["usage"]["prompt_tokens_details"]["cached_tokens"] or 0
            gateway.wait_learned(gateway.pods, learned, new_full_blocks(response))
    audited = 2 * len(cases)
    wait_until(
        lambda: sum(audit_totals(gateway).values()) >= sum(before.values()) + audited,
        timeout=30,
        what="every response to be audited",
    )
    after = audit_totals(gateway)
    assert reused > 0
    assert after == {**before, "exact": before["exact"] + audited}, gateway.log_tail()

    # Induced miss: a request the pod refuses still leaves the picker's speculative entry
    # for its prompt (it was routed), but the pod never computed it. The same prompt sent
    # right away is predicted cached and is not.
    prompt = unique_prompt("audit-miss", words=300)
    # (a negative temperature passes the gateway's parser; vLLM refuses it)
    status, refused = gateway.post("/v1/completions", completion_body(prompt, temperature=-1.0))
    assert status == 400, refused
    status, response = gateway.post("/v1/completions", completion_body(prompt))
    assert status == 200, response
    assert (response["usage"]["prompt_tokens_details"]["cached_tokens"] or 0) == 0
    wait_until(
        lambda: sum(audit_totals(gateway).values()) > sum(after.values()),
        timeout=30,
        what="the second request to be audited",
    )
    assert audit_totals(gateway) == {**after, "over": after["over"] + 1}, gateway.log_tail()
    out = subprocess.run(
        [*EPP, "audit", "--metrics", gateway.metrics_url], capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert out.returncode == 0 and "exact" in out.stdout, out.stderr
