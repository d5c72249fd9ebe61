"""Measurement windows after a warm-up, and perf_analyzer's stability rule to stop a point.

A point is stable when the last `num_stable` windows agree, in throughput and mean latency,
within `stability_pct` percent of their average. Measurement stops when stable, or when the
time or request-count bound is reached; requests are assigned to windows by completion time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from fulcrum.errors import InvalidInput
from fulcrum.loadgen.records import RequestRecord


class MeasurePlan(msgspec.Struct, frozen=True, kw_only=True):
    """How long to warm up and measure one point."""

    warmup_s: float = 1.0
    window_s: float = 2.0
    max_duration_s: float = 10.0  # measured time, warm-up excluded
    max_requests: int = 0  # 0: no bound on the count
    num_stable: int = 3
    stability_pct: float = 10.0

    def __post_init__(self) -> None:
        if self.window_s <= 0 or self.max_duration_s <= 0 or self.warmup_s < 0:
            raise InvalidInput("window and duration must be > 0 and warm-up >= 0")
        if self.num_stable < 1 or self.stability_pct <= 0:
            raise InvalidInput("num_stable must be >= 1 and stability_pct > 0")


@dataclass(slots=True)
class WindowStats:
    """What one window measured."""

    start_s: float
    end_s: float
    num_done: int
    num_ok: int
    mean_latency_s: float

    @property
    def throughput_rps(self) -> float:
        return self.num_ok / (self.end_s - self.start_s)


def window_stats(start_s: float, end_s: float, records: Sequence[RequestRecord]) -> WindowStats:
    """Throughput and mean latency of the requests that completed in [start_s, end_s)."""
    latencies_s = [r.latency_s for r in records if r.outcome.ok]
    mean_s = sum(latencies_s) / len(latencies_s) if latencies_s else 0.0
    return WindowStats(start_s, end_s, len(records), len(latencies_s), mean_s)


def within_pct(values: Sequence[float], pct: float) -> bool:
    """Every value lies within `pct` percent of the values' mean."""
    mean = sum(values) / len(values)
    if mean == 0:
        return all(v == 0 for v in values)
    return all(abs(v - mean) <= mean * pct / 100.0 for v in values)


def is_stable(windows: Sequence[WindowStats], num_stable: int, stability_pct: float) -> bool:
    """The last `num_stable` windows agree in throughput and mean latency; none is empty."""
    if len(windows) < num_stable:
        return False
    last = windows[-num_stable:]
    if any(w.num_ok == 0 for w in last):
        return False
    return within_pct([w.throughput_rps for w in last], stability_pct) and within_pct(
        [w.mean_latency_s for w in last], stability_pct
    )


class Measurement:
    """Cuts completed requests into windows and says when to stop measuring."""

    def __init__(self, plan: MeasurePlan, start_s: float) -> None:
        self.plan = plan
        self.measure_start_s = start_s + plan.warmup_s
        self.windows: list[WindowStats] = []
        self.records: list[RequestRecord] = []
        self.drained: list[RequestRecord] = []

    @property
    def next_cut_s(self) -> float:
        """When the window being measured closes."""
        # From the last actual cut: a late wake-up shifts later windows instead of shrinking one.
        last_s = self.windows[-1].end_s if self.windows else self.measure_start_s
        return last_s + self.plan.window_s

    @property
    def stable(self) -> bool:
        return is_stable(self.windows, self.plan.num_stable, self.plan.stability_pct)

    def close_window(self, end_s: float, completed: Sequence[RequestRecord]) -> WindowStats:
        """Account the requests completed since the last cut (warm-up ones are dropped)."""
        start_s = self.windows[-1].end_s if self.windows else self.measure_start_s
        kept = [r for r in completed if r.done_s >= self.measure_start_s]
        self.records.extend(kept)
        window = window_stats(start_s, end_s, kept)
        self.windows.append(window)
        return window

    def done(self) -> bool:
        """Stable, or out of time, or out of requests."""
        if not self.windows:
            return False
        elapsed_s = self.windows[-1].end_s - self.measure_start_s
        out_of_requests = 0 < self.plan.max_requests <= len(self.records)
        # A tiny epsilon: windows close on float deadlines that sum to the duration.
        out_of_time = elapsed_s >= self.plan.max_duration_s - 1e-9
        return self.stable or out_of_time or out_of_requests

    def add_drained(self, records: Sequence[RequestRecord]) -> None:
        """Requests still in flight at the end: counted, so a stall cannot hide (not windowed)."""
        self.drained.extend(r for r in records if r.done_s >= self.measure_start_s)

    @property
    def duration_s(self) -> float:
        """Measured time: from the end of warm-up to the last cut."""
        return self.windows[-1].end_s - self.measure_start_s if self.windows else 0.0
