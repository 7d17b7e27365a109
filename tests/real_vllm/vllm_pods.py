"""Real vLLM (CPU build) pods as test fixtures: set-up, start, health, stop.

Each pod is a `vllm serve` process tree started in its own session (so one killpg ends
the API server, the engine core and the worker together), reniced so the gateway and
the test process stay responsive on a small machine. Every pod started here is also
registered with an atexit guard: an interrupted test run leaves no vLLM behind.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support.net import free_port
from support.paths import REPO, VLLM_FIXTURES

SETUP_SCRIPT = REPO / "deploy" / "vllm" / "setup_env.sh"
LAUNCHER = REPO / "deploy" / "vllm" / "vllm_launcher.py"
MODEL_DIR = VLLM_FIXTURES / "model"
SERVED_MODEL = "tiny"
BLOCK_SIZE = 32  # the CPU backend needs a multiple of 32
# epp serve's default metrics scrape period: the load a pod behind the gateway carries.
GATEWAY_SCRAPE_INTERVAL_S = 0.05


def cache_root() -> Path:
    return Path(os.environ.get("SMART_EPP_CACHE", Path.home() / ".cache" / "smart-epp"))


def ensure_vllm_python(timeout_s: float = 1800.0) -> Path:
    """Runs the (idempotent, stamped) set-up and returns the vLLM venv's interpreter."""
    done = subprocess.run(
        ["bash", str(SETUP_SCRIPT)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if done.returncode != 0:
        output = done.stderr[-4000:] + done.stdout[-2000:]
        raise RuntimeError(f"{SETUP_SCRIPT} failed ({done.returncode}):\n{output}")
    return Path(done.stdout.strip().splitlines()[-1])


@dataclass(frozen=True)
class PodConfig:
    """How one vLLM pod is started; ports are chosen by the caller."""

    name: str
    http_port: int
    kv_port: int
    replay_port: int
    lora_modules: tuple[tuple[str, Path], ...] = ()
    num_gpu_blocks: int = 128
    max_model_len: int = 1024
    # None: vLLM's CPU defaults (2,048 tokens per step, 128 sequences). A smaller step
    # budget splits a prompt's prefill into chunks, one engine step each, as on GPU pods
    # serving long prompts.
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    # How long the model worker polls for its next step after one (deploy/vllm/
    # vllm_launcher.py); None: vLLM's 1 s, a core per pod meanwhile. A pod asleep pays a
    # wake-up on its next request, which calibration (back-to-back requests) does not see.
    worker_busy_loop_s: float | None = None
    # Eager mode: the CPU build's compile cache does not reload in this vLLM version, so
    # compiling costs ~30 s on every start; events, hashes and metrics are the same.
    enforce_eager: bool = True
    extra_env: tuple[tuple[str, str], ...] = ()
    chat_template: Path | None = None  # --chat-template; None = the model's own

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def topic(self) -> str:
        return f"kv@{self.address}@{SERVED_MODEL}"

    @property
    def kv_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.kv_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def argv(self, python: Path) -> list[str]:
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.kv_port}",
            "replay_endpoint": f"tcp://*:{self.replay_port}",
            "topic": self.topic,
        }
        args = [
            str(python), str(LAUNCHER), "serve", str(MODEL_DIR / "tiny-model"),
            "--served-model-name", SERVED_MODEL,
            "--host", "127.0.0.1",
            "--port", str(self.http_port),
            "--max-model-len", str(self.max_model_len),
            "--block-size", str(BLOCK_SIZE),
            "--num-gpu-blocks-override", str(self.num_gpu_blocks),
            "--enable-prefix-caching",
            # Without it usage.prompt_tokens_details (cached_tokens) is always null.
            "--enable-prompt-tokens-details",
            "--kv-events-config", json.dumps(kv_events),
        ]  # fmt: skip
        if self.max_num_batched_tokens is not None:
            args += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if self.max_num_seqs is not None:
            args += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.chat_template is not None:
            args += ["--chat-template", str(self.chat_template)]
        if self.enforce_eager:
            args.append("--enforce-eager")
        if self.lora_modules:
            args += ["--enable-lora", "--max-loras", "1", "--max-lora-rank", "8", "--lora-modules"]
            args += [f"{name}={path}" for name, path in self.lora_modules]
        return args

    def env(self, caches: Path) -> dict[str, str]:
        # PYTHONHASHSEED would change vLLM's block-hash seed (unset, like the captures);
        # PYTHONPATH could mix the test environment's packages into vLLM's.
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHASHSEED", "PYTHONPATH")}
        env.update(
            VLLM_CACHE_ROOT=str(caches / "vllm"),
            TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"),
            HF_HOME=str(caches / "hf"),
            XDG_CACHE_HOME=str(caches / "xdg"),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            VLLM_CPU_KVCACHE_SPACE="1",
            # vLLM's automatic binding pins every pod's worker to the same first core;
            # leave placement to the OS and keep each worker to one thread.
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
        )
        if self.worker_busy_loop_s is not None:
            env["SMART_EPP_VLLM_WORKER_BUSY_LOOP_S"] = str(self.worker_busy_loop_s)
        env.update(dict(self.extra_env))
        return env


def dev_mode_pod_config(name: str) -> PodConfig:
    """A plain pod with /reset_prefix_cache enabled (vLLM's dev mode), on free ports."""
    return PodConfig(
        name=name,
        http_port=free_port(),
        kv_port=free_port(),
        replay_port=free_port(),
        extra_env=(("VLLM_SERVER_DEV_MODE", "1"),),
    )


@dataclass(eq=False)  # identity semantics: pods live in a set
class VllmPod:
    config: PodConfig
    python: Path
    log_dir: Path
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    ready_after_s: list[float] = field(default_factory=list)  # one entry per start
    log_start: int = 0  # where this start's output begins in the log

    @property
    def url(self) -> str:
        return f"http://{self.config.address}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"vllm-{self.config.name}.log"

    def start(self) -> None:
        if self.running():
            raise RuntimeError(f"pod {self.config.name} is already running")
        caches = cache_root() / "pod-caches"
        caches.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.log_start = log.tell()
        self.started_at = time.monotonic()
        self.process = subprocess.Popen(
            _process_wrappers() + self.config.argv(self.python),
            env=self.config.env(caches),
            cwd=caches,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        _LIVE.add(self)

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=1.0) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def get_text(self, path: str, timeout_s: float = 30.0) -> str:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=timeout_s) as resp:
            return resp.read().decode()

    def post_json(self, path: str, body: dict[str, Any], timeout_s: float = 120.0) -> Any:
        """POSTs a JSON body; raises with vLLM's error text on a non-2xx answer."""
        request = urllib.request.Request(
            f"{self.url}{path}",
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"POST {path} -> {exc.code}: {exc.read()[:2000]!r}") from exc

    def warm_up(self) -> None:
        """Serves one 100-token prompt. On this vLLM CPU build a pod whose first request
        is a prompt of a few tokens loses its worker (SIGILL, exit -4) and answers 500
        from then on; after one longer prompt, short ones are served."""
        self.post_json(
            "/v1/completions",
            {"model": SERVED_MODEL, "prompt": "warm up " * 50, "max_tokens": 1},
        )

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def log_since_start(self) -> str:
        try:
            with self.log_path.open("rb") as log:
                log.seek(self.log_start)
                return log.read().decode(errors="replace")
        except OSError:
            return ""

    def cpu_seconds(self) -> float:
        """CPU time (user + system) the pod's process tree has used so far."""
        if self.process is None:
            return 0.0
        total = 0
        for pid in group_members(self.process.pid):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue  # ended between listing and reading
            total += int(fields[11]) + int(fields[12])  # utime, stime
        return total / os.sysconf("SC_CLK_TCK")

    def memory_bytes(self) -> int:
        """Proportional set size of the whole process tree (shared pages split fairly)."""
        if self.process is None:
            return 0
        return sum(_pss_bytes(pid) for pid in group_members(self.process.pid))

    def stop(self, grace_s: float = 20.0) -> None:
        if self.process is None:
            return
        stop_process_group(self.process, grace_s)
        _LIVE.discard(self)


class PortTaken(RuntimeError):
    """A pod exited because one of its ports was bound by someone else first."""

    def __init__(self, pod: VllmPod, message: str) -> None:
        super().__init__(message)
        self.pod = pod


def wait_healthy(pods: Sequence[VllmPod], timeout_s: float = 300.0) -> None:
    """Polls every pod's /health until all answer 200; fails early when one dies."""
    pending = list(pods)
    deadline = time.monotonic() + timeout_s
    while pending:
        for pod in list(pending):
            if not pod.running():
                code = pod.process.returncode if pod.process else None
                message = (
                    f"vLLM pod {pod.config.name} exited ({code}) before it was healthy:\n"
                    + pod.log_tail()
                )
                if "Address already in use" in pod.log_since_start():
                    raise PortTaken(pod, message)
                raise RuntimeError(message)
            if pod.healthy():
                pod.ready_after_s.append(time.monotonic() - pod.started_at)
                pending.remove(pod)
        if pending and time.monotonic() > deadline:
            names = ", ".join(p.config.name for p in pending)
            tails = "\n".join(f"--- {p.config.name}\n{p.log_tail(2000)}" for p in pending)
            raise TimeoutError(f"vLLM pods not healthy after {timeout_s:.0f}s: {names}\n{tails}")
        if pending:
            time.sleep(0.5)


def start_pods(pods: Iterable[VllmPod], timeout_s: float = 300.0, port_tries: int = 3) -> None:
    """Starts the pods at once (their imports overlap) and waits until all are healthy.

    A port picked free can be taken (by any process's outgoing connection) before vLLM
    binds it; a pod that fails that way is started again on new ports.
    """
    started = list(pods)
    try:
        for pod in started:
            pod.start()
        pending = started
        for attempt in range(port_tries):
            try:
                wait_healthy(pending, timeout_s)
                return
            except PortTaken as taken:
                if attempt == port_tries - 1:
                    raise
                pending = [p for p in started if p is taken.pod or not p.healthy()]
                taken.pod.config = dataclasses.replace(
                    taken.pod.config,
                    http_port=free_port(),
                    kv_port=free_port(),
                    replay_port=free_port(),
                )
                taken.pod.start()
    except BaseException:
        for pod in started:
            pod.stop()
        raise


# --------------------------------------------------------------------------- processes


def die_with_parent() -> list[str]:
    """A command prefix that stops the process when the test process dies.

    The parent-death signal works even when the test process is killed outright
    (SIGKILL, a CI timeout), where no teardown or atexit handler can run.
    """
    return ["setpriv", "--pdeathsig", "TERM"] if shutil.which("setpriv") else []


def _process_wrappers() -> list[str]:
    # Lower priority keeps the gateway and the tests responsive next to busy pods.
    return [*die_with_parent(), "nice", "-n", "10"]


def group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command name: state ppid pgrp ...
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def _pss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def stop_process_group(process: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM to the pod's process group, SIGKILL for whatever outlives the grace time."""
    pgid = process.pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace_s)
    # The engine and worker processes can outlive the API server for a moment.
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5)
    # SIGKILL is delivered when each member is next scheduled: on a busy machine an
    # orphaned child can still be listed for a moment after the parent was reaped.
    deadline = time.monotonic() + 5
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.02)


_LIVE: set[VllmPod] = set()


@atexit.register
def _stop_leftovers() -> None:
    for pod in list(_LIVE):
        pod.stop(grace_s=5.0)


# --------------------------------------------------------------------------- requests

_WORDS = (
    "route",
    "prefix",
    "cache",
    "block",
    "token",
    "event",
    "pod",
    "model",
    "gateway",
    "queue",
    "shard",
    "replica",
    "score",
    "prompt",
    "stream",
    "latency",
    "batch",
    "index",
    "memory",
    "value",
    "answer",
    "question",
    "server",
    "client",
)


def unique_prompt(tag: str, words: int = 80) -> str:
    """A prompt no other request of the session shares a first block with."""
    nonce = uuid.uuid4().hex
    rng = random.Random(nonce)
    return f"{tag} {nonce} " + " ".join(rng.choice(_WORDS) for _ in range(words))


def completion_body(prompt: str, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    """Greedy, fixed-length completions: the same request always does the same work."""
    return {
        "model": SERVED_MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
