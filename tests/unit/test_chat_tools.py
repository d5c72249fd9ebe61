"""Tools and tool-call messages rendered into real tool-aware chat templates (Qwen2.5, Hermes,
Llama 3.1 JSON) exactly as transformers' apply_chat_template renders them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fulcrum.errors import InvalidInput
from fulcrum.llm.chat import ChatOptions, ChatTemplate
from fulcrum.llm.examples import build_tokenizer
from fulcrum.protocol.openai import ChatCompletionRequest, chat_messages, decode_request

TEMPLATES = Path(__file__).parent.parent / "data" / "chat_templates"
SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city's name."},
                    "days": {"type": "integer", "description": "Days ahead."},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "now",
            "description": "The time.",
            "parameters": {"type": "object", "properties": {}},
        },
    },
]
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1", "name": "get_weather"},
]


def _messages(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as the chat endpoint hands them to the template."""
    body = {"model": "m", "messages": raw, "tools": TOOLS}
    return chat_messages(decode_request(json.dumps(body).encode(), ChatCompletionRequest))


def _transformers(template: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(list(SPECIALS.values())), **SPECIALS
    )
    rendered: str = tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, **kwargs
    )
    return rendered


@pytest.mark.parametrize("name", ["qwen2_5", "hermes", "llama3_1_json"])
@pytest.mark.parametrize("conversation", [CONVERSATION[:1], CONVERSATION])
def test_tools_and_calls_render_as_transformers_does(
    name: str, conversation: list[dict[str, Any]]
) -> None:
    source = (TEMPLATES / f"{name}.jinja").read_text()
    messages = _messages(conversation)
    kwargs = {"date_string": "01 Dec 2026"}  # the Llama template prints today's date
    ours = ChatTemplate(source, SPECIALS).render(
        messages, ChatOptions(tools=TOOLS, chat_template_kwargs=kwargs)
    )
    theirs = _transformers(source, messages, tools=TOOLS, add_generation_prompt=True, **kwargs)
    assert ours == theirs
    assert '"get_weather"' in ours and "The city's name." in ours  # the tools are in the prompt
    if len(conversation) > 1:
        assert "Paris" in ours and "21" in ours  # the call and its result too


def test_call_arguments_reach_the_template_as_an_object() -> None:
    messages = _messages(CONVERSATION)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 2}
    assert messages[2]["tool_call_id"] == "call_1"


def test_a_template_that_ignores_tools_is_refused_rather_than_dropping_them() -> None:
    template = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}", SPECIALS)
    with pytest.raises(InvalidInput) as caught:
        template.render(_messages(CONVERSATION[:1]), ChatOptions(tools=TOOLS))
    assert caught.value.param == "tools"


def test_the_default_template_shows_tools_and_calls() -> None:
    rendered = ChatTemplate(None, SPECIALS).render(
        _messages(CONVERSATION), ChatOptions(tools=TOOLS)
    )
    assert rendered.startswith("tools: [")
    assert '"get_weather"' in rendered.splitlines()[0]
    assert '"city": "Paris"' in rendered  # the assistant's call


def test_tool_definitions_count_towards_the_prompt_size() -> None:
    texts = ChatOptions(tools=TOOLS).extra_texts()
    assert any("get_weather" in text for text in texts)


def test_bad_call_arguments_are_a_400_naming_the_message() -> None:
    bad = {**CALL, "function": {"name": "get_weather", "arguments": "{not json"}}
    with pytest.raises(InvalidInput) as caught:
        _messages([CONVERSATION[0], {"role": "assistant", "tool_calls": [bad]}])
    assert caught.value.param == "messages[1].tool_calls[0].function.arguments"
