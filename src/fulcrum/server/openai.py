"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions (JSON, or server-sent events
ending with `data: [DONE]`), /v1/embeddings and /v1/models, all through the service facade. A
client that goes away, while streaming or waiting for a JSON answer, aborts its request."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from fulcrum.cache.tiered import CACHE_HEADER
from fulcrum.embeddings import encode_vectors
from fulcrum.llm.tools import tool_plan
from fulcrum.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    chat_messages,
    check_unsupported,
    decode_request,
    embedding_response,
    embedding_texts,
)
from fulcrum.router import ROUTE_HEADER
from fulcrum.routing.generation_cascade import then_context
from fulcrum.server import openai_choices
from fulcrum.server.http import (
    endpoint,
    error_body,
    json_response,
    read_body,
    request_context,
    until_disconnect,
)
from fulcrum.server.openai_choices import AnswerSpec, Choice, prompt_infos
from fulcrum.server.openai_extra import extra_routes, model_cards
from fulcrum.server.openai_request import chat_options, with_request_id
from fulcrum.server.openai_tools import tool_answer
from fulcrum.service_openai import (
    admit_choices,
    check_num_choices,
    completion_prompts,
    num_choices_per_prompt,
    prepare_structured,
    sampling_params,
    truncated,
)

if TYPE_CHECKING:
    from fulcrum.context import RequestContext
    from fulcrum.llm.sampling_params import SamplingParams
    from fulcrum.llm.tools import ToolPlan
    from fulcrum.service import LLMCall, Service
    from fulcrum.service_openai import ChoiceOutput

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_json = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True)
class _Generation:
    """A request made ready for one model: its prompts, sampling and the answer's shape."""

    calls: list[LLMCall]
    sampling: SamplingParams
    spec: AnswerSpec


def openai_routes(service: Service) -> list[Route]:
    """The OpenAI-compatible routes over `service`."""
    api = _OpenAIApi(service)
    return [
        Route("/v1/completions", endpoint(api.completions), methods=["POST"]),
        Route("/v1/chat/completions", endpoint(api.chat), methods=["POST"]),
        Route("/v1/embeddings", endpoint(api.embeddings), methods=["POST"]),
        Route("/v1/models", endpoint(api.models), methods=["GET"]),
        *extra_routes(service),
    ]


class _OpenAIApi:
    def __init__(self, service: Service) -> None:
        self.service = service

    async def models(self, request: Request) -> Response:
        return json_response({"object": "list", "data": model_cards(self.service)})

    async def completions(self, request: Request) -> Response:
        ctx = request_context(request, "openai")
        body = decode_request(await read_body(request, MAX_BODY_BYTES), CompletionRequest)
        check_unsupported(body)
        ctx = with_request_id(ctx, request, body.request_id)
        prompts = completion_prompts(body)
        check_num_choices(len(prompts), num_choices_per_prompt(body))
        special = body.add_special_tokens is not False  # vLLM: true unless told otherwise
        calls = [
            await self.service.prepare_prompt(ctx, body.model, p, add_special_tokens=special)
            for p in prompts
        ]
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        texts = [p if isinstance(p, str) else None for p in prompts]
        return await self._generate(request, ctx, calls, body, lambda _: max_tokens, texts)

    async def chat(self, request: Request) -> Response:
        ctx = request_context(request, "openai")
        body = decode_request(await read_body(request, MAX_BODY_BYTES), ChatCompletionRequest)
        check_unsupported(body)
        ctx = with_request_id(ctx, request, body.request_id)
        tools = tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls)
        call = await self.service.prepare_chat(
            ctx, body.model, chat_messages(body), chat_options(body, tools)
        )
        # Without a limit, a chat answer may use whatever context the prompt leaves (vLLM's rule).
        given = (
            body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
        )

        def max_tokens(call: LLMCall) -> int:
            return max(1, call.max_model_len - len(call.token_ids)) if given is None else given

        return await self._generate(request, ctx, [call], body, max_tokens, None, tools)

    async def _generate(
        self,
        request: Request,
        ctx: RequestContext,
        calls: list[LLMCall],
        body: CompletionRequest | ChatCompletionRequest,
        max_tokens: Callable[[LLMCall], int],
        texts: list[str | None] | None,  # completions: the prompts given as text
        tools: ToolPlan | None = None,  # chat: the request's tools
    ) -> Response:
        """Admit every choice (prompts x n; errors raise here) and answer for them all; a
        cascade's first model answers whole first, and may hand the request to its second."""
        gen = await self._prepare(ctx, calls, body, max_tokens(calls[0]), texts, tools)
        route = self.service.generation_route(ctx, calls[0])  # the A/B arm, as v2 answers say it
        cascade = self.service.generation_cascade(calls[0])
        if cascade is None:
            return await self._answer(request, ctx, gen, body, route)
        # Decided before the first byte: the header says which model answers.
        first = await until_disconnect(request, self.service.first_answer(
            ctx, cascade, gen.calls, gen.sampling, gen.spec.n, gen.spec.request_id,
            priority=body.priority, cache_salt=body.cache_salt,
        ))  # fmt: skip
        route = first.header if route is None else f"{route}; {first.header}"
        if not first.escalate:
            return await self._respond(request, gen, body, first.replay(), {ROUTE_HEADER: route})
        ctx = then_context(ctx)  # `then` serves its own default variant and A/B split
        calls = await self.service.escalate_calls(ctx, cascade.then, calls)
        gen = await self._prepare(ctx, calls, body, max_tokens(calls[0]), texts, tools)
        return await self._answer(request, ctx, gen, body, route)

    async def _prepare(
        self,
        ctx: RequestContext,
        calls: list[LLMCall],
        body: CompletionRequest | ChatCompletionRequest,
        max_tokens: int,
        texts: list[str | None] | None,
        plan: ToolPlan | None,
    ) -> _Generation:
        """The sampling, prompts and answer's shape of a request on the model of `calls`."""
        chat = texts is None
        tools = None if plan is None else tool_answer(plan, calls[0].tool_call_parser)
        n = num_choices_per_prompt(body)
        sampling = sampling_params(body, max_tokens)
        field = None  # the request field the grammar came from (None: find it in the body)
        if tools is not None:  # required / named: the calls' schema constrains the output
            sampling = tools.sampling(sampling)
            field = "tools" if tools.plan.is_forced else None
        await prepare_structured(calls[0], body, sampling, field)  # compiles off the loop
        calls = [truncated(call, body.truncate_prompt_tokens) for call in calls]

        echo = isinstance(body, CompletionRequest) and bool(body.echo)
        spec = AnswerSpec(
            request_id=f"{'chatcmpl' if chat else 'cmpl'}-{ctx.request_id}",  # vLLM's ids
            model=body.model, chat=chat, n=n,
            prompts=prompt_infos(calls, texts, echo=echo),
            decode=calls[0].decode_token,
            logprobs=sampling.logprobs is not None, echo=echo,
            prompt_logprobs=body.prompt_logprobs is not None, tools=tools,
        )  # fmt: skip
        return _Generation(calls, sampling, spec)

    async def _answer(
        self,
        request: Request,
        ctx: RequestContext,
        gen: _Generation,
        body: CompletionRequest | ChatCompletionRequest,
        route: str | None,
    ) -> Response:
        # The result cache answers before admission, so its header precedes the first byte.
        plan = await self.service.plan_generation(
            ctx, gen.calls, gen.sampling, gen.spec.n, body.cache_salt
        )
        headers: dict[str, str] = {} if plan is None else {CACHE_HEADER: plan.status}
        if route is not None:
            headers[ROUTE_HEADER] = route

        def start(call: LLMCall, params: SamplingParams, choice_id: str) -> Choice:
            def live() -> Choice:
                return self.service.generate(
                    ctx, call, params, request_id=choice_id, priority=body.priority,
                    cache_salt=body.cache_salt,
                )  # fmt: skip

            return live() if plan is None else plan.open(live, choice_id)

        outputs = admit_choices(start, gen.calls, gen.sampling, gen.spec.n, gen.spec.request_id)
        return await self._respond(request, gen, body, outputs, headers)

    async def _respond(
        self,
        request: Request,
        gen: _Generation,
        body: CompletionRequest | ChatCompletionRequest,
        outputs: AsyncGenerator[ChoiceOutput, None],
        headers: dict[str, str],
    ) -> Response:
        """The answer as server-sent events or as one JSON body."""
        if body.is_stream:
            events = openai_choices.events(
                gen.spec, outputs, include_usage=body.include_usage,
                error_json=lambda exc: error_body(request.url.path, exc),
            )  # fmt: skip
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        answer = await until_disconnect(request, openai_choices.collect(gen.spec, outputs))
        response = json_response(answer)
        response.headers.update(headers)
        return response

    async def embeddings(self, request: Request) -> Response:
        ctx = request_context(request, "openai")
        body = decode_request(await read_body(request, MAX_BODY_BYTES), EmbeddingRequest)
        texts = embedding_texts(body)
        result = await until_disconnect(
            request, self.service.embed(ctx, body.model, texts, dimensions=body.dimensions)
        )
        vectors = encode_vectors(result.matrix, body.encoding_format)
        response = json_response(embedding_response(body.model, vectors, result.prompt_tokens))
        if result.cache is not None:
            response.headers[CACHE_HEADER] = result.cache
        if result.route is not None:
            response.headers[ROUTE_HEADER] = result.route
        return response
