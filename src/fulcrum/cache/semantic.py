"""The semantic tier: a request's text is embedded, the nearest cached texts of the same scope
above the similarity threshold are candidates, and the first the verifier accepts answers with
its exact-tier key. Counts lookups, hits, below-threshold misses and rejections by reason."""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from fulcrum.cache.protocols import Embedder, SemanticEntry, VectorIndex, Verifier

if TYPE_CHECKING:
    from fulcrum.cache.settings import CacheSettings
    from fulcrum.types import Array

# From `fulcrum cache calibrate --fit dev` on the shipped pairs with MiniLM (benchmarks/
# RESULTS.md): the lowest threshold keeping false hits <= 1% of hard near misses on two thirds of
# the pairs (held-out third: 50.9% of paraphrases hit, 1.3% of near misses served).
DEFAULT_THRESHOLD = 0.815  # with the rules verifier
# Without a verifier no threshold is safe: at 0.99 MiniLM still serves 10% of near misses (swapped
# roles score 0.996) and catches 9% of paraphrases. The highest useful value, not a safe one.
DEFAULT_THRESHOLD_UNVERIFIED = 0.99
NUM_CANDIDATES = 4  # a rejected nearest entry may hide an acceptable second one
_MEMO_TEXTS = 256  # the miss path embeds a text at lookup and again at insert: once is enough


def threshold_for(settings: CacheSettings) -> float:
    """The configured threshold, or the calibrated default for the configured verifier."""
    if settings.semantic_threshold > 0:
        return settings.semantic_threshold
    return (
        DEFAULT_THRESHOLD_UNVERIFIED if settings.semantic_verifier == "off" else DEFAULT_THRESHOLD
    )


@dataclass(frozen=True, slots=True)
class SemanticStats:
    lookups: int
    hits: int
    below_threshold: int  # no cached text of the scope was similar enough
    rejections: dict[str, int]  # a similar text the verifier refused, by its reason
    inserts: int


class SemanticTier:
    """Lookups and inserts of one model's semantic tier (all its scopes share the index)."""

    def __init__(
        self,
        settings: CacheSettings,
        index: VectorIndex,
        embedder: Embedder,
        verifier: Verifier,
        *,
        num_candidates: int = NUM_CANDIDATES,
    ) -> None:
        self.threshold = threshold_for(settings)
        self._index = index
        self._embedder = embedder
        self._verifier = verifier
        self._num_candidates = num_candidates
        self._memo: OrderedDict[str, Array] = OrderedDict()
        self._lookups = 0
        self._hits = 0
        self._below_threshold = 0
        self._inserts = 0
        self._rejections: Counter[str] = Counter()

    async def lookup(self, scope: bytes, text: str) -> tuple[bytes | None, str | None]:
        """(key, None) on a hit; (None, reason) when the verifier refused every similar text;
        (None, None) when none was similar enough."""
        self._lookups += 1
        vector = await self._embed(text)
        candidates = await self._index.nearest(scope, vector, self._num_candidates)
        reason: str | None = None
        for similarity, entry in candidates:  # best first
            if similarity < self.threshold:
                break
            verdict = self._verifier(text, entry.text)
            if verdict.ok:
                self._hits += 1
                return entry.key, None
            reason = reason or verdict.reason or "rejected"
        if reason is None:
            self._below_threshold += 1
        else:
            self._rejections[reason] += 1
        return None, reason

    async def insert(self, scope: bytes, text: str, key: bytes) -> None:
        """Index `text` under `key`, unless the scope already holds this very text and key."""
        vector = await self._embed(text)
        nearest = await self._index.nearest(scope, vector, 1)
        if nearest and nearest[0][1] == SemanticEntry(text, key):
            return
        await self._index.add(scope, vector, SemanticEntry(text=text, key=key))
        self._inserts += 1

    def stats(self) -> SemanticStats:
        return SemanticStats(
            lookups=self._lookups,
            hits=self._hits,
            below_threshold=self._below_threshold,
            rejections=dict(self._rejections),
            inserts=self._inserts,
        )

    async def _embed(self, text: str) -> Array:
        vector = self._memo.get(text)
        if vector is not None:
            self._memo.move_to_end(text)
            return vector
        vector = np.asarray((await self._embedder([text]))[0], dtype=np.float32)
        self._memo[text] = vector
        if len(self._memo) > _MEMO_TEXTS:
            self._memo.popitem(last=False)
        return vector
