"""Finding a model's tokenizer on disk, and trusting it only once it agrees with the pods.

Tokenizing in-process saves a round trip to a pod's `/tokenize` on every request (the
pod's API server answers it between its own work: milliseconds on a busy pod, on the
request's critical path). Nothing needs configuring: for a model that no
`local-tokenizer` plugin names, the picker looks for the model's files

- in each `--tokenizers-dir DIR`, as `DIR/<model name>/tokenizer.json` (a model name with
  a slash is a nested folder, as a Hugging Face download lays it out), then
- in the Hugging Face hub cache (`HF_HUB_CACHE`, else `HF_HOME/hub`, else
  `~/.cache/huggingface/hub`), where `hf download <model>` leaves them,

and loads them off the event loop. Files found by name may be another revision than the
pods serve, so they are not trusted at once: the next `verify_requests` requests are still
tokenized by a pod and, beside it, locally; only when every one agrees token for token
does the model switch to local tokenization. One disagreement (or a local failure) and the
model stays on the pods for the picker's lifetime, logged and counted in
`smart_epp_tokenizer_discovery_total`. A trusted tokenizer keeps being checked: one request
in `recheck_every` is also sent to a pod in the background, so pods rolled to another
revision take the model back to pod tokenization.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from prometheus_client import Counter

from ..framework.scheduling import DEFAULT_TOKENIZER_CACHE_BYTES, PromptTokenizer
from ..framework.types import LLMRequest, PodState
from .tokenization import LocalTokenizer, tokenizer_thread

log = logging.getLogger(__name__)

DISCOVERY_TOTAL = Counter(
    "smart_epp_tokenizer_discovery_total",
    "Models whose tokenizer the picker looked for on disk, by outcome: not_found, "
    "load_failed, trusted (agreed with the pods), rejected (disagreed; the pods tokenize)",
    ["result"],
)

# Requests compared with a pod's answer before a found tokenizer is used alone.
DEFAULT_VERIFY_REQUESTS = 3
# A trusted tokenizer: one request in this many is compared with a pod's answer too.
DEFAULT_RECHECK_EVERY = 1000
# Model names are the clients' strings: past this many, new names are not searched for.
MAX_MODELS = 256

State = Literal["searching", "verifying", "trusted", "not_found", "load_failed", "rejected"]


def hub_cache_dir(model: str, cache_dir: str | Path | None = None) -> Path | None:
    """The folder holding `model`'s tokenizer.json in the Hugging Face hub cache
    (`cache_dir`, else the one the environment names)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model, "tokenizer.json", cache_dir=cache_dir)
    except Exception:  # not a valid repository id, or an unreadable cache
        return None
    return Path(found).parent if isinstance(found, str) else None


def find_model_dir(model: str, dirs: Sequence[Path], *, hub_cache: bool = True) -> Path | None:
    """The first folder holding `model`'s tokenizer.json: the given dirs, then the hub."""
    parts = Path(model).parts
    if Path(model).is_absolute() or ".." in parts:
        return None  # a model name is a client's string: never a path out of the dirs
    for root in dirs:
        folder = Path(root) / model
        if (folder / "tokenizer.json").is_file():
            return folder
    return hub_cache_dir(model) if hub_cache else None


@dataclass
class _Model:
    state: State = "searching"
    tokenizer: LocalTokenizer | None = None
    agreed: int = 0
    checking: bool = False
    served: int = 0  # requests tokenized in-process since it was trusted


class TokenizerDiscovery:
    """Per model: look for its tokenizer once, verify it against the pods, then use it."""

    def __init__(
        self,
        dirs: Sequence[str | Path] = (),
        *,
        hub_cache: bool = True,
        verify_requests: int = DEFAULT_VERIFY_REQUESTS,
        recheck_every: int = DEFAULT_RECHECK_EVERY,
        cache_bytes: int = DEFAULT_TOKENIZER_CACHE_BYTES,
        find: Callable[[str], Path | None] | None = None,
    ) -> None:
        if verify_requests < 1:
            raise ValueError("verify_requests must be at least 1")
        self.dirs = [Path(d) for d in dirs]
        self.verify_requests = verify_requests
        self.recheck_every = max(1, recheck_every)
        self.cache_bytes = cache_bytes
        self._find = find or (lambda model: find_model_dir(model, self.dirs, hub_cache=hub_cache))
        self._models: dict[str, _Model] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def state(self, model: str) -> State | None:
        entry = self._models.get(model)
        return None if entry is None else entry.state

    async def tokenize(
        self,
        model: str,
        request: LLMRequest,
        pods: Sequence[PodState],
        fallback: PromptTokenizer | None,
    ) -> list[int] | None:
        entry = self._models.get(model)
        if entry is None:
            if len(self._models) >= MAX_MODELS:
                return await fallback.tokenize(request, pods) if fallback is not None else None
            entry = self._models[model] = _Model()
            self._spawn(self._load(model, entry))
        if entry.state == "trusted" and entry.tokenizer is not None:
            ids = await entry.tokenizer.tokenize(request, pods)
            entry.served += 1
            recheck = entry.served % self.recheck_every == 0 and not entry.checking
            if recheck and ids is not None and fallback is not None:
                entry.checking = True
                self._spawn(self._recheck(model, entry, request, pods, fallback, ids))
            if ids is not None or fallback is None:
                return ids
            # A request the local path cannot render (a template error): ask a pod.
        ids = await fallback.tokenize(request, pods) if fallback is not None else None
        if entry.state == "verifying" and ids is not None and not entry.checking:
            entry.checking = True
            self._spawn(self._verify(model, entry, request, ids))
        return ids

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _load(self, model: str, entry: _Model) -> None:
        loop = asyncio.get_running_loop()
        try:
            folder = await loop.run_in_executor(tokenizer_thread(), self._find, model)
        except Exception:
            log.exception("looking for the tokenizer of model %s failed", model)
            folder = None
        if folder is None:
            entry.state = "not_found"
            DISCOVERY_TOTAL.labels("not_found").inc()
            log.info("model %s: no tokenizer on disk; its prompts are tokenized by a pod", model)
            return
        try:
            entry.tokenizer = await loop.run_in_executor(
                tokenizer_thread(),
                lambda: LocalTokenizer.from_model_dir(folder, cache_bytes=self.cache_bytes),
            )
        except Exception as exc:
            entry.state = "load_failed"
            DISCOVERY_TOTAL.labels("load_failed").inc()
            log.warning(
                "model %s: tokenizer in %s does not load (%s); using a pod", model, folder, exc
            )
            return
        entry.state = "verifying"
        log.info("model %s: found a tokenizer in %s; checking it against the pods", model, folder)

    async def _verify(
        self, model: str, entry: _Model, request: LLMRequest, expected: list[int]
    ) -> None:
        assert entry.tokenizer is not None
        loop = asyncio.get_running_loop()
        try:
            got = await loop.run_in_executor(
                tokenizer_thread(), entry.tokenizer.tokenize_sync, request
            )
            why = "" if got == expected else _first_difference(got or [], expected)
        except Exception as exc:
            why = str(exc)
        finally:
            entry.checking = False
        if entry.state != "verifying":
            return
        if not why:
            entry.agreed += 1
            if entry.agreed >= self.verify_requests:
                entry.state = "trusted"
                DISCOVERY_TOTAL.labels("trusted").inc()
                log.info(
                    "model %s: the local tokenizer agreed with the pods on %d requests; "
                    "tokenizing in-process from now on",
                    model,
                    entry.agreed,
                )
            return
        self._reject(model, entry, why)

    async def _recheck(
        self,
        model: str,
        entry: _Model,
        request: LLMRequest,
        pods: Sequence[PodState],
        fallback: PromptTokenizer,
        local: list[int],
    ) -> None:
        try:
            expected = await fallback.tokenize(request, pods)
        except Exception:  # the pods cannot answer now: check a later request
            expected = None
        finally:
            entry.checking = False
        if expected is None or entry.state != "trusted" or expected == local:
            return
        self._reject(model, entry, _first_difference(local, expected))

    def _reject(self, model: str, entry: _Model, why: str) -> None:
        entry.state = "rejected"
        entry.tokenizer = None
        DISCOVERY_TOTAL.labels("rejected").inc()
        log.warning(
            "model %s: the tokenizer found on disk disagrees with the pods (%s); the pods "
            "keep tokenizing its prompts",
            model,
            why,
        )

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _first_difference(got: Sequence[int], expected: Sequence[int]) -> str:
    for i, (a, b) in enumerate(zip(got, expected, strict=False)):
        if a != b:
            return f"token {i}: {a} locally, {b} from a pod"
    return f"{len(got)} tokens locally, {len(expected)} from a pod"


__all__ = [
    "DEFAULT_RECHECK_EVERY",
    "DEFAULT_VERIFY_REQUESTS",
    "TokenizerDiscovery",
    "find_model_dir",
    "hub_cache_dir",
]
