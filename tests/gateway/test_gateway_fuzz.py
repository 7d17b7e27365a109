"""Property-based fuzz of the request parser: every input ends as a request or a clean 4xx.

A few hundred seeds here; `python -m smart_epp.benchmarks.fuzz` runs 100,000+ cases.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from smart_epp.benchmarks.fuzz import check_request_input, mutations, request_inputs


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request_inputs, st.randoms(use_true_random=False))
def test_parser_never_crashes(data: bytes, rnd: random.Random) -> None:
    for case in [data, *mutations(data, rnd, 4)]:
        check_request_input(case)
