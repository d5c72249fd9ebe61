"""RedisStore against a real redis-server: bytes, TTL, namespaces, value bound, and the fault
rules — a paused or killed Redis is a miss within the timeout, skipped while the breaker is
open, and used again once it is back."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as redis_asyncio

from fulcrum.cache.breaker import CircuitBreaker
from fulcrum.cache.redis_store import RedisStore
from fulcrum.errors import ConfigError
from redis_fixture import RedisServer

KEY = bytes(range(32))
TIMEOUT_S = 0.25
# A paused Redis must cost one timeout, not a hang: this bound is the behaviour (the timeout is
# enforced), far above TIMEOUT_S so a busy machine does not fail it.
HANG_BOUND_S = 2.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def store(redis_server: RedisServer, clock: FakeClock) -> AsyncIterator[RedisStore]:
    store = RedisStore(
        redis_server.url, timeout_s=TIMEOUT_S, namespace="m", clock=clock,
        breaker=CircuitBreaker(min_backoff_s=0.1, max_backoff_s=1.0, failure_threshold=1),
    )  # fmt: skip
    yield store
    await store.close()


@pytest.fixture
async def raw(redis_server: RedisServer) -> AsyncIterator[redis_asyncio.Redis]:
    client = redis_asyncio.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


async def test_set_then_get_round_trips_bytes(store: RedisStore) -> None:
    assert await store.get(KEY) is None
    await store.set(KEY, b"\x00result\xff", ttl_s=None)
    assert await store.get(KEY) == b"\x00result\xff"
    assert await store.get(KEY[::-1]) is None
    assert store.stats().errors == 0


async def test_keys_are_namespaced_hex(store: RedisStore, raw: redis_asyncio.Redis) -> None:
    await store.set(KEY, b"v", ttl_s=None)
    assert await raw.get(b"fulcrum:m:" + KEY.hex().encode()) == b"v"
    assert await raw.dbsize() == 1


async def test_namespaces_do_not_share_entries(
    redis_server: RedisServer, store: RedisStore
) -> None:
    other = RedisStore(redis_server.url, timeout_s=TIMEOUT_S, namespace="other")
    try:
        await store.set(KEY, b"mine", ttl_s=None)
        assert await other.get(KEY) is None
        await other.set(KEY, b"theirs", ttl_s=None)
        assert await store.get(KEY) == b"mine"
        assert await other.get(KEY) == b"theirs"
    finally:
        await other.close()


async def test_ttl_is_set_in_milliseconds(store: RedisStore, raw: redis_asyncio.Redis) -> None:
    name = store.redis_key(KEY)
    await store.set(KEY, b"v", ttl_s=0.25)
    assert 0 < await raw.pttl(name) <= 250
    await store.set(KEY, b"v", ttl_s=3600.0)
    assert 3_500_000 < await raw.pttl(name) <= 3_600_000
    await store.set(KEY, b"v", ttl_s=None)
    assert await raw.pttl(name) == -1  # no expiry
    await store.set(KEY, b"v", ttl_s=0.0)
    assert await raw.pttl(name) == -1  # 0 means no expiry, as in the config


async def test_expired_entry_is_a_miss(store: RedisStore, raw: redis_asyncio.Redis) -> None:
    await store.set(KEY, b"v", ttl_s=3600.0)
    await raw.pexpire(store.redis_key(KEY), 1)  # expire now, server side: no sleep here
    deadline = time.monotonic() + HANG_BOUND_S
    while await raw.exists(store.redis_key(KEY)) and time.monotonic() < deadline:
        await asyncio.sleep(0)
    assert await store.get(KEY) is None


async def test_oversized_value_is_not_stored(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url, timeout_s=TIMEOUT_S, namespace="m", max_value_bytes=8)
    try:
        await store.set(KEY, b"12345678", ttl_s=None)
        await store.set(KEY[::-1], b"123456789", ttl_s=None)
        assert await store.get(KEY) == b"12345678"
        assert await store.get(KEY[::-1]) is None
        assert store.num_oversized == 1
        assert store.stats().errors == 0
    finally:
        await store.close()


async def test_paused_redis_is_a_bounded_miss_then_skipped(
    redis_server: RedisServer, store: RedisStore, clock: FakeClock
) -> None:
    await store.set(KEY, b"v", ttl_s=None)
    redis_server.pause()
    try:
        start = time.perf_counter()
        assert await store.get(KEY) is None
        assert time.perf_counter() - start < HANG_BOUND_S
        await store.set(KEY, b"w", ttl_s=None)  # dropped without a call: the breaker is open
        assert await store.get(KEY) is None
        assert store.stats().errors == 1
        assert store.link.num_skipped == 2
    finally:
        redis_server.resume()
    clock.now += 0.1  # the back-off has passed: the next call probes and succeeds
    assert await store.get(KEY) == b"v"
    assert store.stats().errors == 1


async def test_killed_and_restarted_redis_reconnects(
    redis_server: RedisServer, store: RedisStore, clock: FakeClock
) -> None:
    await store.set(KEY, b"v", ttl_s=None)
    assert await store.get(KEY) == b"v"  # a pooled connection exists
    redis_server.kill()
    assert await store.get(KEY) is None
    clock.now += 0.1
    assert await store.get(KEY) is None  # the probe fails: still down
    assert store.stats().errors == 2
    assert store.link.breaker.backoff_s == 0.2
    redis_server.start()  # same port, empty (no persistence)
    assert await store.get(KEY) is None  # skipped: the back-off has not passed
    assert store.link.num_skipped == 1
    clock.now += 0.2
    await store.set(KEY, b"again", ttl_s=None)
    assert await store.get(KEY) == b"again"
    assert store.stats().errors == 2
    assert not store.link.breaker.is_open


async def test_cancelled_caller_does_not_count_as_a_redis_failure(
    redis_server: RedisServer, store: RedisStore
) -> None:
    await store.set(KEY, b"v", ttl_s=None)
    redis_server.pause()
    try:
        task = asyncio.get_running_loop().create_task(store.get(KEY))
        await asyncio.sleep(0)  # let it send the command
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert store.stats().errors == 0
        assert not store.link.breaker.is_open
    finally:
        redis_server.resume()
    assert await store.get(KEY) == b"v"


async def test_stats_read_the_database(store: RedisStore) -> None:
    for i in range(3):
        await store.set(bytes([i]) * 32, b"x" * 100, ttl_s=None)
    await store.refresh_stats()
    stats = store.stats()
    assert stats.entries == 3
    assert stats.bytes > 300  # Redis's used memory: at least the values
    assert stats.evictions == 0
    assert stats.errors == 0


async def test_stats_refresh_runs_on_traffic(store: RedisStore, clock: FakeClock) -> None:
    await store.set(KEY, b"v", ttl_s=None)
    assert store._stats_task is None  # not yet: the first refresh is an interval after start
    assert store.stats().entries == 0
    clock.now += 10.0
    assert await store.get(KEY) == b"v"
    await store._stats_task
    assert store.stats().entries == 1


async def test_unreachable_url_is_a_miss_until_the_breaker_skips_it() -> None:
    store = RedisStore("redis://127.0.0.1:1/0", timeout_s=TIMEOUT_S, namespace="m")
    try:
        assert await store.get(KEY) is None
        await store.set(KEY, b"v", ttl_s=None)
        assert await store.get(KEY) is None  # the third failure in a row opens the breaker
        assert await store.get(KEY) is None
        assert store.stats().errors == 3
        assert store.link.num_skipped == 1
    finally:
        await store.close()


async def test_calls_in_flight_are_bounded(redis_server: RedisServer, clock: FakeClock) -> None:
    store = RedisStore(
        redis_server.url, timeout_s=TIMEOUT_S, namespace="m", clock=clock,
        breaker=CircuitBreaker(failure_threshold=100),
    )  # fmt: skip
    store.link.max_in_flight = 2
    await store.set(KEY, b"v", ttl_s=None)
    redis_server.pause()
    try:
        # Late calls keep running (their connection is reused once Redis answers), so the
        # bound, not the breaker, is what stops them piling up here.
        assert [await store.get(KEY) for _ in range(3)] == [None, None, None]
        assert store.stats().errors == 2
        assert store.link.num_skipped == 1
    finally:
        redis_server.resume()
    await asyncio.gather(*store.link._tasks)  # the late calls finish once Redis answers
    assert await store.get(KEY) == b"v"
    await store.close()


def test_missing_redis_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "redis.asyncio", None)  # import fails as if absent
    with pytest.raises(ConfigError, match=r"Redis cache backend needs redis: pip install "):
        RedisStore("redis://127.0.0.1:1/0", timeout_s=TIMEOUT_S, namespace="m")
