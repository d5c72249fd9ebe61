"""The lifecycle manager: owns the repository's loads, so each is measured and fits the memory
budget; parks idle models (scale to zero) and wakes a parked model for the request that needs it,
one load however many requests wait for it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from pathlib import Path

from fulcrum.config import ModelConfig
from fulcrum.context import RequestContext
from fulcrum.errors import DeadlineExceeded, FulcrumError, Unavailable
from fulcrum.lifecycle.idle import BUSY_RECHECK_S, Activity, num_in_flight, plan_idle
from fulcrum.lifecycle.memory import (
    MemoryProbe,
    ProcessMemory,
    ProcessRss,
    Resident,
    folder_bytes,
    import_libraries,
    over_budget,
    owned_bytes,
    plan_eviction,
    process_rss_bytes,
)
from fulcrum.lifecycle.record import ModelLife, woken
from fulcrum.metrics import LifecycleMetrics
from fulcrum.repository import Loader, ModelRepository, Servable
from fulcrum.types import Clock, MonotonicClock

log = logging.getLogger(__name__)

# A failed cold start is tried again by the next request only after this backoff, doubled at
# each failure in a row: a broken model is not reloaded in a loop by its traffic.
FIRST_RETRY_S = 1.0
MAX_RETRY_S = 60.0
# The budget never evicts a model used this recently: an LLM request between its prompt's
# preparation and its admission to the engine holds no lease the budget could see.
EVICTION_GRACE_S = 1.0


class ModelLifecycle:
    """Loads, parks and wakes the repository's models for the service."""

    def __init__(
        self,
        root: Path,
        loader: Loader,
        metrics: LifecycleMetrics,
        *,
        memory_budget_bytes: int | None = None,
        clock: Clock | None = None,
        probe: MemoryProbe | None = None,
        process_rss: ProcessRss | None = None,
    ) -> None:
        self.clock: Clock = clock or MonotonicClock()
        self.repository = ModelRepository(root, self._measured)
        self.memory_budget_bytes = memory_budget_bytes
        self._loader = loader
        self._metrics = metrics
        self._probe = probe or ProcessMemory()
        self._process_rss = process_rss or process_rss_bytes  # a model's own processes
        self._models: dict[str, ModelLife] = {}
        # Under a budget, loads run one at a time: each one's memory is measured alone, and an
        # eviction decided for one load is not undone by another. Without one they overlap (a
        # small model's cold start never waits for an LLM's), each figure then an upper bound.
        self._load_lock = asyncio.Lock()
        self._measured_bytes: dict[str, int] = {}
        self._changed = asyncio.Event()  # a model loaded: the sweep's next deadline may move
        self._reaper: asyncio.Task[None] | None = None
        metrics.budget_bytes.set(memory_budget_bytes or 0)
        metrics.used_bytes.set_function(lambda: self.used_bytes)

    # --- start and stop -------------------------------------------------------------------

    async def start(self, names: tuple[str, ...] | None) -> None:
        """Load `names` (None: every model, failures logged), then start the idle sweep. A
        model that does not fit the budget at start-up is parked: its first request loads it."""
        if names is None:
            for name in self.repository.model_names():
                try:
                    await self._start_one(name)
                except FulcrumError as exc:
                    log.error("model %s failed to load: %s", name, exc.message)
        else:
            for name in names:
                await self._start_one(name)
        self._reaper = asyncio.create_task(self._reap(), name="fulcrum-lifecycle")

    async def stop(self) -> None:
        """Stop the sweep and any cold start under way (the repository closes after)."""
        tasks = [t for t in (self._reaper, *(m.wake for m in self._models.values())) if t]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._reaper = None

    async def _start_one(self, name: str) -> None:
        budget = self.memory_budget_bytes
        if budget is not None and self._estimate(name, None) > budget - self.used_bytes:
            self.repository.park_unloaded(name, "memory budget")
            self._life(name)
            log.info("model %s left unloaded: it does not fit the memory budget", name)
            return
        await self.load(name)

    # --- explicit loads and unloads ---------------------------------------------------------

    async def load(self, name: str, override: dict[str, object] | None = None) -> None:
        """Load or reload `name` (start-up, the management API); a parked model only takes the
        new config, loaded by its next request."""
        if self.repository.is_parked(name):
            await self.repository.load(name, override)
            if (life := self._models.get(name)) is not None:  # the fix may be in: try at once
                life.retry_at_s, life.num_failures = 0.0, 0
            return
        await self._load(name, override, wake=False)

    async def unload(self, name: str) -> None:
        """The user's unload: traffic does not load the model again."""
        await self.repository.unload(name)
        # Gone from the user's view, its record goes too: no series, no statistics, no wake.
        self._models.pop(name, None)
        self._metrics.forget(name)

    async def _load(self, name: str, override: dict[str, object] | None, *, wake: bool) -> None:
        budgeted = self.memory_budget_bytes is not None
        async with self._load_lock if budgeted else contextlib.nullcontext():
            if wake and not self.repository.is_parked(name):
                return  # loaded, or unloaded by the user, while this wake waited its turn
            if budgeted:
                await self._make_room(name, self._estimate(name, override))
            self._measured_bytes[name] = 0
            try:
                await self.repository.load(name, override, wake=wake)
            finally:
                measured_bytes = self._measured_bytes.pop(name, 0)
            life = self._life(name)
            # A wake reloads the very config it parked with: what its first load measured still
            # holds, though RSS now grows less (the allocator reuses the pages the park freed).
            kept_bytes = life.memory_bytes if wake else 0
            life.memory_bytes = max(measured_bytes, self._disk_bytes(name), kept_bytes)
            life.own_bytes, life.last_used_s = measured_bytes, self.clock.now()
            self._memory_of(name, life)  # its own processes' RSS, where it has any
        self._changed.set()

    async def _measured(
        self, config: ModelConfig, version: int, folder: Path, variant: str
    ) -> Servable:
        """The service's loader, with the memory each servable took added to this load's."""
        await import_libraries(config.platform)
        before = self._probe.used_bytes()
        servable = await self._loader(config, version, folder, variant)
        grown_bytes = max(0, self._probe.used_bytes() - before)
        self._measured_bytes[config.name] = self._measured_bytes.get(config.name, 0) + grown_bytes
        return servable

    # --- the memory budget ------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        """Memory of the loaded models, as measured at their loads (processes of their own: now)."""
        models = self._models
        return sum(self._memory_of(n, models[n]) for n in self._loaded_names() if n in models)

    def _memory_of(self, name: str, life: ModelLife) -> int:
        """A loaded model's figure, its own processes' RSS read now (`owned_bytes`); while they
        cannot be read it keeps its figure (after its load: the files on disk)."""
        servables = (s for c, _, s in self.repository.loaded() if c.name == name)
        found = owned_bytes(servables, life.own_bytes, self._process_rss)
        life.memory_bytes = life.stats.memory_bytes = life.memory_bytes if found is None else found
        self._metrics.memory_bytes.labels(name).set(life.memory_bytes)
        return life.memory_bytes

    def _estimate(self, name: str, override: dict[str, object] | None) -> int:
        """What a load of `name` will take: its last measured figure, else its size on disk."""
        life = self._models.get(name)
        if life is not None and life.memory_bytes > 0 and override is None:
            return life.memory_bytes
        try:
            config = self.repository.read_config(name, override)
            return folder_bytes(self.repository.version_folders(config))
        except FulcrumError:
            return 0  # the load itself fails with the reason

    def _disk_bytes(self, name: str) -> int:
        # RSS misses pages the allocator reuses after an unload, and weights not yet touched:
        # the files a load reads are the floor of what it holds.
        config = self.repository.config_of(name)
        return 0 if config is None else folder_bytes(self.repository.version_folders(config))

    async def _make_room(self, name: str, need_bytes: int) -> None:
        """Evict the least recently used idle models until `need_bytes` fit, or raise 503."""
        budget = self.memory_budget_bytes
        assert budget is not None
        skipped: set[str] = set()
        while True:
            plan = plan_eviction(self._residents(name, skipped), need_bytes, budget)
            if not plan.fits:
                in_use = [n for n in self._loaded_names() if n != name]
                raise Unavailable(over_budget(name, need_bytes, budget, plan.free_bytes, in_use))
            if not plan.evict:
                return
            victim = plan.evict[0]
            if not await self._park(victim, "memory budget"):
                skipped.add(victim)  # became busy: the next plan passes it by

    def _residents(self, loading: str, skipped: set[str]) -> list[Resident]:
        now = self.clock.now()
        residents: list[Resident] = []
        for name in self._loaded_names():
            life = self._models.get(name)
            config = self.repository.config_of(name)
            if life is None or config is None:
                continue
            evictable = (
                name != loading
                and name not in skipped
                and config.lifecycle.evictable
                and not self._busy(name)
                and now - life.last_used_s >= EVICTION_GRACE_S
            )
            memory_bytes = self._memory_of(name, life)
            residents.append(Resident(name, memory_bytes, life.last_used_s, evictable))
        return residents

    # --- requests: leases and wakes ---------------------------------------------------------

    async def ensure_loaded(self, ctx: RequestContext, name: str) -> RequestContext:
        """Note a request for `name`; a parked model is loaded first, the request waiting for
        it (bounded by its deadline and the model's `load_timeout_s`). Names the repository
        does not know pass through (the caller's 404). Returns the context to serve it with:
        after a cold start its SLO age counts from when the model was ready (the wait was the
        load's, not the queue's: an adaptive batcher would shed the request that woke it)."""
        life = self._models.get(name)
        if life is None:
            return ctx
        life.last_used_s = self.clock.now()
        if not self.repository.is_parked(name):
            return ctx
        await self._wait_for_wake(ctx, name, life)
        life.last_used_s = self.clock.now()
        if ctx.received_s is None:
            return ctx
        return dataclasses.replace(ctx, received_s=time.monotonic())

    async def _wait_for_wake(self, ctx: RequestContext, name: str, life: ModelLife) -> None:
        if life.wake is None:
            left_s = life.retry_at_s - self.clock.now()
            if left_s > 0:
                raise Unavailable(
                    f"model '{name}' could not be loaded ({life.num_failures} time(s) in a row, "
                    f"next try in {left_s:.1f} s): {life.last_error}",
                    retry_after_s=left_s,
                )
            life.wake = asyncio.create_task(self._cold_start(name, life), name=f"wake-{name}")
            life.wake.add_done_callback(lambda task: woken(life, task))
        config = self.repository.config_of(name)
        timeout_s = config.lifecycle.load_timeout_s if config is not None else None
        deadline_left_s = ctx.remaining_s(time.monotonic())  # 504 if it passed already
        bound_s = _min(timeout_s, deadline_left_s)
        try:
            async with asyncio.timeout(bound_s):
                await asyncio.shield(life.wake)  # a waiter that gives up leaves the load running
        except TimeoutError:
            if deadline_left_s is not None and bound_s == deadline_left_s:
                raise DeadlineExceeded(
                    f"request {ctx.request_id} passed its deadline while model '{name}' loaded"
                ) from None
            raise Unavailable(
                f"model '{name}' is still loading after {bound_s:g} s (load_timeout_s): retry"
            ) from None

    async def _cold_start(self, name: str, life: ModelLife) -> None:
        start_s = self.clock.now()
        try:
            await self._load(name, None, wake=True)
        except FulcrumError as exc:
            life.num_failures += 1
            backoff_s = min(MAX_RETRY_S, FIRST_RETRY_S * 2 ** (life.num_failures - 1))
            life.retry_at_s = self.clock.now() + backoff_s
            life.last_error = exc.message
            life.stats.cold_start_failures += 1
            self._metrics.cold_start_failures.labels(name).inc()
            log.error("model %s failed to load for a request: %s", name, exc.message)
            raise Unavailable(
                f"model '{name}' could not be loaded: {exc.message}", retry_after_s=backoff_s
            ) from exc
        took_s = self.clock.now() - start_s
        life.num_failures, life.retry_at_s = 0, 0.0
        life.stats.cold_start.add(took_s)
        self._metrics.cold_start_s.labels(name).observe(took_s)
        log.info("model %s loaded for a request in %.3f s", name, took_s)

    # --- idle models ------------------------------------------------------------------------

    async def sweep(self) -> float | None:
        """Park every model idle for its `idle_unload_s`; returns when to look again."""
        now = self.clock.now()
        activities: list[Activity] = []
        for name in self._loaded_names():
            life = self._models.get(name)
            config = self.repository.config_of(name)
            if life is None or config is None:
                continue
            busy = self._busy(name)
            if busy:  # its idle time starts when its work ends, not when it began
                life.last_used_s = now
            activities.append(
                Activity(name, config.lifecycle.idle_unload_s, life.last_used_s, busy)
            )
        plan = plan_idle(activities, now)
        next_s = plan.next_check_s
        for name in plan.unload:
            if not await self._park(name, "idle"):
                next_s = _min(next_s, now + BUSY_RECHECK_S)
        return next_s

    async def _reap(self) -> None:
        """The idle sweep, woken at the earliest idle deadline or when a model loads."""
        while True:
            self._changed.clear()
            try:
                next_s = await self.sweep()
            except Exception:  # a failed stop must not end the sweep for every other model
                log.exception("idle sweep failed")
                next_s = self.clock.now() + BUSY_RECHECK_S
            delay_s = None if next_s is None else max(0.0, next_s - self.clock.now())
            # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a cancel that
            # meets the event being set, and the sweep would outlive its owner.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay_s):
                    await self._changed.wait()

    async def _park(self, name: str, reason: str) -> bool:
        if self._busy(name):
            return False
        if not await self.repository.park(name, reason):
            return False
        life = self._life(name)
        if reason == "idle":
            life.stats.idle_unloads += 1
        else:
            life.stats.evictions += 1
        self._metrics.unloads.labels(name, reason.replace(" ", "_")).inc()
        self._metrics.memory_bytes.labels(name).set(0)
        log.info("model %s unloaded (%s)", name, reason)
        return True

    # --- what others ask --------------------------------------------------------------------

    def would_serve(self, name: str, version: int | None) -> bool:
        """A parked model is ready: a request to it loads it (a scaled-to-zero KServe service
        stays Ready); not while a failed load's backoff runs."""
        life = self._models.get(name)
        if life is None or self.clock.now() < life.retry_at_s:
            return False
        described = self.parked_config(name)
        return described is not None and (version is None or version in described[1])

    def parked_config(self, name: str) -> tuple[ModelConfig, list[int]] | None:
        """A parked model's config and the versions its next load starts (None: not parked),
        so questions about it are answered without loading it."""
        config = self.repository.config_of(name)
        if not self.repository.is_parked(name) or config is None:
            return None
        try:
            folders = self.repository.version_folders(config)
        except FulcrumError:
            folders = []
        return config, [int(f.name) for f in folders]

    def stats_json(self, name: str) -> dict[str, object] | None:
        life = self._models.get(name)
        return None if life is None else life.stats.to_json()

    def _busy(self, name: str) -> bool:
        life = self._models.get(name)
        if (life is not None and life.wake is not None) or self.repository.is_loading(name):
            return True
        return any(num_in_flight(s) > 0 for c, _, s in self.repository.loaded() if c.name == name)

    def _loaded_names(self) -> list[str]:
        return sorted({c.name for c, _, _ in self.repository.loaded()})

    def _life(self, name: str) -> ModelLife:
        life = self._models.get(name)
        if life is None:
            life = self._models[name] = ModelLife(last_used_s=self.clock.now())
        return life


def _min(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)
