"""Measurement windows: warm-up dropped, stability rule, time and count bounds."""

from __future__ import annotations

import pytest

from fulcrum.errors import InvalidInput
from fulcrum.loadgen.records import Outcome, RequestRecord
from fulcrum.loadgen.windows import (
    Measurement,
    MeasurePlan,
    WindowStats,
    is_stable,
    window_stats,
    within_pct,
)


def done_at(done_s: float, latency_s: float = 0.01, status: int = 200) -> RequestRecord:
    return RequestRecord(done_s - latency_s, done_s - latency_s, done_s, Outcome(status))


def window(num_ok: int, mean_latency_s: float) -> WindowStats:
    return WindowStats(0.0, 1.0, num_ok, num_ok, mean_latency_s)


def test_window_stats_count_only_successes_for_throughput_and_latency() -> None:
    records = [done_at(0.5, 0.01), done_at(0.6, 0.03), done_at(0.7, 5.0, status=500)]
    stats = window_stats(0.0, 2.0, records)
    assert stats.num_done == 3 and stats.num_ok == 2
    assert stats.throughput_rps == 1.0
    assert stats.mean_latency_s == pytest.approx(0.02)


def test_stability_needs_the_last_windows_to_agree() -> None:
    assert within_pct([100, 105, 95], 10)
    assert not within_pct([100, 125, 95], 10)
    agreeing = [window(50, 0.5), window(100, 0.010), window(104, 0.0102), window(98, 0.0099)]
    assert is_stable(agreeing, 3, 10)
    assert not is_stable(agreeing, 4, 10)  # the first window (warming) disagrees
    assert not is_stable(agreeing[:2], 3, 10)  # too few windows
    slow_tail = [window(100, 0.010), window(100, 0.010), window(100, 0.020)]
    assert not is_stable(slow_tail, 3, 10)  # same throughput, latency drifting
    assert not is_stable([window(0, 0.0)] * 3, 3, 10)  # nothing completed is not stable


def test_measurement_drops_warmup_and_stops_when_stable() -> None:
    plan = MeasurePlan(warmup_s=1.0, window_s=1.0, max_duration_s=10.0, stability_pct=10.0)
    measurement = Measurement(plan, start_s=0.0)
    assert measurement.next_cut_s == 2.0
    first = measurement.close_window(
        2.0, [done_at(0.5), *[done_at(1.0 + i / 10) for i in range(10)]]
    )
    assert first.num_done == 10  # the warm-up completion is dropped
    assert not measurement.done()
    for end_s in (3.0, 4.0):
        measurement.close_window(end_s, [done_at(end_s - 1 + i / 10) for i in range(10)])
    assert measurement.stable and measurement.done()
    assert len(measurement.records) == 30
    assert measurement.duration_s == 3.0


def test_measurement_stops_at_the_time_bound_and_the_count_bound() -> None:
    plan = MeasurePlan(warmup_s=0.0, window_s=1.0, max_duration_s=2.0, stability_pct=1.0)
    measurement = Measurement(plan, start_s=0.0)
    measurement.close_window(1.0, [done_at(0.5)] * 5)
    assert not measurement.done()
    measurement.close_window(2.0, [done_at(1.5)] * 50)
    assert measurement.done() and not measurement.stable

    by_count = Measurement(MeasurePlan(warmup_s=0, window_s=1, max_requests=20), start_s=0.0)
    by_count.close_window(1.0, [done_at(0.5)] * 25)
    assert by_count.done()


def test_late_cut_shifts_the_next_window_and_drained_are_kept_apart() -> None:
    measurement = Measurement(MeasurePlan(warmup_s=0.0, window_s=1.0), start_s=0.0)
    measurement.close_window(1.3, [done_at(1.2)])  # woke 0.3 s late
    assert measurement.next_cut_s == pytest.approx(2.3)
    measurement.add_drained([done_at(2.5, 1.0)])
    assert len(measurement.records) == 1 and len(measurement.drained) == 1


def test_plan_rejects_nonsense() -> None:
    with pytest.raises(InvalidInput):
        MeasurePlan(window_s=0)
    with pytest.raises(InvalidInput):
        MeasurePlan(num_stable=0)
