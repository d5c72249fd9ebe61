"""Closed loop: N slots, each sends its next request as soon as its previous one answered."""

from __future__ import annotations

import asyncio

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


async def run_closed_loop(
    target: Target,
    concurrency: int,
    plan: MeasurePlan,
    timer: Timer,
    *,
    timeout_s: float = 30.0,
    hooks: PointHooks | None = None,
) -> RawPoint:
    """Keep `concurrency` requests in flight through warm-up and the measurement windows."""
    measurement = Measurement(plan, timer.now())
    loop = WindowLoop(timer, measurement, hooks or PointHooks())
    stopping = False
    drained: list[RequestRecord] = []

    async def worker(slot: Slot) -> None:
        while not stopping:
            sent_s = timer.now()
            outcome = await send_once(slot, timeout_s)
            record = RequestRecord(sent_s, sent_s, timer.now(), outcome)
            # After the last cut, records go to `drained`: counted, but in no window.
            (drained if stopping else loop.completed).append(record)

    slots = [target.open_slot() for _ in range(concurrency)]
    workers = [asyncio.create_task(worker(slot)) for slot in slots]
    try:
        await loop.run()
        stopping = True
        await asyncio.gather(*workers)
    finally:
        for task in workers:
            task.cancel()
        for slot in slots:
            slot.close()
    measurement.add_drained(drained)
    return RawPoint(measurement, loop.client_cpu)
