"""The pool-state store on a Redis-protocol server (Redis, Valkey).

Layout, all under one hash tag so a cluster keeps it in one slot:

    {prefix}:pickers        sorted set: picker id -> expiry (server ms)
    {prefix}:load:<picker>  hash: pod -> "requests prompt_tokens prefilling prefilling_tokens"
    {prefix}:routed         stream: picker, pod, ttl_ms, packed block keys (MAXLEN ~ N,
                            and trimmed to the longest ttl by id, ids being server ms)
    {prefix}:learned        stream: picker, one batch of learned-from answers per exchange
                            that has any (JSON; MAXLEN ~ N batches)
    {prefix}:scrapes        hash: pod -> "written_ms taken_ms picker seq payload", the
                            newest shared scrape of each pod (dropped when not rewritten
                            for a minute)
    {prefix}:epoch          a random token set once: a new one means the store was
                            emptied (restarted) and every picker writes its table again
    {prefix}:changed        pub/sub channel: the id of a picker whose exchange changed
                            what the others' decisions read (its change notice)

One Lua script does a whole exchange, so it is atomic and costs one round trip: it
writes this picker's changed loads, refreshes its expiry, drops pickers past theirs,
appends its routed entries and learned answers, records its scrapes, and returns the
other pickers' ids and loads, the routed entries and learned answers appended since this
picker's cursors, and the others' scrapes written since its last exchange; and it
publishes the change notice when asked, after the writes it announces. Expiry
runs on the server's clock (TIME), so pickers on different hosts need no synchronised
clocks.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis

from .store import (
    DEFAULT_MAX_LEARNED,
    DEFAULT_MAX_READ,
    DEFAULT_MAX_ROUTED_ENTRIES,
    DEFAULT_PICKER_TTL_S,
    SCRAPE_FORGET_S,
    PeerView,
    PickerUpdate,
    PodLoad,
    RoutedEntry,
    SharedScrape,
    decode_learned,
    encode_learned,
)

_EXCHANGE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local pickers, own, routed, epoch_key, learned = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local me, load_prefix, cursor = ARGV[1], ARGV[2], ARGV[3]
local ttl, max_read, max_entries = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local max_routed_ttl = tonumber(ARGV[7])
local replace, nloads = ARGV[8], tonumber(ARGV[9])
local epoch = redis.call('GET', epoch_key)
if not epoch then
  epoch = ARGV[10]
  redis.call('SET', epoch_key, epoch)
end
local learned_cursor, batch = ARGV[11], ARGV[12]
local max_learned = tonumber(ARGV[13])
local scrapes, nscrapes = KEYS[6], tonumber(ARGV[14])
local scrape_cursor, scrape_forget = tonumber(ARGV[15]), tonumber(ARGV[16])
local channel, notify = ARGV[17], ARGV[18]
local i = 19
if replace == '1' then redis.call('DEL', own) end
for _ = 1, nloads do
  if ARGV[i + 1] == '' then
    redis.call('HDEL', own, ARGV[i])
  else
    redis.call('HSET', own, ARGV[i], ARGV[i + 1])
  end
  i = i + 2
end
redis.call('PEXPIRE', own, ttl)
for _ = 1, nscrapes do
  -- pod, age ms, seq, payload
  redis.call('HSET', scrapes, ARGV[i], now .. ' ' .. (now - tonumber(ARGV[i + 1])) .. ' ' ..
             me .. ' ' .. ARGV[i + 2] .. ' ' .. ARGV[i + 3])
  i = i + 4
end
if nscrapes > 0 then redis.call('PEXPIRE', scrapes, scrape_forget + ttl) end
redis.call('ZADD', pickers, now + ttl, me)
redis.call('ZREMRANGEBYSCORE', pickers, '-inf', now)
redis.call('PEXPIRE', pickers, ttl)
local added = false
while i <= #ARGV do
  redis.call('XADD', routed, 'MAXLEN', '~', max_entries, '*',
             'p', me, 'pod', ARGV[i], 'ttl', ARGV[i + 1], 'k', ARGV[i + 2])
  i = i + 3
  added = true
end
if added then
  redis.call('XTRIM', routed, 'MINID', '~', now - max_routed_ttl)
  redis.call('PEXPIRE', routed, max_routed_ttl + ttl)
end
if batch ~= '' then
  redis.call('XADD', learned, 'MAXLEN', '~', max_learned, '*', 'p', me, 'd', batch)
end
redis.call('PEXPIRE', learned, ttl + 60000)
redis.call('PEXPIRE', epoch_key, math.max(ttl, max_routed_ttl) + 60000)
if notify == '1' then redis.call('PUBLISH', channel, me) end
local loads = {}
local ids = {}
for _, id in ipairs(redis.call('ZRANGE', pickers, 0, -1)) do
  if id ~= me then
    ids[#ids + 1] = id
    loads[#loads + 1] = redis.call('HGETALL', load_prefix .. id)
  end
end
-- Flat (pod, age ms, picker, seq, payload) of the others' scrapes written since this
-- picker's last exchange (at or after it: the reader drops what it has seen).
local seen = {}
local held = redis.call('HGETALL', scrapes)
for j = 1, #held, 2 do
  local written, taken, who, seq, payload =
    string.match(held[j + 1], '^(%d+) (%-?%d+) (%S+) (%d+) (.*)$')
  if written == nil or tonumber(written) < now - scrape_forget then
    redis.call('HDEL', scrapes, held[j])
  elseif tonumber(written) >= scrape_cursor and who ~= me then
    seen[#seen + 1] = held[j]
    seen[#seen + 1] = now - tonumber(taken)
    seen[#seen + 1] = who
    seen[#seen + 1] = seq
    seen[#seen + 1] = payload
  end
end
local entries
if cursor == '' then
  entries = redis.call('XRANGE', routed, now - max_routed_ttl, '+', 'COUNT', max_read)
else
  entries = redis.call('XRANGE', routed, '(' .. cursor, '+', 'COUNT', max_read)
end
-- Flat (pod, ms left, packed keys) triples of the others' live entries: the reply stays
-- small and cheap to parse, whatever the stream holds.
local out = {}
local last = cursor
for _, entry in ipairs(entries) do
  local id, f = entry[1], entry[2]
  last = id
  if f[2] ~= me then
    local born = tonumber(string.match(id, '^(%d+)'))
    local left = tonumber(f[6]) - (now - born)
    if left > 0 then
      out[#out + 1] = f[4]
      out[#out + 1] = left
      out[#out + 1] = f[8]
    end
  end
end
local batches = {}
local learned_last = learned_cursor
local from = '-'
if learned_cursor ~= '' then from = '(' .. learned_cursor end
for _, entry in ipairs(redis.call('XRANGE', learned, from, '+', 'COUNT', max_read)) do
  learned_last = entry[1]
  if entry[2][2] ~= me then batches[#batches + 1] = entry[2][4] end
end
return {epoch, last, loads, out, learned_last, batches, ids, seen, now}
"""


class RedisPoolStore:
    """`PoolStateStore` on a Redis-protocol server; see the module notes for the layout."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        prefix: str = "smart-epp:{default}",
        picker_ttl_s: float = DEFAULT_PICKER_TTL_S,
        max_entries: int = DEFAULT_MAX_ROUTED_ENTRIES,
        max_read: int = DEFAULT_MAX_READ,
        max_routed_ttl_s: float = 10.0,
        max_learned: int = DEFAULT_MAX_LEARNED,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.picker_ttl_ms = max(1, int(picker_ttl_s * 1000))
        self.max_entries = max_entries
        self.max_read = max_read
        self.max_routed_ttl_ms = max(1, int(max_routed_ttl_s * 1000))
        self._script = client.register_script(_EXCHANGE)
        self._keys_prefix = f"{prefix}:load:"
        self.channel = f"{prefix}:changed"
        self._cursor = ""
        self._learned_cursor = ""
        self._scrape_cursor = 0  # server ms of the last exchange
        # Batches of learned answers: one per exchange, a few answers each.
        self.max_learned_batches = max(1, max_learned // 4)
        self._epoch: str | None = None

    @classmethod
    def from_url(cls, url: str, *, pool_name: str = "default", **kwargs: Any) -> RedisPoolStore:
        # Short timeouts: a store that does not answer must not hold the picker's sync
        # loop, which then falls back to local state and retries.
        client = aioredis.Redis.from_url(
            url, socket_timeout=0.5, socket_connect_timeout=0.5, decode_responses=False
        )
        return cls(client, prefix=f"smart-epp:{{{pool_name}}}", **kwargs)

    async def exchange(self, update: PickerUpdate) -> PeerView:
        args: list[Any] = [
            update.picker,
            self._keys_prefix,
            self._cursor,
            self.picker_ttl_ms,
            self.max_read,
            self.max_entries,
            self.max_routed_ttl_ms,
            "1" if update.replace else "0",
            len(update.loads),
            secrets.token_hex(8),
            self._learned_cursor,
            encode_learned(update.learned) if update.learned else "",
            self.max_learned_batches,
            len(update.scrapes),
            self._scrape_cursor,
            int(SCRAPE_FORGET_S * 1000),
            self.channel,
            "1" if update.notify else "0",
        ]
        for pod, load in update.loads.items():
            args += [pod, "" if load.empty else load.encode()]
        for scrape in update.scrapes:
            args += [scrape.pod, max(0, int(scrape.age_s * 1000)), scrape.seq, scrape.payload]
        for entry in update.routed:
            args += [entry.pod, int(entry.ttl_s * 1000), entry.packed_keys()]
        keys = [
            f"{self.prefix}:pickers",
            f"{self._keys_prefix}{update.picker}",
            f"{self.prefix}:routed",
            f"{self.prefix}:epoch",
            f"{self.prefix}:learned",
            f"{self.prefix}:scrapes",
        ]
        reply = await self._script(keys=keys, args=args)
        (epoch_raw, cursor_raw, loads_raw, routed_raw, learned_cursor_raw, batches, ids_raw,
         scrapes_raw, now_ms) = reply  # fmt: skip
        epoch = epoch_raw.decode()
        peer_ids = tuple(sorted(raw.decode() for raw in ids_raw))
        view = PeerView(peers=len(peer_ids), peer_ids=peer_ids)
        self._scrape_cursor = int(now_ms)
        view.scrapes = [
            SharedScrape(pod.decode(), who.decode(), int(seq), int(age_ms) / 1000, payload.decode())
            for pod, age_ms, who, seq, payload in zip(
                *(scrapes_raw[k::5] for k in range(5)), strict=True
            )
        ]
        if self._epoch is not None and epoch != self._epoch:
            # Emptied since we last looked: our cursor means nothing there any more.
            view.store_reset = True
            self._cursor = ""
        else:
            self._cursor = cursor_raw.decode()
        # Read in this same call, from the store as it is now: valid either way.
        self._learned_cursor = learned_cursor_raw.decode()
        self._epoch = epoch
        for peer_raw, flat in zip(ids_raw, loads_raw, strict=True):
            peer = peer_raw.decode()
            for pod_raw, value in zip(flat[::2], flat[1::2], strict=True):
                pod = pod_raw.decode()
                load = PodLoad.decode(value)
                view.loads[pod] = view.loads.get(pod, PodLoad()) + load
                view.routed_prefill_s[peer, pod] = load.routed_prefill_s
        unpack = RoutedEntry.unpack_keys
        view.routed = [
            RoutedEntry(pod.decode(), unpack(packed), left_ms / 1000)
            for pod, left_ms, packed in zip(
                routed_raw[::3], routed_raw[1::3], routed_raw[2::3], strict=True
            )
        ]
        for batch in batches:
            try:
                view.learned.extend(decode_learned(batch))
            except ValueError:
                view.malformed_learned += 1
        return view

    async def watch(
        self, picker: str, notice: Callable[[], None], subscribed: Callable[[], None]
    ) -> None:
        own = picker.encode()
        async with self.client.pubsub(ignore_subscribe_messages=True) as pubsub:
            await pubsub.subscribe(self.channel)
            subscribed()
            # Blocks with no read timeout: a quiet pool sends no notices for a long time.
            async for message in pubsub.listen():
                if message["data"] != own:
                    notice()

    async def close(self) -> None:
        await self.client.aclose()


__all__ = ["RedisPoolStore"]
