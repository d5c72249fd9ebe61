"""OpenAI wire format: completions, chat and embeddings request structs (parsed with msgspec) and
the JSON bodies of responses, stream chunks and errors. Pure: no HTTP, no engine."""

from __future__ import annotations

import time
from typing import Any, TypeVar

import msgspec

from fulcrum.errors import InvalidInput
from fulcrum.llm.tools import template_tool_calls
from fulcrum.protocol.openai_fields import refuse_unimplemented_json

_T = TypeVar("_T")


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = None  # null or absent: usage sent, as vLLM does


class _Request(msgspec.Struct, kw_only=True):
    """Fields both endpoints share; each optional field accepts null (the official client sends
    null for a None argument). Unknown fields are ignored, as OpenAI clients send extras; a known
    field that is not declared here is refused (protocol.openai_fields)."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extension; 0 or -1 = off
    min_p: float | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens; -1 = the context
    priority: int | None = None  # lower is served first (vLLM's convention)
    cache_salt: str | None = None
    user: str | None = None
    request_id: str | None = None  # vLLM's: the response id is cmpl-/chatcmpl-<request_id>
    add_special_tokens: bool | None = None  # null: True for a prompt, False for chat (vLLM)
    # Structured output (protocol.openai_structured): OpenAI's, vLLM's and vLLM's older fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

    @property
    def is_stream(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        options = self.stream_options
        return options is not None and options.include_usage is not False


class CompletionRequest(_Request, kw_only=True):
    prompt: str | list[Any]
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None  # refused by check_unsupported unless empty


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[Any] | None = None
    # The speaker's name (multi-agent clients send it); passed to the template as vLLM does.
    name: str | None = None
    tool_calls: list[Any] | None = None  # an assistant's calls (fulcrum.llm.tools)
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatCompletionRequest(_Request, kw_only=True):
    messages: list[ChatMessage]
    # vLLM's chat-template controls (fulcrum.llm.chat.ChatOptions)
    add_generation_prompt: bool | None = None  # null: true
    continue_final_message: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # Function tools (fulcrum.llm.tools): rendered into the template; calls parsed or forced.
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


def decode_request(body: bytes, kind: type[_T]) -> _T:
    """Parse a body; InvalidInput names the offending field. A completions or chat body that
    sets a known field its struct does not implement is refused (protocol.openai_fields)."""
    try:
        request = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        message, _, where = str(exc).partition(" - at `$.")
        # "Object missing required field `model`" has no path: the field is in the message.
        missing = message.partition("required field `")[2].rstrip("`")
        field = where.rstrip("`") or missing
        raise InvalidInput(f"{field}: {message}" if field else message) from None
    except msgspec.DecodeError as exc:
        raise InvalidInput(f"malformed JSON: {exc}") from None
    except RecursionError:
        raise InvalidInput("malformed JSON: nested too deeply") from None
    if isinstance(request, _Request):
        refuse_unimplemented_json(body, type(request))
    return request


MAX_TOP_LOGPROBS = 20  # vLLM's default max_logprobs
# vLLM writes -inf logprobs as this, since JSON has no infinity.
MIN_LOGPROB = -9999.0


def check_unsupported(request: _Request) -> None:
    """400 for fields that conflict or that this engine does not implement, naming the field."""
    if request.stream_options is not None and not request.is_stream:
        raise InvalidInput("stream_options: only allowed when stream is true (as vLLM)")
    if request.prompt_logprobs is not None and request.is_stream:
        raise InvalidInput("prompt_logprobs: not available when stream is true (as vLLM)")
    if isinstance(request, CompletionRequest):
        if request.suffix:
            raise InvalidInput("suffix: not supported")
    elif isinstance(request, ChatCompletionRequest) and request.top_logprobs is not None:
        if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidInput(
                f"top_logprobs: must be in 0..{MAX_TOP_LOGPROBS}, got {request.top_logprobs}"
            )
        if request.top_logprobs > 0 and not request.logprobs:  # vLLM lets 0 pass
            raise InvalidInput("top_logprobs: requires logprobs to be true")


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def chat_logprob_entry(token: str, logprob: float, top: list[tuple[str, float]]) -> dict[str, Any]:
    """One token of a chat choice's `logprobs.content`: OpenAI's token, logprob, bytes and
    top_logprobs."""
    return {
        "token": token,
        "logprob": _logprob(logprob),
        "bytes": list(token.encode("utf-8")),
        "top_logprobs": [
            {"token": t, "logprob": _logprob(v), "bytes": list(t.encode("utf-8"))} for t, v in top
        ],
    }


def completion_logprobs(
    tokens: list[str],
    logprobs: list[float | None],
    tops: list[dict[str, float] | None],
    first_offset: int,
) -> dict[str, Any]:
    """A completion choice's `logprobs` (the legacy format): tokens, token_logprobs,
    top_logprobs and each token's character offset, counted from first_offset."""
    offsets: list[int] = []
    offset = first_offset
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [None if v is None else _logprob(v) for v in logprobs],
        "top_logprobs": [
            None if top is None else {t: _logprob(v) for t, v in top.items()} for top in tops
        ],
        "text_offset": offsets,
    }


def chat_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as {"role", "content"} strings (content parts of type text are joined), with
    an assistant's tool_calls (arguments as objects) and a tool message's tool_call_id."""
    if not request.messages:
        raise InvalidInput("messages: at least one message is required")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(request.messages):
        content = message.content
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise InvalidInput(f"messages[{i}].content: only text parts are supported")
            content = "".join(str(p.get("text", "")) for p in content)
        rendered: dict[str, Any] = {"role": message.role, "content": content or ""}
        if message.name is not None:
            rendered["name"] = message.name
        if message.tool_call_id is not None:
            rendered["tool_call_id"] = message.tool_call_id
        if message.tool_calls:
            where = f"messages[{i}].tool_calls"
            rendered["tool_calls"] = template_tool_calls(where, message.tool_calls)
        out.append(rendered)
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
