"""One model's result cache: the exact tier, then the semantic tier, then the model (with
identical concurrent misses computed once). A fault in a tier is a miss, never a failed
request; errors, partial and cancelled results are never stored."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from fulcrum.batcher import InferResult
from fulcrum.cache.coalesce import Coalescer
from fulcrum.cache.exact import ExactTier
from fulcrum.cache.stats import CacheStats

if TYPE_CHECKING:
    from fulcrum.cache.protocols import Store, VectorIndex
    from fulcrum.cache.settings import CacheSettings

log = logging.getLogger(__name__)
CacheStatus = Literal["exact", "semantic", "miss"]
CACHE_HEADER = "Fulcrum-Cache"  # on responses of models with a cache: where the answer came from


@dataclass(frozen=True, slots=True)
class CachedResult(InferResult):
    """A result that passed a model's cache, saying where it came from (`Fulcrum-Cache`)."""

    cache: CacheStatus = "miss"
    cache_s: float = 0.0  # time in the cache: the lookup, and for a miss its insert too


class SemanticLookup(Protocol):
    """What the semantic tier (`cache.semantic.SemanticTier`) offers this one."""

    async def lookup(self, scope: bytes, text: str) -> tuple[bytes | None, str | None]: ...

    async def insert(self, scope: bytes, text: str, key: bytes) -> None: ...


@dataclass(frozen=True, slots=True)
class CacheRequest:
    """One request as the cache sees it: its exact key and, when the semantic tier may answer
    it, its scope and text."""

    key: bytes
    scope: bytes | None = None
    text: str | None = None


class ModelCache:
    """The tiers of one model (every loaded version and variant share it; keys tell them apart)."""

    def __init__(
        self,
        model: str,
        settings: CacheSettings,
        store: Store,
        semantic: SemanticLookup | None = None,
        index: VectorIndex | None = None,
    ) -> None:
        self.model = model
        self.settings = settings
        self.exact = ExactTier(store, settings)
        self.semantic = semantic if settings.semantic else None
        self._index = index
        self.stats = CacheStats()
        self._coalescer: Coalescer[InferResult] = Coalescer()

    async def run(
        self,
        request: CacheRequest,
        compute: Callable[[], Awaitable[InferResult]],
        *,
        timeout_s: float | None = None,
    ) -> CachedResult:
        """The cached answer to `request`, else `compute()`'s (stored for the next one);
        `timeout_s` bounds a wait for an identical request's computation."""
        start_s = time.perf_counter()
        found = await self.lookup(request)
        lookup_s = time.perf_counter() - start_s
        if found is not None:
            return _tagged(found, found.cache, lookup_s)
        self.stats.misses += 1
        store_s = 0.0

        async def compute_and_store() -> InferResult:
            nonlocal store_s
            result = await compute()  # raises on error or cancellation: nothing is stored
            stored_at_s = time.perf_counter()
            await self.store(request, result)
            store_s = time.perf_counter() - stored_at_s
            return result

        result, shared = await self._coalescer.run(
            request.key, compute_and_store, timeout_s=timeout_s
        )
        if shared:
            self.stats.coalesced += 1
            self.stats.saved_s["exact"] += result.compute_s
        return _tagged(result, "miss", lookup_s + store_s)

    async def lookup(self, request: CacheRequest) -> CachedResult | None:
        """The exact tier's answer, else the semantic tier's; None on a miss."""
        if self.settings.exact:
            found = await self.exact.get_result(request.key)
            if found is not None:
                result, saved_s = found
                self.stats.hit("exact", saved_s)
                return _tagged(result, "exact")
        if self.semantic is None or request.scope is None or request.text is None:
            return None
        key = await self._semantic_key(self.semantic, request.scope, request.text)
        if key is None:
            return None
        found = await self.exact.get_result(key)
        if found is None:  # indexed, but the value expired or was evicted
            return None
        result, saved_s = found
        self.stats.hit("semantic", saved_s)
        return _tagged(result, "semantic")

    async def store(self, request: CacheRequest, result: InferResult) -> None:
        """Keep a complete result under its key (and its text in the semantic index)."""
        try:
            stored = await self.exact.put_result(request.key, result)
        except Exception:  # a value the codec cannot take is not worth a failed request
            log.exception("cache of %s: result not stored", self.model)
            self.stats.not_stored["error"] += 1
            return
        if not stored:
            self.stats.not_stored["too_large"] += 1
            return
        if self.semantic is not None and request.scope is not None and request.text is not None:
            try:
                await self.semantic.insert(request.scope, request.text, request.key)
            except Exception:
                self.stats.semantic_errors += 1
                log.warning("cache of %s: semantic insert failed", self.model, exc_info=True)

    async def _semantic_key(
        self, semantic: SemanticLookup, scope: bytes, text: str
    ) -> bytes | None:
        try:
            key, reason = await semantic.lookup(scope, text)
        except Exception:  # the embedder model is unloaded or failing: a miss
            self.stats.semantic_errors += 1
            log.warning("cache of %s: semantic lookup failed", self.model, exc_info=True)
            return None
        if key is None and reason is not None:
            self.stats.rejections[reason] += 1
        return key

    def semantic_entries(self) -> int | None:
        """Entries in the semantic index; None without a semantic tier."""
        if self.semantic is None:
            return None
        return self._index.size() if self._index is not None else 0

    def to_json(self) -> dict[str, object]:
        return self.stats.to_json(self.exact.store.stats(), self.semantic_entries())

    async def close(self) -> None:
        await self.exact.store.close()
        if self._index is not None:
            await self._index.close()


def _tagged(result: InferResult, status: CacheStatus, cache_s: float = 0.0) -> CachedResult:
    r = result
    return CachedResult(r.outputs, r.queue_s, r.compute_s, r.batch_size, status, cache_s)
