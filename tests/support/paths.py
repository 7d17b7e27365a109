"""Where the test data lives."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Real vLLM 0.32 captures (KV events, metrics, requests) and the tiny model they used.
VLLM_FIXTURES = REPO / "tests" / "fixtures" / "vllm"
TINY_MODEL = VLLM_FIXTURES / "model" / "tiny-model"
MOONCAKE_TRACE = REPO / "benchmarks" / "traces" / "mooncake_synthetic_trace.jsonl"
# The tiny model's ChatML template extended with tools and documents (see its README).
TOOLS_TEMPLATE = REPO / "tests" / "fixtures" / "templates" / "chatml-tools.jinja"
