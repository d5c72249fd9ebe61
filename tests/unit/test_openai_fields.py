"""The field registry: a known field the request struct does not declare is refused (400 naming
it) unless null, ignored metadata or its documented default; unknown fields pass; what counts as
implemented is read from the struct itself."""

from __future__ import annotations

import json

import msgspec
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from fulcrum.errors import InvalidInput, ModelError
from fulcrum.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    decode_request,
)
from fulcrum.protocol.openai_fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    IGNORED_FIELDS,
    MESSAGE_FIELDS,
    NEUTRAL_VALUES,
    declared_fields,
    known_fields,
    refuse_unimplemented,
    refuse_unimplemented_json,
)
from fulcrum.server.http import error_body


class Narrow(msgspec.Struct, kw_only=True):
    """A completions struct that implements only these fields."""

    model: str
    prompt: str
    temperature: float | None = None


def _refused_param(raw: dict[str, object], struct: type[msgspec.Struct]) -> str | None:
    try:
        refuse_unimplemented(raw, struct)
    except InvalidInput as exc:
        assert exc.status_code == 400
        return exc.param
    return None


def test_the_registry_holds_every_field_of_the_official_clients_params() -> None:
    # The installed openai client is the reference for OpenAI's own schemas.
    completion = set(completion_create_params.CompletionCreateParamsBase.__annotations__)
    chat = set(chat_create_params.CompletionCreateParamsBase.__annotations__)
    assert completion <= COMPLETION_FIELDS
    assert chat <= CHAT_FIELDS
    assert {"stream", "request_id", "guided_json", "structured_outputs"} <= CHAT_FIELDS


def test_a_known_field_the_struct_does_not_declare_is_refused_by_name() -> None:
    assert _refused_param({"model": "m", "prompt": "p", "logit_bias": {"1": 5}}, Narrow) == (
        "logit_bias"
    )
    assert _refused_param({"model": "m", "prompt": "p", "min_p": 0.2}, Narrow) == "min_p"
    assert _refused_param({"guided_regex": "a+"}, Narrow) == "guided_regex"


def test_declared_fields_come_from_the_struct_not_from_a_list() -> None:
    assert declared_fields(Narrow) == {"model", "prompt", "temperature"}
    assert _refused_param({"temperature": 0.5}, Narrow) is None
    # The same field, on a struct that does not declare it, is refused.
    assert _refused_param({"temperature": 0.5}, Bare) == "temperature"


class Bare(msgspec.Struct, kw_only=True):
    model: str
    prompt: str


class BareChat(msgspec.Struct, kw_only=True):
    model: str
    messages: list[dict[str, str]]


def test_null_unknown_and_metadata_fields_are_accepted() -> None:
    raw = {
        "logit_bias": None,  # the official client sends null for a None argument
        "tools": None,
        "x_custom_extension": {"anything": 1},  # truly unknown: ignored
        "user": "u-1",
        "metadata": {"k": "v"},
        "store": True,
        "service_tier": "auto",
    }
    assert _refused_param(raw, Narrow) is None
    assert {"user", "metadata", "store", "service_tier"} <= IGNORED_FIELDS


@pytest.mark.parametrize(
    ("field", "value"),
    [("n", 1), ("use_beam_search", False), ("bad_words", []), ("tool_choice", "none"),
     ("response_format", {"type": "text"}), ("repetition_penalty", 1.0), ("echo", False)],
)  # fmt: skip
def test_a_documented_default_asks_for_nothing_and_passes(field: str, value: object) -> None:
    assert _refused_param({field: value}, BareChat) is None


@pytest.mark.parametrize(
    ("field", "value"),
    [("n", 2), ("use_beam_search", True), ("bad_words", ["x"]), ("tool_choice", "auto"),
     ("response_format", {"type": "json_object"}), ("echo", 0), ("logprobs", 0)],
)  # fmt: skip
def test_any_other_value_is_refused(field: str, value: object) -> None:
    # `logprobs: 0` asks for the sampled token's logprob, and 0 == False in Python.
    assert _refused_param({field: value}, BareChat) == field


def test_neutral_values_only_name_known_fields() -> None:
    assert set(NEUTRAL_VALUES) <= CHAT_FIELDS | COMPLETION_FIELDS | MESSAGE_FIELDS


def test_the_endpoint_is_told_by_the_struct() -> None:
    assert known_fields(ChatCompletionRequest) == CHAT_FIELDS
    assert known_fields(CompletionRequest) == COMPLETION_FIELDS
    # `tools` is a chat field: on completions it is an unknown extra, as OpenAI has it.
    assert _refused_param({"tools": [{"type": "function"}]}, Bare) is None


def test_the_json_probe_agrees_with_the_dict_check() -> None:
    body = {"model": "m", "prompt": "x" * 10_000, "response_format": {"type": "json_object"}}
    with pytest.raises(InvalidInput) as caught:
        refuse_unimplemented_json(json.dumps(body).encode(), Bare)
    assert caught.value.param == "response_format"
    neutral = {**body, "response_format": {"type": "text"}, "user": "u", "extra": [1]}
    refuse_unimplemented_json(json.dumps(neutral).encode(), Bare)


def test_decoding_a_request_refuses_unimplemented_fields() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for field, value in [("functions", [{"name": "f"}]),
                         ("structural_tag", {"type": "structural_tag"}),
                         ("use_beam_search", True),
                         ("reasoning_effort", "low")]:  # fmt: skip
        with pytest.raises(InvalidInput) as caught:
            decode_request(json.dumps({**chat, field: value}).encode(), ChatCompletionRequest)
        assert caught.value.param == field
    decoded = decode_request(json.dumps({**chat, "tools": None}).encode(), ChatCompletionRequest)
    assert decoded.model == "m"


def test_a_type_error_names_its_field_as_param() -> None:
    with pytest.raises(InvalidInput) as caught:
        decode_request(b'{"model": "m", "prompt": "p", "max_tokens": "many"}', CompletionRequest)
    assert caught.value.param == "max_tokens"
    with pytest.raises(InvalidInput) as missing:
        decode_request(b'{"prompt": "p"}', CompletionRequest)
    assert missing.value.param == "model"


def test_a_message_field_the_message_struct_leaves_out_is_refused_with_its_path() -> None:
    def body(message: dict[str, object]) -> bytes:
        system = {"role": "system", "content": "Be brief."}
        return json.dumps({"model": "m", "messages": [system, message]}).encode()

    for field, value in [("function_call", {"name": "f", "arguments": "{}"}),
                         ("audio", {"id": "a1"})]:  # fmt: skip
        with pytest.raises(InvalidInput) as caught:
            decode_request(body({"role": "user", "content": "hi", field: value}),
                           ChatCompletionRequest)  # fmt: skip
        assert caught.value.param == f"messages[1].{field}"
    neutral = {"role": "assistant", "content": "x", "tool_calls": [], "refusal": None, "y": 1}
    assert len(decode_request(body(neutral), ChatCompletionRequest).messages) == 2


def test_a_message_name_reaches_the_template_messages() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi", "name": "alice"},
                                       {"role": "user", "content": "yo"}]}  # fmt: skip
    request = decode_request(json.dumps(body).encode(), ChatCompletionRequest)
    assert chat_messages(request) == [
        {"role": "user", "content": "hi", "name": "alice"},
        {"role": "user", "content": "yo"},
    ]


def test_server_errors_under_v1_have_openais_server_error_type() -> None:
    body = error_body("/v1/chat/completions", ModelError("generation failed: RuntimeError"))
    assert body == {"error": {"message": "generation failed: RuntimeError",
                              "type": "server_error", "param": None, "code": 500}}  # fmt: skip
    assert error_body("/v2/models/m/infer", ModelError("boom")) == {"error": "boom"}
