"""A vLLM 0.32 pod simulator: a pure engine model behind vLLM's HTTP, metrics and KV-event wire.

Modules: ``engine`` (block pool, prefix cache, scheduler, LoRA slots; no I/O),
``profiles`` (latency constants per GPU/model), ``vllm_hash`` (vLLM's block hashes),
``tokenizer``, ``kv_events`` (event encoding + ZMQ PUB/replay), ``prom`` (/metrics),
``http_api`` (aiohttp front), ``pod`` (one engine + its I/O shells), ``pool`` (N pods in one
process) and ``cli`` (``epp sim``).
"""
