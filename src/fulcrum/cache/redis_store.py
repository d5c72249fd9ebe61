"""The exact tier's bytes in Redis, shared by every replica pointed at the same server: keys
namespaced, TTL through SET PX, values bounded; a slow or dead Redis is a miss, never an error."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fulcrum.cache.breaker import CircuitBreaker
from fulcrum.cache.protocols import StoreStats
from fulcrum.cache.redis_link import RedisLink, decode_info
from fulcrum.errors import Unavailable

if TYPE_CHECKING:
    from redis.asyncio import Redis

KEY_PREFIX = "fulcrum"
# A cached result bigger than this costs more to move than most models take to recompute it,
# and would crowd out many small ones (Redis's own hard limit is 512 MiB).
DEFAULT_MAX_VALUE_BYTES = 8 * 1024 * 1024
# How often stats() is refreshed from the server (a background call; stats() itself is sync).
DEFAULT_STATS_INTERVAL_S = 5.0


class RedisStore:
    """protocols.Store over one Redis database. `stats()` reports the database as Redis sees it
    (shared by the replicas), refreshed every few seconds; `errors` counts this process's failed
    calls."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float,
        namespace: str,
        max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
        stats_interval_s: float = DEFAULT_STATS_INTERVAL_S,
        breaker: CircuitBreaker | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.link = RedisLink(url, timeout_s=timeout_s, breaker=breaker, clock=clock)
        self.prefix = f"{KEY_PREFIX}:{namespace}:".encode()
        self.max_value_bytes = max_value_bytes
        self.num_oversized = 0  # values refused for size (not errors: Redis was never asked)
        self._stats_interval_s = stats_interval_s
        self._next_stats_at = self.link.clock() + stats_interval_s
        self._stats_task: asyncio.Task[None] | None = None
        self._entries = 0
        self._bytes = 0
        self._evictions = 0

    def redis_key(self, key: bytes) -> bytes:
        return self.prefix + key.hex().encode()

    async def get(self, key: bytes) -> bytes | None:
        self._maybe_refresh_stats()
        name = self.redis_key(key)

        async def op(client: Redis) -> Any:
            return await client.get(name)

        try:
            value = await self.link.call(op)
        except Unavailable:
            return None
        return value if isinstance(value, bytes) else None

    async def set(self, key: bytes, value: bytes, ttl_s: float | None) -> None:
        self._maybe_refresh_stats()
        if len(value) > self.max_value_bytes:
            self.num_oversized += 1
            return
        name = self.redis_key(key)
        # PX, not EX: a sub-second TTL must not round to 0 (which Redis refuses) or to 1 s.
        ttl_ms = max(1, round(ttl_s * 1000)) if ttl_s is not None and ttl_s > 0 else None

        async def op(client: Redis) -> Any:
            return await client.set(name, value, px=ttl_ms)

        with contextlib.suppress(Unavailable):  # a dropped set is a later miss, counted
            await self.link.call(op)

    def stats(self) -> StoreStats:
        return StoreStats(
            entries=self._entries,
            bytes=self._bytes,
            evictions=self._evictions,
            errors=self.link.num_errors,
        )

    async def refresh_stats(self) -> None:
        """Read the database's size, memory and evictions (one pipelined round trip)."""

        async def op(client: Redis) -> Any:
            async with client.pipeline(transaction=False) as pipe:
                pipe.dbsize()
                pipe.info("memory")
                pipe.info("stats")
                return await pipe.execute()

        with contextlib.suppress(Unavailable):
            entries, memory, counters = await self.link.call(op)
            self._entries = int(entries)
            self._bytes = decode_info(memory, "used_memory")
            self._evictions = decode_info(counters, "evicted_keys")

    def _maybe_refresh_stats(self) -> None:
        # Piggybacks on traffic instead of a timer: an idle store keeps its last figures.
        now = self.link.clock()
        if now < self._next_stats_at or (self._stats_task and not self._stats_task.done()):
            return
        self._next_stats_at = now + self._stats_interval_s
        self._stats_task = asyncio.get_running_loop().create_task(self.refresh_stats())

    async def close(self) -> None:
        task, self._stats_task = self._stats_task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.link.close()
