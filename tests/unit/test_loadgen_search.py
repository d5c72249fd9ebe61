"""The max-rate search: bisection converges on the knee of a fake latency curve."""

from __future__ import annotations

import pytest

from fulcrum.errors import InvalidInput
from fulcrum.loadgen.results import PointResult
from fulcrum.loadgen.search import Evaluate, max_rate_under
from fulcrum.loadgen.server_stats import ServerSplit
from fulcrum.loadgen.stats import LatencySummary


def point(rate: float, held: bool) -> PointResult:
    latency = LatencySummary(
        count=1, mean_ms=1, p50_ms=1, p90_ms=1, p95_ms=1, p99_ms=1, p999_ms=1, max_ms=1
    )
    return PointResult(
        mode="rate", level=rate, duration_s=1, num_requests=1, num_ok=1, throughput_rps=rate,
        rows_per_s=rate, latency=latency, errors={}, goodput_rps=rate, slo_met=held,
        server=ServerSplit(), header_queue_ms=None, header_compute_ms=None,
        header_batch_size=None, client_cpu=0, num_behind=0, max_lag_ms=0, stable=True,
        num_windows=3, warnings=[], cdf_ms=[],
    )  # fmt: skip


def capacity(limit: float) -> tuple[list[float], Evaluate]:
    tried: list[float] = []

    async def evaluate(rate: float) -> PointResult:
        tried.append(rate)
        return point(rate, rate <= limit)

    return tried, evaluate


async def test_doubles_then_bisects_to_within_tolerance() -> None:
    tried, evaluate = capacity(173.0)
    found = await max_rate_under(evaluate, start_rate=10, rel_tolerance=0.02, max_steps=30)
    assert found.best_rate is not None
    assert 173 * 0.98 <= found.best_rate <= 173
    assert tried[:6] == [10, 20, 40, 80, 160, 320]
    assert [p.level for p in found.points] == tried


async def test_start_above_capacity_bisects_downward() -> None:
    _, evaluate = capacity(3.0)
    found = await max_rate_under(evaluate, start_rate=100, rel_tolerance=0.05, max_steps=30)
    assert found.best_rate is not None and 3 * 0.95 <= found.best_rate <= 3


async def test_step_budget_bounds_the_search() -> None:
    tried, evaluate = capacity(1e9)
    found = await max_rate_under(evaluate, start_rate=1, max_steps=5)
    assert len(tried) == 5 and found.best_rate == 16  # a lower bound: never failed


async def test_nothing_held() -> None:
    _, evaluate = capacity(0.0)
    found = await max_rate_under(evaluate, start_rate=8, max_steps=4)
    assert found.best_rate is None


async def test_bad_arguments() -> None:
    _, evaluate = capacity(1.0)
    with pytest.raises(InvalidInput):
        await max_rate_under(evaluate, start_rate=0)
