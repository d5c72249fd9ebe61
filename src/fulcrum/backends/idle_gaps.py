"""Whether an instance's runs are sparse: the smoothed idle time between one run and the next.

The idle time is from the end of a run to the start of the next, not start to start: under load
a run starts as soon as the last one ends, however long each takes, so long batches back to
back read as load (start-to-start gaps as long as the batches would read as light load).
Instances sharing one backend overlap their runs: a run that starts while another runs had no
idle gap before it.
"""

from __future__ import annotations

import math

# Weight of the newest idle gap in the mean. Poisson gaps scatter as widely as their mean: at
# 0.25 the mean of 10 requests/s (100 ms gaps) fell under a 50 ms threshold for ~5% of runs,
# at 0.1 for ~0.3%, while 50 requests/s still reads as load on all but ~0.1%.
GAP_WEIGHT = 0.1
# A long idle counts as this many sparse gaps, so load that then begins is seen within 16 runs.
MAX_GAP_FACTOR = 5


class IdleGaps:
    """Smoothed idle seconds between runs; `start(now)` says whether runs are sparse.

    Pure: the caller passes its clock's readings (`perf_counter` in the backend, a fake in
    tests). Not thread-safe: callers on several threads hold a lock around each call.
    """

    def __init__(self, min_gap_s: float) -> None:
        self.min_gap_s = min_gap_s  # sparse: a mean idle gap of at least this
        self.mean_gap_s = math.inf  # none yet
        self._last_end_s = -math.inf
        self._running = 0  # runs started and not yet ended

    def start(self, now_s: float) -> bool:
        """A run starts: fold the idle gap since the last run's end; whether runs are sparse."""
        idle_s = 0.0 if self._running else max(0.0, now_s - self._last_end_s)
        gap_s = min(idle_s, MAX_GAP_FACTOR * self.min_gap_s)
        self._running += 1
        if math.isinf(self.mean_gap_s):
            self.mean_gap_s = gap_s
        else:
            self.mean_gap_s += GAP_WEIGHT * (gap_s - self.mean_gap_s)
        return self.sparse

    @property
    def sparse(self) -> bool:
        """Whether runs are sparse now: the mean idle gap is at least the threshold (true
        before any run: the first comes after an idle)."""
        return self.mean_gap_s >= self.min_gap_s

    def end(self, now_s: float) -> None:
        """A run has ended."""
        self._running = max(0, self._running - 1)
        self._last_end_s = now_s
