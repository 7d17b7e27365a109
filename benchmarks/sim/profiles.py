"""Step-latency profiles: how long one engine step takes on a given GPU and model.

A profile is data: a YAML document with fixed field names (the built-ins ship as YAML files
in ``builtin_profiles/``; ``epp sim --print-profile NAME`` prints one, ``epp calibrate``
writes one measured on a live pod). A step's duration is

    step_s = step_overhead_s
           + prefill_tokens      * prefill_s_per_token                 (weights, per token)
           + prefill_token_pairs * prefill_attention_s_per_token_pair  (causal attention)
           + decode_seqs         * decode_s_per_seq                    (sampling, launches)
           + decode_context      * decode_kv_read_s_per_token          (reading the KV cache)
           + new_requests        * prefill_s_per_request               (optional, default 0)

where a prefill chunk of ``n`` new tokens after ``c`` already-computed ones (prefix-cache
hits and earlier chunks of the same prompt) attends over ``n * (c + n / 2)`` (query, key)
pairs, and ``decode_context`` is the number of context tokens the batch's decoding
sequences read; ``new_requests`` counts requests scheduled for the first time (input
preparation a serving engine does once per request, which ``epp calibrate`` measures).
The quadratic prefill term is what makes a 30k-token prompt cost more than four 7.5k-token
ones; a linear-only model would favour exactly the routing that ignores it.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

BUILTIN_DIR = Path(__file__).with_name("builtin_profiles")
DEFAULT_PROFILE = "h100-llama3-8b"


class ProfileError(ValueError):
    """A profile name that is not known, or a profile file that does not fit the schema."""


class LatencyProfile(BaseModel):
    """One pod's capacity and step-cost coefficients (all times in seconds)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    kv_tokens: int = Field(gt=0, description="KV-cache capacity of one pod, tokens")
    max_model_len: int = Field(gt=0, description="longest prompt + completion accepted")
    max_num_batched_tokens: int = Field(gt=0, description="token budget of one step")
    max_num_seqs: int = Field(gt=0, description="sequences in one batch")
    step_overhead_s: float = Field(ge=0, description="fixed cost of one engine step")
    prefill_s_per_token: float = Field(ge=0, description="linear cost per prompt token")
    prefill_attention_s_per_token_pair: float = Field(
        ge=0, description="per (new token x context token) pair in prefill"
    )
    decode_s_per_seq: float = Field(ge=0, description="per decoding sequence in a step")
    decode_kv_read_s_per_token: float = Field(
        ge=0, description="per context token read by a decoding sequence"
    )
    prefill_s_per_request: float = Field(
        default=0.0, ge=0, description="once per request, in the step that first schedules it"
    )
    source: str = Field(min_length=1, description="how each number was obtained")

    def step_seconds(
        self,
        prefill_tokens: int,
        prefill_token_pairs: float,
        decode_seqs: int,
        decode_context_tokens: int,
        new_requests: int = 0,
    ) -> float:
        if prefill_tokens == 0 and decode_seqs == 0:
            return 0.0
        return (
            self.step_overhead_s
            + prefill_tokens * self.prefill_s_per_token
            + prefill_token_pairs * self.prefill_attention_s_per_token_pair
            + decode_seqs * self.decode_s_per_seq
            + decode_context_tokens * self.decode_kv_read_s_per_token
            + new_requests * self.prefill_s_per_request
        )

    def prefill_seconds(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Compute time of ``new_tokens`` prompt tokens after ``cached_tokens`` (no overhead)."""
        pairs = prefill_token_pairs(new_tokens, cached_tokens)
        return (
            new_tokens * self.prefill_s_per_token + pairs * self.prefill_attention_s_per_token_pair
        )

    def idle_ttft_seconds(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Time to first token of one prompt on an otherwise idle pod: one engine step per
        chunk of ``max_num_batched_tokens``, plus the per-request cost."""
        steps = max(1, math.ceil(new_tokens / self.max_num_batched_tokens))
        return (
            steps * self.step_overhead_s
            + self.prefill_s_per_request
            + self.prefill_seconds(new_tokens, cached_tokens)
        )

    def slowed(self, factor: float) -> LatencyProfile:
        """The same pod taking `factor` times as long for every step (a slower GPU SKU, a
        throttled or noisy-neighboured card): every time coefficient scaled, limits kept."""
        if factor <= 0:
            raise ProfileError(f"a pod's slowdown factor must be positive, not {factor}")
        if factor == 1.0:
            return self
        return self.model_copy(
            update={name: getattr(self, name) * factor for name in STEP_COEFFICIENTS}
            | {"name": f"{self.name}x{factor:g}"}
        )

    def to_yaml(self) -> str:
        return yaml.dump(self.model_dump(), Dumper=_Dumper, sort_keys=False, width=100)


# The step-cost coefficients (seconds per unit), as opposed to capacities and limits:
# what `epp calibrate` fits and what a slower pod multiplies.
STEP_COEFFICIENTS = (
    "step_overhead_s",
    "prefill_s_per_token",
    "prefill_attention_s_per_token_pair",
    "decode_s_per_seq",
    "decode_kv_read_s_per_token",
    "prefill_s_per_request",
)


def prefill_token_pairs(new_tokens: int, context_before: int) -> float:
    """(query, key) pairs of causal attention for ``new_tokens`` after ``context_before``."""
    return new_tokens * (context_before + new_tokens / 2)


# libyaml's loader where the wheel has it: several times faster than the pure-Python one.
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _Dumper(yaml.SafeDumper):
    """Writes multi-line strings (a profile's source) as readable ``|`` blocks."""


def _str_presenter(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str_presenter)


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "(document)"
        parts.append(f"field {field!r}: {err['msg']}")
    return "; ".join(parts)


def profile_from_mapping(data: Any, origin: str) -> LatencyProfile:
    if not isinstance(data, dict):
        raise ProfileError(f"{origin}: a profile is a YAML mapping of field: value")
    try:
        return LatencyProfile.model_validate(data)
    except ValidationError as exc:
        raise ProfileError(f"{origin}: {_describe(exc)}") from None


def load_profile_file(path: Path) -> LatencyProfile:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ProfileError(f"cannot read profile {path}: {exc.strerror or exc}") from None
    try:
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        raise ProfileError(f"{path}: not valid YAML: {exc}") from None
    return profile_from_mapping(data, str(path))


def builtin_names() -> list[str]:
    """Names of the built-in profiles, without loading them (for help texts)."""
    return sorted(path.stem for path in BUILTIN_DIR.glob("*.yaml"))


@functools.cache
def builtin_profiles() -> dict[str, LatencyProfile]:
    """The built-in profiles, loaded on first use: every `epp` command imports this module."""
    profiles = {}
    for name in builtin_names():
        path = BUILTIN_DIR / f"{name}.yaml"
        profile = load_profile_file(path)
        if profile.name != name:
            raise ProfileError(f"{path}: name {profile.name!r} differs from the file name")
        profiles[name] = profile
    return profiles


def __getattr__(name: str) -> Any:
    if name == "PROFILES":  # the built-ins by name, loaded when first asked for
        return builtin_profiles()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:
    PROFILES: dict[str, LatencyProfile]  # served by __getattr__ above


def get_profile(spec: str) -> LatencyProfile:
    """A built-in profile by name, or a profile YAML file by path."""
    builtins = builtin_profiles()
    if spec in builtins:
        return builtins[spec]
    path = Path(spec)
    if path.suffix in (".yaml", ".yml") or path.exists():
        return load_profile_file(path)
    raise ProfileError(
        f"unknown profile {spec!r}; known: {', '.join(builtins)} (or a profile YAML file)"
    )
