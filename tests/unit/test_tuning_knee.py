"""The knee rule and the memory bound on synthetic curves (pure functions, no timing)."""

from __future__ import annotations

import numpy as np
import pytest

from fulcrum.errors import InvalidInput
from fulcrum.tuning.knee import back_off, find_knee, is_flat, memory_bound, throughput_gain

BATCHES = (1, 2, 4, 8, 16, 32, 64)


def curve(throughput_of: dict[int, float]) -> list[tuple[int, float]]:
    return list(throughput_of.items())


def test_linear_curve_never_saturates_and_backs_off_from_the_largest_batch() -> None:
    knee = find_knee([(b, 100.0 * b) for b in BATCHES])
    assert (knee.saturation_batch, knee.saturated) == (64, False)
    assert knee.batch == 51  # 64 * 0.8 = 51.2, rounded down


def test_saturating_curve_stops_at_the_first_flat_doubling() -> None:
    # gains: +90%, +79%, +18%, +5% (below 10%): 8 is where bigger batches stopped paying.
    knee = find_knee(curve({1: 100, 2: 190, 4: 340, 8: 400, 16: 420, 32: 900}))
    assert (knee.saturation_batch, knee.batch, knee.saturated) == (8, 6, True)


def test_the_margin_decides_what_counts_as_flat() -> None:
    points = curve({1: 100, 2: 190, 4: 340, 8: 400, 16: 420})
    assert find_knee(points, margin=0.20).saturation_batch == 4  # +18% is flat at 20%
    assert find_knee(points, margin=0.01).saturation_batch == 16  # +5% still pays at 1%


def test_latency_model_curve_saturates_where_the_gain_formula_says() -> None:
    # latency a + b*B: the gain from B to 2B is a / (a + 2bB), below 10% once B > 4.5 a/b.
    # a = 4, b = 1: B > 18, so the step 32 -> 64 (gain 4/68 = 6%) is the first flat one.
    a_ms, b_ms = 4.0, 1.0
    points = [(b, 1000 * b / (a_ms + b_ms * b)) for b in BATCHES]
    knee = find_knee(points)
    assert (knee.saturation_batch, knee.batch, knee.saturated) == (32, 25, True)
    assert throughput_gain(points[4][1], points[5][1]) > 0.10  # 16 -> 32 still paid


def test_noisy_saturating_curve_finds_the_true_knee() -> None:
    true = {1: 100, 2: 200, 4: 400, 8: 800, 16: 810, 32: 815, 64: 816}  # saturates at 8
    for seed in range(20):
        rng = np.random.default_rng(seed)
        noisy = [(b, t * (1 + rng.uniform(-0.03, 0.03))) for b, t in true.items()]
        assert find_knee(noisy).saturation_batch == 8


def test_a_single_point_is_its_own_knee_and_not_saturated() -> None:
    assert find_knee([(1, 50.0)]) == find_knee([(1, 50.0)], backoff=0.5)
    knee = find_knee([(8, 50.0)])
    assert (knee.saturation_batch, knee.batch, knee.saturated) == (8, 6, False)
    assert find_knee([(1, 50.0)]).batch == 1


def test_decreasing_curve_keeps_batch_one() -> None:
    knee = find_knee(curve({1: 100, 2: 90, 4: 70, 8: 40}))
    assert (knee.saturation_batch, knee.batch, knee.saturated) == (1, 1, True)


def test_points_are_walked_in_batch_order() -> None:
    shuffled = curve({16: 420, 1: 100, 8: 400, 4: 340, 2: 190})
    assert find_knee(shuffled).saturation_batch == 8


def test_back_off_rounds_down_and_never_reaches_zero() -> None:
    assert back_off(10, 0.2) == 8  # 10 * 0.8 is 7.999... in floating point
    assert back_off(2, 0.2) == 1
    assert back_off(1, 0.2) == 1
    assert back_off(64, 0.0) == 64


def test_is_flat_from_zero_throughput() -> None:
    assert not is_flat(0.0, 5.0, 0.1)
    assert is_flat(0.0, 0.0, 0.1)


@pytest.mark.parametrize("kwargs", [{"margin": -0.1}, {"margin": 1.0}, {"backoff": 1.5}])
def test_bad_fractions_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(InvalidInput, match="fraction"):
        find_knee([(1, 1.0)], **kwargs)


def test_no_points_is_an_error() -> None:
    with pytest.raises(InvalidInput, match="at least one"):
        find_knee([])


def test_memory_bound_from_two_batches_of_a_linear_model() -> None:
    # 100 MB of weights, 2.5 MB per row; 1100 MB budget: (1100 - 100) / 2.5 = 400 rows.
    bound = memory_bound([(8, 120.0), (16, 140.0)], 1100.0)
    assert bound is not None
    assert bound.per_sample_mb == pytest.approx(2.5)
    assert bound.weights_mb == pytest.approx(100.0)
    assert bound.max_batch == 400


def test_memory_bound_uses_the_two_largest_batches() -> None:
    # Batch 1's figure is noise (the allocator's own reserve); the fit ignores it.
    bound = memory_bound([(1, 500.0), (16, 140.0), (8, 120.0)], 1100.0)
    assert bound is not None and bound.max_batch == 400


def test_memory_bound_falls_back_to_the_file_size_without_an_intercept() -> None:
    bound = memory_bound([(8, 10.0), (16, 30.0)], 1000.0, weights_mb=200.0)
    assert bound is not None
    assert bound.weights_mb == 200.0  # the intercept would be -10 MB
    assert bound.max_batch == 320  # (1000 - 200) / 2.5


def test_memory_that_does_not_grow_bounds_nothing() -> None:
    bound = memory_bound([(8, 150.0), (16, 149.0)], 1000.0)
    assert bound is not None and bound.max_batch is None


def test_weights_over_the_budget_allow_no_batch() -> None:
    bound = memory_bound([(8, 1020.0), (16, 1040.0)], 500.0)
    assert bound is not None and bound.max_batch == 0


def test_memory_bound_needs_two_batch_sizes() -> None:
    assert memory_bound([(8, 100.0)], 1000.0) is None
    assert memory_bound([(8, 100.0), (8, 110.0)], 1000.0) is None
