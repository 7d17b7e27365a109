"""A prompt goes only to pods whose context holds it; one no pod holds is refused with the
400 vLLM itself would answer."""

from __future__ import annotations

import dataclasses

import pytest
from sched_helpers import pod, request

from smart_epp.benchmarks.sim.engine import EngineConfig, RequestRejected, SimEngine, SimRequest
from smart_epp.epp.config import parse_config
from smart_epp.epp.context_limit import context_problem, pods_that_hold
from smart_epp.epp.errors import RequestError
from smart_epp.epp.scheduler import build_scheduler


@pytest.mark.parametrize(
    ("prompt", "max_tokens"),
    [(70, 1), (64, 5), (4, 100), (64, 64), (200, 300)],
)
def test_the_refusal_is_the_one_the_engine_gives(prompt: int, max_tokens: int) -> None:
    # The simulator's engine answers in vLLM 0.32's words (tests/sim/test_sim_engine.py).
    engine = SimEngine(EngineConfig(block_size=16, num_blocks=100, max_model_len=64))
    with pytest.raises(RequestRejected) as refused:
        engine.add_request(SimRequest("r", [1] * prompt, max_tokens), 0.0)
    problem = context_problem(prompt, max_tokens, 64)
    assert problem is not None
    assert (problem.status, problem.message, problem.param) == (
        400,
        str(refused.value),
        refused.value.param,
    )


@pytest.mark.parametrize(("prompt", "max_tokens"), [(63, 1), (60, None), (1, 64), (10, 64)])
def test_what_fits_passes(prompt: int, max_tokens: int | None) -> None:
    assert context_problem(prompt, max_tokens, 64) is None


LIMITS = {"10.0.0.1:8000": 8192, "10.0.0.2:8000": 8192, "10.0.0.3:8000": 32768}
RANDOM = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
  - type: single-profile-handler
  - type: random-picker
schedulingProfiles:
  - name: default
    plugins:
      - pluginRef: random-picker
"""


def test_only_pods_whose_context_holds_the_prompt_are_candidates() -> None:
    pods = [pod(a) for a in (*LIMITS, "10.0.0.4:8000")]  # the last one's limit unknown
    held = pods_that_hold(pods, 10_000, None, LIMITS.get)
    assert [p.address for p in held] == ["10.0.0.3:8000", "10.0.0.4:8000"]
    assert pods_that_hold(pods, 100, None, LIMITS.get) == pods
    assert pods_that_hold([], 10**6, None, LIMITS.get) == []


def test_none_holds_it_the_longest_context_answers() -> None:
    pods = [pod(a) for a in LIMITS]
    with pytest.raises(RequestError) as refused:
        pods_that_hold(pods, 40_000, None, LIMITS.get)
    assert refused.value.status == 400
    assert "maximum context length is 32768 tokens" in refused.value.message
    body = refused.value.body()
    assert b'"type": "invalid_request_error"' in body and b'"param": "input_tokens"' in body


async def test_the_scheduler_sends_a_long_prompt_to_the_long_context_pod() -> None:
    pods = [pod(a) for a in LIMITS]
    scheduler = build_scheduler("default", seed=0, context_limit_of=LIMITS.get)
    for _ in range(5):
        decision = await scheduler.schedule(request(tokens=list(range(9000))), pods)
        assert decision.endpoints[0].address == "10.0.0.3:8000"
    with pytest.raises(RequestError, match="maximum context length is 32768"):
        await scheduler.schedule(request(tokens=list(range(33_000))), pods)
    # A short prompt may go anywhere.
    short = {
        (await scheduler.schedule(request(tokens=[i, i + 1, i + 2]), pods)).endpoints[0].address
        for i in range(40)
    }
    assert len(short) > 1


async def test_without_token_ids_nothing_is_narrowed_or_refused() -> None:
    # A count estimated from characters could refuse what the pods would take.
    pods = [pod(a) for a in LIMITS]
    scheduler = build_scheduler(parse_config(RANDOM), seed=0, context_limit_of=LIMITS.get)
    text = request(prompt="word " * 60_000)
    chosen = {(await scheduler.schedule(text, pods)).endpoints[0].address for _ in range(30)}
    assert chosen == set(LIMITS)


def test_a_request_with_max_tokens_past_every_context_is_refused() -> None:
    pods = [pod(a) for a in LIMITS]
    req = dataclasses.replace(request(tokens=[1, 2, 3]), max_tokens=40_000)
    with pytest.raises(RequestError) as refused:
        pods_that_hold(pods, 3, req.max_tokens, LIMITS.get)
    assert refused.value.param == "max_tokens"
