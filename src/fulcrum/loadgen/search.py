"""`--max-rate-under`: the highest request rate whose latency objective holds, by bisection.

Double the rate from a start until the objective fails, then bisect between the last rate that
held and the first that failed, until they agree within a relative tolerance.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from fulcrum.errors import InvalidInput
from fulcrum.loadgen.results import PointResult

Evaluate = Callable[[float], Awaitable[PointResult]]


@dataclass(slots=True)
class SearchResult:
    """The answer (None when even the lowest rate tried failed) and every point measured."""

    best_rate: float | None
    points: list[PointResult] = field(default_factory=list)


def _passes(point: PointResult) -> bool:
    return bool(point.slo_met)


async def max_rate_under(
    evaluate: Evaluate,
    *,
    start_rate: float,
    rel_tolerance: float = 0.05,
    max_steps: int = 12,
    passes: Callable[[PointResult], bool] = _passes,
) -> SearchResult:
    """Bisection over the rate; `evaluate(rate)` measures one open-loop point."""
    if start_rate <= 0 or not 0 < rel_tolerance < 1 or max_steps < 1:
        raise InvalidInput("search needs start_rate > 0, 0 < tolerance < 1, max_steps >= 1")
    result = SearchResult(None)

    async def held(rate: float) -> bool:
        point = await evaluate(rate)
        result.points.append(point)
        return passes(point)

    low, high = 0.0, None
    rate = start_rate
    while high is None and len(result.points) < max_steps:
        if await held(rate):
            low, rate = rate, rate * 2
        else:
            high = rate
    if high is None:
        result.best_rate = low  # never failed within the step budget: a lower bound
        return result
    while high - low > rel_tolerance * high and len(result.points) < max_steps:
        middle = (low + high) / 2
        if await held(middle):
            low = middle
        else:
            high = middle
    result.best_rate = low if low > 0 else None
    return result
