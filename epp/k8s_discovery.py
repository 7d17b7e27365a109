"""Endpoint discovery from a Gateway API Inference Extension `InferencePool`.

The pool's members are the Ready pods its selector matches, on its target port(s), the
same rule the Inference Extension's own picker uses. The pool object and its pods are
followed with LIST + WATCH over the Kubernetes REST API (plain aiohttp, no client
library): a watch resumes from the last resourceVersion it saw, re-lists when the
server answers 410 Gone, and reconnects with backoff on any other failure. While the
API is unreachable the last known pool stays in place.

Pure parts (pool object -> PoolSpec, pod object -> Endpoint) are plain functions; the
`KubernetesPoolWatcher` is the thin asyncio shell that feeds `Datastore.set_endpoints`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client import Counter

from ..framework.types import Endpoint
from .datastore import Datastore

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
KV_EVENTS_PORT_ANNOTATION = "smart-epp.io/kv-events-port"
KV_REPLAY_PORT_ANNOTATION = "smart-epp.io/kv-replay-port"
# Tried in this order: the GA group first, then the alpha group older installs still run.
POOL_API_VERSIONS = (
    ("inference.networking.k8s.io", "v1"),
    ("inference.networking.x-k8s.io", "v1alpha2"),
)
WATCH_TIMEOUT_S = 300  # the server ends a watch after this; it is resumed at once

DISCOVERY_ERRORS = Counter(
    "smart_epp_k8s_discovery_errors_total",
    "Kubernetes discovery failures (API errors, malformed pools or pods); the last known "
    "pool stays in place",
    ["reason"],
)
DISCOVERY_UPDATES = Counter(
    "smart_epp_k8s_discovery_updates_total",
    "Times the pool's endpoint set changed from Kubernetes discovery",
)


class DiscoveryError(ValueError):
    """A pool or pod object that cannot be turned into endpoints."""


class ApiStatusError(Exception):
    """The API server answered with a non-success status (HTTP or a watch ERROR event)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"Kubernetes API error {code}: {message}")
        self.code = code


# --------------------------------------------------------------------------- pure parts


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """What an InferencePool says about its members."""

    selector: tuple[tuple[str, str], ...]  # matchLabels, sorted
    target_ports: tuple[int, ...]

    @property
    def label_selector(self) -> str:
        """The `labelSelector` query value that matches the pool's pods."""
        return ",".join(f"{key}={value}" for key, value in self.selector)


def _port_number(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise DiscoveryError(f"{what} must be a port number 1-65535, got {value!r}")
    return value


def _string_map(value: Any, what: str) -> dict[str, str]:
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise DiscoveryError(f"{what} must be a map of strings, got {value!r}")
    return dict(value)


def pool_spec_from_object(pool: Mapping[str, Any]) -> PoolSpec:
    """Reads selector and target ports from an InferencePool of either API version:
    v1 `selector: {matchLabels: {...}}` with `targetPorts: [{number: N}, ...]`, or
    v1alpha2's flat `selector: {...}` with `targetPortNumber: N`."""
    spec = pool.get("spec")
    if not isinstance(spec, Mapping):
        raise DiscoveryError("InferencePool has no spec")
    selector = spec.get("selector")
    if isinstance(selector, Mapping) and (
        "matchLabels" in selector or "matchExpressions" in selector
    ):
        if selector.get("matchExpressions"):
            raise DiscoveryError("InferencePool selector matchExpressions are not supported")
        labels = _string_map(selector.get("matchLabels") or {}, "spec.selector.matchLabels")
    else:
        labels = _string_map(selector, "spec.selector")
    if not labels:
        # An empty selector matches every pod of the namespace: never what a pool means.
        raise DiscoveryError("InferencePool selector is empty")

    if "targetPorts" in spec:
        entries = spec["targetPorts"]
        if not isinstance(entries, list) or not entries:
            raise DiscoveryError("spec.targetPorts must be a non-empty list")
        ports = tuple(
            _port_number(e.get("number") if isinstance(e, Mapping) else None, "targetPorts.number")
            for e in entries
        )
    elif "targetPortNumber" in spec:
        ports = (_port_number(spec["targetPortNumber"], "spec.targetPortNumber"),)
    else:
        raise DiscoveryError("InferencePool has neither targetPorts nor targetPortNumber")
    if len(set(ports)) != len(ports):
        raise DiscoveryError(f"InferencePool target ports repeat: {list(ports)}")
    return PoolSpec(selector=tuple(sorted(labels.items())), target_ports=ports)


def pod_is_serving(pod: Mapping[str, Any]) -> bool:
    """Running, condition Ready=True, not being deleted, and with an IP."""
    metadata = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if metadata.get("deletionTimestamp") or status.get("phase") != "Running":
        return False
    if not status.get("podIP"):
        return False
    return any(
        isinstance(c, Mapping) and c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or ()
    )


def _annotation_port(annotations: Mapping[str, Any], key: str, default: int) -> int:
    raw = annotations.get(key)
    if raw is None:
        return default
    text = str(raw).strip()
    if not text.isdigit():
        raise DiscoveryError(f"annotation {key} must be a port number, got {raw!r}")
    return _port_number(int(text), f"annotation {key}")


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def endpoints_from_pod(
    pod: Mapping[str, Any],
    target_ports: Iterable[int],
    *,
    kv_events_port: int,
    kv_replay_port: int,
) -> list[Endpoint]:
    """The endpoints one pod contributes: none unless it is serving, else one per target
    port. The i-th target port gets KV sockets at the annotated (or default) ports + i,
    the offset vLLM gives the publisher of data-parallel rank i.

    Raises DiscoveryError for a malformed annotation (the pod is better left out than
    dialled at a wrong socket)."""
    if not pod_is_serving(pod):
        return []
    metadata = pod.get("metadata") or {}
    annotations = metadata.get("annotations") or {}
    events_base = _annotation_port(annotations, KV_EVENTS_PORT_ANNOTATION, kv_events_port)
    replay_base = _annotation_port(annotations, KV_REPLAY_PORT_ANNOTATION, kv_replay_port)
    labels = metadata.get("labels") or {}
    label_items = tuple(sorted((str(k), str(v)) for k, v in labels.items()))
    host = _host(str(pod["status"]["podIP"]))
    return [
        Endpoint(
            address=f"{host}:{port}",
            kv_events=f"tcp://{host}:{events_base + rank}",
            kv_replay=f"tcp://{host}:{replay_base + rank}",
            labels=label_items,
        )
        for rank, port in enumerate(target_ports)
    ]


def pod_key(pod: Mapping[str, Any]) -> str:
    metadata = pod.get("metadata") or {}
    return f"{metadata.get('namespace', '')}/{metadata.get('name', '')}"


# --------------------------------------------------------------------------- options


@dataclass(frozen=True)
class KubernetesDiscoveryOptions:
    pool_name: str
    namespace: str
    api_url: str  # e.g. https://10.96.0.1:443
    token_file: Path | None = None  # bearer token, re-read on every request (it rotates)
    ca_file: Path | None = None  # CA bundle for an https API; None = the system's
    kv_events_port: int = 5557  # for pods without the kv-events-port annotation
    kv_replay_port: int = 5558
    backoff_min_s: float = 0.5
    backoff_max_s: float = 30.0


def in_cluster() -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))


def in_cluster_api_url() -> str:
    host = os.environ["KUBERNETES_SERVICE_HOST"]
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    return f"https://{_host(host)}:{port}"


def default_namespace() -> str:
    """The namespace this pod runs in, else "default"."""
    try:
        return (SERVICE_ACCOUNT_DIR / "namespace").read_text().strip() or "default"
    except OSError:
        return "default"


def in_cluster_token_file() -> Path | None:
    path = SERVICE_ACCOUNT_DIR / "token"
    return path if path.is_file() else None


def in_cluster_ca_file() -> Path | None:
    path = SERVICE_ACCOUNT_DIR / "ca.crt"
    return path if path.is_file() else None


# --------------------------------------------------------------------------- API client


class KubernetesApi:
    """GET and WATCH against the API server, with the bearer token and CA configured."""

    def __init__(self, options: KubernetesDiscoveryOptions) -> None:
        self._base = options.api_url.rstrip("/")
        self._token_file = options.token_file
        self._ssl: ssl.SSLContext | bool = True
        if options.ca_file is not None:
            self._ssl = ssl.create_default_context(cafile=str(options.ca_file))
        self._session: aiohttp.ClientSession | None = None

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self._token_file is not None:
            headers["Authorization"] = f"Bearer {self._token_file.read_text().strip()}"
        return headers

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    @staticmethod
    async def _raise_for_status(response: aiohttp.ClientResponse) -> None:
        if response.status < 300:
            return
        text = await response.text()
        message = text[:300]
        with contextlib.suppress(ValueError, AttributeError):
            message = json.loads(text).get("message", message)
        raise ApiStatusError(response.status, message)

    async def get_json(self, path: str, params: Mapping[str, str]) -> dict[str, Any]:
        async with self._client().get(
            self._base + path,
            params=dict(params),
            headers=self._headers(),
            ssl=self._ssl,
            timeout=aiohttp.ClientTimeout(total=30),
        ) as response:
            await self._raise_for_status(response)
            body = await response.json(content_type=None)
        if not isinstance(body, dict):
            raise DiscoveryError(f"GET {path}: expected a JSON object")
        return body

    async def watch(self, path: str, params: Mapping[str, str]) -> AsyncIterator[dict[str, Any]]:
        """Yields the watch events of one streaming response until the server ends it."""
        query = {
            **params,
            "watch": "true",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_TIMEOUT_S),
        }
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=WATCH_TIMEOUT_S + 30)
        async with self._client().get(
            self._base + path, params=query, headers=self._headers(), ssl=self._ssl, timeout=timeout
        ) as response:
            await self._raise_for_status(response)
            buffer = b""
            # Lines can be longer than aiohttp's readline limit (pods with many labels or
            # annotations), so the stream is split here.
            async for chunk in response.content.iter_any():
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield _decode_event(line)
            if buffer.strip():
                yield _decode_event(buffer)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _decode_event(line: bytes) -> dict[str, Any]:
    try:
        event = json.loads(line)
    except ValueError:
        raise DiscoveryError(f"watch event is not JSON: {line[:200]!r}") from None
    if not isinstance(event, dict) or not isinstance(event.get("object"), dict):
        raise DiscoveryError(f"watch event without an object: {line[:200]!r}")
    return event


# --------------------------------------------------------------------------- list + watch


_RETRYABLE = (ApiStatusError, DiscoveryError, aiohttp.ClientError, TimeoutError, OSError)


def _reason(exc: Exception) -> str:
    """The `reason` label of a discovery error."""
    if isinstance(exc, ApiStatusError):
        return "api_status"
    if isinstance(exc, DiscoveryError):
        return "malformed"
    if isinstance(exc, aiohttp.ClientSSLError):
        return "tls"  # e.g. the API server's certificate does not chain to --k8s-ca-file
    return "connection"


class _Gone(Exception):
    """The resourceVersion is too old: list again."""


class Backoff:
    def __init__(self, low: float, high: float) -> None:
        self.low, self.high, self._next = low, high, low

    def reset(self) -> None:
        self._next = self.low

    def next_delay(self) -> float:
        delay = self._next
        self._next = min(self.high, self._next * 2)
        return delay * random.uniform(0.8, 1.2)  # replicas must not reconnect in step


ListHandler = Callable[[list[dict[str, Any]]], None]
EventHandler = Callable[[str, dict[str, Any]], None]


async def list_and_watch(
    api: KubernetesApi,
    path: str,
    params: Mapping[str, str],
    on_list: ListHandler,
    on_event: EventHandler,
    on_error: Callable[[str, Exception], None],
    backoff: Backoff,
) -> None:
    """LIST then WATCH from the list's resourceVersion, forever (cancel to stop).

    A watch the server ends normally is resumed from the last resourceVersion seen
    (bookmarks included); 410 Gone re-lists; any other failure re-lists after a backoff."""
    version: str | None = None
    while True:
        try:
            if version is None:
                listing = await api.get_json(path, params)
                version = str((listing.get("metadata") or {}).get("resourceVersion", ""))
                on_list([i for i in listing.get("items") or () if isinstance(i, dict)])
                backoff.reset()
            async for event in api.watch(path, {**params, "resourceVersion": version}):
                kind = event.get("type")
                obj = event["object"]
                if kind == "ERROR":
                    code = obj.get("code")
                    if code == 410:
                        raise _Gone
                    code = code if isinstance(code, int) else 0
                    raise ApiStatusError(code, str(obj.get("message", "watch error")))
                new_version = (obj.get("metadata") or {}).get("resourceVersion")
                if new_version:
                    version = str(new_version)
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    on_event(kind, obj)
                backoff.reset()
        except asyncio.CancelledError:
            raise
        except _Gone:
            log.info("watch %s: resourceVersion %s expired; listing again", path, version)
            version = None
        except ApiStatusError as exc:
            version = None
            if exc.code != 410:
                on_error(_reason(exc), exc)
                await asyncio.sleep(backoff.next_delay())
        except _RETRYABLE as exc:
            on_error(_reason(exc), exc)
            version = None
            await asyncio.sleep(backoff.next_delay())


# --------------------------------------------------------------------------- watcher


@dataclass(frozen=True, slots=True)
class _KnownPod:
    pod: dict[str, Any]
    endpoints: list[Endpoint]


class KubernetesPoolWatcher:
    """Keeps a Datastore's endpoints equal to an InferencePool's serving pods."""

    def __init__(
        self,
        options: KubernetesDiscoveryOptions,
        datastore: Datastore,
        api: KubernetesApi | None = None,
    ) -> None:
        self.options = options
        self.datastore = datastore
        self.api = api or KubernetesApi(options)
        self.spec: PoolSpec | None = None
        self.pool_path: str | None = None
        self.errors = 0
        self.updates = 0
        self._pods: dict[str, _KnownPod] = {}
        self._pods_task: asyncio.Task[None] | None = None
        self._published: list[Endpoint] | None = None
        self._synced = asyncio.Event()

    # ----------------------------------------------------------------- shell

    async def run(self) -> None:
        try:
            self.pool_path = await self._retry(self._resolve_pool_path)
            await list_and_watch(
                self.api,
                self.pool_path,
                {"fieldSelector": f"metadata.name={self.options.pool_name}"},
                self._pools_listed,
                self._pool_event,
                self._failed,
                self._backoff(),
            )
        finally:
            await self._stop_pods_watch()
            await self.api.close()

    async def wait_synced(self, timeout: float) -> bool:  # noqa: ASYNC109
        """Waits for the first complete view of the pool; False when it took too long."""
        try:
            await asyncio.wait_for(self._synced.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def _backoff(self) -> Backoff:
        return Backoff(self.options.backoff_min_s, self.options.backoff_max_s)

    async def _retry(self, step: Callable[[], Awaitable[str]]) -> str:
        backoff = self._backoff()
        while True:
            try:
                return await step()
            except _RETRYABLE as exc:
                self._failed(_reason(exc), exc)
                await asyncio.sleep(backoff.next_delay())

    def _pools_path(self, group: str, version: str) -> str:
        return f"/apis/{group}/{version}/namespaces/{self.options.namespace}/inferencepools"

    async def _resolve_pool_path(self) -> str:
        """The API version that holds the pool; the first installed one if none does yet."""
        installed: str | None = None
        for group, version in POOL_API_VERSIONS:
            path = self._pools_path(group, version)
            try:
                listing = await self.api.get_json(
                    path, {"fieldSelector": f"metadata.name={self.options.pool_name}"}
                )
            except ApiStatusError as exc:
                if exc.code == 404:
                    continue  # this API version is not installed
                raise
            installed = installed or path
            if listing.get("items"):
                return path
        if installed is None:
            raise DiscoveryError(
                "no InferencePool API is installed ("
                + ", ".join(f"{g}/{v}" for g, v in POOL_API_VERSIONS)
                + ")"
            )
        log.warning(
            "InferencePool %s/%s does not exist yet; waiting for it",
            self.options.namespace,
            self.options.pool_name,
        )
        return installed

    async def _stop_pods_watch(self) -> None:
        task, self._pods_task = self._pods_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def _start_pods_watch(self, spec: PoolSpec) -> None:
        if self._pods_task is not None:
            self._pods_task.cancel()  # its pods stay until the new selector's list arrives
        self._pods_task = asyncio.create_task(
            list_and_watch(
                self.api,
                f"/api/v1/namespaces/{self.options.namespace}/pods",
                {"labelSelector": spec.label_selector},
                self._pods_listed,
                self._pod_event,
                self._failed,
                self._backoff(),
            ),
            name="k8s-pods-watch",
        )

    # ----------------------------------------------------------------- state

    def _failed(self, reason: str, exc: Exception) -> None:
        self.errors += 1
        DISCOVERY_ERRORS.labels(reason).inc()
        log.warning("Kubernetes discovery: %s", exc)

    def _pools_listed(self, items: list[dict[str, Any]]) -> None:
        name = self.options.pool_name
        named = [i for i in items if (i.get("metadata") or {}).get("name") == name]
        self._set_pool(named[0] if named else None)

    def _pool_event(self, kind: str, pool: dict[str, Any]) -> None:
        if (pool.get("metadata") or {}).get("name") != self.options.pool_name:
            return
        self._set_pool(None if kind == "DELETED" else pool)

    def _set_pool(self, pool: dict[str, Any] | None) -> None:
        if pool is None:
            if self.spec is not None or not self._synced.is_set():
                log.warning(
                    "InferencePool %s/%s does not exist; the pool is empty until it does",
                    self.options.namespace,
                    self.options.pool_name,
                )
            self.spec = None
            if self._pods_task is not None:
                self._pods_task.cancel()
                self._pods_task = None
            self._pods.clear()
            self._publish()
            return
        try:
            spec = pool_spec_from_object(pool)
        except DiscoveryError as exc:
            self._failed("malformed", exc)  # keep the last good spec and its pods
            return
        previous, self.spec = self.spec, spec
        if previous is None or previous.selector != spec.selector:
            log.info("InferencePool %s: pods %s, ports %s", self.options.pool_name,
                     spec.label_selector, list(spec.target_ports))  # fmt: skip
            self._start_pods_watch(spec)
        if previous is not None and previous.target_ports != spec.target_ports:
            self._pods = {key: self._convert(known.pod) for key, known in self._pods.items()}
            self._publish()

    def _pods_listed(self, items: list[dict[str, Any]]) -> None:
        self._pods = {pod_key(p): self._convert(p) for p in items}
        self._publish()

    def _pod_event(self, kind: str, pod: dict[str, Any]) -> None:
        if kind == "DELETED":
            self._pods.pop(pod_key(pod), None)
        else:
            self._pods[pod_key(pod)] = self._convert(pod)
        self._publish()

    def _convert(self, pod: dict[str, Any]) -> _KnownPod:
        """Converted once per pod version, so a malformed pod is counted once."""
        endpoints: list[Endpoint] = []
        if self.spec is not None:
            try:
                endpoints = endpoints_from_pod(
                    pod,
                    self.spec.target_ports,
                    kv_events_port=self.options.kv_events_port,
                    kv_replay_port=self.options.kv_replay_port,
                )
            except DiscoveryError as exc:
                self._failed("malformed", DiscoveryError(f"pod {pod_key(pod)}: {exc}"))
        return _KnownPod(pod, endpoints)

    def endpoints(self) -> list[Endpoint]:
        if self.spec is None:
            return []
        return [e for key in sorted(self._pods) for e in self._pods[key].endpoints]

    def _publish(self) -> None:
        endpoints = self.endpoints()
        self._synced.set()
        if endpoints == self._published:
            return
        self._published = endpoints
        self.datastore.set_endpoints(endpoints)
        self.updates += 1
        DISCOVERY_UPDATES.inc()
        log.info("InferencePool %s: %d endpoints", self.options.pool_name, len(endpoints))


def kubernetes_discovery_options(
    *,
    pool_name: str | None,
    namespace: str | None,
    api_url: str | None,
    token_file: Path | None,
    ca_file: Path | None,
    static_pool: bool,
    kv_events_port: int,
    kv_replay_port: int,
) -> KubernetesDiscoveryOptions | None:
    """The CLI rule: discovery is on with an explicit API URL, or inside a cluster when a
    pool name is given and no static pool (--endpoint / --endpoints-file) is.

    Raises ValueError for an API URL without a pool name."""
    if api_url is None and (static_pool or pool_name is None or not in_cluster()):
        return None
    if pool_name is None:
        raise ValueError("--k8s-api needs --pool-name (the InferencePool to follow)")
    if api_url is None:
        api_url = in_cluster_api_url()
        token_file = token_file or in_cluster_token_file()
        ca_file = ca_file or in_cluster_ca_file()
    return KubernetesDiscoveryOptions(
        pool_name=pool_name,
        namespace=namespace or default_namespace(),
        api_url=api_url,
        token_file=token_file,
        ca_file=ca_file,
        kv_events_port=kv_events_port,
        kv_replay_port=kv_replay_port,
    )
