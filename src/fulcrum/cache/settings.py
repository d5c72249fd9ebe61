"""The `[cache]` table of a model's `config.toml`: which tiers run, where entries live and how
long, parsed once at load into a frozen struct every tier reads (absent table: no caching)."""

from __future__ import annotations

import math

import msgspec

from fulcrum.errors import ConfigError

MEMORY_BACKEND = "memory"
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
VERIFIERS_BUILT_IN = ("rules", "off")
# Beyond these a value is a typo, not a setting: a terabyte in process, a year's TTL, a Redis
# call allowed a minute (the point of the timeout is that a slow cache is a miss, not a wait).
MAX_BYTES_LIMIT = 1 << 40
MAX_TTL_S = 366 * 24 * 3600.0
MAX_REDIS_TIMEOUT_MS = 60_000.0
MAX_SEMANTIC_ENTRIES = 10_000_000


class CacheSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One model's cache settings (see README, "Result cache")."""

    exact: bool = True
    semantic: bool = False
    backend: str = MEMORY_BACKEND  # "memory" or a Redis URL
    max_bytes: int = 64 * 1024 * 1024  # in-process budget, LRU by bytes
    ttl_s: float = 3600.0  # 0: no expiry
    redis_timeout_ms: float = 5.0  # a slower Redis call is a miss
    semantic_threshold: float = 0.0  # 0.0: the calibrated default (cache.semantic)
    semantic_embedder: str = "minilm"
    semantic_verifier: str = "rules"  # "rules", "off" or a model name
    semantic_max_entries: int = 10_000
    semantic_sampled: bool = False  # semantic hits for LLM requests with temperature > 0

    @property
    def is_redis(self) -> bool:
        return self.backend != MEMORY_BACKEND

    @property
    def redis_timeout_s(self) -> float:
        return self.redis_timeout_ms / 1000.0

    @property
    def ttl(self) -> float | None:
        """The TTL a store takes: None for no expiry."""
        return self.ttl_s if self.ttl_s > 0 else None

    @property
    def max_value_bytes(self) -> int:
        """The largest value worth caching: one bigger would evict an eighth of the cache."""
        return self.max_bytes // 8


def validate_cache(settings: CacheSettings) -> None:
    """Checks msgspec's types cannot express; each error names the key and the bad value."""
    _check_backend(settings.backend)
    if not 1 <= settings.max_bytes <= MAX_BYTES_LIMIT:
        raise ConfigError(
            f"key 'cache.max_bytes' = {settings.max_bytes}: must lie in 1..{MAX_BYTES_LIMIT}"
        )
    if not 0 <= settings.ttl_s <= MAX_TTL_S:  # NaN and inf too
        raise ConfigError(
            f"key 'cache.ttl_s' = {settings.ttl_s}: must lie in 0..{MAX_TTL_S:g} (0: no expiry)"
        )
    if not 0 < settings.redis_timeout_ms <= MAX_REDIS_TIMEOUT_MS:
        raise ConfigError(
            f"key 'cache.redis_timeout_ms' = {settings.redis_timeout_ms}: "
            f"must lie in (0, {MAX_REDIS_TIMEOUT_MS:g}]"
        )
    if not 0 <= settings.semantic_threshold <= 1 or math.isnan(settings.semantic_threshold):
        raise ConfigError(
            f"key 'cache.semantic_threshold' = {settings.semantic_threshold}: "
            "must lie in 0..1 (0: the calibrated default)"
        )
    if not 1 <= settings.semantic_max_entries <= MAX_SEMANTIC_ENTRIES:
        raise ConfigError(
            f"key 'cache.semantic_max_entries' = {settings.semantic_max_entries}: "
            f"must lie in 1..{MAX_SEMANTIC_ENTRIES}"
        )
    _check_model_ref("semantic_embedder", settings.semantic_embedder)
    if settings.semantic_verifier not in VERIFIERS_BUILT_IN:
        _check_model_ref("semantic_verifier", settings.semantic_verifier)
    if not settings.exact and not settings.semantic:
        raise ConfigError("key 'cache': exact and semantic are both false; drop the table instead")


def _check_backend(backend: str) -> None:
    if backend == MEMORY_BACKEND:
        return
    if not backend.startswith(REDIS_SCHEMES) or len(backend) <= len("redis://"):
        raise ConfigError(
            f"key 'cache.backend' = {backend!r}: expected 'memory' or a Redis URL "
            "('redis://host:port/db')"
        )


def _check_model_ref(key: str, name: str) -> None:
    # Imported here: config.py imports this module for ModelConfig.cache.
    from fulcrum.config import check_model_name

    try:
        check_model_name(name)
    except ConfigError:
        raise ConfigError(f"key 'cache.{key}' = {name!r}: not a model name") from None
