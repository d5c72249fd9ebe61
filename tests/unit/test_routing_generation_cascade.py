"""A generative cascade's decision: an answer's score from its token logprobs (mean or minimum),
the decision at the threshold, NaN for a choice with no token or an error, the scoring logprobs
kept out of the answer unless asked, and the second model's platform checked."""

from __future__ import annotations

import math
from collections.abc import AsyncGenerator

import pytest
from prometheus_client import CollectorRegistry

from fulcrum.config import ModelConfig
from fulcrum.errors import ConfigError
from fulcrum.llm.logprobs import TokenLogprob
from fulcrum.llm.outputs import RequestOutput, Usage
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.routing.cascade import check_compatible
from fulcrum.routing.generation_cascade import (
    FirstAnswer,
    answer_score,
    judge,
    record,
    scoring_params,
)
from fulcrum.routing.metrics import RoutingMetrics
from fulcrum.routing.settings import CascadeSettings, RoutingSettings
from fulcrum.service_openai import ChoiceOutput

MEAN = CascadeSettings(then="big", threshold=-1.0)
MIN = CascadeSettings(then="big", threshold=-1.0, score="min_logprob")


def output(logprobs: list[float], finish: str | None = "length") -> RequestOutput:
    entries = [TokenLogprob(token_id=i, logprob=v, rank=1, top=()) for i, v in enumerate(logprobs)]
    return RequestOutput("r", list(range(len(logprobs))), "t" * len(logprobs), finish,
                         Usage(3, len(logprobs), 0), new_logprobs=entries)  # fmt: skip


async def stream(*items: tuple[int, RequestOutput]) -> AsyncGenerator[ChoiceOutput, None]:
    for index, out in items:
        yield ChoiceOutput(index, out)


def test_the_mean_is_length_normalised_and_the_minimum_is_the_worst_token() -> None:
    assert answer_score([-0.5, -1.5], "mean_logprob") == pytest.approx(-1.0)
    assert answer_score([-0.1, -0.1, -0.1, -3.0], "min_logprob") == pytest.approx(-3.0)
    assert math.isnan(answer_score([], "mean_logprob"))


@pytest.mark.parametrize(("second", "escalates"), [(-1.01, True), (-1.0, False), (-0.99, False)])
async def test_the_decision_at_the_threshold(second: float, escalates: bool) -> None:
    # The mean of (-1.0, second) sits on either side of -1.0 exactly as `second` does.
    answer = await judge(stream((0, output([-1.0, second]))), MEAN, num_choices=1,
                         keep_logprobs=False)  # fmt: skip
    assert answer.escalate is escalates
    assert answer.scores == [pytest.approx((-1.0 + second) / 2)]


async def test_the_minimum_escalates_on_one_guessed_token() -> None:
    answer = [output([-0.01] * 9 + [-4.0])]  # mean -0.409: confident; its minimum is not
    by_mean = await judge(stream((0, answer[0])), MEAN, num_choices=1, keep_logprobs=False)
    by_min = await judge(stream((0, answer[0])), MIN, num_choices=1, keep_logprobs=False)
    assert (by_mean.escalate, by_min.escalate) == (False, True)


async def test_one_unsure_choice_escalates_the_whole_request() -> None:
    answer = await judge(stream((0, output([-0.1])), (1, output([-5.0]))), MEAN, num_choices=2,
                         keep_logprobs=False)  # fmt: skip
    assert answer.escalate
    assert answer.score == pytest.approx(-5.0)
    assert answer.header == "cascade=escalated; then=big; score=-5.0000"


async def test_a_choice_that_failed_or_said_nothing_escalates() -> None:
    failed = await judge(stream((0, output([-0.1], finish="error"))), MEAN, num_choices=1,
                         keep_logprobs=False)  # fmt: skip
    one_of_two = stream((0, output([-0.1])))  # the second choice never said anything
    silent = await judge(one_of_two, MEAN, num_choices=2, keep_logprobs=False)
    assert failed.escalate and silent.escalate
    assert math.isnan(silent.score)
    assert silent.header == "cascade=escalated; then=big; score=nan"


async def test_the_scoring_logprobs_leave_only_when_asked() -> None:
    items = ((0, output([-0.2, -0.3], finish=None)), (0, output([-0.1])))
    hidden = await judge(stream(*items), MEAN, num_choices=1, keep_logprobs=False)
    kept = await judge(stream(*items), MEAN, num_choices=1, keep_logprobs=True)
    assert [x.output.new_logprobs for x in hidden.outputs] == [[], []]
    assert [len(x.output.new_logprobs) for x in kept.outputs] == [2, 1]
    assert hidden.header == "cascade=first; score=-0.2000"
    replayed = [x async for x in hidden.replay()]
    assert [x.output.new_text for x in replayed] == ["tt", "t"]


def test_scoring_asks_for_the_chosen_tokens_logprob_and_keeps_the_requests_own() -> None:
    assert scoring_params(SamplingParams(max_tokens=4)).logprobs == 0
    assert scoring_params(SamplingParams(max_tokens=4, logprobs=3)).logprobs == 3


def test_the_decision_and_finite_scores_are_counted() -> None:
    metrics = RoutingMetrics(CollectorRegistry())
    record(metrics, "small", FirstAnswer([], [-0.5, math.nan], True, "big"))
    assert metrics.stats_json("small") == {"cascade": {"escalated": 1}}
    sample = metrics.logprob_scores.labels("small").collect()[0].samples
    assert next(s.value for s in sample if s.name.endswith("_count")) == 1.0


LLM_FIRST = ModelConfig(name="small", platform="llm",
                        routing=RoutingSettings(cascade=MEAN))  # fmt: skip


def test_a_generative_model_cascades_to_a_generative_model_only() -> None:
    check_compatible(LLM_FIRST, ModelConfig(name="big", platform="llm"))
    with pytest.raises(ConfigError) as caught:
        check_compatible(LLM_FIRST, ModelConfig(name="big", platform="onnx"))
    assert "key 'routing.cascade.then' = 'big'" in caught.value.message
    assert "platform 'onnx'" in caught.value.message
