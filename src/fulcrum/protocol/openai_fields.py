"""The field registry: every request field of OpenAI's completions and chat APIs and of vLLM's
documented extensions, and the one check that refuses a known field the server does not implement
(400 naming it) instead of ignoring it. What is implemented is read from the request struct."""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from typing import get_args

import msgspec

from fulcrum.errors import InvalidInput

# OpenAI's API reference (and the official client's CompletionCreateParams).
OPENAI_COMPLETION_FIELDS = frozenset({
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
    "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix",
    "temperature", "top_p", "user",
})  # fmt: skip
OPENAI_CHAT_FIELDS = frozenset({
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias",
    "logprobs", "max_completion_tokens", "max_tokens", "metadata", "modalities", "moderation", "n",
    "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key",
    "prompt_cache_options", "prompt_cache_retention", "reasoning_effort", "response_format",
    "safety_identifier", "seed", "service_tier", "stop", "store", "stream", "stream_options",
    "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity",
    "web_search_options",
})  # fmt: skip
# vLLM's sampling extensions, accepted by both endpoints (its docs and protocol, current and
# recent releases: the guided_* fields predate `structured_outputs`).
VLLM_SAMPLING_FIELDS = frozenset({
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "early_stopping",
    "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "truncation_side", "allowed_token_ids", "prompt_logprobs", "logprob_token_ids", "bad_words",
    "watermarking", "best_of", "thinking_token_budget", "repetition_detection",
})  # fmt: skip
VLLM_EXTRA_FIELDS = frozenset({
    "add_special_tokens", "response_format", "structured_outputs", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar", "structural_tag",
    "guided_decoding_backend", "guided_whitespace_pattern", "priority", "request_id",
    "session_id", "return_tokens_as_token_ids", "return_token_ids", "return_token_offsets",
    "return_mm_kwargs", "cache_salt", "kv_transfer_params", "ec_transfer_params", "vllm_xargs",
    "logits_processors", "prompt_embeds", "stream_interval", "routed_experts_prompt_start",
})  # fmt: skip
VLLM_CHAT_FIELDS = frozenset({
    "echo", "add_generation_prompt", "continue_final_message", "documents", "chat_template",
    "chat_template_kwargs", "mm_processor_kwargs", "media_io_kwargs", "include_reasoning",
    "return_prompt_text",
})  # fmt: skip
# A chat message's fields (OpenAI's message params, vLLM's reasoning aliases).
MESSAGE_FIELDS = frozenset({
    "role", "content", "name", "tool_calls", "tool_call_id", "function_call", "refusal", "audio",
    "reasoning", "reasoning_content",
})  # fmt: skip
COMPLETION_FIELDS = OPENAI_COMPLETION_FIELDS | VLLM_SAMPLING_FIELDS | VLLM_EXTRA_FIELDS
CHAT_FIELDS = OPENAI_CHAT_FIELDS | VLLM_SAMPLING_FIELDS | VLLM_EXTRA_FIELDS | VLLM_CHAT_FIELDS

# Metadata with no effect on the output: accepted and ignored (vLLM ignores `user` too).
IGNORED_FIELDS = frozenset({
    "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
    "prompt_cache_retention", "session_id",
})  # fmt: skip

# A field set to its documented default asks for nothing, so it is accepted even where the field
# is not implemented: clients and frameworks send `n: 1` or `use_beam_search: false` unasked.
# Compared by type as well (0 == False in Python, and `logprobs: 0` asks for something).
NEUTRAL_VALUES: dict[str, tuple[object, ...]] = {
    "n": (1,),
    "echo": (False,),
    "stream": (False,),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "length_penalty": (1, 1.0),
    "min_p": (0, 0.0),
    "top_k": (0, -1),
    "top_p": (1, 1.0),
    "min_tokens": (0,),
    "use_beam_search": (False,),
    "early_stopping": (False,),
    "watermarking": (False,),
    "include_stop_str_in_output": (False,),
    "ignore_eos": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "bad_words": ([],),
    "stop_token_ids": ([],),
    "logit_bias": ({},),
    "suffix": ("",),
    "priority": (0,),
    "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,),
    "return_token_offsets": (False,),
    "return_prompt_text": (False,),
    "return_mm_kwargs": (True,),
    "include_reasoning": (True,),
    "thinking_token_budget": (-1,),
    "routed_experts_prompt_start": (0,),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    # Declared by the chat struct (fulcrum.llm.tools); neutral for structs that leave tools out.
    "tool_choice": ("none",),
    "parallel_tool_calls": (True, False),
    "tool_calls": ([],),
    "response_format": ({"type": "text"},),
    "modalities": (["text"],),
    "mm_processor_kwargs": ({},),
    "media_io_kwargs": ({},),
    "vllm_xargs": ({},),
}


def known_fields(struct_type: type[msgspec.Struct]) -> frozenset[str]:
    """The registry that applies to a request struct: chat when it has `messages`."""
    return CHAT_FIELDS if "messages" in declared_fields(struct_type) else COMPLETION_FIELDS


@cache
def declared_fields(struct_type: type[msgspec.Struct]) -> frozenset[str]:
    """The wire names the struct declares: what the server implements."""
    return frozenset(f.encode_name for f in msgspec.structs.fields(struct_type))


def refuse_unimplemented(
    raw: Mapping[str, object],
    struct_type: type[msgspec.Struct],
    known: frozenset[str] | None = None,
) -> None:
    """InvalidInput (param: the field) for a known field given a non-null value that the struct
    does not declare; unknown fields and ignored metadata pass. Values may be msgspec.Raw."""
    candidates = _candidates(struct_type, known)
    for name, value in raw.items():
        if name not in candidates or _is_null(value):
            continue
        neutral = NEUTRAL_VALUES.get(name)
        if neutral is not None and _is_neutral(_decoded(value), neutral):
            continue
        raise InvalidInput(
            f"{name}: not supported by this server (refused rather than ignored)", param=name
        )


def refuse_unimplemented_json(
    body: bytes, struct_type: type[msgspec.Struct], known: frozenset[str] | None = None
) -> None:
    """`refuse_unimplemented` on a JSON body already decoded once into `struct_type`: values are
    sliced out as raw bytes (never parsed unless needed), so large prompts cost a skim."""
    raw = _OBJECT.decode(body)
    candidates = _candidates(struct_type, known)
    present = {name: raw[name] for name in candidates.intersection(raw)}
    if present:
        refuse_unimplemented(present, struct_type, known)
    message_type = _message_type(struct_type)
    messages = raw.get(_MESSAGES)
    if message_type is None or messages is None:
        return
    left_out = MESSAGE_FIELDS - declared_fields(message_type)
    for i, message in enumerate(_MESSAGE_LIST.decode(messages) or ()):
        given = {name: message[name] for name in left_out.intersection(message)}
        if not given:
            continue
        try:
            refuse_unimplemented(given, message_type, MESSAGE_FIELDS)
        except InvalidInput as exc:
            where = f"messages[{i}]"
            raise InvalidInput(f"{where}.{exc.message}", param=f"{where}.{exc.param}") from None


_MESSAGES = "messages"
_OBJECT = msgspec.json.Decoder(dict[str, msgspec.Raw])
_MESSAGE_LIST = msgspec.json.Decoder(list[dict[str, msgspec.Raw]] | None)


@cache
def _candidates(struct_type: type[msgspec.Struct], known: frozenset[str] | None) -> frozenset[str]:
    """The fields a body could be refused for: known, not declared, not ignored metadata."""
    fields = known_fields(struct_type) if known is None else known
    return fields - declared_fields(struct_type) - IGNORED_FIELDS


@cache
def _message_type(struct_type: type[msgspec.Struct]) -> type[msgspec.Struct] | None:
    """The struct a chat request decodes each message into, if it has messages."""
    for f in msgspec.structs.fields(struct_type):
        if f.encode_name == _MESSAGES:
            for arg in get_args(f.type):  # list[Message] or list[Message] | None
                for inner in (arg, *get_args(arg)):
                    if isinstance(inner, type) and issubclass(inner, msgspec.Struct):
                        return inner
    return None


def _is_null(value: object) -> bool:
    if isinstance(value, msgspec.Raw):
        return bytes(value).strip() == b"null"
    return value is None


def _decoded(value: object) -> object:
    return msgspec.json.decode(value) if isinstance(value, msgspec.Raw) else value


def _is_neutral(value: object, neutral: tuple[object, ...]) -> bool:
    return any(type(value) is type(n) and value == n for n in neutral)
