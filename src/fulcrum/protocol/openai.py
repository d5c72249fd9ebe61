"""OpenAI wire format: completions, chat and embeddings request structs (parsed with msgspec) and
the JSON bodies of responses, stream chunks and errors. Pure: no HTTP, no engine."""

from __future__ import annotations

import time
from typing import Any, TypeVar

import msgspec

from fulcrum.errors import FulcrumError, InvalidInput

_T = TypeVar("_T")
_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    413: "invalid_request_error",
    503: "service_unavailable_error",
}


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class _Request(msgspec.Struct, kw_only=True):
    """Fields both endpoints share; unknown fields are ignored, as OpenAI clients send extras."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extension
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    priority: int = 0  # lower is served first (vLLM's convention)
    cache_salt: str | None = None
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Request, kw_only=True):
    prompt: str | list[Any]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[Any] | None = None


class ChatCompletionRequest(_Request, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False


def decode_request(body: bytes, kind: type[_T]) -> _T:
    """Parse a body; InvalidInput names the offending field."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        message, _, where = str(exc).partition(" - at `$.")
        field = where.rstrip("`")
        raise InvalidInput(f"{field}: {message}" if field else message) from None
    except msgspec.DecodeError as exc:
        raise InvalidInput(f"malformed JSON: {exc}") from None
    except RecursionError:
        raise InvalidInput("malformed JSON: nested too deeply") from None


def check_unsupported(request: _Request) -> None:
    """400 for features this engine does not implement, naming the field."""
    if request.n != 1:
        raise InvalidInput(f"n: only n=1 is supported, got {request.n}")
    if request.presence_penalty or request.frequency_penalty:
        raise InvalidInput("presence_penalty/frequency_penalty: penalties are not supported")
    if isinstance(request, CompletionRequest):
        if request.echo:
            raise InvalidInput("echo: not supported")
        if request.logprobs is not None:
            raise InvalidInput("logprobs: not supported")
        if request.suffix:
            raise InvalidInput("suffix: not supported")
    elif isinstance(request, ChatCompletionRequest) and request.logprobs:
        raise InvalidInput("logprobs: not supported")


def completion_prompt(request: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion request: a string or a list of token ids."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one prompt
        if isinstance(prompt, str):
            return prompt
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise InvalidInput("prompt: expected a string, a list of token ids, or a list of one of those")


def chat_messages(request: ChatCompletionRequest) -> list[dict[str, str]]:
    """Messages as {"role", "content"} strings; content parts of type text are joined."""
    if not request.messages:
        raise InvalidInput("messages: at least one message is required")
    out: list[dict[str, str]] = []
    for i, message in enumerate(request.messages):
        content = message.content
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise InvalidInput(f"messages[{i}].content: only text parts are supported")
            content = "".join(str(p.get("text", "")) for p in content)
        out.append({"role": message.role, "content": content or ""})
    return out


def usage_json(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def envelope(request_id: str, obj: str, model: str, choices: list[Any]) -> dict[str, Any]:
    """The fields every response and chunk carries."""
    return {
        "id": request_id,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }


def error_json(exc: FulcrumError) -> dict[str, Any]:
    """OpenAI's error body: message, type and code (the HTTP status); never a stack trace."""
    kind = _ERROR_TYPES.get(exc.status_code, "internal_error")
    return {"error": {"message": exc.message, "type": kind, "code": exc.status_code}}


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    """OpenAI's `/v1/embeddings` body: one text or a list of texts."""

    model: str
    input: str | list[str]
    encoding_format: str = "float"  # "float" or "base64" (the official client asks for base64)
    dimensions: int | None = None
    user: str | None = None


MAX_EMBEDDING_INPUTS = 2048  # OpenAI's own limit per request


def embedding_texts(request: EmbeddingRequest) -> list[str]:
    """The request's texts; token-id input is refused (the text front end tokenises)."""
    texts = [request.input] if isinstance(request.input, str) else request.input
    if not texts:
        raise InvalidInput("input: at least one text is required")
    if len(texts) > MAX_EMBEDDING_INPUTS:
        raise InvalidInput(f"input: at most {MAX_EMBEDDING_INPUTS} texts per request")
    if request.encoding_format not in ("float", "base64"):
        raise InvalidInput(
            f"encoding_format: expected 'float' or 'base64', got {request.encoding_format!r}"
        )
    return texts


def embedding_response(
    model: str, vectors: list[list[float]] | list[str], prompt_tokens: int
) -> dict[str, Any]:
    """The embeddings list body; a vector is floats, or base64 of little-endian float32."""
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
