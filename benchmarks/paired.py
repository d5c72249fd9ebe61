"""How far apart two servers' latency quantiles are when both ran the same repeats, and how sure.

On a shared machine one repeat's P50 moves by more than the gap being measured, and it moves
for both servers alike (they run in turn, on the same arrival times). So the difference is
taken within each repeat and averaged over repeats; its interval is a two-level bootstrap:
repeats drawn with replacement, then each drawn repeat's requests drawn with replacement for
both servers. An interval whose top is at or below zero says "no worse" beyond the noise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Difference:
    """`a` minus `b` at one quantile, in the samples' unit, averaged over repeats."""

    estimate: float
    low: float
    high: float
    confidence: float  # of the interval low..high
    per_repeat: list[float]

    def describe(self) -> str:
        return (f"{self.estimate:+.2f} ({self.confidence:.0%} interval {self.low:+.2f} to "
                f"{self.high:+.2f}; per repeat " + ", ".join(f"{d:+.1f}" for d in self.per_repeat)
                + ")")  # fmt: skip


def paired_quantile_difference(
    a: Sequence[Sequence[float]],
    b: Sequence[Sequence[float]],
    quantile: float,
    *,
    confidence: float = 0.9,
    num_boot: int = 2000,
    seed: int = 0,
) -> Difference:
    """`a[k]` and `b[k]`: the two servers' latencies in repeat k (same load, same arrivals)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"need the same repeats for both, at least one: {len(a)} and {len(b)}")
    if any(len(x) == 0 for x in (*a, *b)):
        raise ValueError("a repeat with no latencies")
    pairs = list(zip(a, b, strict=True))
    per_repeat = [float(np.quantile(x, quantile) - np.quantile(y, quantile)) for x, y in pairs]
    rng = np.random.default_rng(seed)
    # Each repeat's own bootstrap distribution of the difference (requests drawn again) ...
    within = np.stack([_boot(x, quantile, num_boot, rng) - _boot(y, quantile, num_boot, rng)
                       for x, y in pairs])  # fmt: skip
    # ... then repeats drawn again: draw i averages draw i of each repeat it picked.
    picks = rng.integers(0, len(a), size=(num_boot, len(a)))
    means = within[picks, np.arange(num_boot)[:, None]].mean(axis=1)
    tail = (1.0 - confidence) / 2
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return Difference(float(np.mean(per_repeat)), float(low), float(high), confidence, per_repeat)


def _boot(sample: Sequence[float], quantile: float, num_boot: int, rng: np.random.Generator
          ) -> np.ndarray:  # fmt: skip
    values = np.asarray(sample, dtype=float)
    draws = rng.integers(0, values.size, size=(num_boot, values.size))
    return np.quantile(values[draws], quantile, axis=1)
