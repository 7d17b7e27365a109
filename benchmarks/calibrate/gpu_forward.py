"""Times a transformer's engine steps on a GPU: the raw measurements behind a GPU profile.

Run with PyTorch and a CUDA GPU (it imports nothing else from smart-epp, so it runs under
any Python that has torch):

    python benchmarks/calibrate/gpu_forward.py --out h200.json

It builds a model of the given shape (default: Llama-3-8B, 32 layers, hidden 4096, 32 query
and 8 KV heads of 128, MLP 14336, vocabulary 128256) with random bf16 weights and times
what one vLLM engine step computes:

- a prefill chunk of ``n`` new tokens after ``c`` tokens already in the KV cache: every
  layer's projections and MLP over the ``n`` tokens, causal attention of the ``n`` queries
  over ``c + n`` keys (FlashAttention through ``scaled_dot_product_attention`` with a
  lower-right causal mask), the new keys and values written into the cache, and the logits
  of the last token;
- a decode step of ``B`` sequences of ``L`` context tokens each: one token per sequence
  through every layer, attention over its ``L`` cached keys, ``B`` rows of logits.

Each shape is captured once as a CUDA graph (as vLLM runs its steps) and replayed; the
median of the replays, timed with CUDA events, is kept. What this does not include, and a
vLLM step adds: the scheduler and input preparation on the CPU, paged (block-table)
attention instead of contiguous caches, and sampling. The KV cache is one layer's worth,
read by every layer: each read still comes from HBM (one layer's cache is far larger than
the L2 cache), so the time is the same while the memory is 1/layers of a real one.

``epp calibrate --from-forward FILE`` fits a latency profile to the file this writes.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right


@dataclass(frozen=True)
class Shape:
    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 14336
    vocab: int = 128256

    @property
    def parameters(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = (
            self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate
        )
        return self.layers * per_layer + 2 * self.vocab * self.hidden

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2  # K and V, bf16


class Model:
    """Random bf16 weights of ``shape``; forward passes for one prefill chunk or one decode."""

    def __init__(self, shape: Shape, device: torch.device, dtype: torch.dtype) -> None:
        self.shape, self.device, self.dtype = shape, device, dtype
        s = shape
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim

        def weight(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, device=device, dtype=dtype) / math.sqrt(rows)

        self.embed = weight(s.vocab, s.hidden)
        self.lm_head = weight(s.hidden, s.vocab)
        self.layers = [
            {
                "qkv": weight(s.hidden, q + 2 * kv),
                "o": weight(q, s.hidden),
                "gate_up": weight(s.hidden, 2 * s.intermediate),
                "down": weight(s.intermediate, s.hidden),
                "norm1": torch.ones(s.hidden, device=device, dtype=dtype),
                "norm2": torch.ones(s.hidden, device=device, dtype=dtype),
            }
            for _ in range(s.layers)
        ]
        self.final_norm = torch.ones(s.hidden, device=device, dtype=dtype)

    def _rotary(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        half = self.shape.head_dim // 2
        freqs = 1.0 / (500000.0 ** (torch.arange(half, device=self.device) / half))
        angles = (positions[:, None].float() * freqs[None, :])[:, None, :]  # [tokens, 1 head, d/2]
        cos, sin = angles.cos().to(self.dtype), angles.sin().to(self.dtype)
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def _mlp(self, layer: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ layer["gate_up"]).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ layer["down"]

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, eps=1e-5)

    def step(
        self,
        tokens: torch.Tensor,
        prefills: list[tuple[int, int, torch.Tensor, torch.Tensor]],
        decode_context: int = 0,
        decode_caches: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One engine step: prefill chunks of ``(new, cached, k_cache, v_cache)`` (caches
        [1, kv_heads, >= cached + new, d], the chunk's keys written at ``cached``) and a
        decode batch over ``decode_caches`` ([batch, kv_heads, decode_context, d]), batched
        as vLLM batches them: projections and MLP over all the step's tokens at once,
        attention per sequence. ``tokens``: the chunks' tokens, then one per decoding
        sequence. A decoding KV head's query heads share its keys, so they are attended as
        that head's query rows: exact grouped-query attention, no copies. Returns the logits
        of each chunk's last token and of each decoding sequence."""
        s = self.shape
        group = s.heads // s.kv_heads
        q_width, kv_width = s.heads * s.head_dim, s.kv_heads * s.head_dim
        batch = decode_caches[0].shape[0] if decode_caches is not None else 0
        spans, start = [], 0
        for n, cached, _, _ in prefills:
            spans.append((start, n, cached))
            start += n
        positions = torch.cat(
            [torch.arange(c, c + n, device=self.device) for _, n, c in spans]
            + [torch.full((batch,), decode_context, device=self.device)]
        )
        masks = [causal_lower_right(n, c + n) for _, n, c in spans]
        x = self.embed[tokens]
        for layer in self.layers:
            h = self._norm(x, layer["norm1"])
            q, k, v = (h @ layer["qkv"]).split((q_width, kv_width, kv_width), -1)
            q = self._rotary(q.view(-1, s.heads, s.head_dim), positions)
            k = self._rotary(k.view(-1, s.kv_heads, s.head_dim), positions)
            v = v.view(-1, s.kv_heads, s.head_dim)
            outs = []
            for (at, n, c), (_, _, kc, vc), mask in zip(spans, prefills, masks, strict=True):
                kc[0, :, c : c + n] = k[at : at + n].transpose(0, 1)
                vc[0, :, c : c + n] = v[at : at + n].transpose(0, 1)
                keys = kc[:, :, : c + n].repeat_interleave(group, dim=1)
                values = vc[:, :, : c + n].repeat_interleave(group, dim=1)
                qs = q[at : at + n].transpose(0, 1).unsqueeze(0)
                attn = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask)
                outs.append(attn[0].transpose(0, 1).reshape(n, -1))
            if decode_caches is not None:
                qd = q[start:].reshape(batch, s.kv_heads, group, s.head_dim)
                attn = F.scaled_dot_product_attention(qd, *decode_caches)
                outs.append(attn.reshape(batch, -1))
            x = x + torch.cat(outs) @ layer["o"]
            x = x + self._mlp(layer, self._norm(x, layer["norm2"]))
        last = [at + n - 1 for at, n, _ in spans] + list(range(start, start + batch))
        return self._norm(x[last], self.final_norm) @ self.lm_head


def timed(step: Callable[[], object], repeats: int, use_graph: bool) -> tuple[float, bool]:
    """Median seconds of ``step``, replayed as a CUDA graph where it can be captured."""
    if not torch.cuda.is_available():
        step()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return statistics.median(times), False
    run = step
    graphed = False
    if use_graph:
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()  # warm-up on a side stream, as graph capture requires
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            run, graphed = graph.replay, True
        except RuntimeError as exc:
            print(f"  graph capture failed ({exc}); timing eagerly", file=sys.stderr)
            torch.cuda.synchronize()
    run()
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000.0)
    return statistics.median(times), graphed


def attention_backend(device: torch.device, dtype: torch.dtype) -> list[SDPBackend]:
    """FlashAttention where this GPU and PyTorch run it with a lower-right causal mask."""
    if device.type != "cuda":
        return [SDPBackend.MATH]
    q = torch.randn(1, 4, 64, 128, device=device, dtype=dtype)
    kv = torch.randn(1, 4, 192, 128, device=device, dtype=dtype)
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                F.scaled_dot_product_attention(q, kv, kv, attn_mask=causal_lower_right(64, 192))
            return [backend]
        except RuntimeError:
            continue
    return [SDPBackend.MATH]


def parse_mixed(spec: str) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """'N@C+N@C|BxL' -> ([(N, C), ...], (B, L)); either part may be left out."""
    prefill_part, _, decode_part = spec.partition("|")
    prefills = []
    for item in filter(None, prefill_part.split("+")):
        n, _, c = item.partition("@")
        prefills.append((int(n), int(c or 0)))
    batch, context = 0, 0
    if decode_part:
        b, _, ctx = decode_part.partition("x")
        batch, context = int(b), int(ctx)
    if not prefills and not batch:
        raise SystemExit(f"--mixed {spec!r}: no prefill chunk and no decode batch")
    return prefills, (batch, context)


class Bench:
    """Times steps of one model and collects what ``main`` writes."""

    def __init__(self, model: Model, repeats: int, graphs: bool) -> None:
        self.model, self.repeats, self.graphs = model, repeats, graphs
        s, self.device, self.dtype = model.shape, model.device, model.dtype
        self.cache_shape = (s.kv_heads, s.head_dim)

    def cache(self, batch: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        heads, dim = self.cache_shape
        k = torch.randn(batch, heads, tokens, dim, device=self.device, dtype=self.dtype)
        return k, torch.randn_like(k)

    def tokens(self, n: int) -> torch.Tensor:
        return torch.randint(0, self.model.shape.vocab, (n,), device=self.device)

    def time(self, label: str, entry: dict[str, Any], *step: Any) -> dict[str, Any]:
        seconds, graphed = timed(
            functools.partial(self.model.step, *step), self.repeats, self.graphs
        )
        print(f"{label}: {seconds * 1e3:9.3f} ms", file=sys.stderr)
        return {**entry, "seconds": seconds, "graph": graphed}

    def prefill(self, chunks: list[int], cached: list[int]) -> list[dict[str, Any]]:
        """Each chunk after each cached length, over one cache long enough for all."""
        if not chunks or not cached:
            return []
        k, v = self.cache(1, max(cached) + max(chunks))
        return [
            self.time(
                f"prefill n={n:6d} c={c:6d}",
                {"new_tokens": n, "cached_tokens": c},
                self.tokens(n),
                [(n, c, k, v)],
            )
            for c in cached
            for n in chunks
        ]

    def decode(self, batches: list[int], contexts: list[int], max_kv: int) -> list[dict[str, Any]]:
        out = []
        for context in contexts:
            for batch in batches:
                if batch * context <= max_kv:
                    out.append(
                        self.time(
                            f"decode B={batch:4d} L={context:6d}",
                            {"batch": batch, "context_tokens": context},
                            self.tokens(batch),
                            [],
                            context,
                            self.cache(batch, context),
                        )
                    )
        return out

    def mixed(self, spec: str) -> dict[str, Any]:
        chunks, (batch, context) = parse_mixed(spec)
        prefills = [(n, c, *self.cache(1, c + n)) for n, c in chunks]
        entry = {
            "prefill": [list(chunk) for chunk in chunks],
            "decode_batch": batch,
            "decode_context_tokens": context,
        }
        total = sum(n for n, _ in chunks) + batch
        decode = self.cache(batch, context) if batch else None
        return self.time(f"mixed {spec}", entry, self.tokens(total), prefills, context, decode)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--layers", type=int, default=Shape.layers)
    p.add_argument("--hidden", type=int, default=Shape.hidden)
    p.add_argument("--heads", type=int, default=Shape.heads)
    p.add_argument("--kv-heads", type=int, default=Shape.kv_heads)
    p.add_argument("--intermediate", type=int, default=Shape.intermediate)
    p.add_argument("--vocab", type=int, default=Shape.vocab)
    p.add_argument("--model-name", default="Llama-3-8B (shape only, random weights)")
    p.add_argument("--chunks", type=int, nargs="+", default=[256, 1024, 2048, 4096, 8192],
                   help="new tokens per prefill step")  # fmt: skip
    p.add_argument("--cached", type=int, nargs="+", default=[0, 4096, 16384, 32768],
                   help="tokens already in the cache before the chunk")  # fmt: skip
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--max-decode-kv-tokens", type=int, default=1 << 21,
                   help="skip decode shapes whose batch x context exceeds this")  # fmt: skip
    p.add_argument("--mixed", nargs="+", default=[], metavar="SPEC",
                   help="also time mixed steps, each 'N@C+N@C...' prefill chunks (N new "
                   "tokens after C cached) and/or '|BxL' a decode batch: e.g. "
                   "'2048@0+2048@0|32x2048'")  # fmt: skip
    p.add_argument("--skip-pure", action="store_true",
                   help="time only the --mixed steps")  # fmt: skip
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--no-graphs", action="store_true", help="time eagerly")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)

    shape = Shape(
        args.layers, args.hidden, args.heads, args.kv_heads, Shape.head_dim,
        args.intermediate, args.vocab,
    )  # fmt: skip
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = Model(shape, device, dtype)
    backend = attention_backend(device, dtype)
    graphs = not args.no_graphs
    result: dict[str, Any] = {
        "model": args.model_name,
        "shape": asdict(shape),
        "parameters": shape.parameters,
        "kv_bytes_per_token": shape.kv_bytes_per_token,
        "dtype": str(dtype).removeprefix("torch."),
        "attention_backend": backend[0].name,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "repeats": args.repeats,
        "measured_on": time.strftime("%Y-%m-%d", time.gmtime()),
        "prefill": [],
        "decode": [],
        "mixed": [],
    }
    if device.type == "cuda":
        _free, total = torch.cuda.mem_get_info(device)
        result["gpu_memory_total_bytes"] = total
        result["weights_bytes"] = torch.cuda.memory_allocated(device)

    bench = Bench(model, args.repeats, graphs)
    with torch.inference_mode(), sdpa_kernel(backend):
        if not args.skip_pure:
            result["prefill"] = bench.prefill(args.chunks, args.cached)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            result["peak_prefill_bytes"] = torch.cuda.max_memory_allocated(device)
        if not args.skip_pure:
            result["decode"] = bench.decode(args.batches, args.contexts, args.max_decode_kv_tokens)
        result["mixed"] = [bench.mixed(spec) for spec in args.mixed]
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
