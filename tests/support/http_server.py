"""A real HTTP server for tests that stand in for a pod's endpoints."""

from __future__ import annotations

from aiohttp import web

from support.net import free_port


class LocalHTTPServer:
    """A real HTTP server on a free local port; subclasses add their routes in `routes`."""

    def __init__(self) -> None:
        self.port = free_port()
        self._runner: web.AppRunner | None = None

    def routes(self, app: web.Application) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        app = web.Application()
        self.routes(app)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"
