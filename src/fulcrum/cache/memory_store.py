"""The in-process store: bytes by key, least recently used first out when over a byte budget,
each entry with its own expiry. The policy is plain code taking the clock's `now`; the async
methods only satisfy `protocols.Store`."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from fulcrum.cache.protocols import StoreStats
from fulcrum.types import Clock, MonotonicClock

# What an entry costs besides its key and value: the dict slot, the entry object and the two
# bytes objects' headers (measured with sys.getsizeof, rounded up). It keeps a budget honest
# when values are tiny.
ENTRY_OVERHEAD_BYTES = 200


@dataclass(slots=True)
class _Entry:
    value: bytes
    expires_s: float | None  # monotonic; None: never
    size: int


class MemoryStore:
    """LRU by bytes with TTL; `max_bytes` bounds keys, values and their overhead together."""

    def __init__(self, max_bytes: int, clock: Clock | None = None) -> None:
        self.max_bytes = max_bytes
        self._clock = clock or MonotonicClock()
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._bytes = 0
        self._evictions = 0

    async def get(self, key: bytes) -> bytes | None:
        return self.get_now(key)

    async def set(self, key: bytes, value: bytes, ttl_s: float | None) -> None:
        self.set_now(key, value, ttl_s)

    def stats(self) -> StoreStats:
        return StoreStats(len(self._entries), self._bytes, self._evictions, 0)

    async def close(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def get_now(self, key: bytes) -> bytes | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.expires_s is not None and self._clock.now() >= entry.expires_s:
            self._remove(key)
            return None
        self._entries.move_to_end(key)
        return entry.value

    def set_now(self, key: bytes, value: bytes, ttl_s: float | None) -> None:
        size = len(key) + len(value) + ENTRY_OVERHEAD_BYTES
        if key in self._entries:
            self._remove(key)
        if size > self.max_bytes:
            return  # could never fit: refusing it keeps the rest of the cache
        expires_s = None if ttl_s is None else self._clock.now() + ttl_s
        self._entries[key] = _Entry(value, expires_s, size)
        self._bytes += size
        self._make_room()

    def _make_room(self) -> None:
        # Least recently used first. Expired entries are not searched for (that is a scan per
        # set once the cache is full); they go when read, or when they reach the LRU end.
        now = self._clock.now()
        while self._bytes > self.max_bytes:
            oldest, entry = next(iter(self._entries.items()))
            self._remove(oldest)
            if entry.expires_s is None or now < entry.expires_s:
                self._evictions += 1  # a live entry pushed out, not one that had expired

    def _remove(self, key: bytes) -> None:
        entry = self._entries.pop(key)
        self._bytes -= entry.size
