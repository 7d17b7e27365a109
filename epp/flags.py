"""Command-line flags shared by `epp serve` and `epp envoy`."""

from __future__ import annotations

import argparse


def boolean(value: str) -> bool:
    """A boolean flag's value, written `--flag`, `--flag=false` or `--flag false`."""
    lowered = value.lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def add_secure_serving(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, help: str
) -> None:
    """`--secure-serving[=true|false]`, default true, as the Inference Extension's picker."""
    parser.add_argument(
        "--secure-serving",
        type=boolean,
        nargs="?",
        const=True,
        default=True,
        metavar="true|false",
        help=help,
    )
