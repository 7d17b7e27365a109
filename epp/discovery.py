"""Standalone endpoint discovery: `--endpoint` flags or an endpoints file, kept in sync.

The file is polled (stat every `interval_s`), which also catches the atomic
write-then-rename that tooling and Kubernetes ConfigMap mounts use. A file that fails to
parse leaves the current pool in place and is counted, so a half-written edit never
empties the pool.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..framework.types import Endpoint
from .datastore import Datastore

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


class EndpointsFileWatcher:
    """Loads an endpoints file into a Datastore and reloads it whenever it changes."""

    def __init__(
        self,
        path: Path,
        datastore: Datastore,
        interval_s: float = 0.5,
        on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        self.path = path
        self.datastore = datastore
        self.interval_s = interval_s
        self.on_error = on_error
        self.reloads = 0
        self.errors = 0
        self._signature: tuple[int, int, int] | None = None

    def _stat_signature(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def poll(self) -> bool:
        """Reloads when the file changed since the last look; True when the pool was set."""
        signature = self._stat_signature()
        if signature == self._signature:
            return False
        self._signature = signature
        if signature is None:
            self._failed(EndpointsFileError(f"{self.path}: file is missing; keeping the pool"))
            return False
        try:
            endpoints = load_endpoints_file(self.path)
        except (OSError, EndpointsFileError) as exc:
            self._failed(exc)
            return False
        self.datastore.set_endpoints(endpoints)
        self.reloads += 1
        return True

    def _failed(self, exc: Exception) -> None:
        self.errors += 1
        log.warning("endpoints file not applied: %s", exc)
        if self.on_error is not None:
            self.on_error(exc)

    async def run(self) -> None:
        while True:
            self.poll()
            await asyncio.sleep(self.interval_s)
