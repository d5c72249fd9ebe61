"""Arrival schedules: mean rate and inter-arrival variance over many seeded samples."""

from __future__ import annotations

import numpy as np
import pytest

from fulcrum.errors import InvalidInput
from fulcrum.loadgen.arrivals import Schedule, inter_arrival_s

NUM = 200_000


def test_poisson_gaps_have_the_rate_and_exponential_variance() -> None:
    gaps = inter_arrival_s("poisson", 50.0, NUM, np.random.default_rng(1))
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.01)
    # Exponential: variance = mean^2 (coefficient of variation 1).
    assert gaps.var() == pytest.approx((1 / 50) ** 2, rel=0.03)
    # Counts per second are Poisson: their variance equals their mean.
    counts = np.bincount(np.cumsum(gaps).astype(int))[:-1]
    assert counts.mean() == pytest.approx(50, rel=0.02)
    assert counts.var() == pytest.approx(50, rel=0.1)


def test_gamma_keeps_the_rate_and_burstiness_sets_the_variance() -> None:
    rng = np.random.default_rng(2)
    for burstiness in (0.25, 1.0, 4.0):
        gaps = inter_arrival_s("gamma", 100.0, NUM, rng, burstiness=burstiness)
        assert gaps.mean() == pytest.approx(0.01, rel=0.02)
        # Gamma(k, theta): CV^2 = 1 / k. Burstiness < 1 clusters requests.
        assert gaps.var() / gaps.mean() ** 2 == pytest.approx(1 / burstiness, rel=0.05)


def test_constant_gaps_are_exact() -> None:
    gaps = inter_arrival_s("constant", 4.0, 10, np.random.default_rng(0))
    assert np.all(gaps == 0.25)


def test_seeded_schedules_repeat_and_differ_by_seed() -> None:
    def times(seed: int) -> list[float]:
        schedule = Schedule("poisson", 10.0, 100.0, seed=seed)
        return [schedule.next_s() for _ in range(5000)]

    first = times(7)
    assert first == times(7)
    assert first != times(8)
    assert first[0] == 100.0  # the first send is at the start
    assert np.all(np.diff(first) >= 0)
    assert (first[-1] - first[0]) / (len(first) - 1) == pytest.approx(0.1, rel=0.05)


@pytest.mark.parametrize(
    ("kind", "rate", "burstiness"),
    [("poisson", 0.0, 1.0), ("gamma", 10.0, 0.0), ("uniform", 10.0, 1.0)],
)
def test_bad_parameters_are_refused(kind: str, rate: float, burstiness: float) -> None:
    with pytest.raises(InvalidInput):
        Schedule(kind, rate, 0.0, burstiness=burstiness)
