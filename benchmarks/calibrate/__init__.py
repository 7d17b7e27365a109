"""`epp calibrate`: measure a live vLLM (or `epp sim`) pod and fit a latency profile to it."""
