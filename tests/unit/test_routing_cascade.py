"""The cascade's decision at its threshold, per-row scores, agreement measures, and the check
that the second model fits the first."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from fulcrum.batch_request import InferResult
from fulcrum.config import ModelConfig, TensorSpec
from fulcrum.errors import ConfigError, ModelError
from fulcrum.routing.agreement import agreement
from fulcrum.routing.cascade import check_compatible, row_scores, run_cascade, should_escalate
from fulcrum.routing.metrics import RoutingMetrics
from fulcrum.routing.settings import CascadeSettings, RoutingSettings

CASCADE = CascadeSettings(then="big", score_output="p", threshold=0.8)


@pytest.mark.parametrize(("score", "escalates"), [(0.79, True), (0.8, False), (0.81, False)])
def test_higher_is_confident_escalates_just_below(score: float, escalates: bool) -> None:
    assert should_escalate([0.99, score], CASCADE) is escalates


@pytest.mark.parametrize(("score", "escalates"), [(0.79, False), (0.8, False), (0.81, True)])
def test_lower_is_confident_escalates_just_above(score: float, escalates: bool) -> None:
    lower = CascadeSettings(then="big", score_output="p", threshold=0.8, higher_is_confident=False)
    assert should_escalate([score], lower) is escalates


def test_a_nan_score_escalates() -> None:
    assert should_escalate([float("nan")], CASCADE)


def test_a_rows_score_is_its_top_probability() -> None:
    probs = np.array([[0.1, 0.9], [0.6, 0.4]], np.float32)
    assert row_scores(probs, batched=True) == pytest.approx([0.9, 0.6])
    assert row_scores(np.array([0.3, 0.7]), batched=False) == pytest.approx([0.7])


T = TensorSpec
FIRST = ModelConfig(
    name="small", platform="echo", max_batch_size=8,
    inputs=(T(name="x", datatype="FP32", shape=(4,)),),
    outputs=(T(name="y", datatype="FP32", shape=(2,)), T(name="p", datatype="FP32", shape=(1,))),
    routing=RoutingSettings(cascade=CASCADE),
)  # fmt: skip
BIG = ModelConfig(name="big", platform="echo", max_batch_size=64, inputs=FIRST.inputs,
                  outputs=(T(name="y", datatype="FP32", shape=(2,)),))  # fmt: skip


def test_a_second_model_with_the_inputs_and_outputs_fits() -> None:
    check_compatible(FIRST, BIG)  # no score output needed on the second


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"inputs": (T(name="z", datatype="FP32", shape=(4,)),)}, "it has no input 'x'"),
        ({"inputs": (T(name="x", datatype="FP16", shape=(4,)),)}, "input 'x' is FP16 [4]"),
        ({"outputs": (T(name="y", datatype="FP32", shape=(3,)),)}, "output 'y' is FP32 [3]"),
        ({"outputs": ()}, "it has no output 'y'"),
        ({"max_batch_size": 0}, "one model is batched"),
    ],
)  # fmt: skip
def test_an_incompatible_second_model_is_refused(change: dict[str, object], message: str) -> None:
    import msgspec

    other = msgspec.structs.replace(BIG, **change)
    with pytest.raises(ConfigError) as caught:
        check_compatible(FIRST, other)
    assert "key 'routing.cascade.then' = 'big'" in caught.value.message
    assert message in caught.value.message


async def test_run_cascade_counts_decisions_and_scores() -> None:
    metrics = RoutingMetrics(CollectorRegistry())
    big = InferResult({"y": np.ones((2, 2), np.float32)}, 0, 0, 2)

    async def escalate() -> InferResult:
        return big

    sure = InferResult({"y": np.zeros((2, 2)), "p": np.array([[0.9], [0.85]])}, 0, 0, 2)
    assert await run_cascade(FIRST, sure, metrics, escalate) == (sure, "cascade=first")
    unsure = InferResult({"y": np.zeros((2, 2)), "p": np.array([[0.9], [0.5]])}, 0, 0, 2)
    answer, route = await run_cascade(FIRST, unsure, metrics, escalate)
    assert (answer, route) == (big, "cascade=escalated; then=big")
    assert metrics.stats_json("small")["cascade"] == {"first": 1, "escalated": 1}
    assert metrics.scores.labels("small")._sum.get() == pytest.approx(0.9 + 0.85 + 0.9 + 0.5)
    with pytest.raises(ModelError, match="no score output 'p'"):
        await run_cascade(FIRST, big, metrics, escalate)


@pytest.mark.parametrize(
    ("compare", "reference", "expected"),
    [("cosine", [[2.0, 0.0], [1.0, -1.0]], 0.5),  # row 1 same direction, row 2 orthogonal
     ("top1", [[2.0, 0.0], [0.0, 1.0]], 0.5),
     ("exact", [[1.0, 0.0], [1.0, 1.0]], 1.0),
     ("exact", [[1.0, 0.0], [1.0, 1.5]], 0.5)],
)  # fmt: skip
def test_agreement_per_row(compare: str, reference: list[list[float]], expected: float) -> None:
    caller = np.array([[1.0, 0.0], [1.0, 1.0]])
    got = agreement(compare, caller, np.array(reference), batched=True)  # type: ignore[arg-type]
    assert got == pytest.approx(expected)


def test_answers_of_other_shapes_disagree_and_zero_rows_agree() -> None:
    assert agreement("cosine", np.ones((2, 2)), np.ones((2, 3)), batched=True) == 0.0
    assert agreement("cosine", np.zeros((1, 2)), np.zeros((1, 2)), batched=True) == 1.0
