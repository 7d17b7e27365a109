"""The `epp` console command: one entry point, one module per subcommand."""

from __future__ import annotations

import argparse
import importlib
import sys

# Each module exposes `register(subparsers)`, which adds its parser and sets
# `func` (a callable taking the parsed args and returning an exit code).
SUBCOMMAND_MODULES = (
    "smart_epp.epp.serve_cmd",
    "smart_epp.epp.envoy_cmd",
    "smart_epp.epp.audit_cmd",
    "smart_epp.benchmarks.sim.cli",
    "smart_epp.benchmarks.replay.cli",
    "smart_epp.benchmarks.calibrate.cli",
    "smart_epp.epp.demo",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epp", description="smart-epp: a KV-cache-aware endpoint picker for vLLM pools"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and name.startswith(exc.name):
                continue  # subcommand not part of this build
            raise
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(args.func(args) or 0)
