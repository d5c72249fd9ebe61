"""The seams a load run is built on (a timer, a target with send slots) and the window loop.

Real runs use `PerfTimer` and an HTTP target; unit tests use a virtual-time timer and a fake
target, so coordinated-omission accounting is tested without sockets or sleeps.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Protocol

from fulcrum.client import ClientError, ClientTimeout
from fulcrum.errors import FulcrumError
from fulcrum.loadgen.records import STATUS_CONNECT_ERROR, STATUS_TIMEOUT, Outcome, RequestRecord
from fulcrum.loadgen.windows import Measurement, WindowStats


class Timer(Protocol):
    """Seconds on one clock, and a way to wait until a point on it."""

    def now(self) -> float: ...

    async def sleep_until(self, deadline_s: float) -> None: ...


class PerfTimer:
    """The real timer: `time.perf_counter()` and asyncio sleeps."""

    def now(self) -> float:
        return time.perf_counter()

    async def sleep_until(self, deadline_s: float) -> None:
        delay_s = deadline_s - time.perf_counter()
        if delay_s > 0:
            await asyncio.sleep(delay_s)


class Slot(Protocol):
    """One in-flight request slot (an HTTP connection): sends the target's next request."""

    async def send(self, timeout_s: float) -> Outcome: ...

    def close(self) -> None: ...


class Target(Protocol):
    """What is measured: hands out slots; each send picks the next prepared input."""

    def open_slot(self) -> Slot: ...


async def send_once(slot: Slot, timeout_s: float) -> Outcome:
    """One send; client-side failures become outcomes the generator counts, never a crash."""
    try:
        return await slot.send(timeout_s)
    except ClientTimeout as exc:
        return Outcome(STATUS_TIMEOUT, error=exc.message)
    except ClientError as exc:
        return Outcome(STATUS_CONNECT_ERROR, error=exc.message)
    except FulcrumError as exc:
        return Outcome(exc.status_code, error=exc.message)


class PointHooks:
    """What a run does around the measurement: progress, server statistics snapshots."""

    def on_window(self, window: WindowStats) -> None:
        """A window closed."""

    async def on_measure_start(self) -> None:
        """Warm-up ended; measurement begins."""

    async def on_measure_end(self) -> None:
        """The last window closed (requests in flight are still draining)."""


@dataclass(slots=True)
class RawPoint:
    """What one load level produced before it is summarized."""

    measurement: Measurement
    client_cpu: float  # process CPU seconds / wall seconds over the measured windows
    num_behind: int = 0  # open loop: sends later than `late_s` behind their schedule
    max_lag_s: float = 0.0


class WindowLoop:
    """Cuts the shared list of completed requests into windows until the measurement is done."""

    def __init__(self, timer: Timer, measurement: Measurement, hooks: PointHooks) -> None:
        self.timer = timer
        self.measurement = measurement
        self.hooks = hooks
        self.completed: list[RequestRecord] = []
        self._cpu_start_s = 0.0
        self._wall_start_s = 0.0
        self.client_cpu = 0.0

    async def run(self) -> None:
        """Returns when the measurement is stable or out of time or requests."""
        await self.timer.sleep_until(self.measurement.measure_start_s)
        await self.hooks.on_measure_start()
        self._cpu_start_s, self._wall_start_s = time.process_time(), time.perf_counter()
        while True:
            await self.timer.sleep_until(self.measurement.next_cut_s)
            completed, self.completed = self.completed, []
            self.hooks.on_window(self.measurement.close_window(self.timer.now(), completed))
            if self.measurement.done():
                break
        wall_s = time.perf_counter() - self._wall_start_s
        cpu_s = time.process_time() - self._cpu_start_s
        self.client_cpu = cpu_s / wall_s if wall_s > 0 else 0.0
        await self.hooks.on_measure_end()
