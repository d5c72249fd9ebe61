"""RedisVectorIndex against a real redis-server: nearest by cosine within a scope, the global
oldest-out bound, the local copy's staleness window, replicas sharing entries, and the fault
rules (a dead Redis answers nothing and recovers)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest
import redis.asyncio as redis_asyncio

from fulcrum.cache.breaker import CircuitBreaker
from fulcrum.cache.protocols import SemanticEntry
from fulcrum.cache.redis_index import RedisVectorIndex
from fulcrum.types import Array
from redis_fixture import RedisServer

TIMEOUT_S = 0.25
STALENESS_S = 1.0
A = b"scope-a" * 4
B = b"scope-b" * 4


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def unit(*values: float) -> Array:
    vector = np.asarray(values, dtype=np.float32)
    return vector / np.linalg.norm(vector)


def entry(name: str) -> SemanticEntry:
    return SemanticEntry(text=name, key=name.encode().ljust(32, b"."))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def make_index(server: RedisServer, clock: FakeClock, max_entries: int = 100) -> RedisVectorIndex:
    return RedisVectorIndex(
        server.url, timeout_s=TIMEOUT_S, max_entries=max_entries, namespace="m", clock=clock,
        max_staleness_s=STALENESS_S,
        breaker=CircuitBreaker(min_backoff_s=0.1, failure_threshold=1),
    )  # fmt: skip


@pytest.fixture
async def index(redis_server: RedisServer, clock: FakeClock) -> AsyncIterator[RedisVectorIndex]:
    index = make_index(redis_server, clock)
    yield index
    await index.close()


async def test_nearest_is_best_first_by_cosine(index: RedisVectorIndex) -> None:
    await index.add(A, unit(1, 0, 0), entry("x"))
    await index.add(A, unit(0, 1, 0), entry("y"))
    await index.add(A, unit(1, 1, 0), entry("xy"))
    found = await index.nearest(A, unit(1, 0.1, 0), k=2)
    assert [e.text for _, e in found] == ["x", "xy"]
    assert found[0][0] == pytest.approx(float(unit(1, 0.1, 0) @ unit(1, 0, 0)), abs=1e-6)
    assert found[0][1] == entry("x")  # key and text survive the round trip
    assert len(await index.nearest(A, unit(1, 0, 0), k=10)) == 3
    assert await index.nearest(A, unit(1, 0, 0), k=0) == []


async def test_scopes_are_searched_apart(index: RedisVectorIndex) -> None:
    await index.add(A, unit(1, 0), entry("a"))
    await index.add(B, unit(1, 0), entry("b"))
    assert [e.text for _, e in await index.nearest(A, unit(1, 0), k=5)] == ["a"]
    assert [e.text for _, e in await index.nearest(B, unit(1, 0), k=5)] == ["b"]
    assert await index.nearest(b"empty", unit(1, 0), k=5) == []


async def test_bound_drops_the_oldest_entry_of_all_scopes(
    redis_server: RedisServer, clock: FakeClock
) -> None:
    index = make_index(redis_server, clock, max_entries=3)
    try:
        await index.add(A, unit(1, 0), entry("a1"))
        await index.add(B, unit(1, 0), entry("b1"))
        await index.add(A, unit(0, 1), entry("a2"))
        await index.add(B, unit(0, 1), entry("b2"))  # a1, the oldest, goes
        assert index.size() == 3
        assert [e.text for _, e in await index.nearest(A, unit(1, 0), k=5)] == ["a2"]
        assert {e.text for _, e in await index.nearest(B, unit(1, 0), k=5)} == {"b1", "b2"}
    finally:
        await index.close()


async def test_replicas_share_entries_within_the_staleness_window(
    redis_server: RedisServer, index: RedisVectorIndex, clock: FakeClock
) -> None:
    replica = make_index(redis_server, clock)
    try:
        assert await replica.nearest(A, unit(1, 0), k=1) == []  # fetched: empty
        await index.add(A, unit(1, 0), entry("a"))
        assert await replica.nearest(A, unit(1, 0), k=1) == []  # its copy is still fresh
        assert replica.num_fetches == 1
        clock.now += STALENESS_S
        assert [e.text for _, e in await replica.nearest(A, unit(1, 0), k=1)] == ["a"]
        assert replica.num_fetches == 2
        assert replica.size() == 1
    finally:
        await replica.close()


async def test_own_adds_are_seen_without_a_fetch(index: RedisVectorIndex) -> None:
    assert await index.nearest(A, unit(1, 0), k=1) == []
    await index.add(A, unit(1, 0), entry("a"))
    assert [e.text for _, e in await index.nearest(A, unit(1, 0), k=1)] == ["a"]
    assert index.num_fetches == 1


async def test_concurrent_cold_lookups_share_one_fetch(index: RedisVectorIndex) -> None:
    await index.add(A, unit(1, 0), entry("a"))
    found = await asyncio.gather(*(index.nearest(A, unit(1, 0), k=1) for _ in range(5)))
    assert all([e.text for _, e in f] == ["a"] for f in found)
    assert index.num_fetches == 1


async def test_rows_of_another_width_are_ignored(index: RedisVectorIndex) -> None:
    await index.add(A, unit(1, 0, 0), entry("old"))
    await index.add(A, unit(1, 0), entry("new"))  # the newest row sets the width
    assert [e.text for _, e in await index.nearest(A, unit(1, 0), k=5)] == ["new"]
    assert await index.nearest(A, unit(1, 0, 0, 0), k=5) == []


async def test_vectors_are_float32_in_redis(index: RedisVectorIndex) -> None:
    await index.add(A, np.array([0.6, 0.8], dtype=np.float64), entry("a"))
    client = redis_asyncio.Redis.from_url(index.link.url)
    try:
        raw = await client.lrange(index.scope_key(A), 0, -1)
    finally:
        await client.aclose()
    assert len(raw) == 1 and np.float32(0.6).tobytes() + np.float32(0.8).tobytes() in raw[0]


async def test_dead_redis_answers_from_the_stale_copy_then_recovers(
    redis_server: RedisServer, index: RedisVectorIndex, clock: FakeClock
) -> None:
    assert await index.nearest(B, unit(1, 0), k=1) == []  # B: copied, empty
    await index.add(A, unit(1, 0), entry("a"))
    assert await index.nearest(A, unit(1, 0), k=1) != []  # A: copied
    redis_server.kill()
    clock.now += STALENESS_S
    # The refresh fails: the stale copy answers (its entries are real, maybe incomplete).
    assert [e.text for _, e in await index.nearest(A, unit(1, 0), k=1)] == ["a"]
    await index.add(A, unit(0, 1), entry("b"))  # skipped: the breaker is open
    assert index.link.num_errors == 1
    assert index.link.num_skipped == 1
    redis_server.start()  # empty: no persistence, epochs start again
    clock.now += 0.1
    await index.add(A, unit(0, 1), entry("c"))
    # The new epoch makes the next lookup fetch the whole scope: "a" is gone with the old Redis.
    assert [e.text for _, e in await index.nearest(A, unit(1, 1), k=5)] == ["c"]
    assert index.size() == 1


async def test_refresh_fetches_only_what_was_appended(
    redis_server: RedisServer, index: RedisVectorIndex, clock: FakeClock
) -> None:
    replica = make_index(redis_server, clock)
    try:
        for i in range(5):
            await index.add(A, unit(1, i), entry(f"old{i}"))
        assert len(await replica.nearest(A, unit(1, 0), k=10)) == 5
        assert replica.num_rows_fetched == 5
        await index.add(A, unit(0, 1), entry("new1"))
        await index.add(A, unit(0, 1), entry("new2"))
        clock.now += STALENESS_S
        found = await replica.nearest(A, unit(0, 1), k=10)
        assert replica.num_rows_fetched == 7  # two more, not seven
        assert {e.text for _, e in found[:2]} == {"new1", "new2"}
        assert len(found) == 7
    finally:
        await replica.close()


async def test_refresh_drops_rows_trimmed_in_redis(
    redis_server: RedisServer, clock: FakeClock
) -> None:
    writer, reader = make_index(redis_server, clock, 3), make_index(redis_server, clock, 3)
    try:
        for i in range(3):
            await writer.add(A, unit(1, i), entry(f"a{i}"))
        assert len(await reader.nearest(A, unit(1, 0), k=10)) == 3
        await writer.add(A, unit(0, 1), entry("a3"))  # a0 goes
        clock.now += STALENESS_S
        found = await reader.nearest(A, unit(1, 0), k=10)
        assert sorted(e.text for _, e in found) == ["a1", "a2", "a3"]
        assert reader.num_rows_fetched == 4
    finally:
        await writer.close()
        await reader.close()


async def test_a_late_fetch_is_a_miss_and_lands_for_the_next_lookup(
    redis_server: RedisServer, index: RedisVectorIndex
) -> None:
    writer = make_index(redis_server, FakeClock())
    try:
        await writer.add(A, unit(1, 0), entry("a"))
    finally:
        await writer.close()
    redis_server.pause()
    try:
        assert await index.nearest(A, unit(1, 0), k=1) == []  # waited the timeout, no more
        assert index.link.num_errors == 0  # late is not failed: the fetch goes on
    finally:
        redis_server.resume()
    await asyncio.gather(*index._fetching.values())
    assert [e.text for _, e in await index.nearest(A, unit(1, 0), k=1)] == ["a"]
    assert index.num_fetches == 1


async def test_too_long_text_is_not_added(redis_server: RedisServer, clock: FakeClock) -> None:
    index = RedisVectorIndex(
        redis_server.url, timeout_s=TIMEOUT_S, max_entries=10, max_text_bytes=4, clock=clock
    )
    try:
        await index.add(A, unit(1, 0), entry("long text"))
        await index.add(A, unit(1, 0), entry("ok"))
        assert [e.text for _, e in await index.nearest(A, unit(1, 0), k=5)] == ["ok"]
    finally:
        await index.close()
