"""The service's caches: one per model whose config has a `[cache]` table, and each loaded
servable's identity (its model, version, variant and files). A reload with other settings
builds a new cache; an unloaded model's cache is closed and its entries dropped (in process)
or left unreachable (Redis, until their TTL)."""

from __future__ import annotations

import asyncio
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from fulcrum.cache.factory import EmbedderFor, build_model_cache
from fulcrum.cache.key import LoadIdentity, files_fingerprint, load_identity

if TYPE_CHECKING:
    from fulcrum.cache.tiered import ModelCache
    from fulcrum.config import ModelConfig


class CacheRegistry:
    """Model caches by model name; load identities by servable (held weakly: an unloaded
    servable's identity goes with it)."""

    def __init__(self, embedder_for: EmbedderFor) -> None:
        self._embedder_for = embedder_for
        self._models: dict[str, ModelCache] = {}
        self._loads: weakref.WeakKeyDictionary[object, LoadIdentity] = weakref.WeakKeyDictionary()

    async def bind(
        self, config: ModelConfig, version: int, variant: str, version_dir: Path, servable: object
    ) -> None:
        """Give a newly loaded servable its cache (or none, without a `[cache]` table)."""
        if config.cache is None:
            await self.drop(config.name)
            return
        cache = self._models.get(config.name)
        if cache is None or cache.settings != config.cache:
            self._models[config.name] = build_model_cache(
                config.name, config.cache, self._embedder_for
            )
            if cache is not None:
                await cache.close()
        # Off the loop: a model folder may hold many files.
        fingerprint = await asyncio.to_thread(
            files_fingerprint, msgspec.json.encode(config), version_dir
        )
        self._loads[servable] = load_identity(config.name, version, variant, fingerprint)

    def lookup(self, servable: object) -> tuple[ModelCache, LoadIdentity] | None:
        identity = self._loads.get(servable)
        if identity is None:
            return None
        cache = self._models.get(identity.model)
        return None if cache is None else (cache, identity)

    def model(self, name: str) -> ModelCache | None:
        return self._models.get(name)

    def items(self) -> list[tuple[str, ModelCache]]:
        return sorted(self._models.items())

    async def drop(self, name: str) -> None:
        cache = self._models.pop(name, None)
        if cache is not None:
            await cache.close()

    async def close(self) -> None:
        for name in list(self._models):
            await self.drop(name)
