"""The generative half of the service facade: OpenAI completions and chat (prompt preparation,
generation, the result cache's plan) and the /v1/models cards. `Service` inherits it; every
call still checks the service is open and routes through its router and lifecycle."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fulcrum.cache.llm_semantic import ChatSource, CompletionSource
from fulcrum.errors import FulcrumError, NotFound
from fulcrum.llm.chat import DEFAULT_OPTIONS, ChatOptions
from fulcrum.routing.ab import split_arm
from fulcrum.routing.generation import ShadowHook, generation_shadow, watch_generation
from fulcrum.routing.generation_cascade import (
    FirstAnswer,
    judge,
    record,
    scoring_params,
    then_context,
)
from fulcrum.service_llm import LLMCall, LLMServable, generate, prepare_chat, prepare_prompt
from fulcrum.service_openai import admit_choices
from fulcrum.service_run import plan_generation, serves_embeddings
from fulcrum.variants import default_variant

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from fulcrum.cache.llm import GenerationPlan
    from fulcrum.cache.registry import CacheRegistry
    from fulcrum.config import ModelConfig
    from fulcrum.context import RequestContext
    from fulcrum.lifecycle.manager import ModelLifecycle
    from fulcrum.llm.engine import AsyncLLMEngine
    from fulcrum.llm.outputs import RequestOutput
    from fulcrum.llm.sampling_params import SamplingParams
    from fulcrum.repository import ModelRepository
    from fulcrum.router import Router
    from fulcrum.routing.serving import RoutingHooks
    from fulcrum.routing.settings import CascadeSettings
    from fulcrum.service import ServiceSettings


class GenerativeFacade:
    """`Service`'s methods for generative models (see `fulcrum.service`)."""

    settings: ServiceSettings
    router: Router
    routing: RoutingHooks
    caches: CacheRegistry
    _repository: ModelRepository
    _lifecycle: ModelLifecycle
    _model_lens: dict[str, int]

    def _check_open(self) -> None:
        raise NotImplementedError  # Service's

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
        ctx = await self._lifecycle.ensure_loaded(ctx, name)
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
        ctx = await self._lifecycle.ensure_loaded(ctx, name)
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
        stream = generate(ctx, call, sampling, request_id=request_id, priority=chosen or 0,
                          cache_salt=cache_salt)  # fmt: skip
        try:
            config = self._repository.get(call.model, call.version)[0]
        except FulcrumError:  # unloaded since it was prepared: it runs on its engine, unwatched
            return stream
        arm = split_arm(ctx, call.model, None, config.routing.ab)  # stable: as `_llm` routed it
        shadow = self._shadow(config, call, arm or ctx.variant, sampling)
        if arm is None and shadow is None:
            return stream
        return watch_generation(self.routing.metrics, call.model, arm, stream, shadow)

    def generation_route(self, ctx: RequestContext, call: LLMCall) -> str | None:
        """The `Fulcrum-Route` header of a generation: its A/B arm (`ab=<arm>`), None without
        a split (or when the request chose its variant itself)."""
        try:
            config = self._repository.get(call.model, call.version)[0]
        except FulcrumError:
            return None
        arm = split_arm(ctx, call.model, None, config.routing.ab)
        return None if arm is None else f"ab={arm}"

    def generation_cascade(self, call: LLMCall) -> CascadeSettings | None:
        """The `[routing.cascade]` of the model a prepared call runs on (None: it has none)."""
        try:
            return self._repository.get(call.model, call.version)[0].routing.cascade
        except FulcrumError:
            return None

    async def first_answer(
        self,
        ctx: RequestContext,
        settings: CascadeSettings,
        calls: list[LLMCall],
        sampling: SamplingParams,
        num_choices: int,
        request_id: str,
        *,
        priority: int | None = None,
        cache_salt: str | None = None,
    ) -> FirstAnswer:
        """A cascade's first model answers every choice whole, with logprobs, and is judged
        (the decision is counted); its result cache is not used (it keeps no logprobs)."""

        def start(
            call: LLMCall, params: SamplingParams, choice_id: str
        ) -> AsyncIterator[RequestOutput]:
            return self.generate(ctx, call, params, request_id=choice_id, priority=priority,
                                 cache_salt=cache_salt)  # fmt: skip

        scoring = scoring_params(sampling)
        outputs = admit_choices(start, calls, scoring, num_choices, request_id)
        answer = await judge(outputs, settings, num_choices=len(calls) * num_choices,
                             keep_logprobs=sampling.logprobs is not None)  # fmt: skip
        record(self.routing.metrics, calls[0].model, answer)
        return answer

    async def escalate_calls(
        self, ctx: RequestContext, then: str, calls: list[LLMCall]
    ) -> list[LLMCall]:
        """A cascade's prompts prepared again on its second model `then` (its own default
        variant, tokenizer and chat template): text and chat prompts are tokenised anew, a
        token-id prompt is passed as it is (it means the same only with the same vocabulary)."""
        ctx = then_context(ctx)
        prepared: list[LLMCall] = []
        for call in calls:
            source = call.source
            if isinstance(source, ChatSource):
                messages = [dict(m) for m in source.messages]
                prepared.append(await self.prepare_chat(ctx, then, messages, source.options))
            elif isinstance(source, CompletionSource):
                prepared.append(await self.prepare_prompt(
                    ctx, then, source.text, add_special_tokens=source.add_special_tokens
                ))  # fmt: skip
            else:
                prepared.append(await self.prepare_prompt(ctx, then, list(call.token_ids)))
        return prepared

    def _shadow(
        self, config: ModelConfig, call: LLMCall, variant: str | None, sampling: SamplingParams
    ) -> ShadowHook | None:
        """The model's `[routing.shadow]` hook for this generation (None: no shadow)."""
        settings = config.routing.shadow
        caller_variant = variant or default_variant(config)
        if settings is None or (settings.version or call.version, settings.variant or
                                caller_variant) == (call.version, caller_variant):  # fmt: skip
            return None  # none, or the caller is the reference

        def reference() -> AsyncLLMEngine:
            found = self._repository.get(call.model, settings.version or call.version,
                                         settings.variant or None)[2]  # fmt: skip
            if not isinstance(found, LLMServable):
                raise NotFound(f"model '{call.model}': the shadow reference is not generative")
            return found.engine

        return generation_shadow(self.routing.shadows, self.routing.metrics, call.model,
                                 settings, sampling, call.token_ids, reference)  # fmt: skip

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

    def generative_stats_rows(self, name: str | None, version: int | None) -> list[dict[str, Any]]:
        """A statistics row per loaded generative model variant: its name, version and variant,
        for the sections the service adds (routing, cache, lifecycle); its token figures (TTFT,
        TPOT, tokens) are Prometheus histograms on /metrics."""
        return [
            {"name": c.name, "version": str(v), "variant": loaded.variant}
            for c, v, loaded in self._repository.loaded()
            if isinstance(loaded, LLMServable)
            and (name is None or c.name == name) and (version is None or v == version)
        ]  # fmt: skip

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
        for config in self._repository.parked():  # listed: a request loads it (see README)
            if config.platform == "llm" or serves_embeddings(config):
                card = {"id": config.name, "object": "model", "created": 0, "owned_by": "fulcrum"}
                if (known := self._model_lens.get(config.name)) is not None:
                    card["max_model_len"] = known
                cards.append(card)
        return cards
