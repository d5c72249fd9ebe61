"""Tool-call parsers by vLLM's `--tool-call-parser` names: each turns one model family's
written calls into OpenAI `tool_calls`, whole or as they stream."""

from __future__ import annotations

import uuid
from collections.abc import Callable

from fulcrum.errors import InvalidInput
from fulcrum.llm.tool_parsers.base import (
    CallDelta,
    Delta,
    Extracted,
    NewId,
    StreamParser,
    ToolCall,
    extract,
)
from fulcrum.llm.tool_parsers.hermes import HermesParser
from fulcrum.llm.tool_parsers.llama3_json import Llama3JsonParser
from fulcrum.llm.tool_parsers.mistral import MistralParser, mistral_call_id
from fulcrum.llm.tool_parsers.pythonic import PythonicParser

__all__ = [
    "PARSER_NAMES",
    "CallDelta",
    "Delta",
    "Extracted",
    "StreamParser",
    "ToolCall",
    "extract",
    "keeps_special_tokens",
    "new_parser",
    "openai_call_id",
]


def openai_call_id() -> str:
    """vLLM's tool call id: chatcmpl-tool-<32 hex>."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


_PARSERS: dict[str, tuple[Callable[[NewId], StreamParser], NewId]] = {
    "hermes": (HermesParser, openai_call_id),
    "llama3_json": (Llama3JsonParser, openai_call_id),
    "mistral": (MistralParser, mistral_call_id),
    "pythonic": (PythonicParser, openai_call_id),
}
PARSER_NAMES = tuple(_PARSERS)
# Formats whose markers are special tokens, which must stay in the text to be found.
_KEEPS_SPECIAL_TOKENS = frozenset({"mistral"})


def new_parser(name: str, new_id: NewId | None = None) -> StreamParser:
    """A parser for one choice; `new_id` makes call ids (the family's own by default)."""
    try:
        factory, default_id = _PARSERS[name]
    except KeyError:
        raise InvalidInput(
            f"tool_call_parser: unknown parser {name!r}; expected one of {list(PARSER_NAMES)}"
        ) from None
    return factory(new_id or default_id)


def keeps_special_tokens(name: str) -> bool:
    """Whether the family's calls are marked by special tokens (generation keeps them)."""
    return name in _KEEPS_SPECIAL_TOKENS
