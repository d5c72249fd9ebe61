"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions (JSON, or server-sent events
ending with `data: [DONE]`), /v1/embeddings and /v1/models, all through the service facade. A
client that goes away, while streaming or waiting for a JSON answer, aborts its request."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from fulcrum.embeddings import encode_vectors
from fulcrum.errors import FulcrumError, ModelError
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    chat_messages,
    check_unsupported,
    completion_prompt,
    decode_request,
    embedding_response,
    embedding_texts,
    envelope,
    usage_json,
)
from fulcrum.server.http import (
    endpoint,
    error_body,
    json_response,
    read_body,
    request_context,
    until_disconnect,
)

if TYPE_CHECKING:
    from fulcrum.context import RequestContext
    from fulcrum.llm.outputs import RequestOutput, Usage
    from fulcrum.protocol.openai import _Request
    from fulcrum.service import LLMCall, Service

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_json = msgspec.json.Encoder()


def openai_routes(service: Service) -> list[Route]:
    """The OpenAI-compatible routes over `service`."""
    api = _OpenAIApi(service)
    return [
        Route("/v1/completions", endpoint(api.completions), methods=["POST"]),
        Route("/v1/chat/completions", endpoint(api.chat), methods=["POST"]),
        Route("/v1/embeddings", endpoint(api.embeddings), methods=["POST"]),
        Route("/v1/models", endpoint(api.models), methods=["GET"]),
    ]


def sampling_params(request: _Request, max_tokens: int) -> SamplingParams:
    """SamplingParams for a request (OpenAI defaults: temperature 1, top_p 1)."""
    stop = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_k=request.top_k or 0,
        top_p=1.0 if request.top_p is None else request.top_p,
        seed=request.seed,
        stop=stop,
        stop_token_ids=tuple(request.stop_token_ids or ()),
        ignore_eos=request.ignore_eos,
    )
    params.validate()
    return params


def _usage(usage: Usage) -> dict[str, Any]:
    return usage_json(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)


class _Call:
    """One admitted request: its stream plus what the response needs to say."""

    def __init__(
        self, stream: AsyncIterator[RequestOutput], request_id: str, model: str, chat: bool
    ) -> None:
        self.stream = stream
        self.request_id = request_id
        self.model = model
        self.chat = chat
        self.object = "chat.completion" if chat else "text_completion"

    def choice(self, text: str, finish_reason: str | None, *, delta: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        if not self.chat:
            choice["text"] = text
        elif delta:
            choice["delta"] = {"content": text} if text else {}
        else:
            choice["message"] = {"role": "assistant", "content": text}
        return choice

    def chunk(self, choices: list[dict[str, Any]]) -> bytes:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return _sse(envelope(self.request_id, obj, self.model, choices))


def _sse(payload: object) -> bytes:
    return b"data: " + _json.encode(payload) + b"\n\n"


class _OpenAIApi:
    def __init__(self, service: Service) -> None:
        self.service = service

    async def models(self, request: Request) -> Response:
        return json_response({"object": "list", "data": self.service.generative_models()})

    async def completions(self, request: Request) -> Response:
        ctx = request_context(request, "openai")
        body = decode_request(await read_body(request, MAX_BODY_BYTES), CompletionRequest)
        check_unsupported(body)
        call = await self.service.prepare_prompt(ctx, body.model, completion_prompt(body))
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        return await self._generate(request, ctx, call, body, max_tokens, chat=False)

    async def chat(self, request: Request) -> Response:
        ctx = request_context(request, "openai")
        body = decode_request(await read_body(request, MAX_BODY_BYTES), ChatCompletionRequest)
        check_unsupported(body)
        call = await self.service.prepare_chat(ctx, body.model, chat_messages(body))
        # Without a limit, a chat answer may use whatever context the prompt leaves (vLLM's rule).
        max_tokens = (
            body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
        )
        if max_tokens is None:
            max_tokens = max(1, call.max_model_len - len(call.token_ids))
        return await self._generate(request, ctx, call, body, max_tokens, chat=True)

    async def _generate(
        self,
        request: Request,
        ctx: RequestContext,
        call: LLMCall,
        body: CompletionRequest | ChatCompletionRequest,
        max_tokens: int,
        *,
        chat: bool,
    ) -> Response:
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        stream = self.service.generate(
            ctx, call, sampling_params(body, max_tokens), request_id=request_id,
            priority=body.priority, cache_salt=body.cache_salt,
        )  # fmt: skip
        return await _respond(request, _Call(stream, request_id, body.model, chat), body)

    async def embeddings(self, request: Request) -> Response:
        ctx = request_context(request, "openai")
        body = decode_request(await read_body(request, MAX_BODY_BYTES), EmbeddingRequest)
        texts = embedding_texts(body)
        result = await until_disconnect(
            request, self.service.embed(ctx, body.model, texts, dimensions=body.dimensions)
        )
        vectors = encode_vectors(result.matrix, body.encoding_format)
        return json_response(embedding_response(body.model, vectors, result.prompt_tokens))


async def _respond(
    request: Request, call: _Call, body: CompletionRequest | ChatCompletionRequest
) -> Response:
    if body.stream:
        return StreamingResponse(
            _events(request, call, include_usage=body.include_usage),
            media_type="text/event-stream",
        )
    return json_response(await until_disconnect(request, _collect(call)))


async def _collect(call: _Call) -> dict[str, Any]:
    texts: list[str] = []
    finish_reason: str | None = None
    usage: Usage | None = None
    async for output in call.stream:
        texts.append(output.new_text)
        finish_reason, usage = output.finish_reason, output.usage
    result = envelope(
        call.request_id,
        call.object,
        call.model,
        [call.choice("".join(texts), finish_reason, delta=False)],
    )
    if usage is not None:
        result["usage"] = _usage(usage)
    return result


async def _events(request: Request, call: _Call, *, include_usage: bool) -> AsyncIterator[bytes]:
    usage: Usage | None = None
    try:
        if call.chat:
            yield call.chunk(
                [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
        async for output in call.stream:
            usage = output.usage
            if output.new_text or output.finished:
                yield call.chunk([call.choice(output.new_text, output.finish_reason, delta=True)])
    except FulcrumError as exc:  # the engine died, shut down or the deadline passed: say so
        yield _sse(error_body(request.url.path, exc))
    except Exception as exc:
        log.exception("stream of %s failed", call.request_id)
        error = ModelError(f"generation failed: {type(exc).__name__}")
        yield _sse(error_body(request.url.path, error))
    if include_usage and usage is not None:
        chunk = envelope(
            call.request_id, call.object + ".chunk" if call.chat else call.object, call.model, []
        )
        chunk["usage"] = _usage(usage)
        yield _sse(chunk)
    yield b"data: [DONE]\n\n"
