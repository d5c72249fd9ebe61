"""Closed and open loops on virtual time: coordinated omission shows, lag is counted."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Awaitable
from typing import TypeVar

import pytest

from fulcrum.client import ClientError, ClientTimeout
from fulcrum.loadgen.closed_loop import run_closed_loop
from fulcrum.loadgen.driver import PointHooks
from fulcrum.loadgen.open_loop import run_open_loop
from fulcrum.loadgen.records import STATUS_CONNECT_ERROR, STATUS_TIMEOUT, Outcome
from fulcrum.loadgen.results import summarize_point
from fulcrum.loadgen.server_stats import ServerSplit
from fulcrum.loadgen.windows import MeasurePlan, WindowStats

T = TypeVar("T")


class VirtualTimer:
    """Time moves only when every task is waiting: to the earliest sleeper's deadline."""

    def __init__(self) -> None:
        self.t = 0.0
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self.t

    async def sleep_until(self, deadline_s: float) -> None:
        if deadline_s <= self.t:
            await asyncio.sleep(0)
            return
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (deadline_s, next(self._seq), future))
        await future

    async def drive(self, main: Awaitable[T]) -> T:
        task = asyncio.ensure_future(main)
        while not task.done():
            for _ in range(20):  # let every runnable task run before time moves
                await asyncio.sleep(0)
            if task.done():
                break
            assert self._sleepers, "deadlock: nothing runnable and nobody sleeping"
            deadline_s, _, future = heapq.heappop(self._sleepers)
            self.t = max(self.t, deadline_s)
            if not future.done():
                future.set_result(None)
        return task.result()


class StallingServer:
    """Answers after `service_s`; a request arriving in [stall_from_s, stall_to_s) waits it out."""

    def __init__(
        self, timer: VirtualTimer, service_s: float, stall_from_s: float, stall_to_s: float
    ) -> None:
        self.timer = timer
        self.service_s = service_s
        self.stall = (stall_from_s, stall_to_s)
        self.num_slots = 0
        self.num_closed = 0

    def open_slot(self) -> FakeSlot:
        self.num_slots += 1
        return FakeSlot(self)


class FakeSlot:
    def __init__(self, server: StallingServer) -> None:
        self.server = server

    async def send(self, timeout_s: float) -> Outcome:
        server = self.server
        start_s = server.timer.now()
        if server.stall[0] <= start_s < server.stall[1]:
            start_s = server.stall[1]
        await server.timer.sleep_until(start_s + server.service_s)
        return Outcome(
            200, num_rows=2, queue_ms=1.0, compute_ms=server.service_s * 1000, total_ms=4.0
        )

    def close(self) -> None:
        self.server.num_closed += 1


# Never stable before the time bound, so the stall at 4-5 s falls inside the measurement.
PLAN = MeasurePlan(warmup_s=1.0, window_s=1.0, max_duration_s=10.0, num_stable=100)


async def test_open_loop_shows_a_one_second_stall_in_p99() -> None:
    timer = VirtualTimer()
    server = StallingServer(timer, service_s=0.002, stall_from_s=4.0, stall_to_s=5.0)
    raw = await timer.drive(
        run_open_loop(server, 100.0, PLAN, timer, arrivals="constant", max_in_flight=10_000)
    )
    point = summarize_point("rate", 100.0, raw, [], ServerSplit())
    # 100 of ~1000 requests were scheduled inside the stall: they waited up to a second.
    assert point.latency.p99_ms > 800
    assert point.latency.max_ms == pytest.approx(1002, abs=15)
    assert point.latency.p50_ms == pytest.approx(2.0, abs=0.5)
    assert point.num_requests == pytest.approx(1000, abs=15)
    assert point.num_behind == 0  # the generator kept its schedule; the server was late


async def test_closed_loop_hides_the_stall_that_open_loop_shows() -> None:
    timer = VirtualTimer()
    server = StallingServer(timer, service_s=0.01, stall_from_s=4.0, stall_to_s=5.0)
    raw = await timer.drive(run_closed_loop(server, 1, PLAN, timer))
    point = summarize_point("concurrency", 1.0, raw, [], ServerSplit())
    # One request saw the whole stall; the others never got sent (coordinated omission).
    assert point.latency.max_ms > 900
    assert point.latency.p99_ms < 20
    assert server.num_slots == 1 and server.num_closed == 1


async def test_closed_loop_keeps_concurrency_and_measures_throughput() -> None:
    timer = VirtualTimer()
    server = StallingServer(timer, service_s=0.01, stall_from_s=1e9, stall_to_s=1e9)
    windows: list[WindowStats] = []

    class Hooks(PointHooks):
        def on_window(self, window: WindowStats) -> None:
            windows.append(window)

    plan = MeasurePlan(warmup_s=1.0, window_s=1.0, max_duration_s=10.0, stability_pct=5.0)
    raw = await timer.drive(run_closed_loop(server, 4, plan, timer, hooks=Hooks()))
    point = summarize_point("concurrency", 4.0, raw, [], ServerSplit())
    assert point.throughput_rps == pytest.approx(400, rel=0.02)
    assert point.rows_per_s == pytest.approx(800, rel=0.02)
    assert point.latency.p50_ms == pytest.approx(10, abs=0.5)
    # Steady service: stable after the minimum three windows.
    assert point.stable and point.num_windows == 3 and len(windows) == 3
    assert point.header_queue_ms == 1.0 and point.header_compute_ms == pytest.approx(10)
    # The server said 4 ms of each ~10 ms answer were its own: the other ~6 ms were outside it.
    assert point.header_total_p50_ms == 4.0
    assert point.outside_p50_ms == pytest.approx(6, abs=0.5)


async def test_open_loop_falls_behind_when_slots_run_out() -> None:
    timer = VirtualTimer()
    server = StallingServer(timer, service_s=0.05, stall_from_s=1e9, stall_to_s=1e9)
    plan = MeasurePlan(warmup_s=0.5, window_s=1.0, max_duration_s=3.0)
    # Capacity 2 slots / 50 ms = 40 req/s, offered 100 req/s: sends slip behind schedule.
    raw = await timer.drive(
        run_open_loop(server, 100.0, plan, timer, arrivals="constant", max_in_flight=2)
    )
    point = summarize_point("rate", 100.0, raw, [], ServerSplit())
    assert point.num_behind > 0 and point.max_lag_ms > 100
    assert any("fell behind" in w for w in point.warnings)
    # Latency still runs from the schedule, so the backlog shows.
    assert point.latency.p99_ms > 500
    assert server.num_slots == 2


class FailingTarget:
    def __init__(self, timer: VirtualTimer) -> None:
        self.timer = timer
        self.count = 0

    def open_slot(self) -> FailingSlot:
        return FailingSlot(self)


class FailingSlot:
    def __init__(self, target: FailingTarget) -> None:
        self.target = target

    async def send(self, timeout_s: float) -> Outcome:
        self.target.count += 1
        await self.target.timer.sleep_until(self.target.timer.now() + 0.01)
        kind = self.target.count % 3
        if kind == 0:
            raise ClientTimeout("late")
        if kind == 1:
            raise ClientError("refused")
        return Outcome(503, error="queue full")

    def close(self) -> None:
        pass


async def test_client_errors_are_counted_not_raised() -> None:
    timer = VirtualTimer()
    plan = MeasurePlan(warmup_s=0.0, window_s=1.0, max_duration_s=2.0)
    raw = await timer.drive(run_closed_loop(FailingTarget(timer), 2, plan, timer))
    point = summarize_point("concurrency", 2.0, raw, [], ServerSplit())
    assert point.num_ok == 0 and point.throughput_rps == 0
    assert set(point.errors) == {"timeout", "connect", "503"}
    assert sum(point.errors.values()) == point.num_requests
    statuses = {r.outcome.status for r in raw.measurement.records}
    assert {STATUS_TIMEOUT, STATUS_CONNECT_ERROR, 503} == statuses
