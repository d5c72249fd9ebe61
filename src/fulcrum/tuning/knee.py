"""Pure rules that choose a batch size from measurements: the knee rule (double the batch until
throughput stops growing, then back off) and the memory bound
`max_batch ≈ (memory budget - weights) / memory per sample`."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from fulcrum.errors import InvalidInput

# Float slack for back-off products such as 10 * 0.8 = 7.999999999999999.
_EPS = 1e-9


@dataclass(frozen=True)
class Knee:
    """Where throughput stopped paying for a bigger batch, and the batch the rule chooses."""

    saturation_batch: int  # the last batch whose doubling still gained at least the margin
    batch: int  # saturation_batch backed off by the back-off fraction (at least 1)
    saturated: bool  # False: throughput still grew at the largest batch measured


@dataclass(frozen=True)
class MemoryBound:
    """A linear memory model `weights_mb + batch * per_sample_mb` and the batch it allows."""

    max_batch: int | None  # None: memory did not grow with the batch, so it bounds nothing
    weights_mb: float
    per_sample_mb: float
    budget_mb: float


def throughput_gain(before: float, after: float) -> float:
    """Relative throughput gain from one batch size to the next (inf from zero throughput)."""
    if before <= 0:
        return math.inf if after > 0 else 0.0
    return after / before - 1.0


def is_flat(before: float, after: float, margin: float) -> bool:
    """True when going from `before` to `after` rows/s gained less than `margin` (0.10 = 10%)."""
    return throughput_gain(before, after) < margin


def back_off(batch: int, backoff: float) -> int:
    """`batch` reduced by the fraction `backoff`, rounded down, never below 1."""
    return max(1, math.floor(batch * (1.0 - backoff) + _EPS))


def find_knee(
    points: Sequence[tuple[int, float]], *, margin: float = 0.10, backoff: float = 0.20
) -> Knee:
    """The knee of (batch size, throughput) points, as the profiling procedure walks them: in
    batch order, stop at the first step whose gain is below `margin`; the batch before it is the
    saturation point (growing the batch past it bought latency, not throughput), and the chosen
    batch is that one backed off by `backoff` for latency headroom. A dip caused by noise stops
    the walk too: that is the rule, so give it enough repetitions for stable throughputs."""
    if not points:
        raise InvalidInput("the knee rule needs at least one (batch, throughput) point")
    _check_fraction("knee margin", margin)
    _check_fraction("back-off", backoff)
    ordered = sorted(points)
    saturation, saturated = ordered[-1][0], False
    for (batch, before), (_, after) in itertools.pairwise(ordered):
        if is_flat(before, after, margin):
            saturation, saturated = batch, True
            break
    return Knee(saturation, back_off(saturation, backoff), saturated)


def memory_bound(
    points: Sequence[tuple[int, float]], budget_mb: float, *, weights_mb: float | None = None
) -> MemoryBound | None:
    """The memory bound from memory measured at batch sizes (MB of memory in use at each).

    The two largest batches give the slope (memory per sample): their allocations dwarf the
    noise of small ones. The intercept is the weights (and runtime); when it is not positive
    (noise, or memory held from before) `weights_mb` (e.g. the model's file size) stands in.
    None when fewer than two distinct batch sizes were measured."""
    by_batch = dict(sorted(points))  # one figure per batch size: the last one given
    if len(by_batch) < 2:
        return None
    (b1, m1), (b2, m2) = list(by_batch.items())[-2:]
    per_sample = (m2 - m1) / (b2 - b1)
    intercept = m2 - per_sample * b2
    weights = intercept if intercept > 0 or weights_mb is None else weights_mb
    if per_sample <= 0:
        return MemoryBound(None, weights, per_sample, budget_mb)
    max_batch = max(0, math.floor((budget_mb - weights) / per_sample + _EPS))
    return MemoryBound(max_batch, weights, per_sample, budget_mb)


def _check_fraction(what: str, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise InvalidInput(f"{what} must be a fraction in [0, 1), got {value}")
