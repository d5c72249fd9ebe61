"""The semantic tier's vectors in Redis, shared by replicas. Debian's redis-server has no vector
search module, so each scope is a Redis list of (float32 vector, key, text) records, copied into
this process (a first fetch moves the whole scope, later ones only what was appended) and
searched with numpy. A copy older than the staleness bound is refreshed before it is used."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from fulcrum.cache.breaker import CircuitBreaker
from fulcrum.cache.protocols import SemanticEntry
from fulcrum.cache.redis_link import RedisLink
from fulcrum.cache.redis_scope import ScopeCopy, decode_records, encode_record
from fulcrum.cache.redis_store import KEY_PREFIX
from fulcrum.errors import ConfigError, Unavailable

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from fulcrum.types import Array

# How stale a scope's copy may be before a lookup refreshes it: entries other replicas added
# within this window are not yet seen (a miss, never a wrong hit).
DEFAULT_MAX_STALENESS_S = 1.0
# A first fetch moves a whole scope (10,000 MiniLM rows are 15 MiB): it runs in the background
# with this bound, while lookups wait only the Redis timeout and answer from what they have.
DEFAULT_FETCH_TIMEOUT_S = 2.0
DEFAULT_MAX_TEXT_BYTES = 64 * 1024
# Fetched records decoded on the event loop at most (about 1 ms); more go to a thread.
DECODE_ON_LOOP_MAX = 256

# Atomic add + oldest-out bound over every scope of the namespace. KEYS: 1 the order list (one
# scope name per add, oldest first), 2 the scope's list, 3 its meta hash (epoch, adds), 4 the
# epoch counter (with the server's clock, so a restarted Redis never repeats an epoch). Each
# scope list is in add order too, so the head of the order list names the scope whose head is
# the oldest entry of all. Keys named in the order list are touched without being declared:
# fine on one Redis server, not on a cluster.
_ADD = """
if redis.call('EXISTS', KEYS[2]) == 0 then
  local t = redis.call('TIME')
  local epoch = redis.call('INCR', KEYS[4]) .. '@' .. t[1] .. '.' .. t[2]
  redis.call('HSET', KEYS[3], 'epoch', epoch, 'n', 0)
end
redis.call('RPUSH', KEYS[2], ARGV[1])
local n = redis.call('HINCRBY', KEYS[3], 'n', 1)
redis.call('RPUSH', KEYS[1], KEYS[2])
local total = redis.call('LLEN', KEYS[1])
local max = tonumber(ARGV[2])
while total > max do
  local oldest = redis.call('LPOP', KEYS[1])
  redis.call('LPOP', oldest)
  if redis.call('LLEN', oldest) == 0 then redis.call('DEL', oldest .. ':meta') end
  total = total - 1
end
return {total, redis.call('HGET', KEYS[3], 'epoch') or '', n}
"""
# The scope as a copy at (ARGV[1] epoch, ARGV[2] adds) lacks it: everything appended since,
# or the whole list when the copy is of another epoch. KEYS as in _ADD (1..3).
_FETCH = """
local epoch = redis.call('HGET', KEYS[3], 'epoch') or ''
local n = tonumber(redis.call('HGET', KEYS[3], 'n') or '0')
local len = redis.call('LLEN', KEYS[2])
local total = redis.call('LLEN', KEYS[1])
local known = tonumber(ARGV[2])
if epoch == '' or epoch ~= ARGV[1] or n < known then
  return {epoch, n, len, total, 1, redis.call('LRANGE', KEYS[2], 0, -1)}
end
local new = math.min(n - known, len)
if new == 0 then return {epoch, n, len, total, 0, {}} end
return {epoch, n, len, total, 0, redis.call('LRANGE', KEYS[2], -new, -1)}
"""


class RedisVectorIndex:
    """protocols.VectorIndex in Redis: at most `max_entries` in all scopes of the namespace
    (oldest out); a slow or dead Redis makes `nearest` answer from the copy it has (or nothing)
    and `add` a no-op."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float,
        max_entries: int,
        namespace: str = "default",
        max_staleness_s: float = DEFAULT_MAX_STALENESS_S,
        fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S,
        max_text_bytes: int = DEFAULT_MAX_TEXT_BYTES,
        breaker: CircuitBreaker | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_entries < 1:
            raise ConfigError(f"semantic max_entries must be >= 1, got {max_entries}")
        self.fetch_timeout_s = max(fetch_timeout_s, timeout_s)
        self.link = RedisLink(
            url, timeout_s=timeout_s, breaker=breaker, clock=clock,
            op_timeout_s=self.fetch_timeout_s,
        )  # fmt: skip
        self.prefix = f"{KEY_PREFIX}:{namespace}:vec:".encode()
        self.order_key = self.prefix + b"order"
        self.epoch_key = self.prefix + b"epoch"
        self.max_entries = max_entries
        self.max_staleness_s = max_staleness_s
        self.max_text_bytes = max_text_bytes
        self.num_fetches = 0
        self.num_rows_fetched = 0
        self._size = 0
        self._scopes: OrderedDict[bytes, ScopeCopy] = OrderedDict()  # LRU, bounded in rows
        self._fetching: dict[bytes, asyncio.Task[ScopeCopy]] = {}

    def scope_key(self, scope: bytes) -> bytes:
        return self.prefix + scope.hex().encode()

    def _keys(self, scope: bytes) -> tuple[bytes, bytes, bytes]:
        scope_key = self.scope_key(scope)
        return self.order_key, scope_key, scope_key + b":meta"

    async def add(self, scope: bytes, vector: Array, entry: SemanticEntry) -> None:
        if len(entry.text.encode()) > self.max_text_bytes:
            return
        row = np.ascontiguousarray(vector, dtype=np.float32).reshape(-1)  # (D,)
        record = encode_record(row, entry)
        keys = (*self._keys(scope), self.epoch_key)

        async def op(client: Redis) -> Any:
            return await client.eval(_ADD, len(keys), *keys, record, self.max_entries)

        try:
            total, epoch, num_added = await self.link.call(op)
        except Unavailable:
            return
        self._size = int(total)
        copy = self._scopes.get(scope)
        if copy is None:
            return
        created = not copy.epoch and not copy.rows and num_added == 1  # by this very add
        if created or (copy.epoch == epoch and copy.num_added == num_added - 1):
            copy.append([row], [entry])  # this process sees its own add at once
            copy.epoch, copy.num_added = epoch, num_added
            copy.keep_last(self.max_entries)
            self._trim()
        else:  # another replica added meanwhile: refresh on the next lookup
            copy.fetched_at = -float("inf")

    async def nearest(
        self, scope: bytes, vector: Array, k: int
    ) -> list[tuple[float, SemanticEntry]]:
        copy = await self._copy(scope)
        if copy is None:
            return []
        return copy.search(np.asarray(vector, dtype=np.float32).reshape(-1), k)

    def size(self) -> int:
        """Entries in the namespace as of this process's last add or fetch."""
        return self._size

    async def close(self) -> None:
        tasks = list(self._fetching.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._fetching.clear()
        self._scopes.clear()
        await self.link.close()

    async def _copy(self, scope: bytes) -> ScopeCopy | None:
        """A fresh copy of the scope; else, when the refresh is late or fails, the stale one
        (its entries are real, only incomplete) or None."""
        copy = self._scopes.get(scope)
        if copy is not None:
            self._scopes.move_to_end(scope)
            if self.link.clock() - copy.fetched_at < self.max_staleness_s:
                return copy
        # Lookups of one scope share one fetch, which outlives a caller that stops waiting.
        task = self._fetching.get(scope)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._fetch(scope, copy))
            self._fetching[scope] = task
            task.add_done_callback(self._fetched(scope))
        done, _ = await asyncio.wait({task}, timeout=self.link.timeout_s)
        if done and not task.cancelled() and task.exception() is None:
            return task.result()
        return copy

    def _fetched(self, scope: bytes) -> Callable[[asyncio.Task[ScopeCopy]], None]:
        def done(task: asyncio.Task[ScopeCopy]) -> None:
            self._fetching.pop(scope, None)
            if not task.cancelled():
                task.exception()  # retrieved even when no caller waited for the end

        return done

    async def _fetch(self, scope: bytes, copy: ScopeCopy | None) -> ScopeCopy:
        epoch, num_added, length, total, full, items = await self._call_fetch(scope, copy)
        keep = length - len(items)
        if not full and (copy is None or keep > len(copy.rows)):
            # The copy was trimmed harder than Redis (or dropped meanwhile): fetch it whole.
            copy = None
            epoch, num_added, length, total, full, items = await self._call_fetch(scope, copy)
        if len(items) > DECODE_ON_LOOP_MAX:  # a whole scope: decoding it would stall the loop
            rows, entries = await asyncio.to_thread(decode_records, items)
        else:
            rows, entries = decode_records(items)
        now = self.link.clock()
        if full or copy is None:
            copy = ScopeCopy(fetched_at=now, epoch=epoch, num_added=num_added)
        else:
            copy.keep_last(length - len(items))
            copy.fetched_at, copy.num_added = now, num_added
        copy.append(rows, entries)
        self.num_fetches += 1
        self.num_rows_fetched += len(items)
        self._size = int(total)
        self._scopes[scope] = copy
        self._scopes.move_to_end(scope)
        self._trim()
        return copy

    async def _call_fetch(self, scope: bytes, copy: ScopeCopy | None) -> list[Any]:
        known = (copy.epoch, copy.num_added) if copy is not None else (b"", 0)
        keys = self._keys(scope)

        async def op(client: Redis) -> Any:
            return await client.eval(_FETCH, len(keys), *keys, *known)

        reply: list[Any] = await self.link.call(op, timeout_s=self.fetch_timeout_s)
        return reply

    def _trim(self) -> None:
        # Bound this process's copies like Redis: all scopes together hold at most max_entries
        # rows, the least recently used scope dropped first.
        total = sum(len(copy.rows) for copy in self._scopes.values())
        while total > self.max_entries and len(self._scopes) > 1:
            _, oldest = self._scopes.popitem(last=False)
            total -= len(oldest.rows)
