"""SemanticTier with a fake embedder: the threshold, the verifier's refusals and their reasons,
scope isolation, the calibrated defaults and the counters."""

from __future__ import annotations

import numpy as np

from fulcrum.cache.protocols import Verdict, Verifier
from fulcrum.cache.semantic import (
    DEFAULT_THRESHOLD,
    DEFAULT_THRESHOLD_UNVERIFIED,
    SemanticStats,
    SemanticTier,
    threshold_for,
)
from fulcrum.cache.settings import CacheSettings
from fulcrum.cache.vector_index import NumpyIndex
from fulcrum.cache.verifier import RulesVerifier
from fulcrum.types import Array

SCOPE, OTHER = b"model/1/tenant-a", b"model/1/tenant-b"


def at_angle(cosine: float) -> Array:
    """A unit vector whose cosine with (1, 0) is `cosine`."""
    return np.array([cosine, np.sqrt(1 - cosine**2)], dtype=np.float32)


class FakeEmbedder:
    """Texts to the vectors it was given; counts the texts it embedded."""

    def __init__(self, vectors: dict[str, Array]) -> None:
        self.vectors = vectors
        self.embedded: list[str] = []

    async def __call__(self, texts: list[str]) -> Array:
        self.embedded += texts
        return np.stack([self.vectors[t] for t in texts])


class RefuseTexts:
    """A verifier refusing candidates whose text it names, with the reason given."""

    def __init__(self, refused: dict[str, str]) -> None:
        self.refused = refused
        self.calls: list[tuple[str, str]] = []

    def __call__(self, query: str, candidate: str) -> Verdict:
        self.calls.append((query, candidate))
        reason = self.refused.get(candidate)
        return Verdict(ok=reason is None, reason=reason)


def tier(
    vectors: dict[str, Array], verifier: Verifier | None = None, threshold: float = 0.9
) -> tuple[SemanticTier, FakeEmbedder, NumpyIndex]:
    settings = CacheSettings(semantic=True, semantic_threshold=threshold)
    embedder = FakeEmbedder(vectors)
    index = NumpyIndex(100)
    chosen = verifier if verifier is not None else RefuseTexts({})
    return SemanticTier(settings, index, embedder, chosen), embedder, index


async def test_a_similar_enough_text_hits_with_its_key() -> None:
    semantic, _, _ = tier({"cached": at_angle(1.0), "query": at_angle(0.95)})
    await semantic.insert(SCOPE, "cached", b"k1")
    assert await semantic.lookup(SCOPE, "query") == (b"k1", None)
    assert semantic.stats() == SemanticStats(1, 1, 0, {}, 1)


async def test_below_the_threshold_is_a_plain_miss() -> None:
    semantic, _, _ = tier({"cached": at_angle(1.0), "query": at_angle(0.85)})
    await semantic.insert(SCOPE, "cached", b"k1")
    assert await semantic.lookup(SCOPE, "query") == (None, None)
    assert semantic.stats().below_threshold == 1 and semantic.stats().hits == 0


async def test_the_threshold_is_inclusive() -> None:
    semantic, _, _ = tier({"cached": at_angle(1.0), "query": at_angle(0.9)}, threshold=0.9)
    await semantic.insert(SCOPE, "cached", b"k1")
    assert (await semantic.lookup(SCOPE, "query"))[0] == b"k1"


async def test_a_refused_candidate_is_a_miss_with_its_reason() -> None:
    verifier = RefuseTexts({"cached": "order"})
    semantic, _, _ = tier({"cached": at_angle(1.0), "query": at_angle(0.99)}, verifier)
    await semantic.insert(SCOPE, "cached", b"k1")
    assert await semantic.lookup(SCOPE, "query") == (None, "order")
    assert verifier.calls == [("query", "cached")]  # the new text is the query
    assert semantic.stats().rejections == {"order": 1}


async def test_the_next_candidate_may_answer_when_the_nearest_is_refused() -> None:
    verifier = RefuseTexts({"nearest": "number"})
    vectors = {"nearest": at_angle(0.99), "second": at_angle(0.95), "query": at_angle(1.0)}
    semantic, _, _ = tier(vectors, verifier)
    await semantic.insert(SCOPE, "second", b"k2")
    await semantic.insert(SCOPE, "nearest", b"k1")
    assert await semantic.lookup(SCOPE, "query") == (b"k2", None)
    assert semantic.stats().rejections == {}


async def test_candidates_below_the_threshold_are_never_verified() -> None:
    verifier = RefuseTexts({})
    semantic, _, _ = tier({"cached": at_angle(1.0), "query": at_angle(0.5)}, verifier)
    await semantic.insert(SCOPE, "cached", b"k1")
    await semantic.lookup(SCOPE, "query")
    assert verifier.calls == []


async def test_the_rules_verifier_refuses_swapped_roles() -> None:
    vectors = {"Convert USD to EUR": at_angle(1.0), "Convert EUR to USD": at_angle(0.99)}
    semantic, _, _ = tier(vectors, RulesVerifier())
    await semantic.insert(SCOPE, "Convert USD to EUR", b"k1")
    assert await semantic.lookup(SCOPE, "Convert EUR to USD") == (None, "order")


async def test_another_scope_never_answers() -> None:
    semantic, _, _ = tier({"cached": at_angle(1.0)})
    await semantic.insert(OTHER, "cached", b"k1")
    assert await semantic.lookup(SCOPE, "cached") == (None, None)
    assert (await semantic.lookup(OTHER, "cached"))[0] == b"k1"


async def test_a_miss_then_its_insert_embed_the_text_once() -> None:
    semantic, embedder, _ = tier({"query": at_angle(1.0)})
    await semantic.lookup(SCOPE, "query")
    await semantic.insert(SCOPE, "query", b"k1")
    assert embedder.embedded == ["query"]


async def test_the_same_text_and_key_are_indexed_once() -> None:
    semantic, _, index = tier({"text": at_angle(1.0)})
    await semantic.insert(SCOPE, "text", b"k1")
    await semantic.insert(SCOPE, "text", b"k1")
    await semantic.insert(OTHER, "text", b"k1")  # another scope is another entry
    assert index.size() == 2 and semantic.stats().inserts == 2


def test_zero_means_the_calibrated_default_for_the_verifier() -> None:
    assert threshold_for(CacheSettings(semantic=True)) == DEFAULT_THRESHOLD
    off = CacheSettings(semantic=True, semantic_verifier="off")
    assert threshold_for(off) == DEFAULT_THRESHOLD_UNVERIFIED
    assert threshold_for(CacheSettings(semantic=True, semantic_threshold=0.7)) == 0.7
    assert 0.5 < DEFAULT_THRESHOLD < DEFAULT_THRESHOLD_UNVERIFIED < 1
