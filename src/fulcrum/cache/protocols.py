"""The contracts between the cache's parts: a byte store (in process or Redis), a vector index
(numpy or Redis), an embedder and a verifier. The tiers (`exact`, `semantic`) are written
against these, so a backend is chosen by configuration, not by code."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from fulcrum.types import Array


@dataclass(frozen=True, slots=True)
class StoreStats:
    """What a store holds and has done: the cache's gauges and counters read these."""

    entries: int
    bytes: int
    evictions: int
    errors: int  # backend failures served as misses (Redis down or slow); 0 in process


class Store(Protocol):
    """Bytes by key, with a time to live. A failing backend never raises from `get`/`set`: a get
    answers None (a miss) and a set is dropped, each counted in `stats().errors`."""

    async def get(self, key: bytes) -> bytes | None: ...

    async def set(self, key: bytes, value: bytes, ttl_s: float | None) -> None: ...

    def stats(self) -> StoreStats: ...

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class SemanticEntry:
    """One cached request as the semantic tier knows it: its text and the exact-tier key under
    which its result is stored."""

    text: str
    key: bytes


class VectorIndex(Protocol):
    """Unit vectors per scope (model, version, variant, parameters and tenant hashed): `nearest`
    searches only the scope it is given, so no entry leaks across tenants or parameters."""

    async def add(self, scope: bytes, vector: Array, entry: SemanticEntry) -> None: ...

    async def nearest(
        self, scope: bytes, vector: Array, k: int
    ) -> list[tuple[float, SemanticEntry]]: ...  # (cosine similarity, entry), best first

    def size(self) -> int: ...

    async def close(self) -> None: ...


class Embedder(Protocol):
    """Texts to unit-length float32 vectors, one row per text (the served MiniLM by default)."""

    async def __call__(self, texts: list[str]) -> Array: ...


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether a cached text may answer a new one; `reason` names the difference found
    (`number`, `negation`, `antonym`, `entity`, `scope`, `order`, ...) when it may not."""

    ok: bool
    reason: str | None = None


class Verifier(Protocol):
    def __call__(self, query: str, candidate: str) -> Verdict: ...
