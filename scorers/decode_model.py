"""How much one more decoding request slows a pod's decode steps, learned from answers.

A decode step reads every running request's KV cache and samples a token for each, so its
time grows with the batch: one more request costs every other request on the pod about
`slope` seconds per output token. Prefill chunks share those steps too, which the answers'
time per output token also shows; dividing it out first (a pod spending a share u of its
time in prefill delivers tokens 1 / (1 - u) times slower) leaves the batch's own cost.

Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

# Weight of the previous fit per new answer: a slope needs spread in batch sizes, which
# a few dozen answers at one load lack, so it remembers about the last 100.
SLOPE_FORGETTING = 0.99
# Below this variance of the batch sizes seen (requests squared) the answers cannot tell
# a slope from noise, and the last one stands.
MIN_BATCH_VARIANCE = 1e-6


@dataclass(slots=True)
class DecodeSlope:
    """Exponentially weighted least squares of seconds per output token on the requests
    running alongside: tpot ~= a + slope x running, slope >= 0."""

    forgetting: float = SLOPE_FORGETTING
    weight: float = 0.0
    sum_x: float = 0.0
    sum_y: float = 0.0
    sum_xx: float = 0.0
    sum_xy: float = 0.0
    slope: float = 0.0

    def observe(self, s_per_token: float, running: float) -> None:
        lam = self.forgetting
        self.weight = lam * self.weight + 1.0
        self.sum_x = lam * self.sum_x + running
        self.sum_y = lam * self.sum_y + s_per_token
        self.sum_xx = lam * self.sum_xx + running * running
        self.sum_xy = lam * self.sum_xy + running * s_per_token
        mean_x = self.sum_x / self.weight
        var_x = self.sum_xx / self.weight - mean_x * mean_x
        if var_x <= MIN_BATCH_VARIANCE:
            return
        cov = self.sum_xy / self.weight - mean_x * self.sum_y / self.weight
        self.slope = max(0.0, cov / var_x)
