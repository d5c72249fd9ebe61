"""The one facade every request passes through, both APIs: KServe v2 inference, embeddings, LLM
generation, management, statistics and health. Each call carries the `RequestContext` built at
the edge; the router and result-cache hooks sit here, so both APIs get them."""

from __future__ import annotations

import asyncio
import gc
import logging
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fulcrum import __version__
from fulcrum.batcher import InferResult
from fulcrum.cache import ResultCache
from fulcrum.config import ModelConfig
from fulcrum.context import RequestContext
from fulcrum.embeddings import TokenCounter, embedding_spec, text_tensor, vectors
from fulcrum.errors import InvalidInput, NotFound, Unavailable
from fulcrum.llm.chat import DEFAULT_OPTIONS, ChatOptions
from fulcrum.metrics import ServerMetrics
from fulcrum.protocol import (
    InferRequest,
    model_config_json,
    model_metadata,
    validate_requested_outputs,
)
from fulcrum.repository import ModelRepository, Servable
from fulcrum.router import DirectRouter, Route, Router
from fulcrum.servable import BatchServable
from fulcrum.service_llm import LLMCall as LLMCall  # re-exported: the routes name it
from fulcrum.service_llm import LLMServable, generate, prepare_chat, prepare_prompt
from fulcrum.service_run import Embeddings as Embeddings  # re-exported: the routes name it
from fulcrum.service_run import (
    cache_registry,
    cache_status,
    gather_or_cancel,
    plan_generation,
    run_batch,
    serves_embeddings,
    with_variant,  # fmt: skip
)
from fulcrum.service_stream import RowStream, open_row_stream
from fulcrum.types import TensorMap

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from fulcrum.cache.llm import GenerationPlan
    from fulcrum.llm.outputs import RequestOutput
    from fulcrum.llm.sampling_params import SamplingParams

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


class Service:
    """Everything the HTTP layer needs, behind plain async methods."""

    def __init__(
        self,
        root: Path,
        settings: ServiceSettings | None = None,
        *,
        router: Router | None = None,
        cache: ResultCache | None = None,
    ) -> None:
        self.settings = settings or ServiceSettings()
        self.metrics = ServerMetrics()
        self.router: Router = router or DirectRouter()
        self.cache = cache  # one cache for every model, in place of:
        self.caches = cache_registry(self.metrics.registry, self.embed)  # the models' own
        self._repository = ModelRepository(root, self._load_version)
        self._token_counters: weakref.WeakKeyDictionary[BatchServable, TokenCounter] = (
            weakref.WeakKeyDictionary()
        )
        self._started = False
        self._stopping = False

    @classmethod
    def from_repository(cls, root: Path, settings: ServiceSettings | None = None) -> Service:
        return cls(Path(root), settings)

    # --- lifecycle and health ------------------------------------------------------------

    async def start(self) -> None:
        """Load the repository's models; a model that fails is logged and stays unavailable."""
        names = self.settings.load_models
        if names is None:
            await self._repository.load_all()
        else:
            for name in names:
                await self._repository.load(name)
        if self.settings.freeze_gc_after_start:
            # What start-up loaded lives as long as the server: out of the collector's sight, so
            # a full collection later (it holds the GIL: the loop waits) walks only newer objects.
            gc.freeze()
        self._started = True

    async def stop(self) -> None:
        """Turn readiness off, drain every model, release everything."""
        self._stopping = True
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
        try:
            _, _, servable = self._repository.get(name, version)
        except NotFound:
            return False
        return not self._stopping and servable.is_ready

    async def _load_version(
        self, config: ModelConfig, version: int, version_dir: Path, variant: str
    ) -> Servable:
        if config.platform == "llm":
            registry = self.metrics.registry
            llm = await LLMServable.load(config, version, version_dir, registry, variant)
            await self.caches.bind(config, version, variant, version_dir, llm.engine)  # its call's
            return llm
        metrics = self.metrics.for_model(config.name, version, variant)
        servable = await BatchServable.load(config, version, version_dir, metrics, variant)
        await self.caches.bind(config, version, variant, version_dir, servable)
        return servable

    def _check_open(self) -> None:
        if self._stopping:
            raise Unavailable("server is shutting down")

    # --- batch models: KServe v2 and embeddings ------------------------------------------

    def _batch_model(self, route: Route) -> BatchServable:
        _, _, servable = self._repository.get(route.model, route.version, route.variant)
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
        ctx = with_variant(ctx, request.parameters.get("variant"))
        route = self.router.route(ctx, name, version)
        servable = self._batch_model(route)
        validate_requested_outputs(servable.config, request.outputs)
        result = await self._run(ctx, route, servable, request.inputs, request)
        return servable.version, result

    async def infer_stream(
        self, ctx: RequestContext, name: str, version: int | None, request: InferRequest
    ) -> RowStream:
        """`infer` with the rows answered in chunks as they complete (`service_stream`); bad
        input or a refused chunk raises here, before any row is sent."""
        self._check_open()
        ctx = with_variant(ctx, request.parameters.get("variant"))
        route = self.router.route(ctx, name, version)
        servable = self._batch_model(route)
        validate_requested_outputs(servable.config, request.outputs)
        return await open_row_stream(
            servable.config, servable.version, request,
            lambda inputs: self._run(ctx, route, servable, inputs, request),
        )  # fmt: skip

    async def _run(
        self,
        ctx: RequestContext,
        route: Route,
        servable: BatchServable,
        inputs: TensorMap,
        request: InferRequest | None = None,
    ) -> InferResult:
        return await run_batch(
            ctx, route, servable, inputs, request, caches=self.caches, injected=self.cache
        )

    async def embed(
        self, ctx: RequestContext, name: str, texts: list[str], *, dimensions: int | None = None
    ) -> Embeddings:
        """Embed `texts` with a batch model that takes text: chunks of max_batch_size rows go
        through the model's batcher like any v2 request; usage counts the model's tokens."""
        self._check_open()
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
        return Embeddings(matrix, servable.version, prompt_tokens, cache_status(results))

    def _token_counter(self, servable: BatchServable) -> TokenCounter:
        counter = self._token_counters.get(servable)
        if counter is None:
            version_dir = self._repository.root / servable.config.name / str(servable.version)
            counter = self._token_counters[servable] = TokenCounter(servable.config, version_dir)
        return counter

    # --- generative models: OpenAI completions and chat ----------------------------------

    def _llm(self, ctx: RequestContext, name: str) -> tuple[int, LLMServable]:
        self._check_open()
        route = self.router.route(ctx, name, None)
        _, version, servable = self._repository.get(route.model, route.version, route.variant)
        if not isinstance(servable, LLMServable):
            raise NotFound(f"model '{name}' is not a generative model")
        return version, servable

    async def prepare_prompt(
        self,
        ctx: RequestContext,
        name: str,
        prompt: str | list[int],
        *,
        add_special_tokens: bool = True,
    ) -> LLMCall:
        """Tokenise a completion prompt (bounded in bytes first, large ones off the loop)."""
        version, servable = self._llm(ctx, name)
        return await prepare_prompt(
            servable, name, version, prompt, self.settings.max_prompt_bytes,
            add_special_tokens=add_special_tokens,
        )  # fmt: skip

    async def prepare_chat(
        self,
        ctx: RequestContext,
        name: str,
        messages: list[dict[str, str]],
        options: ChatOptions = DEFAULT_OPTIONS,
    ) -> LLMCall:
        """Render and tokenise chat messages with the model's template (or the request's, where
        the model trusts them) and the request's chat options (no BOS added twice)."""
        version, servable = self._llm(ctx, name)
        return await prepare_chat(
            servable, name, version, messages, self.settings.max_prompt_bytes, options
        )

    def detokenize(self, ctx: RequestContext, name: str, token_ids: list[int]) -> str:
        """The text of token ids in a generative model's vocabulary (special tokens kept)."""
        return self._llm(ctx, name)[1].engine.decode(token_ids)

    def token_strings(self, ctx: RequestContext, name: str, token_ids: list[int]) -> list[str]:
        """The vocabulary entries of token ids (vLLM's `return_token_strs`)."""
        return self._llm(ctx, name)[1].engine.token_strings(token_ids)

    def generate(
        self,
        ctx: RequestContext,
        call: LLMCall,
        sampling: SamplingParams,
        *,
        request_id: str,
        priority: int | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Admit a prepared prompt now (errors raise here) and stream its outputs; closing the
        stream aborts the request; the context's deadline, when set, bounds the whole stream."""
        self._check_open()
        chosen = ctx.priority if priority is None else priority
        return generate(ctx, call, sampling, request_id=request_id, priority=chosen or 0,
                        cache_salt=cache_salt)  # fmt: skip

    async def plan_generation(
        self,
        ctx: RequestContext,
        calls: list[LLMCall],
        sampling: SamplingParams,
        num_choices: int,
        cache_salt: str | None = None,
    ) -> GenerationPlan | None:
        """The result cache's plan for a generation, before it is admitted: `plan.status` is the
        `Fulcrum-Cache` header, `plan.open(start, id)` its stream (None: the model has none)."""
        self._check_open()
        return await plan_generation(self.caches, ctx, calls, sampling, num_choices, cache_salt)

    def generative_models(self) -> list[dict[str, Any]]:
        """Model cards of the generative and embedding models, for /v1/models."""
        cards: list[dict[str, Any]] = []
        for config, _, servable in self._repository.loaded():
            if any(card["id"] == config.name for card in cards):
                continue
            card: dict[str, Any] = {"id": config.name, "object": "model", "created": 0,
                                    "owned_by": "fulcrum"}  # fmt: skip
            if isinstance(servable, LLMServable):
                card["max_model_len"] = servable.engine.max_model_len
            elif not serves_embeddings(config):
                continue
            cards.append(card)
        return cards

    # --- metadata, statistics, management ------------------------------------------------

    def server_metadata(self) -> dict[str, object]:
        return {"name": "fulcrum", "version": __version__, "extensions": list(EXTENSIONS)}

    def model_metadata(
        self, ctx: RequestContext, name: str, version: int | None
    ) -> dict[str, object]:
        config, _, _ = self._repository.get(name, version)
        entry_versions = [v for c, v, _ in self._repository.loaded() if c.name == name]
        return model_metadata(config, entry_versions if version is None else [version])

    def model_config(self, ctx: RequestContext, name: str) -> dict[str, object]:
        config, _, _ = self._repository.get(name)
        return model_config_json(config)

    def statistics(
        self, ctx: RequestContext, name: str | None, version: int | None
    ) -> dict[str, Any]:
        """Triton's statistics response for one model, one version, or every model."""
        rows = [
            s.stats.to_json(c.name, v, s.variant)
            for c, v, s in self._repository.loaded()
            if isinstance(s, BatchServable)
            and (name is None or c.name == name)
            and (version is None or v == version)
        ]
        if name is not None and not rows:
            self._repository.get(name, version)  # raises NotFound with the right message
        for row in rows:  # beyond Triton: the model's cache tiers
            if (cache := self.caches.model(str(row["name"]))) is not None:
                row["cache"] = cache.to_json()
        return {"model_stats": rows}

    def model_index(self, ctx: RequestContext, *, ready_only: bool) -> list[dict[str, str]]:
        rows = self._repository.index()
        return [r for r in rows if r["state"] == "READY"] if ready_only else rows

    async def load(
        self, ctx: RequestContext, name: str, config_override: dict[str, object] | None = None
    ) -> None:
        """Load or reload a model (Triton's repository load)."""
        self._check_open()
        await self._repository.load(name, config_override)

    async def unload(self, ctx: RequestContext, name: str) -> None:
        await self._repository.unload(name)
        await self.caches.drop(name)  # in process: its entries go; in Redis: unreachable
