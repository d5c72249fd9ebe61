"""An online model of one batch's run time on one instance: t(b) = a + c·b, fitted as batches run.

Weighted least squares over exponentially forgotten sums (fresh as the machine drifts), with each
observation clipped to a band around the prediction (one slow outlier moves it little), and a
fast path: several observations in a row far off the prediction mean the machine changed speed
(another tenant, thermal throttling, a swapped GPU), so the fit is rescaled to them at once
instead of being dragged there over dozens of batches. `error` is a high quantile of how much
slower than the fit batches run (the noise of a shared machine), for plans that must hold at the
P99, not on average. Pure arithmetic, O(1) per batch (a sort of 256 ratios every 16 batches).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FORGET = 0.97  # weight kept per observation: a memory of ~33 batches
CLIP = 2.0  # an observation counts as at most CLIP x (at least 1/CLIP x) the prediction
SHIFT_RATIO = 1.6  # off by this factor ...
SHIFT_RUN = 3  # ... this many times in a row (same direction): the speed changed
PRIOR_A_S = 0.001  # before any batch: 1 ms fixed cost ...
PRIOR_C_S = 0.0001  # ... and 0.1 ms a row: only their ratio matters once one batch is seen
MIN_WEIGHT = 1.0  # below this much evidence the prediction is not trusted to clip
MIN_SPREAD = 0.25  # rows² of weighted variance below which the slope is not identifiable
# How much slower than predicted a batch may run: a high quantile of observed / predicted over
# the last ERROR_WINDOW batches, recomputed every ERROR_EVERY (a sort of the window).
ERROR_WINDOW = 256
ERROR_QUANTILE = 0.99
ERROR_EVERY = 16
MAX_ERROR = 3.0


@dataclass(frozen=True, slots=True)
class Fit:
    """The model's current coefficients (seconds) and how much evidence stands behind them."""

    a_s: float
    c_s: float
    weight: float
    num_shifts: int


class LatencyModel:
    """t(b) = a + c·b, refitted after every observed batch; `predict` is the hot path."""

    def __init__(self) -> None:
        self._sw = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self.a_s, self.c_s = PRIOR_A_S, PRIOR_C_S
        self.num_observed = 0
        self.num_shifts = 0  # speed changes detected
        self._run = 0  # signed: consecutive observations far above (+) or below (-)
        # A high quantile of observed / predicted run time (>= 1): a batch planned to end by a
        # deadline must end by it in (nearly) every run, not on average.
        self.error = 1.0
        self._ratios: list[float] = []
        self._next_ratio = 0
        self._num_ratios = 0

    def predict(self, num_rows: int) -> float:
        """Predicted seconds for a batch of `num_rows` rows on one instance."""
        return self.a_s + self.c_s * num_rows

    def predict_high(self, num_rows: int) -> float:
        """Seconds a batch of `num_rows` rows takes in all but its slowest runs."""
        return self.predict(num_rows) * self.error

    def max_rows(self, budget_s: float) -> int:
        """The largest batch predicted to run within `budget_s` (0 when not even one row)."""
        if budget_s < self.a_s + self.c_s:
            return 0
        if self.c_s <= 0:
            return 1 << 30
        return int((budget_s - self.a_s) / self.c_s + 1e-9)

    @property
    def trusted(self) -> bool:
        """True once enough batches were seen for the fit to stand on its own."""
        return self._sw >= MIN_WEIGHT

    def fit(self) -> Fit:
        return Fit(self.a_s, self.c_s, self._sw, self.num_shifts)

    def observe(self, num_rows: int, seconds: float) -> None:
        """Feed one batch's observed run time; updates the fit."""
        if num_rows < 1 or not seconds > 0 or math.isinf(seconds):
            return
        self.num_observed += 1
        predicted = self.predict(num_rows)
        if self.trusted and self._shifted(seconds / predicted):
            # The machine changed speed: scale what we know by the new ratio and keep little
            # weight on the past, so the next observations settle the fit (no ping-pong: the
            # scaled prediction is already near them, so the run does not trigger again).
            self._rescale(seconds / predicted)
        elif self.trusted:
            raw_s, seconds = seconds, min(max(seconds, predicted / CLIP), predicted * CLIP)
            self._add(num_rows, seconds)
            self._solve()
            # Against the fit that includes it: the noise around the fit, not the time the
            # fit takes to learn a new speed (which the shift above handles); so the errors
            # measured before a speed change stay valid after it (a noisy machine also
            # "changes speed" often: the window must outlive that).
            self._track_error(raw_s / self.predict(num_rows))
            return
        self._add(num_rows, seconds)
        self._solve()

    def _shifted(self, ratio: float) -> bool:
        if ratio >= SHIFT_RATIO:
            self._run = max(self._run, 0) + 1
        elif ratio <= 1 / SHIFT_RATIO:
            self._run = min(self._run, 0) - 1
        else:
            self._run = 0
        if abs(self._run) >= SHIFT_RUN:
            self._run = 0
            self.num_shifts += 1
            return True
        return False

    def _track_error(self, ratio: float) -> None:
        if len(self._ratios) < ERROR_WINDOW:
            self._ratios.append(ratio)
        else:
            self._ratios[self._next_ratio] = ratio
            self._next_ratio = (self._next_ratio + 1) % ERROR_WINDOW
        self._num_ratios += 1
        if self._num_ratios % ERROR_EVERY == 0:
            ordered = sorted(self._ratios)
            at = min(len(ordered) - 1, math.ceil(ERROR_QUANTILE * len(ordered)) - 1)
            self.error = min(max(1.0, ordered[at]), MAX_ERROR)

    def _rescale(self, ratio: float) -> None:
        keep = MIN_WEIGHT / max(self._sw, MIN_WEIGHT)  # the past counts as one batch
        self._sw *= keep
        self._sx *= keep
        self._sxx *= keep
        self._sy *= keep * ratio
        self._sxy *= keep * ratio
        self.a_s *= ratio
        self.c_s *= ratio

    def _add(self, x: float, y: float) -> None:
        f = FORGET
        self._sw = self._sw * f + 1.0
        self._sx = self._sx * f + x
        self._sy = self._sy * f + y
        self._sxx = self._sxx * f + x * x
        self._sxy = self._sxy * f + x * y

    def _solve(self) -> None:
        sw = self._sw
        mean_x, mean_y = self._sx / sw, self._sy / sw
        var_x = self._sxx / sw - mean_x * mean_x
        if var_x < MIN_SPREAD:
            # One batch size seen: the split between fixed and per-row cost is unknown, so keep
            # the current split and scale it to match what was observed.
            scale = mean_y / (self.a_s + self.c_s * mean_x)
            self.a_s *= scale
            self.c_s *= scale
            return
        c = (self._sxy / sw - mean_x * mean_y) / var_x
        a = mean_y - c * mean_x
        if c < 0:  # bigger batches are never cheaper: flat
            a, c = mean_y, 0.0
        elif a < 0:  # no negative fixed cost: a line through the origin
            a, c = 0.0, self._sxy / self._sxx
        self.a_s, self.c_s = a, c
