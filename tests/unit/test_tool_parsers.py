"""Tool-call parsers: each family's calls parsed whole, the same calls streamed in any split,
and malformed output returned as content."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from fulcrum.errors import InvalidInput
from fulcrum.llm.tool_parsers import (
    PARSER_NAMES,
    Delta,
    Extracted,
    ToolCall,
    extract,
    keeps_special_tokens,
    new_parser,
    openai_call_id,
)
from fulcrum.llm.tool_parsers.mistral import mistral_call_id

WEATHER = '{"city": "Paris", "days": [1, {"note": "a } and \\" inside"}], "metric": true}'
HERMES = (
    "Let me look.\n<tool_call>\n"
    f'{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n'
    '<tool_call>\n{"arguments": {}, "name": "now"}\n</tool_call>\n'
)
LLAMA3 = (
    f'{{"name": "get_weather", "parameters": {WEATHER}}}; {{"name": "now", "parameters": {{}}}}'
)
MISTRAL = (
    f'Sure.[TOOL_CALLS] [{{"name": "get_weather", "arguments": {WEATHER}}}, '
    '{"name": "now", "arguments": {}}]'
)
PYTHONIC = (
    '[get_weather(city="Paris", days=[1, {"note": "a } and \\" inside"}], metric=True), now()]'
)
TWO_CALLS = {"hermes": HERMES, "llama3_json": LLAMA3, "mistral": MISTRAL, "pythonic": PYTHONIC}
CONTENT = {"hermes": "Let me look.", "llama3_json": None, "mistral": "Sure.", "pythonic": None}


def _ids() -> itertools.count[int]:
    return itertools.count()


def _parser(name: str):  # type: ignore[no-untyped-def]
    counter = _ids()
    return new_parser(name, lambda: f"call-{next(counter)}")


def _streamed(name: str, pieces: list[str]) -> tuple[Extracted, list[Delta]]:
    """The answer a client assembles from the deltas, and the deltas."""
    parser = _parser(name)
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    content = "".join(d.content for d in deltas)
    calls: dict[int, list[str]] = {}
    names: dict[int, tuple[str, str]] = {}
    for delta in deltas:
        for entry in delta.calls:
            if entry.id is not None:
                assert entry.index not in names, "a call's id and name come once"
                assert entry.index not in calls, "id and name precede the arguments"
                names[entry.index] = (entry.id, entry.name or "")
            calls.setdefault(entry.index, []).append(entry.arguments)
    tool_calls = [ToolCall(*names[i], "".join(calls[i])) for i in sorted(calls)]
    return Extracted(content or None, tool_calls), deltas


def _random_split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]


@pytest.mark.parametrize("name", PARSER_NAMES)
def test_two_calls_parse_whole(name: str) -> None:
    result = extract(_parser(name), TWO_CALLS[name])
    assert result.content == CONTENT[name]
    assert [c.name for c in result.calls] == ["get_weather", "now"]
    assert [c.id for c in result.calls] == ["call-0", "call-1"]
    assert json.loads(result.calls[0].arguments) == json.loads(WEATHER)
    assert json.loads(result.calls[1].arguments) == {}


@pytest.mark.parametrize("name", PARSER_NAMES)
def test_streamed_in_any_split_equals_whole(name: str) -> None:
    text = TWO_CALLS[name]
    whole = extract(_parser(name), text)
    rng = random.Random(0)
    splits = [list(text), [text], *(_random_split(text, rng) for _ in range(200))]
    for pieces in splits:
        assert _streamed(name, pieces)[0] == whole, pieces


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
def test_arguments_stream_in_fragments_after_the_name(name: str) -> None:
    _, deltas = _streamed(name, list(TWO_CALLS[name]))
    fragments = [e for d in deltas for e in d.calls if e.index == 0 and e.arguments]
    assert len(fragments) > 10  # not one blob at the end
    first = next(e for d in deltas for e in d.calls if e.index == 0)
    assert first.id == "call-0" and first.name == "get_weather"


def test_hermes_content_before_the_call_streams_before_it() -> None:
    _, deltas = _streamed("hermes", list(HERMES))
    first_call = next(i for i, d in enumerate(deltas) if d.calls)
    assert "".join(d.content for d in deltas[:first_call]) == "Let me look."


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("hermes", 'Hi <tool_call>\n{"name": get_weather}\n</tool_call>'),
        ("hermes", '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>'),
        ("hermes", '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>'),
        ("hermes", "<tool_call>\nnot json at all</tool_call> trailing"),
        ("llama3_json", '{"answer": 42}'),  # JSON, but not a call
        ("mistral", "[TOOL_CALLS] oops"),
        ("pythonic", "[f(1, 2)]"),  # positional arguments are not a call
        ("pythonic", "[f(a=open('x'))] and"),
        ("pythonic", "[unclosed(a=1"),
    ],
)
def test_malformed_output_is_returned_as_content(name: str, text: str) -> None:
    result = extract(_parser(name), text)
    assert result == Extracted(text, [])
    streamed, _ = _streamed(name, list(text))
    assert streamed.content == text


@pytest.mark.parametrize(
    ("name", "text", "tail"),
    [
        ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1', ""),  # cut by max_tokens
        ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": }}] after', "}] after"),
        ("llama3_json", '{"name": "f", "parameters": {"a": 1} oops', "oops"),
    ],
)
def test_arguments_broken_after_the_name_went_out(name: str, text: str, tail: str) -> None:
    """Whole: all content. Streamed, the name cannot be taken back (vLLM alike): the call
    stays open and the text after the break is content; never an error."""
    assert extract(_parser(name), text) == Extracted(text, [])
    parser = _parser(name)
    deltas = [parser.feed(ch) for ch in text] + [parser.finish()]
    assert not parser.well_formed
    assert [e.name for d in deltas for e in d.calls if e.name] == ["f"]
    assert "".join(d.content for d in deltas) == tail


@pytest.mark.parametrize("name", PARSER_NAMES)
@pytest.mark.parametrize("text", ["", "Plain answer.", "  spaced \n", "a < b and [c] {d}"])
def test_text_without_calls_is_kept_exactly(name: str, text: str) -> None:
    assert extract(_parser(name), text) == Extracted(text, [])
    for pieces in (list(text), [text]):
        assert _streamed(name, [p for p in pieces if p])[0].content == (text or None)


def test_hermes_text_after_a_call_is_content_but_trailing_space_is_not() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n\nDone. \n'
    result = extract(_parser("hermes"), text)
    assert result.content == "\n\nDone."
    assert [c.name for c in result.calls] == ["f"]


def test_hermes_block_left_open_at_the_end_still_counts() -> None:
    result = extract(_parser("hermes"), '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n')
    assert [(c.name, c.arguments) for c in result.calls] == [("f", '{"a": 1}')]


def test_llama3_python_tag_and_arguments_alias() -> None:
    text = '<|python_tag|>{"name": "f", "arguments": {"x": "y"}}'
    result = extract(_parser("llama3_json"), text)
    assert result.content is None
    assert [(c.name, c.arguments) for c in result.calls] == [("f", '{"x": "y"}')]


def test_mistral_single_call_without_list_then_text() -> None:
    text = '[TOOL_CALLS]{"name": "f", "arguments": {"x": 1}} ok'
    result = extract(_parser("mistral"), text)
    assert result.content == " ok"
    assert [c.name for c in result.calls] == ["f"]


def test_call_without_arguments_gets_an_empty_object() -> None:
    result = extract(_parser("hermes"), '<tool_call>{"name": "now"}</tool_call>')
    assert [c.arguments for c in result.calls] == ["{}"]


def test_ids_follow_vllm() -> None:
    assert openai_call_id().startswith("chatcmpl-tool-")
    assert len(openai_call_id()) == len("chatcmpl-tool-") + 32
    assert len(mistral_call_id()) == 9 and mistral_call_id().isalnum()
    result = extract(new_parser("mistral"), MISTRAL)
    assert all(len(c.id) == 9 for c in result.calls)


def test_unknown_parser_is_refused_and_mistral_keeps_special_tokens() -> None:
    with pytest.raises(InvalidInput, match="tool_call_parser"):
        new_parser("nope")
    assert keeps_special_tokens("mistral") and not keeps_special_tokens("hermes")
