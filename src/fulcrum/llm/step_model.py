"""An online model of LLM step time against the tokens computed in the step: step_s ~= a + b * n.

Fitted by exponentially forgetting least squares (old steps fade, so the model follows a machine
whose speed drifts) with Huber weights (a single slow step, a GC pause or a noisy neighbour, moves
it little). Robustness must not hide a real change: a run of SHIFT_RUN same-signed outliers is
taken as a new speed, and the model restarts from that run.
"""

from __future__ import annotations

import math

FORGET = 0.97  # per observation: a sample's weight halves after about 23 steps
HUBER_K = 3.0  # residuals beyond this many scales are down-weighted
SHIFT_RUN = 4  # consecutive same-signed outliers that mean the speed changed
MIN_SAMPLES = 4  # observations before the model predicts
MIN_SPREAD = 0.05  # token counts must spread this share of their mean to identify the slope
SCALE_FLOOR = 0.05  # the residual scale is at least this share of the prediction


class StepTimeModel:
    """step_s ~= intercept_s + per_token_s * num_tokens, fitted online; pure and cheap."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.intercept_s = 0.0
        self.per_token_s = 0.0
        self.num_samples = 0
        self._slope_known = False  # a slope measured from token counts that spread
        self._last_slope_s: float | None = None  # per token, from the last spread window
        self._mean_tokens = 0.0
        self._mean_step_s = 0.0
        self._sums = [0.0] * 5  # weighted, decayed: w, w*x, w*y, w*x*x, w*x*y
        self._scale_s = 0.0  # EWMA of clipped absolute residuals
        self._run: list[tuple[float, float]] = []  # the current run of same-signed outliers
        self._run_sign = 0

    @property
    def is_ready(self) -> bool:
        return self.num_samples >= MIN_SAMPLES

    def predict(self, num_tokens: int) -> float:
        """Predicted step time of num_tokens tokens (0 before any observation)."""
        return self.intercept_s + self.per_token_s * num_tokens

    def max_tokens_within(self, step_s: float) -> int | None:
        """The most tokens a step may hold to take at most step_s; None: no limit known."""
        if not self.is_ready:
            return None
        if self._slope_known and self.per_token_s > 0:
            return max(0, math.floor((step_s - self.intercept_s) / self.per_token_s))
        if self._slope_known:  # flat: tokens cost nothing measurable
            return None if self.intercept_s <= step_s else 0
        # Steps of one size only: the slope is unknown. Cutting in proportion when they are too
        # slow errs large (it ignores the fixed cost), but the steps it yields vary in size,
        # which identifies the slope.
        if self._mean_step_s <= step_s or self._mean_step_s <= 0:
            return None
        return math.floor(self._mean_tokens * step_s / self._mean_step_s)

    def observe(self, num_tokens: int, step_s: float) -> None:
        """Learn from one step of num_tokens tokens that took step_s."""
        x, y = float(num_tokens), step_s
        weight = 1.0
        if self.is_ready:
            predicted_s = self.predict(num_tokens)
            residual_s = y - predicted_s
            scale_s = max(self._scale_s, SCALE_FLOOR * abs(predicted_s), 1e-9)
            if abs(residual_s) > HUBER_K * scale_s:
                if self._on_outlier(x, y, 1 if residual_s > 0 else -1):
                    return
                weight = HUBER_K * scale_s / abs(residual_s)
            else:
                self._run.clear()
            clipped_s = min(abs(residual_s), HUBER_K * scale_s)
            self._scale_s = FORGET * self._scale_s + (1 - FORGET) * clipped_s
        self._add(x, y, weight)

    def _on_outlier(self, x: float, y: float, sign: int) -> bool:
        """Track a run of same-signed outliers; True when it restarted the model."""
        if sign != self._run_sign:
            self._run.clear()
            self._run_sign = sign
        self._run.append((x, y))
        if len(self._run) < SHIFT_RUN:
            return False
        run = self._run
        self._reset()  # forget the old speed entirely
        for rx, ry in run:
            self._add(rx, ry, 1.0)
        return True

    def _add(self, x: float, y: float, weight: float) -> None:
        sums = self._sums
        for i, term in enumerate((1.0, x, y, x * x, x * y)):
            sums[i] = FORGET * sums[i] + weight * term
        self.num_samples += 1
        self._fit()

    def _fit(self) -> None:
        sw, sx, sy, sxx, sxy = self._sums
        mx, my = sx / sw, sy / sw
        self._mean_tokens, self._mean_step_s = mx, my
        vxx = sxx / sw - mx * mx
        if vxx > (MIN_SPREAD * mx) ** 2 and vxx > 0:
            # Step time does not fall with more tokens: a negative slope is noise.
            self._last_slope_s = max(0.0, (sxy / sw - mx * my) / vxx)
        # Steps of one size (the budget held at its cap) keep the slope last measured and move
        # only the fixed cost: forgetting must not turn a held budget into an unknown one.
        self._slope_known = self._last_slope_s is not None
        if self._last_slope_s is not None:
            a, b = my - self._last_slope_s * mx, self._last_slope_s
            if a < 0 and mx > 0:  # no fixed cost below zero: proportional
                a, b = 0.0, my / mx
        elif mx > 0:
            a, b = 0.0, my / mx
        else:
            a, b = my, 0.0
        self.intercept_s, self.per_token_s = a, b
