"""`epp serve --record-traffic`: what the gateway records replays with `epp replay`."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from serve_stack import MODEL, endpoint_entry, epp_process, gateway, sim_pods, text, write_endpoints
from support.net import async_wait_until

from smart_epp.benchmarks.replay.traces import load_trace
from smart_epp.epp.datastore import Datastore
from smart_epp.epp.flow import RequestFlow
from smart_epp.epp.traffic_recorder import TrafficRecorder
from smart_epp.framework.types import Api, Decision, Endpoint, LLMRequest, Usage


class _Passthrough:
    """Routes to the first candidate; hears every outcome."""

    def __init__(self) -> None:
        self.outcomes: list[str] = []

    async def schedule(self, request, candidates):
        return Decision(endpoints=list(candidates))

    def on_routed(self, request, decision) -> None:
        pass

    def on_outcome(self, request, decision, outcome) -> None:
        self.outcomes.append(request.request_id)


def _request(rid: str, prompt: str) -> LLMRequest:
    return LLMRequest(request_id=rid, path="/v1/completions", api=Api.COMPLETIONS,
                      model="m", prompt=prompt)  # fmt: skip


async def test_sizes_only_by_default_and_failed_requests_are_not_recorded() -> None:
    out = io.StringIO()
    now = [10.0]
    datastore = Datastore()
    datastore.set_endpoints([Endpoint("p:1")])
    inner = _Passthrough()
    flow = RequestFlow(inner, datastore, clock=lambda: now[0])
    flow.add_hook(TrafficRecorder(out))
    tracked = {}
    for rid in ("a", "b", "c"):
        tracked[rid] = flow.start(_request(rid, "secret prompt"))
        await flow.route(tracked[rid])
        flow.routed(tracked[rid])
        now[0] += 0.5
    flow.finish(tracked["b"], ok=True, status=200, usage=Usage(7, 3))
    flow.finish(tracked["a"], ok=True, status=200, usage=Usage(9, 4))
    flow.finish(tracked["c"], ok=False, status=500)
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    assert inner.outcomes == ["b", "a", "c"]  # the scheduler still hears every end
    assert [(r["timestamp"], r["prompt_tokens"], r["output_tokens"]) for r in rows] == [
        (0.5, 7, 3),
        (0.0, 9, 4),
    ]
    assert all("prompt" not in r and "prompt_token_ids" not in r for r in rows)


@pytest.mark.envoy
async def test_recorded_traffic_replays_with_its_prompts(tmp_path: Path) -> None:
    record = tmp_path / "traffic.jsonl"
    async with sim_pods() as pool:
        pool_file = tmp_path / "pool.yaml"
        write_endpoints(pool_file, [endpoint_entry(p) for p in pool.pods])
        args = ("--endpoints-file", str(pool_file), "--record-traffic", str(record),
                "--record-prompts")  # fmt: skip
        with epp_process(tmp_path / "epp.log", *args) as epp:
            async with gateway(epp, pool) as gw:
                usages = []
                for n in range(3):
                    body = {"model": MODEL, "prompt": text(40 + n, 80), "max_tokens": 3}
                    _, answer = await gw.via_gateway(body)
                    usages.append(answer["usage"])

                def recorded() -> int:
                    return len(record.read_text().splitlines()) if record.exists() else 0

                await async_wait_until(lambda: recorded() == 3, what="three recorded rows")
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    assert sorted(r["prompt_tokens"] for r in rows) == sorted(u["prompt_tokens"] for u in usages)
    assert all(r["output_tokens"] == 3 and r["model"] == MODEL for r in rows)
    replayed = load_trace(record, fmt="recorded")
    assert len(replayed) == 3
    assert sorted(r.input_tokens for r in replayed) == sorted(r["prompt_tokens"] for r in rows)
