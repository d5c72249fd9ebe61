"""Builds a model's cache from its `[cache]` settings: the store (in process or Redis), and for
the semantic tier the vector index, the embedder and the verifier. Redis and the semantic
modules are imported only when a model's settings name them."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from fulcrum.cache.memory_store import MemoryStore
from fulcrum.cache.protocols import Verdict
from fulcrum.cache.tiered import ModelCache
from fulcrum.errors import ConfigError

if TYPE_CHECKING:
    from fulcrum.cache.protocols import Embedder, Store, VectorIndex, Verifier
    from fulcrum.cache.settings import CacheSettings

EmbedderFor = Callable[[str], "Embedder"]  # the embedder served by the named model


class AcceptAll:
    """`semantic_verifier = "off"`: similarity alone decides (measured unsafe; see README)."""

    def __call__(self, query: str, candidate: str) -> Verdict:
        return Verdict(True)


def build_model_cache(model: str, settings: CacheSettings, embedder_for: EmbedderFor) -> ModelCache:
    """The cache of `model` as its settings describe it (nothing connects until first used)."""
    store = build_store(model, settings)
    if not settings.semantic:
        return ModelCache(model, settings, store)
    from fulcrum.cache.semantic import SemanticTier

    index = build_index(model, settings)
    embedder = embedder_for(settings.semantic_embedder)
    semantic = SemanticTier(settings, index, embedder, build_verifier(settings))
    return ModelCache(model, settings, store, semantic, index)


def build_store(model: str, settings: CacheSettings) -> Store:
    if not settings.is_redis:
        return MemoryStore(settings.max_bytes)
    from fulcrum.cache.redis_store import RedisStore

    return RedisStore(
        settings.backend,
        timeout_s=settings.redis_timeout_s,
        namespace=model,
        max_value_bytes=settings.max_value_bytes,
    )


def build_index(model: str, settings: CacheSettings) -> VectorIndex:
    if not settings.is_redis:
        from fulcrum.cache.vector_index import NumpyIndex

        index: VectorIndex = NumpyIndex(settings.semantic_max_entries)
        return index
    from fulcrum.cache.redis_index import RedisVectorIndex

    return RedisVectorIndex(
        settings.backend,
        timeout_s=settings.redis_timeout_s,
        max_entries=settings.semantic_max_entries,
        namespace=model,
    )


def build_verifier(settings: CacheSettings) -> Verifier:
    if settings.semantic_verifier == "off":
        return AcceptAll()
    if settings.semantic_verifier != "rules":
        raise ConfigError(
            f"key 'cache.semantic_verifier' = {settings.semantic_verifier!r}: a model as verifier "
            "is not supported yet; use 'rules' or 'off'"
        )
    from fulcrum.cache.verifier import RulesVerifier

    return RulesVerifier()
