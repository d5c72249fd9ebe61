"""IdleGaps on a fake clock: sparse runs at light load, never under back-to-back batches."""

from __future__ import annotations

import random

from fulcrum.backends.idle_gaps import MAX_GAP_FACTOR, IdleGaps


class Runs:
    """Drives an IdleGaps through runs on a fake clock; records each run's verdict."""

    def __init__(self, min_gap_s: float = 0.05) -> None:
        self.gaps = IdleGaps(min_gap_s)
        self.now_s = 1000.0
        self.sparse: list[bool] = []

    def run(self, *, idle_s: float, run_s: float) -> None:
        self.now_s += idle_s
        self.sparse.append(self.gaps.start(self.now_s))
        self.now_s += run_s
        self.gaps.end(self.now_s)


def test_the_first_run_is_sparse() -> None:
    runs = Runs()
    runs.run(idle_s=0.0, run_s=0.01)
    assert runs.sparse == [True]


def test_short_runs_far_apart_are_sparse() -> None:
    runs = Runs()
    for _ in range(50):  # 10 requests/s of 8 ms each: the instance idles ~92 ms between runs
        runs.run(idle_s=0.092, run_s=0.008)
    assert all(runs.sparse)


def test_long_batches_back_to_back_are_load_however_long_each_runs() -> None:
    # 60 ms batches, each starting as the last ends: 60 ms from start to start is more than the
    # 50 ms threshold, which a start-to-start gap took for light load; the instance never idles.
    runs = Runs(min_gap_s=0.05)
    for _ in range(60):
        runs.run(idle_s=0.0005, run_s=0.060)
    assert runs.sparse[:1] == [True]  # after the idle before the first run
    assert not any(runs.sparse[16:])  # within 16 runs, and from then on: load
    assert runs.gaps.mean_gap_s < 0.005


def test_load_after_a_long_idle_is_seen_within_sixteen_runs() -> None:
    runs = Runs(min_gap_s=0.05)
    runs.run(idle_s=3600.0, run_s=0.01)  # an hour idle counts as MAX_GAP_FACTOR gaps, no more
    assert runs.gaps.mean_gap_s == MAX_GAP_FACTOR * 0.05
    for _ in range(16):
        runs.run(idle_s=0.002, run_s=0.01)
    assert runs.sparse[-2:] == [True, False]  # 0.9 ** 15 of 5 gaps is still one gap


def test_sparse_again_when_load_falls() -> None:
    runs = Runs(min_gap_s=0.05)
    for _ in range(20):
        runs.run(idle_s=0.001, run_s=0.03)
    assert runs.sparse[-1] is False
    for _ in range(6):
        runs.run(idle_s=0.2, run_s=0.008)
    assert runs.sparse[-3:] == [True, True, True]


def test_a_zero_threshold_is_always_sparse() -> None:
    runs = Runs(min_gap_s=0.0)
    for _ in range(5):
        runs.run(idle_s=0.0, run_s=0.05)
    assert all(runs.sparse)


def test_a_run_that_starts_while_another_runs_had_no_idle_gap() -> None:
    """Instances sharing one backend overlap their runs: such a start is load, not idleness."""
    gaps = IdleGaps(0.05)
    assert gaps.start(0.0)  # the first run after a long idle
    gaps.end(0.01)
    assert gaps.start(1.0)  # idle for a second: sparse
    for i in range(60):  # a second run starts before each one ends
        gaps.start(1.0 + i * 0.01 + 0.005)
        gaps.end(1.0 + i * 0.01 + 0.01)
    assert gaps.mean_gap_s < 0.005
    gaps.end(1.7)
    assert not gaps.start(1.7)  # runs back to back, not sparse


def test_poisson_arrivals_at_ten_per_second_read_as_sparse_at_fifty_as_load() -> None:
    """The mean of exponential gaps scatters: it must not dip under the threshold often at
    10 requests/s (each dip moves a lone request off the spinning session)."""
    rnd = random.Random(7)
    for rate, lowest, highest in ((10.0, 0.99, 1.0), (50.0, 0.0, 0.01)):
        runs = Runs(min_gap_s=0.05)
        for _ in range(4000):
            runs.run(idle_s=rnd.expovariate(rate), run_s=0.005)
        share = sum(runs.sparse[100:]) / len(runs.sparse[100:])
        assert lowest <= share <= highest, (rate, share)
