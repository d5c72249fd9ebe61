"""An online model of one batch's run time on one instance: t(b) = a + c·b, fitted as batches run.

Weighted least squares over exponentially forgotten sums (fresh as the machine drifts), with each
observation clipped to a band around the prediction (one slow outlier moves it little), and a
fast path: several observations in a row far off the prediction mean the machine changed speed
(another tenant, thermal throttling, a swapped GPU), so the fit is rescaled to them at once
instead of being dragged there over dozens of batches. `error` is a high quantile of how much
slower than the fit batches run (the noise of a shared machine), for plans that must hold at the
P99, not on average. Pure arithmetic, O(1) per batch over the size classes seen so far (and a
sort of 256 ratios every 16 batches).

The sums are kept per size class (powers of two), and a class's evidence is forgotten only down
to one batch's worth while other sizes run: a burst of 13-16-row batches alone cannot place the
line (its slope is noise over a narrow band, so the line may meet b = 1 anywhere from 0 to a full
batch's time), but with the last lone rows still in the sums the fit is pinned at both ends. A
size the fit has no fresh evidence for is extrapolated, not measured: an observation there is
taken as it is (only a slow outlier is clipped) and never counts towards a change of speed, so
lone rows after a burst correct the fixed cost without dragging the per-row cost with them (a
loaded machine slows a 16-row batch 3x and a lone row far less), and a size whose evidence a
speed change rescaled (a guess) is corrected by its next batch at once, never by another shift.
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
MIN_SPREAD = 0.25  # rows² of weighted variance below which the slope is not identifiable ...
# ... nor where it stands less than this many standard errors above zero: from sizes 13-16 alone
# the line reaches b = 1 ten deviations away, where a shared machine's noise decides the slope
# (and with it whether a lone row is predicted at 1 ms or at a full batch's time).
MIN_SLOPE_T = 2.0
NUM_CLASSES = 16  # size classes 1, 2-3, 4-7, ... (the last takes every larger size)
FLOOR_WEIGHT = 1.0  # a class's evidence is forgotten down to this, not below, until seen again
# A class with this much weight has fresh evidence: its observations are clipped to the fit and
# may signal a speed change; below it (not seen for a while, or never) the fit is extrapolated.
FRESH_WEIGHT = 2.0
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
        # Per size class: weight and the weighted sums of x, y, x², xy, y² (forgotten per batch).
        self._sums = [[0.0] * 6 for _ in range(NUM_CLASSES)]
        self._sw = 0.0  # their total weight
        self.a_s, self.c_s = PRIOR_A_S, PRIOR_C_S
        self.num_observed = 0
        self.max_observed_rows = 0  # the largest batch ever observed
        self.num_shifts = 0  # speed changes detected
        self._run = 0  # signed: consecutive observations far above (+) or below (-)
        # A high quantile of observed / predicted run time (>= 1): a batch planned to end by a
        # deadline must end by it in (nearly) every run, not on average.
        self.error = 1.0
        self._ratios: list[float] = []
        self._held: list[float] = []  # ratios of the current run far off the fit
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

    def observe(self, num_rows: int, seconds: float, *, probe: bool = False) -> None:
        """Feed one batch's observed run time; updates the fit. `probe`: the batch ran only
        because the fit refused everything for a while (it predicted every request late)."""
        if num_rows < 1 or not seconds > 0 or math.isinf(seconds):
            return
        self.num_observed += 1
        self.max_observed_rows = max(self.max_observed_rows, num_rows)
        predicted = self.predict(num_rows)
        if not self.trusted:
            self._add(num_rows, seconds)
            return
        if probe and seconds * SHIFT_RATIO <= predicted:
            # A probe far faster than the fit is a speed change on its own: each probe costs
            # an SLO of refusals (a burst's contention made lone rows take 140 ms; once it
            # ended they took 15), so waiting for SHIFT_RUN of them refused light load for
            # seconds. Only downwards: an optimistic fit is corrected by the batches it admits.
            self.num_shifts += 1
            self._run = 0
            self._held.clear()
            self._rescale(seconds / predicted)
            return
        if self._sums[_size_class(num_rows)][0] < FRESH_WEIGHT:
            # An extrapolated size: the prediction is a guess, not a band to clip to, and a
            # miss says nothing about the machine's speed. Faster than the guess is believed
            # (a refusal could never correct it; an admission runs and is measured again);
            # only a slow outlier is clipped, as one would be at a familiar size.
            self._add(num_rows, min(seconds, predicted * CLIP))
            return
        run_before = self._run
        if self._shifted(seconds / predicted):
            self._held.clear()  # the way to the new speed, not noise around it
            # The machine changed speed: scale what we know by the new ratio and keep little
            # weight on the past, so the next observations settle the fit (no ping-pong: the
            # scaled prediction is already near them, and each size's next observation is
            # taken as it is, below FRESH_WEIGHT, so the run does not trigger again).
            self._rescale(seconds / predicted)
            return
        self._add(num_rows, min(max(seconds, predicted / CLIP), predicted * CLIP))
        self._note_error(seconds / self.predict(num_rows), run_before)

    def _note_error(self, ratio: float, run_before: int) -> None:
        # Against the fit that includes it: the noise around the fit, not the time the fit
        # takes to learn a new speed (which the shift handles); so the errors measured before a
        # speed change stay valid after it (a noisy machine also "changes speed" often: the
        # window must outlive that). Observations in a run far off the fit are held back until
        # the run ends: if it ends in a shift they were the way to the new speed (counted, the
        # first SHIFT_RUN - 1 of them set the P99 of the next 256 batches at the jump's ratio);
        # if it breaks off they were noise after all.
        if not self._run or (run_before > 0) != (self._run > 0):
            for held in self._held:
                self._track_error(held)
            self._held.clear()
        if self._run:
            self._held.append(ratio)
        else:
            self._track_error(ratio)

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
        for sums in self._sums:
            for i, power in enumerate((0, 0, 1, 0, 1, 2)):  # y's power in w, x, y, x², xy, y²
                sums[i] *= keep * ratio**power
        self._sw *= keep
        self.a_s *= ratio
        self.c_s *= ratio

    def _add(self, x: int, y: float) -> None:
        """Forget, add one observation, refit. One pass over the size classes seen so far (the
        rest hold no weight), summing the columns for the fit as it goes: on every batch, in
        the gap between a lone row's run and its answer."""
        target = _size_class(x)
        forgotten = tw = tx = ty = txx = txy = tyy = 0.0
        for index, sums in enumerate(self._sums):
            weight = sums[0]
            if weight:
                # Measured evidence is forgotten down to the floor only (the last lone rows stay
                # in the fit through a burst); below it (what a speed change rescaled) as usual.
                keep = max(FORGET, FLOOR_WEIGHT / weight) if weight >= FLOOR_WEIGHT else FORGET
                if keep != 1.0:
                    sums[:] = [value * keep for value in sums]
            elif index != target:
                continue
            forgotten += sums[0]
            if index == target:
                for i, value in enumerate((1.0, x, y, x * x, x * y, y * y)):
                    sums[i] += value
            w, sx, sy, sxx, sxy, syy = sums
            tw, tx, ty, txx, txy, tyy = tw + w, tx + sx, ty + sy, txx + sxx, txy + sxy, tyy + syy
        self._sw = forgotten + 1.0  # the evidence the fit stands on (`trusted`, `_rescale`)
        self._solve(tw, tx, ty, txx, txy, tyy)

    def _solve(self, sw: float, sx: float, sy: float, sxx: float, sxy: float, syy: float) -> None:
        mean_x, mean_y = sx / sw, sy / sw
        var_x = sxx / sw - mean_x * mean_x
        cov = sxy / sw - mean_x * mean_y
        c = cov / var_x if var_x >= MIN_SPREAD else 0.0
        # The slope's standard error: the scatter around the line over the spread of sizes.
        residual = max(0.0, syy / sw - mean_y * mean_y - c * cov)
        if c <= 0 or c * c * var_x * max(sw - 2.0, 1.0) < MIN_SLOPE_T**2 * residual:
            # The split between fixed and per-row cost is not identified (one size, a narrow
            # band, or a slope within the noise: bigger batches are never cheaper), so keep
            # the current split and scale it to match what was observed. Not a flat line at
            # the mean: that would predict a lone row at a full batch's time.
            scale = mean_y / (self.a_s + self.c_s * mean_x)
            self.a_s *= scale
            self.c_s *= scale
            return
        a = mean_y - c * mean_x
        if a < 0:  # no negative fixed cost: a line through the origin
            a, c = 0.0, sxy / sxx
        self.a_s, self.c_s = a, c


def _size_class(num_rows: int) -> int:
    return min(num_rows.bit_length() - 1, NUM_CLASSES - 1)
