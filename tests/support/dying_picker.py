"""An ext_proc server that SIGKILLs itself once it has received a whole request: a picker
that dies while deciding, at the one moment that matters for fail-open.

    python -c "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')" \
        tests/support/dying_picker.py PORT

It reports SERVING on the gRPC health service (so Envoy sends it streams), answers a
headers message the way the buffered body mode expects, and dies on the body's end (or
the trailers, in full-duplex mode).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from smart_epp.proto import extproc as px


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


async def serve(port: int) -> None:
    server = grpc.aio.server()

    async def process(requests: Any, context: grpc.aio.ServicerContext) -> None:
        async for message in requests:
            kind = message.WhichOneof("request")
            if kind == "request_headers":
                if message.request_headers.end_of_stream:
                    _die()
                modes = px.body_modes(message)
                if modes is not None and modes[0] is px.BodyMode.BUFFERED:
                    await context.write(px.CONTINUE_REQUEST_HEADERS)
            elif kind == "request_trailers" or (
                kind == "request_body" and message.request_body.end_of_stream
            ):
                _die()

    px.add_ext_proc_service(server, process)
    health_service = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_service, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await health_service.set(px.SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[-1])))
