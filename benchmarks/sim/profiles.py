"""Step-latency profiles: how long one engine step takes on a given GPU and model.

A step's duration is modelled as the roofline of a transformer forward pass over the batch:

    step_s = overhead_s
           + prefill_tokens * prefill_s_per_token      (compute-bound prompt processing)
           + decode_seqs    * decode_s_per_seq         (per-sequence sampling/launch cost)
           + context_tokens * attention_s_per_token    (reading the batch's KV cache)

``overhead_s`` is the weight-read floor of a decode step at batch 1 (plus launch overhead):
at small batches a decode step is memory-bound on reading the weights once.

Calibration sources (public):
- Model shapes from the Hugging Face model cards / config.json of meta-llama/Meta-Llama-3-8B
  (32 layers, 8 KV heads, head_dim 128) and Meta-Llama-3-70B (80 layers, 8 KV heads, head_dim
  128): KV bytes per token = 2 * layers * kv_heads * head_dim * 2 bytes (bf16) = 128 KiB (8B)
  and 320 KiB (70B).
- GPU memory and bandwidth from NVIDIA's datasheets: H100 SXM 80 GB HBM3 3.35 TB/s, 989 dense
  BF16 TFLOPS; A100 SXM 80 GB HBM2e 2.04 TB/s, 312 dense BF16 TFLOPS.
- KV capacity follows vLLM's default ``gpu_memory_utilization=0.9``: 0.9 * 80 GB minus bf16
  weights (16 GB for 8B; 140 GB / TP for 70B) minus ~2-3 GB activations/CUDA graphs, divided
  by the per-token KV size; vLLM logs this as "GPU KV cache size: N tokens" at start-up
  (~467k tokens for Llama-3-8B on one H100 80 GB).
- Prefill throughput ~= 2 * params FLOPs per token at the ~40-50 % model FLOPs utilisation
  that vLLM reaches on long prompts (e.g. ~25k tokens/s for Llama-3-8B on an H100, ~10k on
  an A100), in line with vLLM's published serving benchmarks (vLLM blog, "vLLM v0.6.0: 2.7x
  Throughput Improvement and 5x Latency Reduction", Sept 2024, Llama-3-8B on H100).
- Decode at batch 1 = weight bytes / HBM bandwidth + launch overhead (16 GB / 3.35 TB/s ~=
  4.8 ms -> ~6.5 ms measured-style TPOT for Llama-3-8B on H100; ~9.5 ms on A100); every
  context token in the batch adds one read of its KV bytes per step (KV bytes / bandwidth).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LatencyProfile:
    name: str
    kv_tokens: int  # KV-cache capacity of the pod, in tokens
    overhead_s: float  # a decode step at batch 1 (weight-read floor + launch)
    prefill_s_per_token: float
    decode_s_per_seq: float
    attention_s_per_token: float  # per context token attended in a step
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int = 32768
    source: str = ""
    # Causal attention in prefill, per (new token x context token) pair: n new tokens after
    # `cached` ones attend to n * (cached + n / 2) pairs.
    prefill_attention_s_per_token_pair: float = 0.0

    def step_seconds(
        self,
        prefill_tokens: int,
        decode_seqs: int,
        context_tokens: int,
        prefill_attention_pairs: float = 0.0,
    ) -> float:
        if prefill_tokens == 0 and decode_seqs == 0:
            return 0.0
        return (
            self.overhead_s
            + prefill_tokens * self.prefill_s_per_token
            + decode_seqs * self.decode_s_per_seq
            + context_tokens * self.attention_s_per_token
            + prefill_attention_pairs * self.prefill_attention_s_per_token_pair
        )


_KV_8B = 2 * 32 * 8 * 128 * 2  # bytes per token, Llama-3-8B bf16
_KV_70B = 2 * 80 * 8 * 128 * 2  # bytes per token, Llama-3-70B bf16

PROFILES: dict[str, LatencyProfile] = {
    p.name: p
    for p in (
        LatencyProfile(
            name="h100-llama3-8b",
            kv_tokens=467_000,
            overhead_s=0.0065,
            prefill_s_per_token=1 / 25_000,
            decode_s_per_seq=0.000_05,
            attention_s_per_token=_KV_8B / 3.35e12,
            source="H100 SXM 80GB (3.35 TB/s, 989 TFLOPS bf16) + Llama-3-8B config; see module doc",
        ),
        LatencyProfile(
            name="a100-llama3-8b",
            kv_tokens=410_000,
            overhead_s=0.0095,
            prefill_s_per_token=1 / 10_000,
            decode_s_per_seq=0.000_08,
            attention_s_per_token=_KV_8B / 2.04e12,
            source="A100 SXM 80GB (2.04 TB/s, 312 TFLOPS bf16) + Llama-3-8B config; see module doc",
        ),
        LatencyProfile(
            name="h100x4-llama3-70b-tp4",
            # (0.9 * 80 GB - 35 GB weights - 3 GB) per GPU / (320 KiB / 4 per GPU)
            kv_tokens=415_000,
            overhead_s=0.014,  # 35 GB per GPU / 3.35 TB/s + all-reduce per layer
            prefill_s_per_token=1 / 11_000,  # 140 GFLOP/token on 4 x 989 TFLOPS at ~40 %
            decode_s_per_seq=0.000_12,
            attention_s_per_token=_KV_70B / (4 * 3.35e12),
            max_num_batched_tokens=8192,
            source="4x H100 SXM 80GB tensor-parallel + Llama-3-70B config; see module doc",
        ),
        LatencyProfile(
            # The CPU build that recorded the test fixtures: a 2-layer toy model, 2 cores.
            name="cpu-tiny",
            kv_tokens=65_536 * 32,
            overhead_s=0.004,
            prefill_s_per_token=0.000_15,
            decode_s_per_seq=0.000_3,
            attention_s_per_token=1e-8,
            max_num_batched_tokens=2048,
            max_model_len=1024,
            source="tests/fixtures/vllm basic/metrics: ~4.7 ms inter-token latency at batch 1",
        ),
    )
}
DEFAULT_PROFILE = "h100-llama3-8b"


def get_profile(name: str) -> LatencyProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; known: {', '.join(PROFILES)}") from None
