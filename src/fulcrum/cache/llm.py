"""The cache of generations (OpenAI completions and chat): a greedy or seeded request whose
prompt tokens and sampling fields match a finished generation is answered from the exact tier,
else from the semantic tier (`llm_semantic`) when the model has one, streamed back in the
engine's own pieces; a miss's stream is recorded and stored (and indexed) when it finishes by
itself ("stop" or "length"), never when aborted or failed."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from fulcrum.cache.codec import CachedGeneration
from fulcrum.cache.key import llm_key
from fulcrum.cache.llm_semantic import index_generation, semantic_hit, semantic_slot

if TYPE_CHECKING:
    from fulcrum.cache.key import LoadIdentity
    from fulcrum.cache.llm_semantic import PromptSource, SemanticSlot
    from fulcrum.cache.tiered import CacheStatus, ModelCache
    from fulcrum.llm.outputs import RequestOutput
    from fulcrum.llm.sampling_params import SamplingParams

log = logging.getLogger(__name__)
FINISHED_BY_ITSELF = ("stop", "length")
StartFn = Callable[[], AsyncIterator["RequestOutput"]]


def is_cacheable(sampling: SamplingParams) -> bool:
    """Greedy or seeded requests only: any other sample is a fresh draw by definition. Log
    probabilities are not kept, so requests asking for them are not cached either."""
    if not (sampling.is_greedy or sampling.seed is not None):
        return False
    return getattr(sampling, "logprobs", None) is None and (
        getattr(sampling, "prompt_logprobs", None) is None
    )


class GenerationPlan:
    """What the cache says about one generation, looked up before it is admitted (so the
    response's `Fulcrum-Cache` header is known before its first byte): `open` then replays the
    hit, or starts the generation and records it for the next request."""

    def __init__(
        self,
        cache: ModelCache,
        key: bytes | None,
        hit: CachedGeneration | None,
        num_prompt_tokens: int,
        *,
        semantic: bool = False,  # the hit came from the semantic tier
        slot: SemanticSlot | None = None,  # where a finished miss is indexed
    ) -> None:
        self._cache = cache
        self._key = key  # None: not cacheable
        self._hit = hit
        self._num_prompt_tokens = num_prompt_tokens
        self._semantic = semantic
        self._slot = slot

    @property
    def status(self) -> CacheStatus:
        if self._hit is None:
            return "miss"
        return "semantic" if self._semantic else "exact"

    def open(self, start: StartFn, request_id: str) -> AsyncIterator[RequestOutput]:
        if self._hit is not None:
            return replay(self._hit, request_id)
        if self._key is None:
            return start()
        return _recording(start(), self._cache, self._key, self._num_prompt_tokens, self._slot)


def uncacheable(cache: ModelCache) -> GenerationPlan:
    """A plan that only starts the generation (counted as uncacheable)."""
    cache.stats.uncacheable += 1
    return GenerationPlan(cache, None, None, 0)


async def plan_generation(
    cache: ModelCache,
    identity: LoadIdentity,
    tenant: str,
    token_ids: list[int],
    sampling: SamplingParams,
    *,
    cache_salt: str | None,
    source: PromptSource | None = None,
    max_model_len: int = 0,
) -> GenerationPlan:
    """Look the generation up in the model's exact tier, then in its semantic tier (`source`
    is what the prompt was made from; None: the exact tier only)."""
    salt = cache_salt or ""
    exact = cache.settings.exact and is_cacheable(sampling)
    key = llm_key(identity, tenant, token_ids, sampling, salt=salt) if exact else None
    if key is not None:
        hit = await cache.exact.get_generation(key)
        if hit is not None:
            cache.stats.hit("exact", hit.compute_s)
            return GenerationPlan(cache, key, hit, len(token_ids))
    slot = await semantic_slot(
        cache, identity, tenant, source, token_ids, sampling, salt=salt,
        max_model_len=max_model_len,
    )  # fmt: skip
    if slot is None and key is None:
        return uncacheable(cache)
    if slot is not None:
        outcome = await semantic_hit(cache, slot, sampling, len(token_ids))
        if outcome.generation is not None:
            cache.stats.hit("semantic", outcome.generation.compute_s)
            return GenerationPlan(cache, key, outcome.generation, len(token_ids), semantic=True)
        slot = slot if outcome.index else None
    cache.stats.misses += 1
    if key is None and slot is not None:
        # Stored under its exact key even though the exact tier may not answer it (a sampled
        # request with `semantic_sampled`, or `exact = false`): the semantic index points there.
        key = llm_key(identity, tenant, token_ids, sampling, salt=salt)
    return GenerationPlan(cache, key, None, len(token_ids), slot=slot)


async def replay(generation: CachedGeneration, request_id: str) -> AsyncIterator[RequestOutput]:
    """A cached generation as the engine would have streamed it (the prompt counted as cached)."""
    from fulcrum.llm.outputs import RequestOutput, Usage

    g = generation
    num_done = 0
    last = len(g.texts) - 1
    for i, (text, ids) in enumerate(zip(g.texts, g.token_ids, strict=True)):
        num_done += len(ids)
        usage = Usage(g.prompt_tokens, num_done, g.prompt_tokens)
        reason = g.finish_reason if i == last else None
        yield RequestOutput(request_id, list(ids), text, reason, usage)


async def _recording(
    stream: AsyncIterator[RequestOutput],
    cache: ModelCache,
    key: bytes,
    num_prompt_tokens: int,
    slot: SemanticSlot | None,
) -> AsyncIterator[RequestOutput]:
    start_s = time.perf_counter()
    texts: list[str] = []
    token_ids: list[list[int]] = []
    iterator = aiter(stream)
    try:
        async for output in iterator:
            texts.append(output.new_text)
            token_ids.append(list(output.new_token_ids))
            if output.finish_reason in FINISHED_BY_ITSELF and output.error is None:
                # Stored before the last piece is handed on: a client that stops reading at
                # the finish still leaves a complete entry behind.
                took_s = time.perf_counter() - start_s
                generation = CachedGeneration(
                    texts, token_ids, str(output.finish_reason), num_prompt_tokens, took_s
                )
                await _store(cache, key, generation, slot)
            yield output
    finally:
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            await aclose()


async def _store(
    cache: ModelCache, key: bytes, generation: CachedGeneration, slot: SemanticSlot | None
) -> None:
    try:
        stored = await cache.exact.put_generation(key, generation)
    except Exception:
        log.exception("cache of %s: generation not stored", cache.model)
        cache.stats.not_stored["error"] += 1
        return
    if not stored:
        cache.stats.not_stored["too_large"] += 1
    elif slot is not None:
        await index_generation(cache, slot, key)
