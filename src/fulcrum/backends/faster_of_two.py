"""Picks the faster of two ways to run the same work from their measured run times.

Spinning threads make a lone run faster on idle cores and slower on cores shared with other
processes, so which session serves a lone batch is measured, not assumed: the favourite runs
most batches, the other one now and then, so its estimate follows the machine.

- The favourite's estimate is the median time per row of its last `WINDOW` runs. On a shared machine
  a two-thread run now and then takes 2-3x its usual time (a pool thread preempted); a moving
  mean over two such runs in a row handed the lone batches to a session slower at the median.
- Each exploring run costs a request what the other choice is slower by. While exploring keeps
  confirming a clear loss (the run and the other's median both over 20% slower, from its third
  measured run on), it comes half as often each time: every `explore_every`-th pick, doubling
  up to `max_explore_every`. A close or reversed result brings the interval back at once.
- The favourite's own estimate is fresh from every run, so a favourite that slows down is
  dropped as soon as its median passes the other's, however wide the interval.
- An exploring run faster than the favourite's median is followed by another at once, and so on
  while they keep winning: the other's window, filled one run per interval, may hold runs from a
  slow spell long past. For the same reason the other's estimate is the median of its last
  `OTHER_WINDOW` runs, and a choice that takes over drops its older ones. Without these, 4 of 6
  fresh servers on a 2-core VM handed 39-61% of their first 150 lone runs to the slower session.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

FIRST, SECOND = 0, 1
# Runs of the favourite whose median is its estimate: a two-thread lone run's time on a shared
# 2-core VM is wide (a median of 5.3 ms with runs of 3.3-17), so a median of 8 runs fell above
# the other session's steady 6.8 ms often enough to hand it lone runs (replaying measured runs:
# 23% of them, against 15% with 16).
WINDOW = 16
# An exploring run this much slower per row than the favourite's median is a clear loss.
CLEAR_LOSS = 1.2
# The other choice's estimate is the median of its last few runs only: they come one per
# exploring interval (8-64 picks), so a full window would reach back minutes.
OTHER_WINDOW = 5
# Each choice's first run is not measured: right after a load its caches are cold and ORT
# allocates its buffers, a run several times slower than any later one.
UNMEASURED_RUNS = 1
# Measured runs of the other choice before a loss may widen the interval.
MIN_RUNS_TO_WIDEN = 3


class FasterOfTwo:
    """The median seconds per row of each of two choices' last runs (the favourite's last
    `WINDOW`, the other's last `OTHER_WINDOW`); `pick` the faster, trying the other now and
    then.

    Pure and deterministic (no clock, no randomness): the caller times each run and reports it
    with `observe`. A choice not yet measured is picked first (FIRST before SECOND), twice: its
    first run is not measured.
    """

    def __init__(self, *, explore_every: int = 8, max_explore_every: int = 64) -> None:
        if explore_every < 2:
            raise ValueError("explore_every must be at least 2")
        if max_explore_every < explore_every:
            raise ValueError("max_explore_every must be at least explore_every")
        self.explore_every = explore_every
        self.max_explore_every = max_explore_every
        self.interval = explore_every  # picks from one exploring pick to the next, now
        self.runs: tuple[deque[float], deque[float]] = (deque(maxlen=WINDOW), deque(maxlen=WINDOW))
        self.per_row_s = [math.nan, math.nan]  # the medians
        self.num_runs = [0, 0]  # observed, per choice
        # Every measured run's seconds and rows, per choice: the mean per row over a whole
        # measurement, where the medians above are a snapshot of the last few runs.
        self.total_s = [0.0, 0.0]
        self.total_rows = [0, 0]
        self.num_picks = 0
        self._since_explore = 0

    @property
    def favourite(self) -> int:
        """The choice with the lower median time per row (FIRST until both are measured)."""
        first, second = self.per_row_s
        return SECOND if second < first else FIRST  # a NaN compares False: FIRST

    @property
    def explore_interval(self) -> int:
        """Picks from one exploring pick to the next: `interval`, never below `explore_every`
        (which a caller may raise at any time)."""
        return max(self.interval, self.explore_every)

    @property
    def mean_per_row_s(self) -> list[float]:
        """Each choice's mean seconds per row over all its measured runs (NaN before one)."""
        return [
            total / rows if rows else math.nan
            for total, rows in zip(self.total_s, self.total_rows, strict=True)
        ]

    def pick(self) -> int:
        """FIRST or SECOND: the favourite, or the other one every `explore_interval`-th pick."""
        self.num_picks += 1
        unmeasured = [i for i in (FIRST, SECOND) if math.isnan(self.per_row_s[i])]
        if unmeasured:
            return unmeasured[0]
        self._since_explore += 1
        if self._since_explore >= self.explore_interval:
            self._since_explore = 0
            return 1 - self.favourite
        return self.favourite

    def _estimate(self) -> None:
        """Each choice's median: over its whole window for the favourite (fresh from every
        run), over its last `OTHER_WINDOW` runs for the other (one per exploring interval)."""
        favourite = self.favourite
        for choice, runs in enumerate(self.runs):
            latest = list(runs) if choice == favourite else list(runs)[-OTHER_WINDOW:]
            self.per_row_s[choice] = statistics.median(latest) if latest else math.nan

    def observe(self, choice: int, run_s: float, num_rows: int) -> None:
        """Add one run of `choice` (its seconds and rows) to its window; after an exploring
        run, explore again at once if it beat the favourite, widen the exploring interval on a
        clear loss, else narrow it back."""
        per_row_s = run_s / max(1, num_rows)
        favourite = self.favourite
        best_s = self.per_row_s[favourite]
        self.num_runs[choice] += 1
        if self.num_runs[choice] <= UNMEASURED_RUNS:
            return
        self.runs[choice].append(per_row_s)
        self.total_s[choice] += run_s
        self.total_rows[choice] += max(1, num_rows)
        self._estimate()
        if self.favourite != favourite and not math.isnan(best_s):
            # The other took over on its latest runs: its older ones, spread over many
            # intervals, may be from a slow spell long past, and would pull it straight back.
            taken = self.runs[self.favourite]
            latest = list(taken)[-OTHER_WINDOW:]
            taken.clear()
            taken.extend(latest)
            self._estimate()
        measured = self.num_runs[choice] - UNMEASURED_RUNS
        if choice == favourite or math.isnan(best_s):
            return
        if per_row_s < best_s and self.favourite == favourite:
            self._since_explore = self.explore_interval - 1  # the next pick explores again
        if measured < MIN_RUNS_TO_WIDEN:
            return
        clear = min(per_row_s, self.per_row_s[choice]) > CLEAR_LOSS * best_s
        if clear and self.favourite == favourite:
            self.interval = min(2 * self.interval, self.max_explore_every)
        else:
            self.interval = self.explore_every
