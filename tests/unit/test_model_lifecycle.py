"""The lifecycle manager with a fake clock, a fake loader and a fake memory probe: idle unloads,
lazy loads with requests parked (not failed), one load for concurrent first requests, failed
loads and their backoff, the memory budget's LRU eviction, and the user's own load and unload."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from lifecycle_fakes import MB, World, make_model, park

from fulcrum.context import RequestContext, internal_context
from fulcrum.errors import DeadlineExceeded, InvalidInput, NotFound, Unavailable
from fulcrum.lifecycle.manager import FIRST_RETRY_S


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    make_model(tmp_path, "a")
    w = World(tmp_path)
    await w.life.start(None)
    yield w
    await w.life.stop()
    await w.repo.close()


# --- idle unload -------------------------------------------------------------------------------


async def test_idle_model_unloads_after_its_idle_time_not_before(world: World) -> None:
    servable = world.loader.last("a")
    world.clock.advance(9.9)
    assert await world.life.sweep() == pytest.approx(110.0)
    assert not world.repo.is_parked("a") and not servable.stopped
    world.clock.advance(0.1)
    await world.life.sweep()
    assert world.repo.is_parked("a")
    assert servable.stopped  # its memory released: instances closed, engine stopped
    assert world.state("a") == ("UNAVAILABLE", "unloaded (idle)")
    assert world.metric("fulcrum_model_unloads_total", model="a", reason="idle") == 1.0
    assert world.metric("fulcrum_model_memory_bytes", model="a") == 0.0
    assert world.life.stats_json("a") == {
        "cold_start": {"count": 0, "ns": 0}, "cold_start_failures": 0, "idle_unloads": 1,
        "evictions": 0, "memory_bytes": 100 * MB,
    }  # fmt: skip


async def test_a_request_restarts_the_idle_countdown(world: World) -> None:
    world.clock.advance(8.0)
    await world.life.ensure_loaded(internal_context(), "a")
    world.clock.advance(8.0)
    await world.life.sweep()
    assert not world.repo.is_parked("a")
    world.clock.advance(2.0)
    await world.life.sweep()
    assert world.repo.is_parked("a")


async def test_model_with_requests_in_flight_is_not_unloaded(world: World) -> None:
    servable = world.loader.last("a")
    servable.num_admitted = 1
    world.clock.advance(100.0)
    await world.life.sweep()
    assert not world.repo.is_parked("a")
    servable.num_admitted = 0  # the request ends: idle time counts from (about) here
    world.clock.advance(5.0)
    await world.life.sweep()
    assert not world.repo.is_parked("a")
    world.clock.advance(5.0)
    await world.life.sweep()
    assert world.repo.is_parked("a")


async def test_model_without_idle_time_never_unloads(tmp_path: Path) -> None:
    make_model(tmp_path, "a", lifecycle="idle_unload_s = 0")
    w = World(tmp_path)
    await w.life.start(None)
    w.clock.advance(1e7)
    assert await w.life.sweep() is None
    assert not w.repo.is_parked("a")
    await w.life.stop()


async def test_the_sweep_runs_on_its_own_at_the_idle_deadline(tmp_path: Path) -> None:
    make_model(tmp_path, "a", lifecycle="idle_unload_s = 0.01")
    w = World(tmp_path, real_clock=True)
    await w.life.start(None)
    servable = w.loader.last("a")
    await asyncio.wait_for(servable.stopped_event.wait(), 10)  # no sweep() called by the test
    assert w.repo.is_parked("a")
    await w.life.ensure_loaded(internal_context(), "a")  # woken: the sweep watches it again
    await asyncio.wait_for(w.loader.last("a").stopped_event.wait(), 10)
    await w.life.stop()


# --- lazy load ---------------------------------------------------------------------------------


async def test_requests_to_a_parked_model_wait_for_one_load(world: World) -> None:
    await park(world)
    world.loader.gate = asyncio.Event()
    world.loader.started.clear()
    world.loader.load_s = 2.5
    waiters = [
        asyncio.create_task(world.life.ensure_loaded(internal_context(), "a")) for _ in range(5)
    ]
    await world.loader.started.wait()
    await asyncio.sleep(0)  # every waiter has run up to its wait
    assert not any(w.done() for w in waiters)  # parked, not failed
    assert world.state("a")[0] == "LOADING"
    late = asyncio.create_task(world.life.ensure_loaded(internal_context(), "a"))  # mid-load
    world.loader.gate.set()
    await asyncio.gather(*waiters, late)
    assert world.loader.count("a") == 2  # the start-up load and exactly one wake
    assert world.repo.get("a")[2] is world.loader.last("a")
    assert world.state("a") == ("READY", "")
    assert world.metric("fulcrum_model_cold_start_seconds_count", model="a") == 1.0
    assert world.metric("fulcrum_model_cold_start_seconds_sum", model="a") == pytest.approx(2.5)
    stats = world.life.stats_json("a")
    assert stats is not None and stats["cold_start"] == {"count": 1, "ns": 2_500_000_000}


async def test_a_request_that_woke_the_model_counts_its_slo_from_the_ready_model(
    world: World,
) -> None:
    """Its deadline stays; its age (what an adaptive batcher's SLO counts from) restarts, or the
    batcher would shed the very request whose wait was the load's."""
    received_s, deadline_s = time.monotonic() - 5.0, time.monotonic() + 60.0
    ctx = RequestContext("r", "t", "v2", deadline_s=deadline_s, received_s=received_s)
    assert await world.life.ensure_loaded(ctx, "a") is ctx  # resident: unchanged
    await park(world)
    woken = await world.life.ensure_loaded(ctx, "a")
    assert woken.deadline_s == deadline_s and woken.request_id == "r"
    assert woken.received_s is not None and woken.received_s >= received_s + 5.0
    internal = internal_context()
    await park(world)
    assert (await world.life.ensure_loaded(internal, "a")).received_s is None


async def test_a_woken_model_unloads_again_when_idle(world: World) -> None:
    await park(world)
    await world.life.ensure_loaded(internal_context(), "a")
    world.clock.advance(10.0)
    await world.life.sweep()
    assert world.repo.is_parked("a")
    assert world.metric("fulcrum_model_unloads_total", model="a", reason="idle") == 2.0


async def test_failed_cold_start_is_a_clear_503_then_retried_after_a_backoff(world: World) -> None:
    await park(world)
    world.loader.broken.add("a")
    with pytest.raises(Unavailable, match=r"model 'a' could not be loaded: .*weights are broken"):
        await world.life.ensure_loaded(internal_context(), "a")
    assert "weights are broken" in world.state("a")[1]
    # Within the backoff: refused at once, with the reason, without another load.
    with pytest.raises(Unavailable, match=r"next try in 1\.0 s.*weights are broken") as refused:
        await world.life.ensure_loaded(internal_context(), "a")
    assert refused.value.headers() == {"Retry-After": "1"}
    assert world.metric("fulcrum_model_cold_start_failures_total", model="a") == 1.0
    assert not world.life.would_serve("a", None)  # not ready while broken
    world.clock.advance(FIRST_RETRY_S)
    with pytest.raises(Unavailable, match="could not be loaded"):  # tried again, failed again
        await world.life.ensure_loaded(internal_context(), "a")
    world.clock.advance(FIRST_RETRY_S)
    with pytest.raises(Unavailable, match="2 time"):  # the backoff doubled
        await world.life.ensure_loaded(internal_context(), "a")
    world.loader.broken.clear()
    world.clock.advance(FIRST_RETRY_S)
    await world.life.ensure_loaded(internal_context(), "a")
    assert world.state("a") == ("READY", "")


async def test_the_users_reload_of_a_broken_parked_model_ends_its_backoff(world: World) -> None:
    await park(world)
    world.loader.broken.add("a")
    with pytest.raises(Unavailable, match="could not be loaded"):
        await world.life.ensure_loaded(internal_context(), "a")
    world.loader.broken.clear()  # the user fixes the model, then reloads it
    await world.life.load("a")
    assert world.life.would_serve("a", None)
    await world.life.ensure_loaded(internal_context(), "a")  # no wait for the backoff
    assert world.state("a") == ("READY", "")


async def test_a_load_past_load_timeout_is_503_and_goes_on(tmp_path: Path) -> None:
    make_model(tmp_path, "a", lifecycle="idle_unload_s = 10\nload_timeout_s = 0.01")
    w = World(tmp_path)
    await w.life.start(None)
    await park(w)
    w.loader.gate = asyncio.Event()
    with pytest.raises(Unavailable, match=r"model 'a' is still loading after 0.01 s"):
        await w.life.ensure_loaded(internal_context(), "a")
    w.loader.gate.set()
    await w.life.ensure_loaded(internal_context(), "a")  # the same load, finished
    assert w.loader.count("a") == 2
    await w.life.stop()


async def test_a_load_past_the_request_deadline_is_504(world: World) -> None:
    await park(world)
    world.loader.gate = asyncio.Event()
    ctx = RequestContext("r1", "t", "v2", deadline_s=time.monotonic() + 0.01)
    with pytest.raises(DeadlineExceeded, match="r1 passed its deadline while model 'a' loaded"):
        await world.life.ensure_loaded(ctx, "a")
    world.loader.gate.set()


async def test_unknown_names_pass_through(world: World) -> None:
    await world.life.ensure_loaded(internal_context(), "nope")
    with pytest.raises(NotFound):
        world.repo.get("nope")


# --- the user's own load and unload ------------------------------------------------------------


async def test_explicit_unload_is_not_reloaded_by_traffic(world: World) -> None:
    await world.life.unload("a")
    await world.life.ensure_loaded(internal_context(), "a")
    assert world.loader.count("a") == 1
    with pytest.raises(NotFound, match="not loaded"):
        world.repo.get("a")
    assert not world.life.would_serve("a", None)
    assert world.metric("fulcrum_model_memory_bytes", model="a") is None  # its series went too
    assert world.life.stats_json("a") is None


async def test_unloading_a_parked_model_keeps_it_unloaded(world: World) -> None:
    await park(world)
    await world.life.unload("a")
    await world.life.ensure_loaded(internal_context(), "a")
    assert world.loader.count("a") == 1
    assert world.state("a") == ("UNAVAILABLE", "unloaded")


async def test_reload_of_a_parked_model_only_updates_its_config(world: World) -> None:
    await park(world)
    await world.life.load("a", {"max_batch_size": 2})
    assert world.loader.count("a") == 1 and world.repo.is_parked("a")
    await world.life.ensure_loaded(internal_context(), "a")
    assert world.loader.last("a").config.max_batch_size == 2
    await park(world)  # a second wake keeps the override
    await world.life.ensure_loaded(internal_context(), "a")
    assert world.loader.last("a").config.max_batch_size == 2


async def test_a_bad_reload_of_a_parked_model_is_refused_and_changes_nothing(world: World) -> None:
    await park(world)
    with pytest.raises(InvalidInput, match="max_batch_size"):
        await world.life.load("a", {"max_batch_size": -1})
    await world.life.ensure_loaded(internal_context(), "a")
    assert world.loader.last("a").config.max_batch_size == 4


async def test_hot_reload_of_a_loaded_model_still_swaps(world: World) -> None:
    old = world.loader.last("a")
    await world.life.load("a")
    assert old.stopped and world.repo.get("a")[2] is world.loader.last("a")


async def test_every_variant_parks_and_wakes(tmp_path: Path) -> None:
    variants = "[variants.fp32]\n[variants.int8]\n"
    make_model(tmp_path, "v", extra=variants)
    w = World(tmp_path)
    await w.life.start(None)
    await park(w, "v")
    assert all(s.stopped for s in w.loader.loads)
    await w.life.ensure_loaded(internal_context(), "v")
    assert [s.variant for s in w.loader.loads[2:]] == ["fp32", "int8"]
    assert w.repo.get("v", variant="int8")[2] is w.loader.loads[3]
    await w.life.stop()


async def test_parked_model_is_ready_for_its_versions(world: World) -> None:
    await park(world)
    assert world.life.would_serve("a", None)
    assert world.life.would_serve("a", 1)
    assert not world.life.would_serve("a", 2)
    described = world.life.parked_config("a")
    assert described is not None and described[1] == [1]
