"""OpenAI-compatible routes for generative models: /v1/completions, /v1/chat/completions (JSON
or server-sent events ending with `data: [DONE]`) and /v1/models. A client that goes away, while
streaming or waiting for a JSON answer, aborts its request so its KV blocks are freed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from fulcrum.errors import FulcrumError, ModelError
from fulcrum.llm.outputs import RequestOutput, Usage
from fulcrum.server.http import read_body
from fulcrum.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    check_unsupported,
    completion_prompt,
    decode_request,
    envelope,
    error_json,
    sampling_params,
    usage_json,
)

if TYPE_CHECKING:
    from fulcrum.llm.engine import AsyncLLMEngine

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
LARGE_PROMPT_CHARS = 16 * 1024
_json = msgspec.json.Encoder()


class LLMService(Protocol):
    """What the routes need from the service."""

    def llm_engine(self, name: str) -> AsyncLLMEngine: ...

    def llm_model_names(self) -> list[str]: ...


def openai_routes(service: LLMService) -> list[Route]:
    """The OpenAI-compatible routes over `service`'s generative models."""
    api = _OpenAIApi(service)
    return [
        Route("/v1/completions", _errors(api.completions), methods=["POST"]),
        Route("/v1/chat/completions", _errors(api.chat), methods=["POST"]),
        Route("/v1/models", _errors(api.models), methods=["GET"]),
    ]


async def _encode_large(engine: AsyncLLMEngine, prompt: str | list[int]) -> str | list[int]:
    # Tokenising a long text takes milliseconds per 100 KB: do it off the event loop.
    if isinstance(prompt, str) and len(prompt) > LARGE_PROMPT_CHARS:
        return await asyncio.to_thread(engine.encode, prompt)
    return prompt


def _json_response(content: object, status_code: int = 200) -> Response:
    return Response(_json.encode(content), status_code, media_type="application/json")


def _errors(endpoint: Callable[[Request], Awaitable[Response]]) -> Callable[..., Any]:
    async def wrapper(request: Request) -> Response:
        try:
            return await endpoint(request)
        except FulcrumError as exc:
            response = _json_response(error_json(exc), exc.status_code)
            response.headers.update(exc.headers())
            return response
        except Exception:
            log.exception("unhandled error on %s", request.url.path)
            return _json_response(error_json(FulcrumError("internal server error")), 500)

    return wrapper


class _Call:
    """One admitted request: its engine stream plus what the response needs to say."""

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
    def __init__(self, service: LLMService) -> None:
        self.service = service

    async def models(self, request: Request) -> Response:
        data = []
        for name in self.service.llm_model_names():
            engine = self.service.llm_engine(name)
            data.append(
                {
                    "id": name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "fulcrum",
                    "max_model_len": engine.max_model_len,
                }
            )
        return _json_response({"object": "list", "data": data})

    async def completions(self, request: Request) -> Response:
        body = decode_request(await read_body(request, MAX_BODY_BYTES), CompletionRequest)
        check_unsupported(body)
        engine = self.service.llm_engine(body.model)
        prompt = await _encode_large(engine, completion_prompt(body))
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        sampling = sampling_params(body, max_tokens)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = engine.generate(
            prompt,
            sampling,
            request_id=request_id,
            priority=body.priority,
            cache_salt=body.cache_salt,
        )
        return await self._respond(request, _Call(stream, request_id, body.model, False), body)

    async def chat(self, request: Request) -> Response:
        body = decode_request(await read_body(request, MAX_BODY_BYTES), ChatCompletionRequest)
        check_unsupported(body)
        engine = self.service.llm_engine(body.model)
        prompt = await _encode_large(engine, engine.apply_chat_template(chat_messages(body)))
        prompt_ids = engine.encode(prompt) if isinstance(prompt, str) else prompt
        # Without a limit, a chat answer may use whatever context the prompt leaves (vLLM's rule).
        max_tokens = (
            body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
        )
        if max_tokens is None:
            max_tokens = max(1, engine.max_model_len - len(prompt_ids))
        sampling = sampling_params(body, max_tokens)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = engine.generate(
            prompt_ids,
            sampling,
            request_id=request_id,
            priority=body.priority,
            cache_salt=body.cache_salt,
        )
        return await self._respond(request, _Call(stream, request_id, body.model, True), body)

    async def _respond(
        self, request: Request, call: _Call, body: CompletionRequest | ChatCompletionRequest
    ) -> Response:
        if body.stream:
            return StreamingResponse(
                _events(call, include_usage=body.include_usage), media_type="text/event-stream"
            )
        collect = asyncio.ensure_future(_collect(call))
        disconnect = asyncio.ensure_future(_wait_disconnect(request))
        done, _ = await asyncio.wait((collect, disconnect), return_when=asyncio.FIRST_COMPLETED)
        if collect not in done:  # the client left: cancelling the stream aborts the request
            collect.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await collect
        disconnect.cancel()
        return _json_response(collect.result()) if collect in done else Response(status_code=499)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass  # each receive waits for the next ASGI message; no polling


async def _collect(call: _Call) -> dict[str, Any]:
    texts: list[str] = []
    finish_reason: str | None = None
    usage = Usage(0, 0, 0)
    async for output in call.stream:
        texts.append(output.new_text)
        finish_reason, usage = output.finish_reason, output.usage
    result = envelope(
        call.request_id,
        call.object,
        call.model,
        [call.choice("".join(texts), finish_reason, delta=False)],
    )
    result["usage"] = usage_json(usage)
    return result


async def _events(call: _Call, *, include_usage: bool) -> AsyncIterator[bytes]:
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
    except FulcrumError as exc:  # the engine died or shut down mid-stream: say so, then end
        yield _sse(error_json(exc))
    except Exception as exc:
        log.exception("stream of %s failed", call.request_id)
        yield _sse(error_json(ModelError(f"generation failed: {type(exc).__name__}")))
    if include_usage and usage is not None:
        chunk = envelope(
            call.request_id, call.object + ".chunk" if call.chat else call.object, call.model, []
        )
        chunk["usage"] = usage_json(usage)
        yield _sse(chunk)
    yield b"data: [DONE]\n\n"
