"""ZMQ CURVE authentication for the central KV-event socket.

In central mode every pod's publisher connects to one socket the picker binds, and a
batch's topic names the pod it speaks for. Without authentication anyone who reaches that
port can publish for any pod (and, before sequence checks, clear its index). With CURVE
the socket only accepts publishers whose public key is in an allow-list directory, and
the stream is encrypted. Keys are ZeroMQ certificate files, as written by
`python -c "import zmq.auth; zmq.auth.create_certificates('DIR', 'NAME')"`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator


@dataclass(frozen=True, slots=True)
class CurveServerConfig:
    # The picker's own certificate (public + secret key): `NAME.key_secret`.
    secret_key_file: Path
    # A directory of the publishers' public certificates (`*.key`): only they may connect.
    clients_dir: Path

    def __post_init__(self) -> None:
        if not zmq.has("curve"):
            raise ValueError("this libzmq was built without CURVE support")
        if not self.secret_key_file.is_file():
            raise ValueError(f"CURVE secret key file {self.secret_key_file} does not exist")
        if not self.clients_dir.is_dir():
            raise ValueError(f"CURVE clients directory {self.clients_dir} does not exist")

    def keys(self) -> tuple[bytes, bytes]:
        public, secret = zmq.auth.load_certificate(self.secret_key_file)
        if secret is None:
            raise ValueError(f"{self.secret_key_file} holds no secret key")
        return public, secret


class CurveGuard:
    """Makes a socket a CURVE server and runs the ZAP handler that checks client keys."""

    def __init__(self, ctx: zmq.asyncio.Context, config: CurveServerConfig) -> None:
        self.config = config
        self._auth = AsyncioAuthenticator(ctx)

    def secure(self, sock: zmq.asyncio.Socket) -> None:
        """Call before bind: the options apply to connections made afterwards."""
        public, secret = self.config.keys()
        self._auth.start()
        # The allow-list is read here, once: a key added or removed takes effect at the
        # picker's next start.
        self._auth.configure_curve(domain="*", location=str(self.config.clients_dir))
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True

    def stop(self) -> None:
        self._auth.stop()
