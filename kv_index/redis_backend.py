"""The block index on a shared Redis server, so several gateway replicas see one index.

Layout under a namespace `ns` (keys are decimal strings: Lua numbers are doubles and
would round 64-bit keys):
- `ns:b:<key>`  hash: pod -> tier bits (1 GPU, 2 CPU), and `~<pod>` -> speculative
  expiry (ms, the caller's clock);
- `ns:p:<pod>`  set of the pod's keys, so clearing a pod touches only its own blocks;
- `ns:lru`      sorted set key -> last store tick, for the capacity bound;
- `ns:spec`     sorted set "<pod>|<key>" -> expiry, to purge expired speculative fields.
Every operation is one Lua script call: one round trip, atomic across replicas.

The backend also keeps a local `MemoryBlockIndex` mirror. When Redis is unreachable,
lookups answer from the mirror, writes keep updating it, and the outage shows in
`smart_epp_kv_redis_up` and the log; Redis is tried again after `retry_after_s`.

Recovery (`maintain()`, a background loop): after a failure every pooled connection is
dropped at once (a restarted server leaves all of them stale, which otherwise fail one
by one and flap the state), connections idle for a while are checked with PING before
use, and a failed command is retried once on a fresh connection. `ns:epoch` names the
store's generation: when it is missing (the server came back empty, or was replaced) or
changed, and after every outage of this replica, the replica writes its local mirror
back (per pod: clear, then add), so replicas that share the store converge on what the
pods published. `smart_epp_kv_redis_divergence_blocks` is the store's block count minus
the mirror's, sampled every interval.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Collection, Sequence

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.typing import EncodableT

from ..framework.types import Medium, PrefixHit
from . import metrics
from .ingest import medium_of
from .memory import DEFAULT_CAPACITY, DEFAULT_SPECULATIVE_TTL_S, MemoryBlockIndex

log = logging.getLogger(__name__)

_ADD = """
local ns, pod, tier, cap = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local lru, podset = ns .. ':lru', ns .. ':p:' .. pod
local tick = redis.call('INCR', ns .. ':tick')
for i = 5, #ARGV do
  local k = ARGV[i]
  local hk = ns .. ':b:' .. k
  local cur = tonumber(redis.call('HGET', hk, pod) or '0')
  redis.call('HSET', hk, pod, bit.bor(cur, tier))
  if redis.call('HDEL', hk, '~' .. pod) == 1 then
    redis.call('ZREM', ns .. ':spec', pod .. '|' .. k)
  end
  redis.call('SADD', podset, k)
  redis.call('ZADD', lru, tick, k)
end
local excess = redis.call('ZCARD', lru) - cap
if excess > 0 then
  local old = redis.call('ZPOPMIN', lru, excess)
  for j = 1, #old, 2 do
    local k = old[j]
    local hk = ns .. ':b:' .. k
    local fields = redis.call('HKEYS', hk)
    for _, f in ipairs(fields) do
      if string.sub(f, 1, 1) == '~' then
        redis.call('ZREM', ns .. ':spec', string.sub(f, 2) .. '|' .. k)
      else
        redis.call('SREM', ns .. ':p:' .. f, k)
      end
    end
    redis.call('DEL', hk)
  end
end
return 0
"""

_REMOVE = """
local ns, pod, tier = ARGV[1], ARGV[2], tonumber(ARGV[3])
for i = 4, #ARGV do
  local k = ARGV[i]
  local hk = ns .. ':b:' .. k
  local cur = tonumber(redis.call('HGET', hk, pod) or '0')
  if bit.band(cur, tier) ~= 0 then
    local new = bit.band(cur, bit.bnot(tier))
    if new == 0 then
      redis.call('HDEL', hk, pod)
      redis.call('SREM', ns .. ':p:' .. pod, k)
    else
      redis.call('HSET', hk, pod, new)
    end
  end
  -- A speculative field stays: a request routed to the pod recomputes what it evicted.
  local held = false
  for _, f in ipairs(redis.call('HKEYS', hk)) do
    if string.sub(f, 1, 1) ~= '~' then
      held = true
      break
    end
  end
  if not held then
    redis.call('ZREM', ns .. ':lru', k)
  end
end
return 0
"""

_CLEAR_POD = """
local ns, pod = ARGV[1], ARGV[2]
local podset = ns .. ':p:' .. pod
local keys = redis.call('SMEMBERS', podset)
for _, k in ipairs(keys) do
  local hk = ns .. ':b:' .. k
  redis.call('HDEL', hk, pod)
  if redis.call('HLEN', hk) == 0 then
    redis.call('ZREM', ns .. ':lru', k)
  end
end
redis.call('DEL', podset)
local prefix = pod .. '|'
local spec = redis.call('ZRANGE', ns .. ':spec', 0, -1)
for _, m in ipairs(spec) do
  if string.sub(m, 1, #prefix) == prefix then
    local k = string.sub(m, #prefix + 1)
    local hk = ns .. ':b:' .. k
    redis.call('HDEL', hk, '~' .. pod)
    redis.call('ZREM', ns .. ':spec', m)
    if redis.call('HLEN', hk) == 0 then
      redis.call('ZREM', ns .. ':lru', k)
    end
  end
end
return #keys
"""

_SPECULATE = """
local ns, pod, now, expiry = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local specz = ns .. ':spec'
local expired = redis.call('ZRANGEBYSCORE', specz, '-inf', now)
for _, m in ipairs(expired) do
  local sep = string.find(m, '|', 1, true)
  local p, k = string.sub(m, 1, sep - 1), string.sub(m, sep + 1)
  local hk = ns .. ':b:' .. k
  redis.call('HDEL', hk, '~' .. p)
  if redis.call('HLEN', hk) == 0 then
    redis.call('ZREM', ns .. ':lru', k)
  end
end
if #expired > 0 then
  redis.call('ZREMRANGEBYSCORE', specz, '-inf', now)
end
local tick = redis.call('INCR', ns .. ':tick')
for i = 5, #ARGV do
  local k = ARGV[i]
  local hk = ns .. ':b:' .. k
  if redis.call('HGET', hk, pod) then
    redis.call('ZADD', ns .. ':lru', 'XX', tick, k)  -- confirmed and about to be reused
  end
  -- Also speculative when confirmed: the pod may evict it before the request runs.
  -- A shorter life never cuts a longer one (a prompt predicted to wait).
  local held = tonumber(redis.call('HGET', hk, '~' .. pod))
  if held == nil or held < tonumber(expiry) then
    redis.call('HSET', hk, '~' .. pod, expiry)
    redis.call('ZADD', specz, expiry, pod .. '|' .. k)
  end
end
return 0
"""

# Returns a flat list: pod, matched blocks, 1 if some matched block is CPU-only, ...
_LOOKUP = """
local ns, now, npods = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local alive, nalive = {}, 0
local all = npods == 0
for i = 1, npods do
  alive[ARGV[3 + i]] = true
  nalive = nalive + 1
end
local out, cpu = {}, {}
local first = 4 + npods
local i = first
while i <= #ARGV do
  local flat = redis.call('HGETALL', ns .. ':b:' .. ARGV[i])
  local held = {}
  for j = 1, #flat, 2 do
    local f, v = flat[j], flat[j + 1]
    if string.sub(f, 1, 1) == '~' then
      if tonumber(v) > now then
        local p = string.sub(f, 2)
        held[p] = bit.bor(held[p] or 0, 1)
      end
    else
      held[f] = bit.bor(held[f] or 0, tonumber(v))
    end
  end
  if all then
    for p, _ in pairs(held) do
      alive[p] = true
      nalive = nalive + 1
    end
    all = false
  end
  for p, _ in pairs(alive) do
    local h = held[p]
    if not h then
      alive[p] = nil
      nalive = nalive - 1
      if i > first then
        out[#out + 1] = p
        out[#out + 1] = i - first
        out[#out + 1] = cpu[p] and 1 or 0
      end
    elseif bit.band(h, 1) == 0 then
      cpu[p] = true
    end
  end
  if nalive == 0 then
    break
  end
  i = i + 1
end
if nalive > 0 and #ARGV >= first then
  for p, _ in pairs(alive) do
    out[#out + 1] = p
    out[#out + 1] = #ARGV - first + 1
    out[#out + 1] = cpu[p] and 1 or 0
  end
end
return out
"""

_CONNECTION_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


def _bit(medium: str | None) -> int:
    return 1 if medium_of(medium) == "GPU" else 2


class RedisBlockIndex:
    """`BlockIndex` on Redis, with a local in-memory mirror to fall back on."""

    def __init__(
        self,
        client: aioredis.Redis,
        namespace: str = "smart-epp:kv",
        capacity: int = DEFAULT_CAPACITY,
        clock: Callable[[], float] = time.time,
        local: MemoryBlockIndex | None = None,
        retry_after_s: float = 1.0,
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.capacity = capacity
        self._clock = clock
        # The mirror only ever answers during outages; it shares the clock so that
        # speculative entries expire alike in both.
        self.local = local if local is not None else MemoryBlockIndex(capacity, clock=clock)
        self.retry_after_s = retry_after_s
        self._add = client.register_script(_ADD)
        self._remove = client.register_script(_REMOVE)
        self._clear = client.register_script(_CLEAR_POD)
        self._speculate = client.register_script(_SPECULATE)
        self._lookup = client.register_script(_LOOKUP)
        self.up = True
        self._down_since = 0.0
        # The store generation this replica's state was last written under; None = never.
        # (str where the client decodes responses.)
        self._epoch: bytes | str | None = None
        self._reconcile = False  # writes were lost while the store was unreachable
        self.reseeds = 0
        metrics.REDIS_UP.set(1)

    @classmethod
    def from_url(cls, url: str, **kwargs: object) -> RedisBlockIndex:
        client = aioredis.Redis.from_url(
            url,
            socket_connect_timeout=0.5,
            socket_timeout=0.5,
            decode_responses=False,
            # A connection idle this long is PINGed before use, not found stale by a command.
            health_check_interval=5,
            retry=Retry(NoBackoff(), 1),
            retry_on_error=[redis.exceptions.ConnectionError, redis.exceptions.TimeoutError],
        )
        return cls(client, **kwargs)  # type: ignore[arg-type]

    def held_blocks_sync(self, pod: str) -> int:
        """Blocks `pod` holds on its GPU tier, from the local mirror: every replica takes
        every pod's KV events, so its mirror counts what the store holds."""
        return self.local.held_blocks_sync(pod)

    async def close(self) -> None:
        await self.client.aclose()

    # ---- availability ------------------------------------------------------------------

    @property
    def store_synced(self) -> bool:
        """Whether the shared store is reachable and this replica has joined its current
        generation (one `check()` has run): lookups then read what every replica wrote."""
        return self.up and self._epoch is not None

    def _should_try(self) -> bool:
        return self.up or time.monotonic() - self._down_since >= self.retry_after_s

    async def _failed(self, op: str, exc: BaseException) -> None:
        metrics.REDIS_ERRORS.labels(op).inc()
        if self.up:
            log.warning("kv index: Redis unreachable (%s: %s); routing on local state", op, exc)
        self.up = False
        self._reconcile = True
        self._down_since = time.monotonic()
        metrics.REDIS_UP.set(0)
        # Whatever broke one pooled connection (a restart, a failover) broke them all.
        await self.client.connection_pool.disconnect()

    def _succeeded(self) -> None:
        if not self.up:
            log.info("kv index: Redis reachable again")
        self.up = True
        metrics.REDIS_UP.set(1)

    async def _call(self, op: str, script: AsyncScript, args: list[EncodableT]) -> object | None:
        if not self._should_try():
            return None
        try:
            result: object = await script(args=args)
        except _CONNECTION_ERRORS as exc:
            await self._failed(op, exc)
            return None
        self._succeeded()
        return result

    # ---- BlockIndex ----------------------------------------------------------------------

    async def add(self, pod: str, keys: Sequence[int], medium: Medium = "GPU") -> None:
        self.local.add_sync(pod, keys, medium)
        if keys:
            await self._call(
                "add", self._add, [self.namespace, pod, _bit(medium), self.capacity, *keys]
            )

    async def remove(self, pod: str, keys: Sequence[int], medium: Medium = "GPU") -> None:
        self.local.remove_sync(pod, keys, medium)
        if keys:
            await self._call("remove", self._remove, [self.namespace, pod, _bit(medium), *keys])

    async def clear_pod(self, pod: str) -> None:
        self.local.clear_pod_sync(pod)
        await self._call("clear_pod", self._clear, [self.namespace, pod])

    async def add_speculative(
        self, pod: str, keys: Sequence[int], ttl_s: float = DEFAULT_SPECULATIVE_TTL_S
    ) -> None:
        self.local.add_speculative_sync(pod, keys, ttl_s)
        now = self._clock()
        await self._call(
            "add_speculative",
            self._speculate,
            [self.namespace, pod, repr(now * 1000), repr((now + ttl_s) * 1000), *keys],
        )

    async def lookup(
        self, keys: Sequence[int], pods: Collection[str] | None = None
    ) -> dict[str, PrefixHit]:
        if not keys or (pods is not None and not pods):
            return {}
        pod_list = [] if pods is None else list(pods)
        args: list[EncodableT] = [self.namespace, repr(self._clock() * 1000), len(pod_list)]
        args += pod_list
        args += keys
        flat = await self._call("lookup", self._lookup, args)
        if flat is None:
            return self.local.lookup_sync(keys, pods)
        out: dict[str, PrefixHit] = {}
        items = list(flat)  # type: ignore[call-overload]
        for j in range(0, len(items), 3):
            pod = items[j].decode() if isinstance(items[j], bytes) else str(items[j])
            blocks = int(items[j + 1])
            if blocks:
                out[pod] = PrefixHit(blocks=blocks, medium="CPU" if int(items[j + 2]) else "GPU")
        return out

    # ---- recovery ------------------------------------------------------------------------

    async def maintain(self, interval_s: float = 1.0) -> None:
        """Runs `check()` every `interval_s` until cancelled."""
        while True:
            try:
                await self.check()
            except _CONNECTION_ERRORS as exc:
                await self._failed("check", exc)
            except redis.exceptions.RedisError as exc:
                log.warning("kv index: Redis check failed: %s", exc)
            await asyncio.sleep(interval_s)

    async def check(self) -> bool:
        """One recovery step; True when the local state was written back to the store."""
        if not self._should_try():
            return False
        epoch_key = f"{self.namespace}:epoch"
        epoch = await self.client.get(epoch_key)
        if epoch is None:  # empty or replaced: start a new generation (one replica wins)
            await self.client.set(epoch_key, uuid.uuid4().hex, nx=True)
            epoch = await self.client.get(epoch_key)
        self._succeeded()
        reseed = epoch != self._epoch or self._reconcile
        if reseed:
            reason = "lost writes during an outage" if self._reconcile else "new store generation"
            written = await self._write_back(clear=self._reconcile)
            self._epoch, self._reconcile = epoch, False
            self.reseeds += 1
            metrics.REDIS_RESEEDS.inc()
            log.info("kv index: wrote %d local entries back to Redis (%s)", written, reason)
        metrics.REDIS_DIVERGENCE.set(await self.entries() - self.local.blocks)
        return reseed

    async def _write_back(self, clear: bool, batch: int = 4096) -> int:
        """Writes every confirmed local entry to the store; with `clear`, each pod's store
        entries are dropped first (removals made while it was unreachable)."""
        if clear:
            for pod in self.local.pods():
                await self._clear(args=[self.namespace, pod])
        written = 0
        for chunk in self.local.held_by_pod():
            for (pod, medium), keys in chunk.items():
                for start in range(0, len(keys), batch):
                    part = keys[start : start + batch]
                    args: list[EncodableT] = [
                        self.namespace,
                        pod,
                        _bit(medium),
                        self.capacity,
                        *part,
                    ]
                    await self._add(args=args)
                    written += len(part)
            await asyncio.sleep(0)  # a large mirror must not hold up routing
        return written

    async def entries(self) -> int:
        """Distinct blocks held in Redis (for tests and the benchmark)."""
        return int(await self.client.zcard(f"{self.namespace}:lru"))
