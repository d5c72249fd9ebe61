"""Open loop: requests sent on a schedule, whatever the server does; no coordinated omission.

Each request's latency runs from its scheduled send time. When the generator cannot keep up
(slots exhausted, event loop busy) it sends late, and the lag is counted and reported.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from fulcrum.loadgen.arrivals import ArrivalKind, Schedule
from fulcrum.loadgen.driver import (
    PointHooks,
    RawPoint,
    Slot,
    Target,
    Timer,
    WindowLoop,
    send_once,
)
from fulcrum.loadgen.records import RequestRecord
from fulcrum.loadgen.windows import Measurement, MeasurePlan

NEVER_S = 1e12  # a finite "never": timers sleep until it without overflowing


class OffsetSchedule:
    """A schedule over precomputed send times: `offsets` seconds after `start_s`, in order (a
    trace replayed the same for every configuration compared)."""

    def __init__(self, offsets: Sequence[float], start_s: float) -> None:
        self._due = [start_s + t for t in reversed(offsets)]

    def next_s(self) -> float:
        # After the last send: a time never reached (the sender is cancelled long before).
        return self._due.pop() if self._due else NEVER_S


LATE_S = 0.01  # a send this far behind its schedule counts as the generator falling behind


class Dispatcher:
    """Sends each scheduled request on an idle slot; opens slots up to `max_in_flight`. Public:
    benchmarks feed it their own schedules (a replayed trace, `OffsetSchedule`)."""

    def __init__(self, target: Target, timer: Timer, loop: WindowLoop, max_in_flight: int):
        self.target = target
        self.timer = timer
        self.loop = loop
        self.max_in_flight = max_in_flight
        self.idle: list[Slot] = []
        self.all_slots: list[Slot] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.slot_freed = asyncio.Event()
        self.stopping = False
        self.drained: list[RequestRecord] = []
        self.num_behind = 0
        self.max_lag_s = 0.0

    async def run(self, schedule: Schedule | OffsetSchedule, timeout_s: float) -> None:
        while not self.stopping:
            due_s = schedule.next_s()
            if due_s > self.timer.now():
                await self.timer.sleep_until(due_s)
                if self.stopping:
                    return
            slot = await self._slot()
            task = asyncio.create_task(self._one(slot, due_s, timeout_s))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _slot(self) -> Slot:
        while not self.idle and len(self.all_slots) >= self.max_in_flight:
            self.slot_freed.clear()
            await self.slot_freed.wait()
        if self.idle:
            return self.idle.pop()
        slot = self.target.open_slot()
        self.all_slots.append(slot)
        return slot

    async def _one(self, slot: Slot, due_s: float, timeout_s: float) -> None:
        sent_s = self.timer.now()
        lag_s = sent_s - due_s
        if lag_s > LATE_S:
            self.num_behind += 1
        self.max_lag_s = max(self.max_lag_s, lag_s)
        outcome = await send_once(slot, timeout_s)
        record = RequestRecord(due_s, sent_s, self.timer.now(), outcome)
        (self.drained if self.stopping else self.loop.completed).append(record)
        self.idle.append(slot)
        self.slot_freed.set()

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for slot in self.all_slots:
            slot.close()


async def run_open_loop(
    target: Target,
    rate_per_s: float,
    plan: MeasurePlan,
    timer: Timer,
    *,
    arrivals: ArrivalKind = "poisson",
    burstiness: float = 1.0,
    seed: int = 0,
    max_in_flight: int = 1024,
    timeout_s: float = 30.0,
    hooks: PointHooks | None = None,
) -> RawPoint:
    """Send at `rate_per_s` through warm-up and the measurement windows, then drain."""
    start_s = timer.now()
    schedule = Schedule(arrivals, rate_per_s, start_s, seed=seed, burstiness=burstiness)
    measurement = Measurement(plan, start_s)
    loop = WindowLoop(timer, measurement, hooks or PointHooks())
    dispatcher = Dispatcher(target, timer, loop, max_in_flight)
    sender = asyncio.create_task(dispatcher.run(schedule, timeout_s))
    try:
        await loop.run()
        dispatcher.stopping = True
        # Requests in flight at the end still count: a stall in progress must show.
        while dispatcher.tasks:
            await asyncio.gather(*dispatcher.tasks)
    finally:
        sender.cancel()
        dispatcher.close()
    measurement.add_drained(dispatcher.drained)
    return RawPoint(measurement, loop.client_cpu, dispatcher.num_behind, dispatcher.max_lag_s)
