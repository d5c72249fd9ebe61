"""vLLM's routes beside the OpenAI API: /tokenize, /detokenize (prompt or chat messages, vLLM's
request and response shapes), /health, /version, and the model cards of /v1/models and
/v1/models/{id} with the fields vLLM returns."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from fulcrum import __version__
from fulcrum.errors import InvalidInput, NotFound
from fulcrum.protocol.openai import (
    ChatCompletionRequest,
    ChatMessage,
    chat_messages,
    decode_request,
)
from fulcrum.protocol.openai_fields import refuse_unimplemented_json
from fulcrum.server.http import endpoint, json_response, read_body, request_context
from fulcrum.server.openai_request import chat_options

if TYPE_CHECKING:
    from fulcrum.context import RequestContext
    from fulcrum.service import LLMCall, Service

MAX_BODY_BYTES = 8 * 1024 * 1024
# Fields of vLLM's tokenize requests this server does not implement: refused, never ignored.
_TOKENIZE_REFUSED = frozenset({"mm_processor_kwargs", "media_io_kwargs"})


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's TokenizeCompletionRequest (`prompt`) or TokenizeChatRequest (`messages`)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # null: true for a prompt, false for messages
    return_token_strs: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    tools: list[Any] | None = None  # rendered as the chat endpoint renders them


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


def extra_routes(service: Service) -> list[Route]:
    """/tokenize, /detokenize, /health, /version and /v1/models/{id}."""
    api = _ExtraApi(service)
    return [
        Route("/tokenize", endpoint(api.tokenize), methods=["POST"]),
        Route("/detokenize", endpoint(api.detokenize), methods=["POST"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/version", api.version, methods=["GET"]),
        Route("/v1/models/{model_id:path}", endpoint(api.model), methods=["GET"]),
    ]


def model_cards(service: Service) -> list[dict[str, Any]]:
    """The served generative and embedding models, as vLLM's /v1/models describes them."""
    now = int(time.time())
    return [_card(card, now) for card in service.generative_models()]


def _card(card: dict[str, Any], now: int) -> dict[str, Any]:
    permission = {
        "id": f"modelperm-{uuid.uuid4().hex}",
        "object": "model_permission",
        "created": now,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    return {
        **card,
        "created": card.get("created") or now,
        "root": card["id"],  # vLLM: the served checkpoint; here the repository model
        "parent": None,
        "max_model_len": card.get("max_model_len"),
        "permission": [permission],
    }


class _ExtraApi:
    def __init__(self, service: Service) -> None:
        self.service = service

    async def health(self, request: Request) -> Response:
        """vLLM's liveness-and-engines probe: 200 with no body, 503 while not ready."""
        return Response(status_code=200 if self.service.is_ready else 503)

    async def version(self, request: Request) -> Response:
        return json_response({"version": __version__})

    async def model(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        for card in model_cards(self.service):
            if card["id"] == model_id:
                return json_response(card)
        raise NotFound(f"model '{model_id}' not found")

    async def tokenize(self, request: Request) -> Response:
        ctx = request_context(request, "openai")
        raw = await read_body(request, MAX_BODY_BYTES)
        body = decode_request(raw, TokenizeRequest)
        refuse_unimplemented_json(raw, TokenizeRequest, _TOKENIZE_REFUSED)
        model = self._model(body.model)
        call = await self._prepare(ctx, model, body)
        result: dict[str, Any] = {
            "count": len(call.token_ids),
            "max_model_len": call.max_model_len,
            "tokens": call.token_ids,
            "token_strs": None,
        }
        if body.return_token_strs:
            result["token_strs"] = self.service.token_strings(ctx, model, call.token_ids)
        return json_response(result)

    async def _prepare(self, ctx: RequestContext, model: str, body: TokenizeRequest) -> LLMCall:
        if (body.prompt is None) == (body.messages is None):
            raise InvalidInput("prompt: give either `prompt` or `messages`", param="prompt")
        if body.prompt is not None:
            special = body.add_special_tokens is not False
            return await self.service.prepare_prompt(
                ctx, model, body.prompt, add_special_tokens=special
            )
        chat = ChatCompletionRequest(
            model=model,
            messages=body.messages or [],
            add_special_tokens=body.add_special_tokens,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            chat_template=body.chat_template,
            chat_template_kwargs=body.chat_template_kwargs,
            documents=body.documents,
            tools=body.tools,
            tool_choice=None if body.tools is None else "none",  # rendered, not parsed
        )
        return await self.service.prepare_chat(ctx, model, chat_messages(chat), chat_options(chat))

    async def detokenize(self, request: Request) -> Response:
        ctx = request_context(request, "openai")
        body = decode_request(await read_body(request, MAX_BODY_BYTES), DetokenizeRequest)
        model = self._model(body.model)
        return json_response({"prompt": self.service.detokenize(ctx, model, body.tokens)})

    def _model(self, model: str | None) -> str:
        """The model asked for; without one, the only generative model (vLLM serves one)."""
        if model is not None:
            return model
        generative = [c["id"] for c in self.service.generative_models() if "max_model_len" in c]
        if len(generative) != 1:
            raise InvalidInput("model: required when more than one model is served", param="model")
        return str(generative[0])
