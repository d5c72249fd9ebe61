"""Fidelity metrics on hand-made arrays: cosine, top-1 agreement, accuracy, the metric choice."""

from __future__ import annotations

import numpy as np
import pytest

from fulcrum.errors import InvalidInput
from fulcrum.tuning.fidelity import (
    accuracy,
    choose_metric,
    compare,
    cosine,
    passes,
    top1_agreement,
)


def test_cosine_of_identical_and_scaled_rows_is_one() -> None:
    ref = np.array([[1.0, 2.0, 3.0], [0.5, -1.0, 0.0]], dtype=np.float32)
    assert cosine(ref, ref).value == pytest.approx(1.0)
    assert cosine(ref, ref * 3).value == pytest.approx(1.0)


def test_cosine_averages_rows_and_reports_the_worst() -> None:
    ref = np.array([[1.0, 0.0], [1.0, 0.0]])
    var = np.array([[1.0, 0.0], [0.0, 1.0]])  # row 0 identical, row 1 orthogonal
    found = cosine(ref, var)
    assert found.value == pytest.approx(0.5)
    assert found.worst_row == pytest.approx(0.0)
    assert found.metric == "cosine"


def test_cosine_flattens_each_row_past_axis_zero() -> None:
    ref = np.ones((2, 3, 4))
    var = ref.copy()
    var[1, 0, 0] = -1.0  # one element of 12 flipped: cos = 10 / 12
    assert cosine(ref, var).value == pytest.approx((1 + 10 / 12) / 2)


def test_cosine_of_zero_rows() -> None:
    zero = np.zeros((1, 3))
    assert cosine(zero, zero).value == 1.0
    assert cosine(zero, np.ones((1, 3))).value == 0.0


def test_cosine_refuses_different_shapes() -> None:
    with pytest.raises(InvalidInput, match="shapes differ"):
        cosine(np.ones((2, 3)), np.ones((2, 4)))


def test_noisy_embeddings_fail_the_default_bound() -> None:
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((64, 384))
    noisy = ref + 0.4 * rng.standard_normal((64, 384))  # cos ~ 1 / sqrt(1.16) ~ 0.93
    found = cosine(ref, noisy)
    assert 0.9 < found.value < 0.95
    assert not passes(found, 0.99)
    assert passes(cosine(ref, ref + 1e-4 * rng.standard_normal((64, 384))), 0.99)


def test_top1_agreement_counts_rows_with_the_same_winner() -> None:
    ref = np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])
    var = np.array([[0.2, 0.8], [0.7, 0.3], [0.6, 0.4], [0.9, 0.1]])  # row 2 flips
    found = top1_agreement(ref, var)
    assert found.value == pytest.approx(0.75)
    assert not passes(found, 0.99)


def test_accuracy_against_labels() -> None:
    scores = np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]])
    assert accuracy(scores, [1, 0, 0]).value == pytest.approx(2 / 3)
    with pytest.raises(InvalidInput, match="2 labels for 3 rows"):
        accuracy(scores, [1, 0])


def test_choose_metric() -> None:
    embedding = np.random.default_rng(1).standard_normal((4, 8))
    probabilities = np.array([[0.2, 0.8], [0.5, 0.5]])
    assert choose_metric("embedding", embedding, has_labels=False) == "cosine"
    assert choose_metric("logits", embedding, has_labels=False) == "top1"
    assert choose_metric("output", probabilities, has_labels=False) == "top1"
    assert choose_metric("logits", embedding, has_labels=True) == "accuracy"
    assert choose_metric("score", np.ones((4, 1)), has_labels=False) == "cosine"  # one column


def test_compare_takes_the_worst_output() -> None:
    ref = {"a": np.eye(2), "b": np.eye(2)}
    var = {"a": np.eye(2), "b": np.array([[1.0, 0.0], [1.0, 0.0]])}
    found = compare(ref, var, metric="cosine")
    assert found.value == pytest.approx(0.5)


def test_compare_accuracy_is_relative_to_the_reference() -> None:
    labels = [1, 0, 1, 0]
    ref = {"logits": np.array([[0, 1], [1, 0], [0, 1], [0, 1]], dtype=float)}  # 3 of 4 right
    var = {"logits": np.array([[0, 1], [1, 0], [1, 0], [0, 1]], dtype=float)}  # 2 of 4 right
    found = compare(ref, var, labels=labels)
    assert found.metric == "accuracy"
    assert found.value == pytest.approx((2 / 4) / (3 / 4))


def test_compare_errors() -> None:
    ref = {"a": np.eye(2)}
    with pytest.raises(InvalidInput, match="did not return outputs"):
        compare(ref, {})
    with pytest.raises(InvalidInput, match="metric 'l2'"):
        compare(ref, ref, metric="l2")
    with pytest.raises(InvalidInput, match="needs a 'label'"):
        compare(ref, ref, metric="accuracy")
