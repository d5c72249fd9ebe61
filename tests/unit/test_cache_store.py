"""The in-process store: least recently used out first within a byte budget, entries expire
after their TTL (a fake clock, no sleeps), a value that cannot fit is refused."""

from __future__ import annotations

from fulcrum.cache.memory_store import ENTRY_OVERHEAD_BYTES, MemoryStore
from fulcrum.cache.protocols import Store
from fulcrum.types import FakeClock


def size(key: bytes, value: bytes) -> int:
    return len(key) + len(value) + ENTRY_OVERHEAD_BYTES


async def test_it_is_a_store() -> None:
    store: Store = MemoryStore(1 << 20)
    await store.set(b"k", b"v", None)
    assert await store.get(b"k") == b"v"
    assert await store.get(b"other") is None
    stats = store.stats()
    assert (stats.entries, stats.bytes) == (1, size(b"k", b"v"))
    assert (stats.evictions, stats.errors) == (0, 0)


def test_the_least_recently_used_goes_first_when_over_budget() -> None:
    value = b"x" * 100
    store = MemoryStore(3 * size(b"a", value))
    for k in (b"a", b"b", b"c"):
        store.set_now(k, value, None)
    assert store.get_now(b"a") == value  # "a" is now the most recently used
    store.set_now(b"d", value, None)
    assert store.get_now(b"b") is None
    assert [store.get_now(k) is not None for k in (b"a", b"c", b"d")] == [True, True, True]
    assert store.stats().evictions == 1
    assert store.stats().bytes <= store.max_bytes


def test_the_budget_counts_bytes_not_entries() -> None:
    store = MemoryStore(size(b"a", b"x" * 1000) + size(b"b", b"y"))
    store.set_now(b"a", b"x" * 1000, None)
    store.set_now(b"b", b"y", None)
    assert store.stats().entries == 2
    store.set_now(b"c", b"z" * 500, None)  # room only by evicting the large one
    assert store.get_now(b"a") is None and store.get_now(b"c") == b"z" * 500


def test_a_value_that_can_never_fit_is_refused_and_keeps_the_rest() -> None:
    store = MemoryStore(1000)
    store.set_now(b"small", b"s", None)
    store.set_now(b"huge", b"h" * 2000, None)
    assert store.get_now(b"huge") is None
    assert store.get_now(b"small") == b"s"
    assert store.stats().evictions == 0


def test_overwriting_a_key_replaces_its_size() -> None:
    store = MemoryStore(1 << 20)
    store.set_now(b"k", b"x" * 100, None)
    store.set_now(b"k", b"y", None)
    assert store.get_now(b"k") == b"y"
    assert store.stats().bytes == size(b"k", b"y") and store.stats().entries == 1


def test_entries_expire_after_their_ttl() -> None:
    clock = FakeClock()
    store = MemoryStore(1 << 20, clock)
    store.set_now(b"short", b"1", 10.0)
    store.set_now(b"forever", b"2", None)
    clock.advance(9.9)
    assert store.get_now(b"short") == b"1"
    clock.advance(0.1)
    assert store.get_now(b"short") is None
    assert store.stats().entries == 1  # the expired entry is gone, not just hidden
    clock.advance(1e9)
    assert store.get_now(b"forever") == b"2"


def test_an_expired_entry_pushed_out_is_not_counted_as_an_eviction() -> None:
    clock = FakeClock()
    value = b"x" * 100
    store = MemoryStore(2 * size(b"a", value), clock)
    store.set_now(b"a", value, 1.0)
    store.set_now(b"b", value, None)
    clock.advance(2.0)
    store.set_now(b"c", value, None)
    assert store.get_now(b"a") is None and store.get_now(b"b") == value
    assert store.stats().evictions == 0


async def test_close_drops_everything() -> None:
    store = MemoryStore(1 << 20)
    store.set_now(b"k", b"v", None)
    await store.close()
    assert store.get_now(b"k") is None and store.stats().bytes == 0
