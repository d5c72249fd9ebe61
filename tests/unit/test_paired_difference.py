"""benchmarks/paired.py: a latency quantile's difference between two servers, paired by repeat."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # the benchmarks import their siblings by name
paired = importlib.import_module("paired")


def _repeats(rng: np.random.Generator, drift: list[float], n: int = 150) -> list[list[float]]:
    return [list(8.0 + d + rng.exponential(2.0, size=n)) for d in drift]


def test_a_constant_gap_is_found_with_a_narrow_interval() -> None:
    rng = np.random.default_rng(1)
    theirs = _repeats(rng, [0.0, 0.0, 0.0])
    ours = [[x + 2.0 for x in r] for r in theirs]
    d = paired.paired_quantile_difference(ours, theirs, 0.5)
    assert d.estimate == pytest.approx(2.0)
    # Requests of the two servers are drawn apart (each ran its own), so sampling noise stays.
    assert 1.5 < d.low < 2.0 < d.high < 2.5
    assert d.per_repeat == pytest.approx([2.0, 2.0, 2.0])


def test_drift_shared_by_both_servers_cancels_out_of_the_difference() -> None:
    rng = np.random.default_rng(2)
    drift = [0.0, 4.0, -2.0, 7.0, 1.0]  # the machine's speed moving between repeats
    theirs = _repeats(rng, drift)
    ours = [list(np.array(r) - 1.0) for r in _repeats(rng, drift)]  # 1 ms faster, own noise
    d = paired.paired_quantile_difference(ours, theirs, 0.5)
    assert d.high < 0.0  # ahead beyond the noise, though the drift is 11 ms wide
    assert d.low < d.estimate < d.high
    assert -1.6 < d.estimate < -0.4


def test_two_draws_of_one_distribution_give_an_interval_around_zero() -> None:
    rng = np.random.default_rng(3)
    drift = [0.0, 3.0, 1.0]
    d = paired.paired_quantile_difference(_repeats(rng, drift), _repeats(rng, drift), 0.5)
    assert d.low < 0.0 < d.high
    assert "90% interval" in d.describe() and "per repeat" in d.describe()


def test_repeats_must_pair_and_hold_latencies() -> None:
    with pytest.raises(ValueError, match="same repeats"):
        paired.paired_quantile_difference([[1.0]], [[1.0], [2.0]], 0.5)
    with pytest.raises(ValueError, match="same repeats"):
        paired.paired_quantile_difference([], [], 0.5)
    with pytest.raises(ValueError, match="no latencies"):
        paired.paired_quantile_difference([[1.0], []], [[1.0], [2.0]], 0.5)
