"""The exact tier: encoded results by key in a store (in process or Redis), with the size rule
that keeps one large value from flushing the cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fulcrum.cache.codec import (
    CachedGeneration,
    decode_generation,
    decode_result,
    encode_generation,
    encode_result,
)

if TYPE_CHECKING:
    from fulcrum.batcher import InferResult
    from fulcrum.cache.protocols import Store
    from fulcrum.cache.settings import CacheSettings


class ExactTier:
    """Results by exact key; a value over `max_bytes / 8` is not cached (it would evict an
    eighth of the cache for one request)."""

    def __init__(self, store: Store, settings: CacheSettings) -> None:
        self.store = store
        self._ttl_s = settings.ttl
        self._max_value_bytes = settings.max_value_bytes
        self.num_too_large = 0

    async def get_result(self, key: bytes) -> tuple[InferResult, float] | None:
        """The cached result of `key` and the compute time it saves, or None."""
        value = await self.store.get(key)
        return None if value is None else decode_result(key, value)

    async def put_result(self, key: bytes, result: InferResult) -> bool:
        # Checked before encoding, so a huge result is not copied only to be dropped.
        if sum(arr.nbytes for arr in result.outputs.values()) > self._max_value_bytes:
            self.num_too_large += 1
            return False
        return await self._put(key, encode_result(key, result))

    async def get_generation(self, key: bytes) -> CachedGeneration | None:
        value = await self.store.get(key)
        return None if value is None else decode_generation(key, value)

    async def put_generation(self, key: bytes, generation: CachedGeneration) -> bool:
        return await self._put(key, encode_generation(key, generation))

    async def _put(self, key: bytes, value: bytes) -> bool:
        if len(value) > self._max_value_bytes:
            self.num_too_large += 1
            return False
        await self.store.set(key, value, self._ttl_s)
        return True
