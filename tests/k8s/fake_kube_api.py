"""A small Kubernetes API server for tests, speaking the real wire format.

It serves pods (`/api/v1/namespaces/{ns}/pods`) and InferencePools
(`/apis/{group}/{version}/namespaces/{ns}/inferencepools`, only for the API versions it
is told are installed; others answer 404 like an uninstalled CRD):

- LIST: `{"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "N"},
  "items": [...]}` (items carry no kind/apiVersion, as the real server sends them).
- WATCH (`watch=true`): a chunked stream of newline-delimited JSON events
  `{"type": "ADDED|MODIFIED|DELETED|BOOKMARK|ERROR", "object": {...}}` starting after the
  given resourceVersion. With a label selector, an object that stops matching arrives as
  DELETED and one that starts matching as ADDED. A resourceVersion older than the
  compaction point gets an ERROR event with a `Status` object, code 410, then the stream
  ends, exactly as the apiserver answers "too old resource version".
- `labelSelector` (`k=v`, `k==v`, `k!=v`, `k`, `!k`, comma-joined) and
  `fieldSelector=metadata.name=...` are honoured; every request needs the bearer token.
- It serves HTTPS, as every real API server does, with a certificate for 127.0.0.1 from
  its own test CA (`ca_pem`, `write_ca`); `tls=False` serves plain HTTP.

Test controls: put/delete objects, send bookmarks, drop open watches, compact history.
"""

from __future__ import annotations

import asyncio
import copy
import json
import ssl
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from support.certificates import CertificateAuthority

Obj = dict[str, Any]
Matcher = Callable[[Obj], bool]


def status(code: int, reason: str, message: str) -> Obj:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def parse_label_selector(text: str) -> Matcher:
    """Equality-based label selector requirements, all of which must hold."""
    requirements: list[tuple[str, str, str]] = []  # (operator, key, value)
    for raw in filter(None, (part.strip() for part in text.split(","))):
        if "!=" in raw:
            key, value = raw.split("!=", 1)
            requirements.append(("!=", key.strip(), value.strip()))
        elif "=" in raw:
            key, value = raw.replace("==", "=").split("=", 1)
            requirements.append(("=", key.strip(), value.strip()))
        elif raw.startswith("!"):
            requirements.append(("absent", raw[1:].strip(), ""))
        else:
            requirements.append(("present", raw, ""))

    def holds(op: str, key: str, value: str, labels: dict[str, str]) -> bool:
        if op == "=":
            return labels.get(key) == value
        if op == "!=":
            return labels.get(key) != value
        return (key in labels) == (op == "present")

    return lambda obj: all(
        holds(op, k, v, obj["metadata"].get("labels") or {}) for op, k, v in requirements
    )


def parse_field_selector(text: str) -> Matcher:
    wanted: dict[str, str] = {}
    for raw in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = raw.replace("==", "=").partition("=")
        if key not in ("metadata.name", "metadata.namespace"):
            raise ValueError(f"field label not supported: {key}")
        wanted[key.split(".", 1)[1]] = value
    return lambda obj: all(obj["metadata"].get(k) == v for k, v in wanted.items())


@dataclass
class _Change:
    version: int
    resource: str  # "pods" or "<group>/<version>/inferencepools"
    namespace: str
    old: Obj | None
    new: Obj | None  # None: deleted (then `old` is the last state)


@dataclass
class _Watch:
    resource: str
    namespace: str
    matches: Matcher
    queue: asyncio.Queue[_Change | None] = field(default_factory=asyncio.Queue)
    request: web.Request | None = None


class FakeKubeApi:
    def __init__(
        self,
        token: str = "test-token",
        pool_versions: tuple[str, ...] = ("inference.networking.k8s.io/v1",),
        *,
        tls: bool = True,
        ca: CertificateAuthority | None = None,
    ) -> None:
        self.token = token
        # A restarted API server keeps its CA: pass the previous one's.
        self.ca = (ca or CertificateAuthority("fake Kubernetes API CA")) if tls else None
        self.pool_versions = pool_versions
        self.version = 100
        self.compacted = 0  # watches from a resourceVersion below this get 410
        self.objects: dict[tuple[str, str, str], Obj] = {}  # (resource, ns, name) -> obj
        self.history: list[_Change] = []
        self.watches: list[_Watch] = []
        self.requests: list[tuple[str, dict[str, str]]] = []  # (path, query) of each request
        self.unauthorized = 0
        self._runner: web.AppRunner | None = None
        self.port = 0

    # ----------------------------------------------------------------- lifecycle

    @property
    def url(self) -> str:
        return f"{'https' if self.ca else 'http'}://127.0.0.1:{self.port}"

    @property
    def ca_pem(self) -> bytes:
        assert self.ca is not None, "a plain-HTTP fake API has no CA"
        return self.ca.pem

    def write_ca(self, directory: Path) -> Path:
        """The CA bundle a client needs to trust this server (as a pod's ca.crt)."""
        path = directory / "ca.crt"
        path.write_bytes(self.ca_pem)
        return path

    def _ssl_context(self) -> ssl.SSLContext | None:
        if self.ca is None:
            return None
        files = self.ca.issue(Path(tempfile.mkdtemp(prefix="fake-kube-api-")), ["127.0.0.1"])
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(files.cert, files.key)
        return context

    async def start(self, port: int = 0) -> FakeKubeApi:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._pods)
        app.router.add_get(
            "/apis/{group}/{version}/namespaces/{ns}/inferencepools", self._inferencepools
        )
        app.router.add_get(
            "/apis/{group}/{version}/namespaces/{ns}/inferenceobjectives", self._objectives
        )
        self._runner = web.AppRunner(
            app, access_log=None, shutdown_timeout=0.1, handler_cancellation=True
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port, ssl_context=self._ssl_context())
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        for watch in list(self.watches):
            watch.queue.put_nowait(None)
        if self._runner is not None:
            await self._runner.cleanup()

    # ----------------------------------------------------------------- test controls

    def put(self, resource: str, obj: Obj) -> Obj:
        """Creates or replaces an object (a new resourceVersion) and tells the watches."""
        obj = copy.deepcopy(obj)
        meta = obj["metadata"]
        key = (resource, meta.get("namespace", "default"), meta["name"])
        meta.setdefault("namespace", key[1])
        self.version += 1
        meta["resourceVersion"] = str(self.version)
        old = self.objects.get(key)
        self.objects[key] = obj
        self._record(_Change(self.version, resource, key[1], old, obj))
        return obj

    def delete(self, resource: str, name: str, namespace: str = "default") -> None:
        old = self.objects.pop((resource, namespace, name))
        self.version += 1
        gone = copy.deepcopy(old)
        gone["metadata"]["resourceVersion"] = str(self.version)
        self._record(_Change(self.version, resource, namespace, gone, None))

    def put_pod(self, pod: Obj) -> Obj:
        return self.put("pods", pod)

    def put_pool(self, pool: Obj, api_version: str = "inference.networking.k8s.io/v1") -> Obj:
        return self.put(f"{api_version}/inferencepools", pool)

    def put_objective(
        self, obj: Obj, api_version: str = "inference.networking.x-k8s.io/v1alpha2"
    ) -> Obj:
        return self.put(f"{api_version}/inferenceobjectives", obj)

    def send_bookmark(self) -> None:
        self.version += 1
        for watch in self.watches:
            watch.queue.put_nowait(_Change(self.version, "BOOKMARK", "", None, None))

    def compact(self) -> None:
        """Forgets history: open watches get ERROR 410, and so does any resume."""
        self.version += 1
        self.compacted = self.version
        self.history.clear()
        for watch in self.watches:
            watch.queue.put_nowait(_Change(0, "GONE", "", None, None))

    def drop_watches(self) -> None:
        """Cuts every open watch connection mid-stream, as a broken network does."""
        for watch in self.watches:
            if watch.request is not None and watch.request.transport is not None:
                watch.request.transport.abort()
            watch.queue.put_nowait(None)

    def lists(self, path_suffix: str) -> int:
        return sum(1 for p, q in self.requests if p.endswith(path_suffix) and "watch" not in q)

    def watch_requests(self, path_suffix: str) -> int:
        return sum(1 for p, q in self.requests if p.endswith(path_suffix) and "watch" in q)

    def open_watches(self, resource: str) -> int:
        return sum(1 for w in self.watches if w.resource == resource)

    # ----------------------------------------------------------------- handlers

    def _record(self, change: _Change) -> None:
        self.history.append(change)
        for watch in self.watches:
            if watch.resource == change.resource and watch.namespace == change.namespace:
                watch.queue.put_nowait(change)

    def _authorized(self, request: web.Request) -> bool:
        ok = request.headers.get("Authorization") == f"Bearer {self.token}"
        self.unauthorized += not ok
        return ok

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "pods", "PodList", "v1", "Pod")

    async def _objectives(self, request: web.Request) -> web.StreamResponse:
        api_version = f"{request.match_info['group']}/{request.match_info['version']}"
        return await self._serve(
            request,
            f"{api_version}/inferenceobjectives",
            "InferenceObjectiveList",
            api_version,
            "InferenceObjective",
        )

    async def _inferencepools(self, request: web.Request) -> web.StreamResponse:
        group, version = request.match_info["group"], request.match_info["version"]
        api_version = f"{group}/{version}"
        if api_version not in self.pool_versions:
            self.requests.append((request.path, dict(request.query)))
            return web.json_response(
                status(404, "NotFound", "the server could not find the requested resource"),
                status=404,
            )
        return await self._serve(
            request,
            f"{api_version}/inferencepools",
            "InferencePoolList",
            api_version,
            "InferencePool",
        )

    async def _serve(
        self, request: web.Request, resource: str, list_kind: str, api_version: str, kind: str
    ) -> web.StreamResponse:
        self.requests.append((request.path, dict(request.query)))
        if not self._authorized(request):
            return web.json_response(status(401, "Unauthorized", "Unauthorized"), status=401)
        namespace = request.match_info["ns"]
        try:
            labels = parse_label_selector(request.query.get("labelSelector", ""))
            fields = parse_field_selector(request.query.get("fieldSelector", ""))
        except ValueError as exc:
            return web.json_response(status(400, "BadRequest", str(exc)), status=400)

        def matches(obj: Obj) -> bool:
            return labels(obj) and fields(obj)

        if request.query.get("watch") in ("true", "1"):
            return await self._watch(request, resource, namespace, matches, api_version, kind)
        items = [
            copy.deepcopy(obj)
            for (res, ns, _), obj in sorted(self.objects.items())
            if res == resource and ns == namespace and matches(obj)
        ]
        return web.json_response(
            {
                "kind": list_kind,
                "apiVersion": api_version,
                "metadata": {"resourceVersion": str(self.version)},
                "items": items,
            }
        )

    async def _watch(
        self,
        request: web.Request,
        resource: str,
        namespace: str,
        matches: Matcher,
        api_version: str,
        kind: str,
    ) -> web.StreamResponse:
        start = int(request.query.get("resourceVersion") or self.version)
        bookmarks = request.query.get("allowWatchBookmarks") == "true"
        timeout = float(request.query.get("timeoutSeconds", "1800"))
        watch = _Watch(resource, namespace, matches)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        watch.request = request

        def typed(obj: Obj) -> Obj:
            return {"kind": kind, "apiVersion": api_version, **copy.deepcopy(obj)}

        async def send(event_type: str, obj: Obj) -> None:
            await response.write(json.dumps({"type": event_type, "object": obj}).encode() + b"\n")

        if start < self.compacted:
            too_old = status(410, "Expired", f"too old resource version: {start}")
            await send("ERROR", too_old)
            return response
        backlog = [
            c
            for c in self.history
            if c.version > start and c.resource == resource and c.namespace == namespace
        ]
        self.watches.append(watch)
        try:
            for change in backlog:
                watch.queue.put_nowait(change)
            async with asyncio.timeout(timeout):
                while (change := await watch.queue.get()) is not None:
                    if change.resource == "GONE":
                        await send("ERROR", status(410, "Expired", "too old resource version"))
                        break
                    if change.resource == "BOOKMARK":
                        if bookmarks:
                            await send(
                                "BOOKMARK",
                                {
                                    "kind": kind,
                                    "apiVersion": api_version,
                                    "metadata": {"resourceVersion": str(change.version)},
                                },
                            )
                        continue
                    was = change.old is not None and matches(change.old)
                    now = change.new is not None and matches(change.new)
                    if now:
                        await send("MODIFIED" if was else "ADDED", typed(change.new))  # type: ignore[arg-type]
                    elif was:
                        gone = change.new if change.new is not None else change.old
                        gone = copy.deepcopy(gone)
                        gone["metadata"]["resourceVersion"] = str(change.version)  # type: ignore[index]
                        await send("DELETED", typed(gone))  # type: ignore[arg-type]
        except (TimeoutError, ConnectionResetError, ConnectionError):
            pass
        finally:
            self.watches.remove(watch)
        return response


# --------------------------------------------------------------------------- objects


def make_pod(
    name: str,
    ip: str | None,
    labels: dict[str, str],
    *,
    ready: bool = True,
    phase: str = "Running",
    annotations: dict[str, str] | None = None,
    deleting: bool = False,
    namespace: str = "default",
) -> Obj:
    metadata: Obj = {
        "name": name,
        "namespace": namespace,
        "uid": f"uid-{name}",
        "labels": dict(labels),
        "annotations": dict(annotations or {}),
        "creationTimestamp": "2026-01-01T00:00:00Z",
    }
    if deleting:
        metadata["deletionTimestamp"] = "2026-01-01T00:05:00Z"
        metadata["deletionGracePeriodSeconds"] = 30
    status_: Obj = {
        "phase": phase,
        "conditions": [
            {"type": "Initialized", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"},
            {"type": "ContainersReady", "status": "True" if ready else "False"},
            {"type": "PodScheduled", "status": "True"},
        ],
        "hostIP": "10.1.0.1",
    }
    if ip is not None:
        status_["podIP"] = ip
        status_["podIPs"] = [{"ip": ip}]
    return {
        "metadata": metadata,
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
        "status": status_,
    }


def make_pool_v1(name: str, match_labels: dict[str, str], ports: list[int]) -> Obj:
    return {
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "selector": {"matchLabels": dict(match_labels)},
            "targetPorts": [{"number": p} for p in ports],
            "endpointPickerRef": {"name": "smart-epp", "port": {"number": 9002}},
        },
    }


def make_pool_v1alpha2(name: str, selector: dict[str, str], port: int) -> Obj:
    return {
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "selector": dict(selector),
            "targetPortNumber": port,
            "extensionRef": {"name": "smart-epp"},
        },
    }
