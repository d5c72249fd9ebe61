"""The service's run path: a batch model's request is validated, then goes through the model's
result cache (exact, semantic, coalesced misses) to its batcher; a generation goes through the
LLM tiers (exact, then semantic). Keys are built here from what the request carries (tenant,
inputs, parameters) and the servable's load identity."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fulcrum.cache.key import scope_key, tensor_key
from fulcrum.cache.llm import GenerationPlan, uncacheable
from fulcrum.cache.llm import plan_generation as plan_generation_of
from fulcrum.cache.metrics import CacheCollector
from fulcrum.cache.registry import CacheRegistry
from fulcrum.cache.tiered import CachedResult, CacheRequest, CacheStatus
from fulcrum.context import DEFAULT_TENANT, RequestContext, internal_context, with_parameter
from fulcrum.embeddings import embedding_spec
from fulcrum.errors import InvalidInput
from fulcrum.protocol import validate_inputs

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from prometheus_client import CollectorRegistry

    from fulcrum.batcher import InferResult
    from fulcrum.cache import ResultCache
    from fulcrum.cache.key import LoadIdentity
    from fulcrum.cache.registry import CacheRegistry
    from fulcrum.cache.tiered import ModelCache
    from fulcrum.config import ModelConfig
    from fulcrum.llm.sampling_params import SamplingParams
    from fulcrum.protocol import InferRequest
    from fulcrum.router import Route
    from fulcrum.servable import BatchServable
    from fulcrum.service_llm import LLMCall
    from fulcrum.types import Array, TensorMap

    EmbedFn = Callable[[RequestContext, str, list[str]], Awaitable["Embeddings"]]

__all__ = ["CacheStatus", "Embeddings", "run_batch"]

# The context of the cache's own calls (the semantic tier's embeddings): they never go through
# a cache themselves, or a model embedding its own requests would recurse.
CACHE_API = "cache"
# Past this many input bytes the key is hashed on a worker thread (hashlib releases the GIL):
# a 64 MiB request would otherwise hold the event loop for tens of milliseconds.
LARGE_INPUT_BYTES = 1 << 20
# Request parameters that say how to answer, not what: they stay out of the key.
TRANSPORT_PARAMETERS = frozenset({"variant", "lane"})


async def run_batch(
    ctx: RequestContext,
    route: Route,
    servable: BatchServable,
    inputs: TensorMap,
    request: InferRequest | None,
    *,
    caches: CacheRegistry,
    injected: ResultCache | None = None,
) -> InferResult:
    """One request through the model's cache (if it has one) and batcher."""
    inputs = validate_inputs(servable.config, inputs)
    own_timeout_s = request.timeout_s if request is not None else None
    now_s = time.monotonic()
    timeout_s = ctx.timeout_s(own_timeout_s, now_s)
    priority = request.priority if request is not None else None

    async def compute() -> InferResult:
        chosen = ctx.priority if priority is None else priority
        return await servable.infer(
            inputs, priority=chosen, timeout_s=timeout_s, age_s=ctx.age_s(now_s)
        )

    if injected is not None:  # a cache given to the Service (tests, embedders of Fulcrum)
        hit = await injected.get(ctx, route, servable.version, inputs)
        if hit is not None:
            return hit
        result = await compute()
        await injected.put(ctx, route, servable.version, inputs, result)
        return result
    found = caches.lookup(servable) if ctx.api != CACHE_API else None
    if found is None:
        return await compute()
    cache, identity = found
    start_s = time.perf_counter()
    cache_request = await _cache_request(cache, identity, ctx, servable.config, inputs, request)
    result = await cache.run(cache_request, compute, timeout_s=timeout_s)
    _record(servable, inputs, result, time.perf_counter() - start_s)
    return result


async def _cache_request(
    cache: ModelCache,
    identity: LoadIdentity,
    ctx: RequestContext,
    config: ModelConfig,
    inputs: TensorMap,
    request: InferRequest | None,
) -> CacheRequest:
    params = {} if request is None else _key_parameters(request.parameters)
    tenant = ctx.tenant or DEFAULT_TENANT
    if sum(arr.nbytes for arr in inputs.values()) > LARGE_INPUT_BYTES:
        key = await asyncio.to_thread(tensor_key, identity, tenant, inputs, params)
    else:
        key = tensor_key(identity, tenant, inputs, params)
    text = request_text(config, inputs) if cache.semantic is not None else None
    if text is None:
        return CacheRequest(key)
    return CacheRequest(key, scope_key(identity, tenant, params), text)


def _key_parameters(parameters: dict[str, object]) -> dict[str, object]:
    return {k: v for k, v in parameters.items() if k not in TRANSPORT_PARAMETERS}


def request_text(config: ModelConfig, inputs: TensorMap) -> str | None:
    """The text the semantic tier compares: a text model's one input of one row; None for any
    other request (several rows or inputs are matched exactly only)."""
    if config.tokenizer is None or set(inputs) != {config.tokenizer.input}:
        return None
    texts: Array = inputs[config.tokenizer.input]
    if texts.size != 1:
        return None
    value = texts.reshape(-1)[0]
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else None


def _record(
    servable: BatchServable, inputs: TensorMap, result: InferResult, total_s: float
) -> None:
    """Triton's cache statistics on the version's row; a hit counts as a success there and in
    the request metrics (a miss was counted by the batcher already)."""
    if not isinstance(result, CachedResult):
        return
    if result.cache == "miss":
        servable.stats.cache_miss.add(result.cache_s)
        return
    num_rows = 1
    if servable.config.max_batch_size > 0 and inputs:
        num_rows = int(next(iter(inputs.values())).shape[0])
    servable.stats.record_cache_hit(num_rows, total_s, result.cache_s)
    servable.metrics.request_s.observe(total_s)
    servable.metrics.outcomes["success"].inc()


class ServiceEmbedder:
    """protocols.Embedder over the service's own embeddings of a served model (MiniLM by
    default): unit-length float32 rows, computed outside any cache."""

    def __init__(self, embed: EmbedFn, model: str) -> None:
        self._embed = embed
        self.model = model

    async def __call__(self, texts: list[str]) -> Array:
        ctx = internal_context(CACHE_API)
        embeddings = await self._embed(ctx, self.model, texts)
        matrix = np.asarray(embeddings.matrix, dtype=np.float32)
        norms = np.linalg.norm(matrix, axis=1, keepdims=True)
        unit: Array = matrix / np.maximum(norms, 1e-12)
        return unit


def cache_registry(metrics: CollectorRegistry, embed: EmbedFn) -> CacheRegistry:
    """The service's model caches, on its `/metrics`; semantic tiers embed with `embed`."""
    caches = CacheRegistry(lambda model: ServiceEmbedder(embed, model))
    metrics.register(CacheCollector(caches.items))
    return caches


async def plan_generation(
    caches: CacheRegistry,
    ctx: RequestContext,
    calls: list[LLMCall],
    sampling: SamplingParams,
    num_choices: int,
    cache_salt: str | None,
) -> GenerationPlan | None:
    """The LLM cache's plan for a request, exact then semantic (None: the model has no cache).
    One prompt and one choice only: several are answered live (and counted as uncacheable)."""
    found = caches.lookup(calls[0].engine)  # an LLM call knows its engine, which names its load
    if found is None:
        return None
    cache, identity = found
    if len(calls) != 1 or num_choices != 1:
        return uncacheable(cache)
    tenant = ctx.tenant or DEFAULT_TENANT
    call = calls[0]
    return await plan_generation_of(
        cache, identity, tenant, call.token_ids, sampling, cache_salt=cache_salt,
        source=call.source, max_model_len=call.max_model_len,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Embeddings:
    """The vectors of an embeddings request, the version that made them, and tokens counted."""

    matrix: Array  # (texts, dim) float32
    version: int
    prompt_tokens: int
    cache: CacheStatus | None = None  # None: the model has no cache
    route: str | None = None  # the `Fulcrum-Route` header (laned models only)


def cache_status(results: list[InferResult]) -> CacheStatus | None:
    """One `Fulcrum-Cache` value for several chunks: a hit only when every chunk was one."""
    statuses = {r.cache for r in results if isinstance(r, CachedResult)}
    if not statuses:
        return None
    if statuses == {"exact"}:
        return "exact"
    return "miss" if "miss" in statuses else "semantic"


def with_variant(ctx: RequestContext, variant: object) -> RequestContext:
    """The context with the request's `variant` parameter (v2); it may not contradict the
    X-Fulcrum-Variant header."""
    return with_parameter(ctx, "variant", variant)


def serves_embeddings(config: ModelConfig) -> bool:
    try:
        embedding_spec(config)
    except InvalidInput:
        return False
    return True


async def gather_or_cancel(coros: list[Any]) -> list[InferResult]:
    """Run concurrently; on the first failure cancel the rest (their rows are not needed)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
