"""The memory budget: each load measured (RSS delta, with the files on disk as a floor), the
least recently used idle models evicted to make room, busy or pinned ones never, a clear 503
when nothing can go, and start-up leaving what does not fit parked."""

from __future__ import annotations

from pathlib import Path

import pytest
from lifecycle_fakes import MB, World, make_model

from fulcrum.context import internal_context
from fulcrum.errors import Unavailable
from fulcrum.lifecycle.manager import EVICTION_GRACE_S


async def started(root: Path, names: list[str], budget_mb: int | None = 250) -> World:
    """`names` loaded in order, one fake second apart (so each is older than the next)."""
    for name in names:
        make_model(root, name)
    w = World(root, budget_mb=budget_mb)
    for name in names:
        await w.life.load(name)
        w.clock.advance(EVICTION_GRACE_S + 1)
    return w


async def test_memory_of_each_load_is_measured(tmp_path: Path) -> None:
    w = await started(tmp_path, ["a"], budget_mb=None)
    w.loader.size_mb["b"] = 37
    make_model(tmp_path, "b", weights_mb=1)
    await w.life.load("b")
    assert w.life.stats_json("b") == {
        "cold_start": {"count": 0, "ns": 0}, "cold_start_failures": 0, "idle_unloads": 0,
        "evictions": 0, "memory_bytes": 37 * MB,
    }  # fmt: skip
    assert w.metric("fulcrum_model_memory_bytes", model="b") == 37 * MB
    assert w.life.used_bytes == 137 * MB
    assert w.metric("fulcrum_memory_used_bytes") == 137 * MB


async def test_files_on_disk_are_the_floor_of_the_figure(tmp_path: Path) -> None:
    make_model(tmp_path, "a", weights_mb=3)
    w = World(tmp_path)
    w.loader.size_mb["a"] = 0  # the allocator reused freed pages: RSS did not grow
    await w.life.load("a")
    assert w.life.stats_json("a") is not None
    assert w.life.used_bytes == 3 * MB


async def test_a_wake_keeps_the_figure_its_first_load_measured(tmp_path: Path) -> None:
    w = await started(tmp_path, ["a"], budget_mb=None)
    assert w.life.used_bytes == 100 * MB
    w.clock.advance(1000.0)
    await w.life.sweep()
    w.loader.size_mb["a"] = 0  # the park freed pages the wake's allocations reuse
    await w.life.ensure_loaded(internal_context(), "a")
    assert w.life.used_bytes == 100 * MB
    await w.life.load("a")  # the user's reload is measured afresh (the disk floor: 100 MiB)
    w.loader.size_mb["a"] = 150
    await w.life.load("a")
    assert w.life.used_bytes == 150 * MB


async def test_a_load_past_the_budget_evicts_the_least_recently_used(tmp_path: Path) -> None:
    w = await started(tmp_path, ["a", "b"])
    await w.life.ensure_loaded(internal_context(), "a")  # a used after b: b is the LRU
    w.clock.advance(EVICTION_GRACE_S + 1)
    make_model(tmp_path, "c")
    await w.life.load("c")
    assert w.repo.is_parked("b") and w.loader.last("b").stopped
    assert not w.repo.is_parked("a")
    assert w.state("b") == ("UNAVAILABLE", "unloaded (memory budget)")
    assert w.metric("fulcrum_model_unloads_total", model="b", reason="memory_budget") == 1.0
    stats = w.life.stats_json("b")
    assert stats is not None and stats["evictions"] == 1
    assert w.life.used_bytes == 200 * MB
    # b's next request loads it again, evicting the LRU of the others in its turn (a).
    w.clock.advance(EVICTION_GRACE_S + 1)
    await w.life.ensure_loaded(internal_context(), "b")
    assert w.repo.is_parked("a") and not w.repo.is_parked("b")


async def test_eviction_skips_models_with_requests_in_flight(tmp_path: Path) -> None:
    w = await started(tmp_path, ["a", "b"])
    w.loader.last("a").num_admitted = 1  # the LRU, but busy
    make_model(tmp_path, "c")
    await w.life.load("c")
    assert not w.repo.is_parked("a") and w.repo.is_parked("b")


async def test_a_model_used_just_now_is_not_evicted(tmp_path: Path) -> None:
    w = await started(tmp_path, ["a", "b"])
    await w.life.ensure_loaded(internal_context(), "a")
    await w.life.ensure_loaded(internal_context(), "b")
    make_model(tmp_path, "c")
    with pytest.raises(Unavailable, match="memory budget"):
        await w.life.load("c")


async def test_pinned_models_are_never_evicted(tmp_path: Path) -> None:
    make_model(tmp_path, "a", lifecycle="evictable = false")
    w = World(tmp_path, budget_mb=150)
    await w.life.load("a")
    w.clock.advance(100.0)
    make_model(tmp_path, "b")
    with pytest.raises(Unavailable, match="in use or pinned: a"):
        await w.life.load("b")
    assert not w.repo.is_parked("a")


async def test_nothing_to_evict_is_a_clear_503_naming_the_budget(tmp_path: Path) -> None:
    w = await started(tmp_path, ["a", "b"])
    for name in ("a", "b"):
        w.loader.last(name).num_admitted = 1
    make_model(tmp_path, "c")
    with pytest.raises(Unavailable) as refused:
        await w.life.load("c")
    assert refused.value.message == (
        "model 'c' needs about 100 MiB; the memory budget (250 MiB) has 50 MiB free and no idle "
        "model to unload (in use or pinned: a, b)"
    )
    assert refused.value.status_code == 503
    assert w.loader.count("c") == 0
    assert not w.repo.is_parked("a") and not w.repo.is_parked("b")


async def test_a_model_bigger_than_the_budget_is_refused_at_once(tmp_path: Path) -> None:
    make_model(tmp_path, "big", weights_mb=2)
    w = World(tmp_path, budget_mb=1)
    with pytest.raises(Unavailable, match="more than the whole memory budget"):
        await w.life.load("big")


async def test_a_parked_model_waking_over_budget_fails_clearly(tmp_path: Path) -> None:
    w = await started(tmp_path, ["a", "b"])
    w.clock.advance(1000.0)
    await w.life.sweep()  # both idle: parked
    assert w.repo.is_parked("a") and w.repo.is_parked("b")
    await w.life.ensure_loaded(internal_context(), "a")
    w.loader.last("a").num_admitted = 1
    w.loader.size_mb["b"] = 200
    w.life._models["b"].memory_bytes = 200 * MB  # measured so at an earlier load
    with pytest.raises(Unavailable, match=r"model 'b' could not be loaded: .*memory budget"):
        await w.life.ensure_loaded(internal_context(), "b")


async def test_start_up_leaves_what_does_not_fit_parked(tmp_path: Path) -> None:
    for name in ("a", "b"):
        make_model(tmp_path, name, weights_mb=2)
    w = World(tmp_path, budget_mb=3)
    w.loader.size_mb = {"a": 0, "b": 0}
    await w.life.start(None)
    assert not w.repo.is_parked("a")
    assert w.state("b") == ("UNAVAILABLE", "unloaded (memory budget)")
    assert w.loader.count("b") == 0
    assert w.life.would_serve("b", None)
    w.clock.advance(EVICTION_GRACE_S + 1)
    await w.life.ensure_loaded(internal_context(), "b")  # the first request loads it
    assert w.repo.is_parked("a") and w.loader.count("b") == 1
    await w.life.stop()


async def test_hot_reload_counts_the_old_version_until_it_stops(tmp_path: Path) -> None:
    w = await started(tmp_path, ["a", "b"])
    await w.life.load("a")  # needs 100 more while the old a runs: b (idle) makes room
    assert w.repo.is_parked("b")
    assert w.life.used_bytes == 100 * MB


def test_the_budget_is_a_serve_flag_or_an_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    from fulcrum.cli import build_parser

    serve = ["serve", "--repository", "models"]
    assert build_parser().parse_args([*serve, "--memory-budget-mb", "512"]).memory_budget_mb == 512
    assert build_parser().parse_args(serve).memory_budget_mb is None
    monkeypatch.setenv("FULCRUM_MEMORY_BUDGET_MB", "64")
    assert build_parser().parse_args(serve).memory_budget_mb == 64
    with pytest.raises(SystemExit):
        build_parser().parse_args([*serve, "--memory-budget-mb", "0"])
