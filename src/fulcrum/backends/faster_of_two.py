"""Picks the faster of two ways to run the same work from their measured run times.

Spinning threads make a lone run faster on idle cores and slower on cores shared with other
processes, so which session serves a lone batch is measured, not assumed: the favourite runs
most batches, the other one every `explore_every`-th, so its estimate follows the machine.
"""

from __future__ import annotations

import math

FIRST, SECOND = 0, 1


class FasterOfTwo:
    """Smoothed seconds per row of two choices; `pick` the faster, trying the other now and then.

    Pure and deterministic (no clock, no randomness): the caller times each run and reports it
    with `observe`. A choice not yet measured is picked first (FIRST before SECOND).
    """

    def __init__(self, *, explore_every: int = 8, weight: float = 0.2) -> None:
        if explore_every < 2:
            raise ValueError("explore_every must be at least 2")
        if not 0 < weight <= 1:
            raise ValueError("weight must be in (0, 1]")
        self.explore_every = explore_every
        self.weight = weight  # of the newest run in the moving average
        self.per_row_s = [math.nan, math.nan]
        self.num_picks = 0

    @property
    def favourite(self) -> int:
        """The choice with the lower smoothed time per row (FIRST until both are measured)."""
        first, second = self.per_row_s
        return SECOND if second < first else FIRST  # a NaN compares False: FIRST

    def pick(self) -> int:
        """FIRST or SECOND: the favourite, or the other one every `explore_every`-th pick."""
        self.num_picks += 1
        unmeasured = [i for i in (FIRST, SECOND) if math.isnan(self.per_row_s[i])]
        if unmeasured:
            return unmeasured[0]
        if self.num_picks % self.explore_every == 0:
            return 1 - self.favourite
        return self.favourite

    def observe(self, choice: int, run_s: float, num_rows: int) -> None:
        """Fold one run of `choice` (its seconds and rows) into its average."""
        per_row_s = run_s / max(1, num_rows)
        old = self.per_row_s[choice]
        self.per_row_s[choice] = (
            per_row_s if math.isnan(old) else old + self.weight * (per_row_s - old)
        )
