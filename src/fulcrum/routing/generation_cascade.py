"""A cascade across two generative models (OpenAI completions and chat): the first model's
answer is generated whole, with its token logprobs, and scored before any byte goes out; a
confident answer is returned, else the whole request runs on model `then`.

An answer's score is its mean token logprob (`mean_logprob`, the default: minus the log of its
perplexity, so it does not fall with the answer's length), or its least likely token's logprob
(`min_logprob`: one confident-sounding answer with a single guessed token escalates). Logprobs
are the model's raw ones (before temperature and processors), so a sampled answer is judged by
what the model believed, not by how it was drawn. A request escalates when any of its choices
is not confident; a choice that ended in an error or with no token scores NaN, which escalates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fulcrum.context import RequestContext
from fulcrum.routing.cascade import should_escalate
from fulcrum.routing.metrics import RoutingMetrics
from fulcrum.routing.settings import CascadeScore, CascadeSettings

if TYPE_CHECKING:  # the lean core serves batch models without the LLM stack's imports
    from fulcrum.llm.sampling_params import SamplingParams
    from fulcrum.service_openai import ChoiceOutput

FAILED_REASONS = ("error", "abort")


def answer_score(logprobs: Sequence[float], score: CascadeScore) -> float:
    """One answer's score from its tokens' logprobs (NaN: no token, nothing to judge)."""
    if not logprobs:
        return math.nan
    if score == "min_logprob":
        return min(logprobs)
    return math.fsum(logprobs) / len(logprobs)


def then_context(ctx: RequestContext) -> RequestContext:
    """The request as the second model sees it: the variant or lane the caller named was the
    first model's, so `then` serves it on its own default (and its own A/B split)."""
    return dataclasses.replace(ctx, variant=None, lane=None)


def scoring_params(sampling: SamplingParams) -> SamplingParams:
    """The request's sampling, asking for at least the chosen tokens' logprobs (the request's
    own `logprobs` setting, when it has one, is kept as it is)."""
    if sampling.logprobs is not None:
        return sampling
    return dataclasses.replace(sampling, logprobs=0)


@dataclass(frozen=True)
class FirstAnswer:
    """The first model's whole answer, its choices' scores and the decision."""

    outputs: list[ChoiceOutput]  # as the engine gave them; logprobs only where the request asked
    scores: list[float]  # one per choice, in choice order
    escalate: bool
    then: str
    higher_is_confident: bool = True

    @property
    def score(self) -> float:
        """The deciding score: the least confident choice's (NaN first)."""
        if any(math.isnan(s) for s in self.scores) or not self.scores:
            return math.nan
        return min(self.scores) if self.higher_is_confident else max(self.scores)

    @property
    def header(self) -> str:
        """The cascade's part of `Fulcrum-Route`."""
        score = f"score={self.score:.4f}"
        if self.escalate:
            return f"cascade=escalated; then={self.then}; {score}"
        return f"cascade=first; {score}"

    async def replay(self) -> AsyncGenerator[ChoiceOutput, None]:
        """The buffered answer, as the merged choices were streamed."""
        for item in self.outputs:
            yield item


async def judge(
    outputs: AsyncGenerator[ChoiceOutput, None],
    settings: CascadeSettings,
    *,
    num_choices: int,
    keep_logprobs: bool,
) -> FirstAnswer:
    """Read the first model's merged choices to the end (closing `outputs` aborts them all) and
    decide; the scoring logprobs are dropped unless the request asked for them."""
    buffered: list[ChoiceOutput] = []
    logprobs: list[list[float]] = [[] for _ in range(num_choices)]
    failed = [False] * num_choices
    async with contextlib.aclosing(outputs):
        async for item in outputs:
            output = item.output
            logprobs[item.index].extend(e.logprob for e in output.new_logprobs)
            failed[item.index] |= output.finish_reason in FAILED_REASONS or output.error is not None
            if not keep_logprobs and output.new_logprobs:
                item = dataclasses.replace(
                    item, output=dataclasses.replace(output, new_logprobs=[])
                )
            buffered.append(item)
    score = settings.generation_score
    scores = [
        math.nan if bad else answer_score(lp, score)
        for lp, bad in zip(logprobs, failed, strict=True)
    ]
    return FirstAnswer(buffered, scores, should_escalate(scores, settings), settings.then,
                       settings.higher_is_confident)  # fmt: skip


def record(metrics: RoutingMetrics, model: str, answer: FirstAnswer) -> None:
    """Count the decision and each choice's score (a NaN score counts as a decision only)."""
    decision = "escalated" if answer.escalate else "first"
    scores = [s for s in answer.scores if not math.isnan(s)]
    metrics.record_cascade(model, answer.then, decision, scores, logprobs=True)
