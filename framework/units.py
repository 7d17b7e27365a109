"""Kubernetes-style durations ("200ms", "1m30s") and quantities ("1Gi", "5k") as configs
written for the Inference Extension and llm-d spell them."""

from __future__ import annotations

import re

_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_DURATION_UNITS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_QUANTITY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?\s*$")
_QUANTITY_UNITS = {
    None: 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
}


def parse_duration(value: object) -> float:
    """Seconds from a Go duration string ("200ms", "1m30s") or a plain number of seconds."""
    if isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"a duration cannot be negative: {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"not a duration: {value!r}")
    text = value.strip()
    if text in ("0", ""):
        return 0.0
    total = 0.0
    end = 0
    for match in _DURATION_PART.finditer(text):
        if match.start() != end:
            break
        total += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        end = match.end()
    if end != len(text) or end == 0:
        raise ValueError(f"not a duration: {value!r} (write e.g. 200ms, 30s, 1m30s)")
    return total


def parse_quantity(value: object) -> int:
    """An integer from a Kubernetes quantity ("1Gi", "500M", "1k") or a plain number."""
    if isinstance(value, bool):
        raise ValueError(f"not a quantity: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a quantity cannot be negative: {value!r}")
        return value
    if isinstance(value, float) and value >= 0:
        return int(value)
    if isinstance(value, str):
        match = _QUANTITY.match(value)
        if match is not None:
            return int(float(match.group(1)) * _QUANTITY_UNITS[match.group(2)])
    raise ValueError(f"not a quantity: {value!r} (write e.g. 100, 5k, 512Mi, 1Gi)")
