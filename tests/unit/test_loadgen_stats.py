"""Statistics against known distributions; SLO parsing, goodput and SLO checks."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fulcrum.errors import InvalidInput
from fulcrum.loadgen.records import Outcome, RequestRecord
from fulcrum.loadgen.stats import EMPTY, Slo, meets_all, parse_slo, slo_met, summarize_s


def test_uniform_sample_percentiles() -> None:
    values_s = np.random.default_rng(0).uniform(0.0, 1.0, 400_000)
    summary = summarize_s(values_s)
    assert summary.count == 400_000
    for got_ms, want in [
        (summary.mean_ms, 500),
        (summary.p50_ms, 500),
        (summary.p90_ms, 900),
        (summary.p95_ms, 950),
        (summary.p99_ms, 990),
        (summary.p999_ms, 999),
    ]:
        assert got_ms == pytest.approx(want, abs=3)
    assert summary.max_ms <= 1000 and summary.max_ms > 999.9


def test_exponential_sample_tail() -> None:
    mean_s = 0.01
    summary = summarize_s(np.random.default_rng(1).exponential(mean_s, 400_000))
    # Exponential quantile: -mean * ln(1 - q).
    assert summary.mean_ms == pytest.approx(10, rel=0.01)
    assert summary.p50_ms == pytest.approx(10 * math.log(2), rel=0.02)
    assert summary.p99_ms == pytest.approx(10 * math.log(100), rel=0.03)
    assert summary.p999_ms == pytest.approx(10 * math.log(1000), rel=0.06)


def test_exact_small_sample_and_empty() -> None:
    summary = summarize_s([0.001, 0.002, 0.003, 0.004, 0.005])
    assert summary.p50_ms == pytest.approx(3.0)
    assert summary.max_ms == pytest.approx(5.0)
    assert summary.mean_ms == pytest.approx(3.0)
    assert summarize_s([]) == EMPTY
    assert summary.percentile_ms(99.9) == summary.p999_ms
    with pytest.raises(InvalidInput):
        summary.percentile_ms(42)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("p99=100ms", Slo(metric="latency", bound_ms=100, percentile=99)),
        ("p99.9=1s", Slo(metric="latency", bound_ms=1000, percentile=99.9)),
        ("latency<=250us", Slo(metric="latency", bound_ms=0.25)),
        ("ttft<=200ms", Slo(metric="ttft", bound_ms=200)),
        ("tpot:p90=50ms", Slo(metric="tpot", bound_ms=50, percentile=90)),
    ],
)
def test_parse_slo(text: str, want: Slo) -> None:
    assert parse_slo(text) == want
    assert parse_slo(str(want)) == want  # round trip through the printed form


@pytest.mark.parametrize("text", ["p99", "100ms", "p99=100", "p0=1ms", "ttft<=p99=1ms", "foo<=1s"])
def test_bad_slo_is_refused(text: str) -> None:
    with pytest.raises(InvalidInput):
        parse_slo(text)


def record(latency_s: float, status: int = 200, ttft_s: float | None = None) -> RequestRecord:
    times = [] if ttft_s is None else [10.0 + ttft_s, 10.0 + latency_s]
    outcome = Outcome(status, token_times_s=times, num_output_tokens=len(times))
    return RequestRecord(10.0, 10.0, 10.0 + latency_s, outcome)


def test_goodput_counts_requests_meeting_every_bound() -> None:
    slos = [parse_slo("latency<=100ms"), parse_slo("ttft<=20ms")]
    assert meets_all(record(0.05, ttft_s=0.01), slos)
    assert not meets_all(record(0.05, ttft_s=0.03), slos)
    assert not meets_all(record(0.15, ttft_s=0.01), slos)
    assert not meets_all(record(0.01, status=503), slos)


def test_slo_met_uses_the_percentile_and_counts_errors_as_failures() -> None:
    fast = [record(0.01) for _ in range(99)]
    assert slo_met([*fast, record(0.5)], [parse_slo("p99=100ms")])
    assert not slo_met([*fast, record(0.5), record(0.5)], [parse_slo("p99=100ms")])
    # Fast errors must not pass for a good tail.
    errors = [record(0.001, status=503) for _ in range(5)]
    assert not slo_met([*fast, *errors], [parse_slo("p99=100ms")])
    assert not slo_met([*fast, record(0.2)], [parse_slo("latency<=100ms")])
