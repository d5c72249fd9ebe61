"""The one facade every request passes through, both APIs: KServe v2 inference, embeddings, LLM
generation, management, statistics and health. Each call carries the `RequestContext` built at
the edge; the router and result-cache hooks sit here, so both APIs get them."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fulcrum import __version__
from fulcrum.batcher import InferResult
from fulcrum.cache import ResultCache
from fulcrum.config import ModelConfig
from fulcrum.context import RequestContext, with_rows
from fulcrum.embeddings import TokenCounter, embedding_spec, text_tensor, vectors
from fulcrum.errors import FulcrumError, InvalidInput, NotFound, Unavailable
from fulcrum.lanes.group import lanes_over, load_lane_group
from fulcrum.lanes.router import LaneRouter
from fulcrum.lanes.serving import batch_servables, lane_of, lane_table, with_lane, with_timeout
from fulcrum.lifecycle.manager import ModelLifecycle
from fulcrum.metrics import ServerMetrics
from fulcrum.protocol import (
    InferRequest,
    model_config_json,
    model_metadata,
    validate_requested_outputs,
)
from fulcrum.repository import Servable
from fulcrum.router import Route, Router
from fulcrum.routing.ab import AbRouter
from fulcrum.routing.cascade import check_compatible, run_cascade
from fulcrum.routing.metrics import RoutingMetrics
from fulcrum.routing.serving import RoutingHooks, check_cascade, num_rows, shadow_reference
from fulcrum.servable import BatchServable
from fulcrum.service_generative import GenerativeFacade
from fulcrum.service_llm import LLMCall as LLMCall  # re-exported: the routes name it
from fulcrum.service_llm import LLMServable
from fulcrum.service_run import Embeddings as Embeddings  # re-exported: the routes name it
from fulcrum.service_run import (
    cache_registry,
    cache_status,
    gather_or_cancel,
    run_batch,
    with_variant,  # fmt: skip
)
from fulcrum.service_stream import RowStream, open_row_stream
from fulcrum.thread_priority import DEFAULT_COMPUTE_NICE
from fulcrum.types import Clock, TensorMap

log = logging.getLogger(__name__)

EXTENSIONS = ("binary_tensor_data", "model_repository", "statistics", "schedule_policy",
              "model_configuration")  # fmt: skip


@dataclass(frozen=True)
class ServiceSettings:
    """Server-wide limits and policies."""

    max_body_bytes: int = 64 * 1024 * 1024
    max_prompt_bytes: int = 1024 * 1024  # an LLM prompt (or chat messages), before tokenising
    drain_timeout_s: float = 30.0
    load_models: tuple[str, ...] | None = None  # None: every model in the repository
    freeze_gc_after_start: bool = False  # a server process (the CLI) sets it; tests do not
    memory_budget_bytes: int | None = None  # None: no budget (idle unloads still apply)
    compute_nice: int = DEFAULT_COMPUTE_NICE  # instance threads' nice steps below the loop


class Service(GenerativeFacade):
    """Everything the HTTP layer needs, behind plain async methods."""

    def __init__(
        self,
        root: Path,
        settings: ServiceSettings | None = None,
        *,
        router: Router | None = None,
        cache: ResultCache | None = None,
        clock: Clock | None = None,  # the lifecycle's (idle times, cold starts); tests fake it
    ) -> None:
        self.settings = settings or ServiceSettings()
        self.metrics = ServerMetrics()
        self.cache = cache  # one cache for every model, in place of:
        self.caches = cache_registry(self.metrics.registry, self.embed)  # the models' own
        self._lifecycle = ModelLifecycle(
            root, self._load_version, self.metrics.lifecycle,
            memory_budget_bytes=self.settings.memory_budget_bytes, clock=clock,
        )  # fmt: skip
        self._repository = self._lifecycle.repository
        self.router: Router = AbRouter(router or LaneRouter(  # the A/B split, then the lanes
            lambda name, version: lane_table(self._repository, name, version),
            self.metrics.lane_routes,
        ), lambda name, version: self._repository.get(name, version)[0])  # fmt: skip
        self.routing = RoutingHooks(RoutingMetrics(self.metrics.registry),
                                    lambda *a: shadow_reference(self._repository, *a))  # fmt: skip
        self._token_counters: weakref.WeakKeyDictionary[BatchServable, TokenCounter] = (
            weakref.WeakKeyDictionary()
        )
        self._model_lens: dict[str, int] = {}  # LLMs' max_model_len, for their cards when parked
        self._started = False
        self._stopping = False

    @classmethod
    def from_repository(cls, root: Path, settings: ServiceSettings | None = None) -> Service:
        return cls(Path(root), settings)

    # --- lifecycle and health ------------------------------------------------------------

    async def start(self) -> None:
        """Load the repository's models; a model that fails is logged and stays unavailable."""
        await self._lifecycle.start(self.settings.load_models)
        if self.settings.freeze_gc_after_start:
            # What start-up loaded lives as long as the server: out of the collector's sight, so
            # a full collection later (it holds the GIL: the loop waits) walks only newer objects.
            gc.freeze()
        self._started = True

    async def stop(self) -> None:
        """Turn readiness off, drain every model, release everything."""
        self._stopping = True
        await self.routing.shadows.close()  # shadows first: they would hold the drain up
        await self._lifecycle.stop()
        await self._repository.close()
        await self.caches.close()

    def begin_shutdown(self) -> None:
        """Readiness off at once (SIGTERM); the drain follows."""
        self._stopping = True

    async def drain(self) -> None:
        """Stop every model, bounded by the drain timeout: past it, the stop is abandoned rather
        than awaited (wait_for would wait for a backend stuck in its call), and the exit goes on."""
        stopping = asyncio.ensure_future(self.stop())
        done, _ = await asyncio.wait({stopping}, timeout=self.settings.drain_timeout_s)
        if not done:
            log.warning("drain timed out after %.0f s", self.settings.drain_timeout_s)
            stopping.cancel()

    @property
    def is_live(self) -> bool:
        return True

    @property
    def is_ready(self) -> bool:
        return (
            self._started
            and not self._stopping
            and all(s.is_ready for _, _, s in self._repository.loaded())
        )

    def model_ready(self, ctx: RequestContext, name: str, version: int | None) -> bool:
        if self._repository.is_parked(name):  # ready: a request loads it (see README)
            return not self._stopping and self._lifecycle.would_serve(name, version)
        try:
            _, _, servable = self._repository.get(name, version)
        except NotFound:
            return False
        return not self._stopping and servable.is_ready

    async def _load_version(
        self, config: ModelConfig, version: int, version_dir: Path, variant: str
    ) -> Servable:
        check_cascade(self._repository, config)  # its second model must fit, or no load
        if config.platform == "llm":
            registry = self.metrics.registry
            llm = await LLMServable.load(config, version, version_dir, registry, variant)
            self._model_lens[config.name] = llm.engine.max_model_len
            await self.caches.bind(config, version, variant, version_dir, llm.engine)  # its call's
            return llm
        if config.lanes and lanes_over(config, variant):
            return await load_lane_group(
                config, variant,
                lambda lane_config, lane: self._load_batch(
                    lane_config, version, version_dir, f"{variant}@{lane}", config, variant),
            )  # fmt: skip
        return await self._load_batch(config, version, version_dir, variant, config, variant)

    async def _load_batch(
        self, config: ModelConfig, version: int, version_dir: Path, label: str,
        cache_config: ModelConfig, variant: str,
    ) -> BatchServable:  # fmt: skip
        """One batcher (a variant, or a lane: `label` is then `variant@lane`); a variant's lanes
        share its cache entries (bound with the variant's config)."""
        metrics = self.metrics.for_model(config.name, version, label)
        servable = await BatchServable.load(
            config, version, version_dir, metrics, label, self.settings.compute_nice
        )
        await self.caches.bind(cache_config, version, variant, version_dir, servable)
        return servable

    def _check_open(self) -> None:
        if self._stopping:
            raise Unavailable("server is shutting down")

    # --- batch models: KServe v2 and embeddings ------------------------------------------

    def _batch_model(self, route: Route) -> BatchServable:
        _, _, servable = self._repository.get(route.model, route.version, route.variant)
        servable = lane_of(servable, route)
        if not isinstance(servable, BatchServable):
            raise InvalidInput(
                f"model '{route.model}' is a generative model: use /v1/completions or "
                "/v1/chat/completions"
            )
        return servable

    async def infer(
        self, ctx: RequestContext, name: str, version: int | None, request: InferRequest
    ) -> tuple[int, InferResult]:
        """Validate and run one request; returns the version that served it and its result."""
        self._check_open()
        ctx = self._v2_context(ctx, request)
        ctx = await self._lifecycle.ensure_loaded(ctx, name)
        route = self.router.route(ctx, name, version)
        servable = self._batch_model(route)
        validate_requested_outputs(servable.config, request.outputs)
        result = await self._run(ctx, route, servable, request.inputs, request)
        header = route.header  # the `Fulcrum-Route` header
        if servable.config.routing.cascade is not None:
            result, taken = await run_cascade(
                servable.config, result, self.routing.metrics,
                lambda: self._escalate(ctx, servable.config, request),
            )  # fmt: skip
            header = taken if header is None else f"{header}; {taken}"
        if header is not None:
            result = dataclasses.replace(result, route=header)
        return servable.version, result

    async def _escalate(
        self, ctx: RequestContext, first: ModelConfig, request: InferRequest
    ) -> InferResult:
        """A cascade's second model answers the request (its own default variant and lane)."""
        assert first.routing.cascade is not None
        then = first.routing.cascade.then
        ctx = dataclasses.replace(ctx, variant=None, lane=None)
        ctx = await self._lifecycle.ensure_loaded(ctx, then)
        route = self.router.route(ctx, then, None)
        servable = self._batch_model(route)
        check_compatible(first, servable.config)  # checked at load; the second may have reloaded
        return await self._run(ctx, route, servable, request.inputs, request)

    def early_refusal(
        self, ctx: RequestContext, name: str, version: int | None
    ) -> Unavailable | None:
        """The 503 a v2 request would get from its model's queue now, decided from its headers
        before its body is read (None: read it and take the full path). Only where the headers
        alone pick the batcher: no result cache (a hit needs no queue), no lanes (the router
        may spill), one variant or the one the header names (the body may name another)."""
        if self._stopping:
            return None
        try:
            _, _, servable = self._repository.get(name, version, ctx.variant)
        except FulcrumError:
            return None  # not loaded (yet), unknown, ...: the full path says so
        if not isinstance(servable, BatchServable):
            return None
        config = servable.config
        if config.cache is not None or config.lanes or config.routing.ab is not None:
            return None  # a cache hit, another lane or another arm may serve it
        if ctx.variant is None and len(config.variants) > 1:
            return None
        return servable.early_refusal(ctx.priority, 0.0)

    def _v2_context(self, ctx: RequestContext, request: InferRequest) -> RequestContext:
        """The context with the request's variant and lane parameters and its timeout."""
        ctx = with_lane(with_variant(ctx, request.parameters.get("variant")),
                        request.parameters.get("lane"))  # fmt: skip
        ctx = with_rows(ctx, num_rows(request.inputs))
        return with_timeout(ctx, request.timeout_s, time.monotonic())

    async def infer_stream(
        self, ctx: RequestContext, name: str, version: int | None, request: InferRequest
    ) -> RowStream:
        """`infer` with the rows answered in chunks as they complete (`service_stream`); bad
        input or a refused chunk raises here, before any row is sent."""
        self._check_open()
        ctx = self._v2_context(ctx, request)
        ctx = await self._lifecycle.ensure_loaded(ctx, name)
        route = self.router.route(ctx, name, version)
        servable = self._batch_model(route)
        validate_requested_outputs(servable.config, request.outputs)
        stream = await open_row_stream(
            servable.config, servable.version, request,
            lambda inputs: self._run(ctx, route, servable, inputs, request),
        )  # fmt: skip
        stream.route = route.header
        return stream

    async def _run(
        self,
        ctx: RequestContext,
        route: Route,
        servable: BatchServable,
        inputs: TensorMap,
        request: InferRequest | None = None,
    ) -> InferResult:
        return await self.routing.observe(ctx, route, servable, inputs, lambda: run_batch(
            ctx, route, servable, inputs, request, caches=self.caches, injected=self.cache,
        ))  # fmt: skip

    async def embed(
        self, ctx: RequestContext, name: str, texts: list[str], *, dimensions: int | None = None
    ) -> Embeddings:
        """Embed `texts` with a batch model that takes text: chunks of max_batch_size rows go
        through the model's batcher like any v2 request; usage counts the model's tokens."""
        self._check_open()
        ctx = await self._lifecycle.ensure_loaded(ctx, name)
        ctx = with_rows(ctx, max(1, len(texts)))
        route = self.router.route(ctx, name, None)
        servable = self._batch_model(route)
        spec = embedding_spec(servable.config)
        batched = servable.config.max_batch_size > 0
        size = servable.config.max_batch_size if batched else 1
        chunks = [texts[i : i + size] for i in range(0, len(texts), size)]
        runs = [
            self._run(
                ctx, route, servable, {spec.text_input: text_tensor(spec, c, batched=batched)}
            )
            for c in chunks
        ]
        results = await gather_or_cancel(runs)
        matrix = vectors(spec, [r.outputs for r in results], num_texts=len(texts),
                         dimensions=dimensions)  # fmt: skip
        counter = self._token_counter(servable)
        prompt_tokens = await asyncio.to_thread(counter.count, texts)
        return Embeddings(matrix, servable.version, prompt_tokens, cache_status(results),
                          route.header)  # fmt: skip

    def _token_counter(self, servable: BatchServable) -> TokenCounter:
        counter = self._token_counters.get(servable)
        if counter is None:
            version_dir = self._repository.root / servable.config.name / str(servable.version)
            counter = self._token_counters[servable] = TokenCounter(servable.config, version_dir)
        return counter

    # --- metadata, statistics, management ------------------------------------------------

    def server_metadata(self) -> dict[str, object]:
        return {"name": "fulcrum", "version": __version__, "extensions": list(EXTENSIONS)}

    def model_metadata(
        self, ctx: RequestContext, name: str, version: int | None
    ) -> dict[str, object]:
        if (parked := self._lifecycle.parked_config(name)) is not None:  # asking does not load
            return model_metadata(parked[0], parked[1] if version is None else [version])
        config, _, _ = self._repository.get(name, version)
        entry_versions = [v for c, v, _ in self._repository.loaded() if c.name == name]
        return model_metadata(config, entry_versions if version is None else [version])

    def model_config(self, ctx: RequestContext, name: str) -> dict[str, object]:
        parked = self._lifecycle.parked_config(name)
        config = parked[0] if parked is not None else self._repository.get(name)[0]
        return model_config_json(config)

    def statistics(
        self, ctx: RequestContext, name: str | None, version: int | None
    ) -> dict[str, Any]:
        """Triton's statistics response for one model, one version, or every model."""
        rows = [
            s.stats.to_json(c.name, v, s.variant)
            for c, v, loaded in self._repository.loaded()
            for s in batch_servables(loaded)  # a laned variant: one row per lane
            if (name is None or c.name == name) and (version is None or v == version)
        ]
        rows += self.generative_stats_rows(name, version)  # beyond Triton
        if name is not None and not rows and not self._repository.is_parked(name):
            self._repository.get(name, version)  # raises NotFound with the right message
        for row in rows:  # beyond Triton: the model's cache tiers and scale-to-zero record
            if (cache := self.caches.model(str(row["name"]))) is not None:
                row["cache"] = cache.to_json()
            if (life := self._lifecycle.stats_json(str(row["name"]))) is not None:
                row["lifecycle"] = life
            if routing := self.routing.metrics.stats_json(str(row["name"])):
                row["routing"] = routing  # A/B arms, shadow agreement, cascade decisions
        return {"model_stats": rows}

    def model_index(self, ctx: RequestContext, *, ready_only: bool) -> list[dict[str, str]]:
        rows = self._repository.index()
        return [r for r in rows if r["state"] == "READY"] if ready_only else rows

    async def load(
        self, ctx: RequestContext, name: str, config_override: dict[str, object] | None = None
    ) -> None:
        """Load or reload a model (Triton's repository load)."""
        self._check_open()
        await self._lifecycle.load(name, config_override)

    async def unload(self, ctx: RequestContext, name: str) -> None:
        await self._lifecycle.unload(name)
        await self.caches.drop(name)  # in process: its entries go; in Redis: unreachable
        if isinstance(self.router, (AbRouter, LaneRouter)):
            self.router.forget(name)  # its lanes' route counters go with it
        self.routing.metrics.forget(name)
