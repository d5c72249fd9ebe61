"""What a request constrains its output to, as the engine receives it: one grammar source of a
known kind. The OpenAI layer builds it from `response_format`, vLLM's `structured_outputs` or the
older `guided_*` fields (and the tool-calling layer from `tool_choice`); the engine compiles it
(`fulcrum.llm.structured`) and masks every step's logits with it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fulcrum.errors import InvalidInput

StructuredKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]


@dataclass(frozen=True, slots=True)
class StructuredSpec:
    """kind: what `source` holds. json_schema: a JSON schema (text); json_object: any JSON object
    (`source` unused, ""); regex: a regular expression; choice: a JSON list of strings; grammar: a
    Lark or GBNF grammar."""

    kind: StructuredKind
    source: str


# The grammar text is compiled per request (cached by text): bound what one request may send.
MAX_SOURCE_BYTES = 64 * 1024
KINDS: tuple[StructuredKind, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")


def check_spec(spec: object, field: str = "structured") -> None:
    """InvalidInput naming `field` for a spec of an unknown kind, a non-text source, or a source
    over MAX_SOURCE_BYTES (checked before anything compiles it)."""
    if not isinstance(spec, StructuredSpec):
        raise InvalidInput(f"{field}: expected a StructuredSpec, got {type(spec).__name__}")
    if spec.kind not in KINDS:
        raise InvalidInput(f"{field}: unknown kind {spec.kind!r} (one of {', '.join(KINDS)})")
    if not isinstance(spec.source, str):
        raise InvalidInput(f"{field}: the grammar source must be text")
    # len() counts characters, never more than bytes: a cheap first test on a huge source.
    size = len(spec.source)
    if size <= MAX_SOURCE_BYTES:
        size = len(spec.source.encode("utf-8", "replace"))
    if size > MAX_SOURCE_BYTES:
        raise InvalidInput(
            f"{field}: the {spec.kind} is {size} bytes; at most {MAX_SOURCE_BYTES} are accepted"
        )
    if spec.kind != "json_object" and not spec.source.strip():
        raise InvalidInput(f"{field}: the {spec.kind} must not be empty")
