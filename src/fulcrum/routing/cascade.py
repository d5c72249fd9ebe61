"""A cascade across two models: the model that declares `[routing.cascade]` answers first; when
any row's score is not confident, the whole request runs on model `then`, whose answer is
returned (the whole request, not its rows: one answer comes from one model).

A row's score is the largest value of its `score_output` row (a probability vector's top-1
probability, or a one-value confidence); it is confident at or past the threshold
(`higher_is_confident`; else at or below it). The decision and every row's score are counted.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import numpy as np

from fulcrum.batch_request import InferResult
from fulcrum.config import ModelConfig, TensorSpec
from fulcrum.errors import ConfigError, ModelError
from fulcrum.routing.metrics import RoutingMetrics
from fulcrum.routing.settings import CascadeSettings
from fulcrum.types import Array


def row_scores(output: Array, *, batched: bool) -> list[float]:
    """Each row's score: the largest value of its row of the score output."""
    rows = output.shape[0] if batched and output.ndim > 0 else 1
    if output.size == 0:
        return []
    values = output.reshape(rows, -1).astype(np.float64)  # (R, N)
    return [float(x) for x in values.max(axis=1)]


def is_confident(score: float, settings: CascadeSettings) -> bool:
    if settings.higher_is_confident:
        return score >= settings.threshold
    return score <= settings.threshold


def should_escalate(scores: list[float], settings: CascadeSettings) -> bool:
    """Whether the request goes on to the second model: a row is not confident (or a score is
    NaN, which is confident of nothing)."""
    return any(not is_confident(s, settings) for s in scores)


def check_compatible(first: ModelConfig, then: ModelConfig) -> None:
    """The second model takes the first one's inputs and gives its outputs (all but the score
    output): same names, datatypes and shapes, and both batched or both not. A generative
    model's second model is generative too (its prompts are prepared again on it)."""
    key = "key 'routing.cascade.then'"
    where = f"{key} = {then.name!r}: incompatible with model '{first.name}'"
    if first.platform == "llm":  # generations compare by text: any two LLMs fit
        if then.platform != "llm":
            raise ConfigError(
                f"{where}: a generative model cascades to a generative model (platform 'llm'), "
                f"not to platform {then.platform!r}"
            )
        return
    if (first.max_batch_size > 0) != (then.max_batch_size > 0):
        raise ConfigError(f"{where}: one model is batched (max_batch_size > 0), the other not")
    if then.platform == "llm":
        raise ConfigError(f"{where}: a generative model cannot answer a v2 request")
    _same_tensors(where, "input", first.inputs, then.inputs)
    score = first.routing.cascade.score_output if first.routing.cascade else ""
    _same_tensors(where, "output", [t for t in first.outputs if t.name != score], then.outputs)


def _same_tensors(
    where: str, kind: str, wanted: list[TensorSpec] | tuple[TensorSpec, ...],
    given: tuple[TensorSpec, ...],
) -> None:  # fmt: skip
    theirs = {t.name: t for t in given}
    for spec in wanted:
        other = theirs.get(spec.name)
        if other is None:
            raise ConfigError(f"{where}: it has no {kind} {spec.name!r}")
        if (other.datatype, tuple(other.shape)) != (spec.datatype, tuple(spec.shape)):
            raise ConfigError(
                f"{where}: {kind} {spec.name!r} is {other.datatype} {list(other.shape)}, "
                f"expected {spec.datatype} {list(spec.shape)}"
            )


async def run_cascade(
    first: ModelConfig,
    result: InferResult,
    metrics: RoutingMetrics,
    escalate: Callable[[], Awaitable[InferResult]],
) -> tuple[InferResult, str]:
    """The answer (the first model's `result`, or the second's) and the route's part of the
    `Fulcrum-Route` header: `cascade=first` or `cascade=escalated; then=<model>`."""
    settings = first.routing.cascade
    assert settings is not None
    output = result.outputs.get(settings.score_output)
    if output is None:
        raise ModelError(
            f"model '{first.name}' returned no score output {settings.score_output!r} "
            "for its cascade"
        )
    scores = row_scores(output, batched=first.max_batch_size > 0)
    if not should_escalate(scores, settings):
        metrics.record_cascade(first.name, settings.then, "first", scores)
        return result, "cascade=first"
    metrics.record_cascade(first.name, settings.then, "escalated", scores)
    return await escalate(), f"cascade=escalated; then={settings.then}"
