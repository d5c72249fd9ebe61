"""LatencyModel: t(b) = a + c·b fitted online, robust to outliers, quick after a speed change."""

from __future__ import annotations

import numpy as np
import pytest

from fulcrum.latency_model import ERROR_QUANTILE, ERROR_WINDOW, SHIFT_RUN, LatencyModel


def true_time(rows: int, scale: float = 1.0) -> float:
    return scale * (0.004 + 0.0005 * rows)  # 4 ms fixed, 0.5 ms a row


def feed(model: LatencyModel, sizes: list[int], scale: float = 1.0) -> None:
    for rows in sizes:
        model.observe(rows, true_time(rows, scale))


def test_fit_recovers_fixed_and_per_row_cost() -> None:
    model = LatencyModel()
    feed(model, [1, 4, 8, 16, 32] * 10)
    assert model.a_s == pytest.approx(0.004, rel=1e-3)
    assert model.c_s == pytest.approx(0.0005, rel=1e-3)
    assert model.predict(20) == pytest.approx(true_time(20), rel=1e-3)


def test_one_batch_size_seen_scales_the_prior_to_match_it() -> None:
    model = LatencyModel()
    assert not model.trusted
    feed(model, [8] * 3)
    assert model.trusted
    assert model.predict(8) == pytest.approx(true_time(8), rel=1e-6)
    assert model.a_s > 0 and model.c_s > 0


def test_one_outlier_moves_the_fit_little() -> None:
    model = LatencyModel()
    feed(model, [1, 4, 8, 16, 32] * 10)
    model.observe(8, 1.0)  # a 100x hiccup (a GC pause, a page fault storm)
    assert model.predict(8) == pytest.approx(true_time(8), rel=0.1)
    assert model.num_shifts == 0


def test_slow_drift_is_followed_by_forgetting() -> None:
    model = LatencyModel()
    feed(model, [1, 8, 32] * 10)
    scale = 1.0
    for _ in range(60):  # +1% per round: 1.8x after 60 rounds, never a jump
        scale *= 1.01
        feed(model, [1, 8, 32], scale)
    # Forgetting lags a steady drift by a few rounds; a plain average would be ~35% behind.
    assert model.predict(16) == pytest.approx(true_time(16, scale), rel=0.12)
    assert model.num_shifts == 0


def test_sudden_3x_slowdown_is_detected_within_a_few_batches_and_does_not_oscillate() -> None:
    model = LatencyModel()
    feed(model, [1, 8, 16, 32] * 10)
    errors = []
    for rows in [1, 8, 16, 32] * 10:
        errors.append(model.predict(rows) / true_time(rows, 3.0))
        model.observe(rows, true_time(rows, 3.0))
    assert model.num_shifts == 1  # once, not back and forth
    # Clipped observations alone would need ~20 batches; the fast path needs SHIFT_RUN.
    assert all(0.85 <= e <= 1.15 for e in errors[SHIFT_RUN:])
    assert all(0.97 <= e <= 1.03 for e in errors[SHIFT_RUN + 4 :])
    assert model.predict(16) == pytest.approx(true_time(16, 3.0), rel=0.02)


def test_recovery_after_the_slowdown_ends_is_detected_too() -> None:
    model = LatencyModel()
    feed(model, [1, 8, 32] * 10)
    feed(model, [1, 8, 32] * 5, 3.0)
    feed(model, [1, 8, 32] * 5, 1.0)
    assert model.num_shifts == 2
    assert model.predict(8) == pytest.approx(true_time(8), rel=0.05)


def test_max_rows_is_the_largest_batch_within_the_budget() -> None:
    model = LatencyModel()
    feed(model, [1, 4, 8, 16, 32] * 10)
    assert model.max_rows(true_time(20)) == 20
    assert model.max_rows(true_time(20) - 1e-5) == 19
    assert model.max_rows(0.004) == 0  # not even one row


def test_nonsense_observations_are_ignored() -> None:
    model = LatencyModel()
    model.observe(0, 0.01)
    model.observe(4, 0.0)
    model.observe(4, float("nan"))
    model.observe(4, float("inf"))
    assert model.num_observed == 0


def test_the_error_is_a_high_quantile_of_the_noise_around_the_fit() -> None:
    rng = np.random.default_rng(5)
    model = LatencyModel()
    feed(model, [1, 4, 8, 16, 32] * 10)
    assert model.error == pytest.approx(1.0)  # exact observations: nothing to add
    ratios = rng.lognormal(0.0, 0.2, 512)
    for i, ratio in enumerate(ratios):
        rows = [1, 4, 8, 16, 32][i % 5]
        model.observe(rows, true_time(rows) * float(ratio))
    expected = float(np.quantile(ratios[-ERROR_WINDOW:], ERROR_QUANTILE))
    assert model.error == pytest.approx(expected, rel=0.15)
    assert model.predict_high(8) == pytest.approx(model.predict(8) * model.error)


def test_a_speed_change_leaves_the_error_to_the_noise() -> None:
    rng = np.random.default_rng(6)
    model = LatencyModel()
    sizes = [1, 4, 8, 16, 32]
    for i in range(300):
        model.observe(sizes[i % 5], true_time(sizes[i % 5]) * float(rng.lognormal(0.0, 0.2)))
    noisy = model.error
    assert noisy > 1.2
    for i in range(300):  # 3x slower, just as noisy: detected, and the error stays the noise's
        rows = sizes[i % 5]
        model.observe(rows, true_time(rows, 3.0) * float(rng.lognormal(0.0, 0.2)))
    assert model.num_shifts >= 1
    assert model.error == pytest.approx(noisy, rel=0.25)
    assert model.predict(8) == pytest.approx(true_time(8, 3.0), rel=0.15)
