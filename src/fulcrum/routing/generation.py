"""A/B arms and shadows for a generative model.

An arm counts its requests (success or failure), generated tokens (the `rows` of its
throughput) and time to the end of the stream; a stream the client closes early counts as
neither. A shadow, once the caller's stream has ended, runs the same prompt with the same
sampling on the reference's engine, after every real request (`SHADOW_PRIORITY`), and records
exact-token agreement. Only greedy requests compare: a sampled one is counted as `sampled`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from fulcrum.errors import FulcrumError
from fulcrum.routing.agreement import token_agreement
from fulcrum.routing.metrics import RoutingMetrics
from fulcrum.routing.settings import ShadowSettings
from fulcrum.routing.shadow import ShadowRunner, reference_name

if TYPE_CHECKING:  # the lean core serves batch models without the LLM stack's imports
    from fulcrum.llm.engine import AsyncLLMEngine
    from fulcrum.llm.outputs import RequestOutput
    from fulcrum.llm.sampling_params import SamplingParams

SHADOW_PRIORITY = 1 << 30  # the engine serves lower values first: a shadow waits for all else

# The caller's generated token ids, once its stream has ended well -> maybe start a shadow
ShadowHook = Callable[[list[int]], None]


async def watch_generation(
    metrics: RoutingMetrics,
    model: str,
    arm: str | None,
    stream: AsyncIterator[RequestOutput],
    shadow: ShadowHook | None = None,
) -> AsyncIterator[RequestOutput]:
    """`stream`, counted under `arm` when it ends, then shadowed; closing this closes (aborts)
    `stream`."""
    start_s = time.perf_counter()
    tokens: list[int] = []
    failed = False
    try:
        async for output in stream:
            tokens.extend(output.new_token_ids)
            failed = failed or output.finish_reason in ("error", "abort")
            yield output
    except FulcrumError:
        if arm is not None:
            metrics.record_arm(model, arm, ok=False, seconds=0.0, rows=0)
        raise
    finally:
        close = getattr(stream, "aclose", None)
        if close is not None:
            await close()
    if arm is not None:
        seconds = time.perf_counter() - start_s
        metrics.record_arm(model, arm, ok=not failed, seconds=seconds, rows=len(tokens))
    if shadow is not None and not failed:
        shadow(tokens)


def generation_shadow(
    shadows: ShadowRunner,
    metrics: RoutingMetrics,
    model: str,
    settings: ShadowSettings,
    sampling: SamplingParams,
    prompt: list[int],
    reference: Callable[[], AsyncLLMEngine],
) -> ShadowHook:
    """The hook that shadows one generation on the reference (`reference`: its engine, or
    raises when it is not loaded)."""
    name = reference_name(settings)

    def offer(tokens: list[int]) -> None:
        if not shadows.draws(settings):
            return
        if not sampling.is_greedy:
            metrics.record_shadow(model, name, "sampled")
            return
        try:
            engine = reference()
        except FulcrumError:
            metrics.record_shadow(model, name, "failed")
            return

        async def compare() -> float:
            theirs = await reference_tokens(engine, prompt, sampling, settings.timeout_ms / 1000)
            return token_agreement(tokens, theirs)

        shadows.offer_call(model, settings, compare, sampled=True)

    return offer


async def reference_tokens(
    engine: AsyncLLMEngine, prompt: list[int], sampling: SamplingParams, timeout_s: float
) -> list[int]:
    """The reference's generation of `prompt`, at the lowest priority, within `timeout_s`."""
    tokens: list[int] = []
    stream = engine.generate(
        prompt, sampling, request_id=f"shadow-{uuid.uuid4().hex}", priority=SHADOW_PRIORITY
    )
    try:
        async with asyncio.timeout(timeout_s):
            async for output in stream:
                if output.error is not None:
                    raise output.error
                tokens.extend(output.new_token_ids)
    finally:
        close = getattr(stream, "aclose", None)
        if close is not None:
            await close()
    return tokens
