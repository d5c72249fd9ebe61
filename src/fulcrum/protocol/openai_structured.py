"""The structured-output fields of an OpenAI request as one StructuredSpec: OpenAI's
`response_format`, vLLM's `structured_outputs` and its older `guided_*` fields. One constraint
per request; anything this server would not honour is a 400 naming the field."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fulcrum.errors import InvalidInput
from fulcrum.llm.structured_spec import StructuredKind, StructuredSpec, check_spec

if TYPE_CHECKING:
    from fulcrum.protocol.openai import _Request

# vLLM's structured_outputs keys, each to a spec kind (json_object: a flag).
_STRUCTURED_KINDS: dict[str, StructuredKind] = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}
# structured_outputs keys accepted when they ask for what this server does anyway.
_NEUTRAL_OPTIONS: dict[str, tuple[object, ...]] = {
    "disable_fallback": (True, False),  # one backend, so never a fallback
    "disable_any_whitespace": (True,),  # JSON is always compact here
    "backend": ("guidance", "auto"),
}
_BACKENDS = ("guidance", "llguidance", "auto")


@dataclass(frozen=True, slots=True)
class StructuredRequest:
    """A request's constraint and the field it came from (errors name it)."""

    spec: StructuredSpec
    field: str


def structured_request(request: _Request) -> StructuredRequest | None:
    """The request's one structured-output constraint, None without one; InvalidInput naming
    the field for a malformed one, and both fields when two constrain the same request."""
    _check_options(request)
    found = [
        c
        for c in (
            _response_format(request.response_format),
            _structured_outputs(request.structured_outputs),
            *_guided(request),
        )
        if c is not None
    ]
    if len(found) > 1:
        first, second = found[0].field, found[1].field
        raise InvalidInput(
            f"{first} and {second}: only one structured-output constraint per request",
            param=second,
        )
    if not found:
        return None
    check_spec(found[0].spec, found[0].field)  # its size, before anything compiles it
    return found[0]


def _check_options(request: _Request) -> None:
    backend = request.guided_decoding_backend
    if backend is not None and backend not in _BACKENDS:
        raise InvalidInput(
            f"guided_decoding_backend: only {', '.join(_BACKENDS)} (llguidance) is available, "
            f"got {backend!r}"
        )
    if request.guided_whitespace_pattern is not None:
        raise InvalidInput(
            "guided_whitespace_pattern: not supported (JSON output is compact)",
            param="guided_whitespace_pattern",
        )


def _schema_source(value: object, field: str) -> str:
    """A JSON schema given as an object or as its JSON text, as JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidInput(f"{field}: the schema is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidInput(f"{field}: the schema must be a JSON object")
    return json.dumps(value)


def _response_format(value: dict[str, Any] | None) -> StructuredRequest | None:
    field = "response_format"
    if value is None:
        return None
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredRequest(StructuredSpec("json_object", ""), field)
    if kind != "json_schema":
        raise InvalidInput(
            f"{field}.type: expected 'text', 'json_object' or 'json_schema', got {kind!r}",
            param=field,
        )
    inner = value.get("json_schema")
    if not isinstance(inner, dict) or "schema" not in inner:
        raise InvalidInput(f"{field}.json_schema.schema: required", param=field)
    strict = inner.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidInput(f"{field}.json_schema.strict: must be a boolean", param=field)
    source = _schema_source(inner["schema"], f"{field}.json_schema.schema")
    return StructuredRequest(StructuredSpec("json_schema", source), field)


def _structured_outputs(value: dict[str, Any] | None) -> StructuredRequest | None:
    field = "structured_outputs"
    if value is None:
        return None
    given: list[tuple[str, object]] = []
    for key, item in value.items():
        if item is None or (key == "json_object" and item is False):
            continue
        if key in _STRUCTURED_KINDS:
            given.append((key, item))
        elif item not in _NEUTRAL_OPTIONS.get(key, ()):
            raise InvalidInput(f"{field}.{key}: not supported by this server", param=field)
    if len(given) > 1:
        names = " and ".join(f"{field}.{key}" for key, _ in given[:2])
        raise InvalidInput(f"{names}: only one constraint per request", param=field)
    if not given:
        return None
    key, item = given[0]
    return StructuredRequest(_spec(_STRUCTURED_KINDS[key], item, f"{field}.{key}"), field)


def _guided(request: _Request) -> list[StructuredRequest | None]:
    fields: list[tuple[str, StructuredKind, object]] = [
        ("guided_json", "json_schema", request.guided_json),
        ("guided_regex", "regex", request.guided_regex),
        ("guided_choice", "choice", request.guided_choice),
        ("guided_grammar", "grammar", request.guided_grammar),
    ]
    return [
        StructuredRequest(_spec(kind, value, name), name)
        for name, kind, value in fields
        if value is not None
    ]


def _spec(kind: StructuredKind, value: object, field: str) -> StructuredSpec:
    if kind == "json_schema":
        return StructuredSpec(kind, _schema_source(value, field))
    if kind == "json_object":
        if value is not True:
            raise InvalidInput(f"{field}: must be true or null")
        return StructuredSpec(kind, "")
    if kind == "choice":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise InvalidInput(f"{field}: must be a non-empty list of non-empty strings")
        return StructuredSpec(kind, json.dumps(value))
    if not isinstance(value, str) or not value.strip():
        raise InvalidInput(f"{field}: must be a non-empty string")
    return StructuredSpec(kind, value)
