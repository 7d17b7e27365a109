"""Standalone endpoint discovery: `--endpoint` flags or an endpoints file, kept in sync.

The file is polled (stat every `interval_s`), which also catches the atomic
write-then-rename that tooling and Kubernetes ConfigMap mounts use. A file that fails to
parse leaves the current pool in place and is counted, so a half-written edit never
empties the pool.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..framework.types import Endpoint
from .datastore import Datastore
from .watched_file import WatchedFile

log = logging.getLogger(__name__)


class EndpointsFileError(ValueError):
    pass


class _EndpointEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    address: str
    metrics: str | None = None
    kv_events: str | None = None
    kv_replay: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)

    @field_validator("address")
    @classmethod
    def _host_port(cls, value: str) -> str:
        return parse_address(value)


class _EndpointsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    endpoints: list[_EndpointEntry] = Field(default_factory=list)


def parse_address(value: str) -> str:
    """Checks a HOST:PORT (IPv6 as [addr]:port) and returns it stripped."""
    value = value.strip()
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"endpoint address must be HOST:PORT, got {value!r}")
    return value


def endpoints_from_addresses(addresses: Iterable[str]) -> list[Endpoint]:
    return [Endpoint(address=parse_address(a)) for a in addresses]


def parse_endpoints_document(text: str, source: str = "<endpoints>") -> list[Endpoint]:
    try:
        raw: Any = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise EndpointsFileError(f"{source}: not valid YAML: {exc}") from None
    if raw is None:
        raw = {}
    try:
        document = _EndpointsFile.model_validate(raw)
    except ValidationError as exc:
        raise EndpointsFileError(f"{source}: {exc}") from None
    return [
        Endpoint(
            address=e.address,
            metrics_url=e.metrics or "",
            kv_events=e.kv_events,
            kv_replay=e.kv_replay,
            labels=tuple(sorted(e.labels.items())),
        )
        for e in document.endpoints
    ]


def load_endpoints_file(path: Path) -> list[Endpoint]:
    return parse_endpoints_document(path.read_text(), str(path))


class EndpointsFileWatcher(WatchedFile):
    """Loads an endpoints file into a Datastore and reloads it whenever it changes."""

    what = "endpoints file"
    load_errors = (EndpointsFileError,)

    def __init__(
        self,
        path: Path,
        datastore: Datastore,
        interval_s: float = 0.5,
        on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        super().__init__(path, on_error)
        self.datastore = datastore
        self.interval_s = interval_s

    def missing(self) -> Exception:
        return EndpointsFileError(f"{self.path}: file is missing; keeping the pool")

    def load(self, text: str) -> None:
        self.datastore.set_endpoints(parse_endpoints_document(text, str(self.path)))

    async def run(self, interval_s: float | None = None) -> None:
        await super().run(self.interval_s if interval_s is None else interval_s)
