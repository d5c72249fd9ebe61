"""NumpyIndex: cosine search per scope, best first; bounded with the oldest evicted first."""

from __future__ import annotations

import numpy as np
import pytest

from fulcrum.cache.protocols import SemanticEntry
from fulcrum.cache.vector_index import NumpyIndex
from fulcrum.errors import InvalidInput

A, B = b"scope-a", b"scope-b"


def entry(n: int) -> SemanticEntry:
    return SemanticEntry(text=f"text {n}", key=f"key {n}".encode())


def unit(*values: float) -> np.ndarray:
    vector = np.asarray(values, dtype=np.float32)
    return vector / np.linalg.norm(vector)


async def test_nearest_is_best_first_with_cosine_similarities() -> None:
    index = NumpyIndex(10)
    await index.add(A, unit(1, 0, 0), entry(0))
    await index.add(A, unit(1, 1, 0), entry(1))
    await index.add(A, unit(0, 0, 1), entry(2))
    found = await index.nearest(A, unit(1, 0.1, 0), 3)
    assert [e for _, e in found] == [entry(0), entry(1), entry(2)]
    sims = [s for s, _ in found]
    query_norm = np.sqrt(1.01)
    assert sims == pytest.approx([1 / query_norm, 1.1 / (query_norm * np.sqrt(2)), 0.0])


async def test_k_limits_the_answer_and_zero_gives_none() -> None:
    index = NumpyIndex(10)
    for n in range(5):
        await index.add(A, unit(1, n, 0), entry(n))
    assert [e for _, e in await index.nearest(A, unit(1, 4, 0), 2)] == [entry(4), entry(3)]
    assert await index.nearest(A, unit(1, 0, 0), 0) == []


async def test_a_scope_sees_only_its_own_entries() -> None:
    index = NumpyIndex(10)
    await index.add(A, unit(1, 0), entry(0))
    await index.add(B, unit(1, 0), entry(1))
    assert [e for _, e in await index.nearest(A, unit(1, 0), 5)] == [entry(0)]
    assert [e for _, e in await index.nearest(B, unit(1, 0), 5)] == [entry(1)]
    assert await index.nearest(b"other", unit(1, 0), 5) == []


async def test_vectors_are_normalised_on_the_way_in() -> None:
    index = NumpyIndex(10)
    await index.add(A, np.array([3.0, 4.0]), entry(0))
    ((similarity, _),) = await index.nearest(A, np.array([30.0, 40.0]), 1)
    assert similarity == pytest.approx(1.0)


async def test_the_oldest_entry_is_evicted_first_across_scopes() -> None:
    index = NumpyIndex(3)
    await index.add(A, unit(1, 0), entry(0))
    await index.add(B, unit(1, 0), entry(1))
    await index.add(A, unit(1, 1), entry(2))
    await index.add(B, unit(0, 1), entry(3))  # evicts entry 0, the oldest (scope A)
    assert index.size() == 3 and index.evictions == 1
    assert [e for _, e in await index.nearest(A, unit(1, 0), 5)] == [entry(2)]
    assert {e for _, e in await index.nearest(B, unit(1, 0), 5)} == {entry(1), entry(3)}


async def test_many_evictions_keep_exactly_the_newest_entries() -> None:
    # Rows are compacted and grown as entries come and go; what stays must stay findable.
    rng = np.random.default_rng(0)
    index = NumpyIndex(37)
    vectors = rng.normal(size=(500, 8)).astype(np.float32)
    for n, vector in enumerate(vectors):
        await index.add(A if n % 3 else B, vector, entry(n))
    assert index.size() == 37 and index.evictions == 463
    for n in range(463, 500):
        ((similarity, found),) = await index.nearest(A if n % 3 else B, vectors[n], 1)
        assert found == entry(n) and similarity == pytest.approx(1.0, abs=1e-5)
    kept_a = await index.nearest(A, vectors[499], 100)
    assert {e for _, e in kept_a} == {entry(n) for n in range(463, 500) if n % 3}


async def test_ten_thousand_entries_search_exactly() -> None:
    rng = np.random.default_rng(1)
    vectors = rng.normal(size=(10_000, 384)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    index = NumpyIndex(10_000)
    for n, vector in enumerate(vectors):
        await index.add(A, vector, entry(n))
    query = vectors[1234] + 0.01 * rng.normal(size=384).astype(np.float32)
    found = await index.nearest(A, query, 5)
    expected = np.argsort(-(vectors @ (query / np.linalg.norm(query))))[:5]
    assert [e for _, e in found] == [entry(int(n)) for n in expected]


async def test_a_vector_of_another_size_or_zero_length_is_refused() -> None:
    index = NumpyIndex(4)
    await index.add(A, unit(1, 0, 0), entry(0))
    with pytest.raises(InvalidInput, match="2 dimensions; this index holds 3"):
        await index.add(A, unit(1, 0), entry(1))
    with pytest.raises(InvalidInput, match="zero or non-finite"):
        await index.nearest(A, np.zeros(3), 1)
    with pytest.raises(InvalidInput, match="max_entries"):
        NumpyIndex(0)


async def test_close_empties_the_index() -> None:
    index = NumpyIndex(4)
    await index.add(A, unit(1, 0), entry(0))
    await index.close()
    assert index.size() == 0 and await index.nearest(A, unit(1, 0), 1) == []
