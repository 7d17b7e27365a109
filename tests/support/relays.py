"""A real HTTP relay in front of a pod's /metrics that a test can switch off."""

from __future__ import annotations

from collections.abc import Callable

import aiohttp
from aiohttp import web

from smart_epp.epp.ports import free_port


class MetricsRelay:
    """Serves the upstream's /metrics page until stopped; the pod itself keeps serving.

    `upstream` is a URL, or a callable giving it (a pod restarted on new ports).
    """

    def __init__(self, upstream: str | Callable[[], str]) -> None:
        self._upstream = upstream if callable(upstream) else (lambda: upstream)
        self.port = free_port()
        self._runner: web.AppRunner | None = None
        self._http: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    async def _metrics(self, _: web.Request) -> web.Response:
        assert self._http is not None
        async with self._http.get(self._upstream()) as resp:
            return web.Response(body=await resp.read(), content_type="text/plain")

    async def start(self) -> None:
        self._http = self._http or aiohttp.ClientSession()
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def close(self) -> None:
        await self.stop()
        if self._http is not None:
            await self._http.close()
