"""smart-epp: a KV-cache-aware endpoint picker (Envoy ext_proc) for pools of vLLM pods.

The repository root is the `smart_epp` package; its folders are the layers, lowest first:
`framework` (shared types and plugin interfaces), `kv_index`, `scorers`, then the gateway
(`proto`, `epp`) and the tools around it (`benchmarks`). Modules import each other
relatively, so the layering reads straight off the tree.
"""
