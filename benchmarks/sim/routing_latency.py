"""What routing costs a request before it reaches a pod, charged in the replay's virtual time.

The default is a measurement, not a guess: ``benchmarks/decision_latency.py`` on this
project's 2-core development machine (``benchmarks/results/decision_latency.json``) put the
`default` policy's decision, with local tokenization of an uncached 8,192-token prompt,
at 6.29 ms p50 over 8 pods (0.32 ms without tokenization). Tokenization dominates and
grows with the prompt; pass ``--routing-latency`` to model another gateway or prompt mix.
"""

DEFAULT_ROUTING_LATENCY_S = 0.0063
