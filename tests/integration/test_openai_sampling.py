"""Sampling and scoring fields through the official openai client (in process, over
httpx.ASGITransport): each field's effect, or its 400 naming the field (issue 13, item 2)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from fulcrum.llm.engine import AsyncLLMEngine
from fulcrum.llm.examples import build_tiny_gpt2
from fulcrum.server.app import create_app
from fulcrum.service import Service

TINY_CONFIG = """platform = "llm"
[parameters]
num_kv_blocks = 128
block_size = 4
max_model_len = 128
"""
GREEDY: dict[str, Any] = {"model": "tiny", "temperature": 0, "max_tokens": 8}
PROMPT = "Hello there, how are"


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory: Path = tmp_path_factory.mktemp("models")
    build_tiny_gpt2(directory, name="tiny")
    (directory / "tiny" / "config.toml").write_text(TINY_CONFIG)
    return directory


@pytest.fixture
async def client(service: Service) -> AsyncIterator[openai.AsyncOpenAI]:
    transport = httpx.ASGITransport(app=create_app(service, manage_lifespan=False))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http)


async def _tokens(client: openai.AsyncOpenAI, **kwargs: Any) -> list[str]:
    answer = await client.completions.create(
        **{**GREEDY, "prompt": PROMPT, "logprobs": 0, **kwargs}
    )
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    return logprobs.tokens


async def _bad_request(call: Any, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await call
    assert param in str(caught.value)


async def test_logit_bias_forces_a_token(
    client: openai.AsyncOpenAI, engine: AsyncLLMEngine
) -> None:
    assert await _tokens(client, logit_bias={"7": 100}) == [engine.decode([7])] * 8


async def test_allowed_token_ids_restrict_the_output(
    client: openai.AsyncOpenAI, engine: AsyncLLMEngine
) -> None:
    tokens = await _tokens(client, temperature=1.0, extra_body={"allowed_token_ids": [9, 11]})
    assert set(tokens) <= {engine.decode([9]), engine.decode([11])}


async def test_bad_words_change_the_greedy_output(client: openai.AsyncOpenAI) -> None:
    plain = await _tokens(client)
    word = plain[0].strip() or plain[1].strip()
    banned = await _tokens(client, extra_body={"bad_words": [word]})
    assert all(t.strip() != word for t in banned)
    assert banned != plain


async def test_penalties_change_the_greedy_output(client: openai.AsyncOpenAI) -> None:
    plain = await _tokens(client, max_tokens=24)
    assert len(set(plain)) < len(plain)  # the tiny model repeats itself
    for extra in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0},
                  {"extra_body": {"repetition_penalty": 3.0}}):  # fmt: skip
        assert await _tokens(client, max_tokens=24, **extra) != plain, extra


async def test_n_three_seeded_is_reproducible_and_distinct(client: openai.AsyncOpenAI) -> None:
    request = {**GREEDY, "prompt": PROMPT, "temperature": 1.0, "n": 3, "seed": 42}
    first = await client.completions.create(**request)
    second = await client.completions.create(**request)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.text for c in sorted(second.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1
    assert first.usage is not None and first.usage.completion_tokens == 24


async def test_chat_n_and_logprobs_with_top_logprobs(client: openai.AsyncOpenAI) -> None:
    answer = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2,
        logprobs=True, top_logprobs=3, temperature=0,
    )  # fmt: skip
    assert len(answer.choices) == 2
    content = answer.choices[1].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    assert all(len(entry.top_logprobs) == 3 for entry in content)
    assert all(entry.logprob == entry.top_logprobs[0].logprob for entry in content)  # greedy


async def test_batched_prompts_index_choices_prompt_major(client: openai.AsyncOpenAI) -> None:
    answer = await client.completions.create(**{**GREEDY, "prompt": ["a b", PROMPT], "n": 2})
    by_index = {c.index: c.text for c in answer.choices}
    assert sorted(by_index) == [0, 1, 2, 3]
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]  # greedy: same per prompt
    single = await client.completions.create(**{**GREEDY, "prompt": PROMPT})
    assert by_index[2] == single.choices[0].text


async def test_echo_prepends_the_prompt_and_scores_it(client: openai.AsyncOpenAI) -> None:
    answer = await client.completions.create(**{**GREEDY, "prompt": PROMPT, "echo": True,
                                                "logprobs": 1})  # fmt: skip
    choice = answer.choices[0]
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert choice.logprobs.token_logprobs[0] is None  # nothing predicts the first token
    assert "".join(choice.logprobs.tokens or []) == choice.text


async def test_streamed_logprobs_equal_the_json_ones(client: openai.AsyncOpenAI) -> None:
    request = {**GREEDY, "prompt": PROMPT, "logprobs": 2}
    whole = await client.completions.create(**request)
    streamed: list[float | None] = []
    async for chunk in await client.completions.create(**request, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.token_logprobs or []
    assert whole.choices[0].logprobs is not None
    # The second request hits the prefix cache: its first token comes from a decode, not a
    # prefill, so float32 sums may differ in the last bits.
    assert streamed == pytest.approx(whole.choices[0].logprobs.token_logprobs, abs=1e-5)


async def test_prompt_logprobs_and_truncation(client: openai.AsyncOpenAI) -> None:
    answer = await client.completions.create(
        **GREEDY, prompt=PROMPT, extra_body={"prompt_logprobs": 2, "truncate_prompt_tokens": 3}
    )
    assert answer.usage is not None and answer.usage.prompt_tokens == 3
    scored = answer.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    assert scored[0] is None and len(scored) == 3
    assert all(2 <= len(entry) <= 3 for entry in scored[1:])


async def test_include_stop_str_in_output(client: openai.AsyncOpenAI) -> None:
    text = (await client.completions.create(**GREEDY, prompt=PROMPT)).choices[0].text
    stop = text[2:4]
    kept = await client.completions.create(
        **GREEDY, prompt=PROMPT, stop=[stop], extra_body={"include_stop_str_in_output": True}
    )
    assert kept.choices[0].text == text[: text.index(stop) + len(stop)]


async def test_explicit_nulls_are_accepted(client: openai.AsyncOpenAI) -> None:
    answer = await client.completions.create(
        **GREEDY, prompt=PROMPT, presence_penalty=None, frequency_penalty=None, n=None,
        logit_bias=None, logprobs=None, seed=None, stop=None, top_p=None, echo=None,
    )  # fmt: skip
    assert answer.choices[0].text


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"n": 33}, "n"),
        ({"best_of": 2}, "best_of"),
        ({"logprobs": 21}, "logprobs"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"extra_body": {"min_p": 2}}, "min_p"),
        ({"extra_body": {"bad_words": ["x"] * 65}}, "bad_words"),
        ({"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
        ({"extra_body": {"min_tokens": 9}}, "min_tokens"),
        ({"extra_body": {"truncate_prompt_tokens": 0}}, "truncate_prompt_tokens"),
    ],
)
async def test_hostile_completion_fields_get_400_naming_them(
    client: openai.AsyncOpenAI, kwargs: dict[str, Any], param: str
) -> None:
    await _bad_request(client.completions.create(**{**GREEDY, "prompt": PROMPT, **kwargs}), param)


async def test_top_logprobs_without_logprobs_is_refused(client: openai.AsyncOpenAI) -> None:
    call = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], top_logprobs=2
    )
    await _bad_request(call, "top_logprobs")


async def test_min_p_one_keeps_only_the_most_likely_token(client: openai.AsyncOpenAI) -> None:
    greedy = await _tokens(client)
    sampled = await _tokens(client, temperature=1.0, extra_body={"min_p": 1.0, "top_k": -1})
    assert sampled == greedy  # and top_k -1 (off, as vLLM) is accepted


async def test_min_tokens_hold_back_a_stop_token(client: openai.AsyncOpenAI) -> None:
    forced = {"logit_bias": {"7": 100}, "extra_body": {"stop_token_ids": [7]}}
    plain = await client.completions.create(**GREEDY, prompt=PROMPT, **forced)  # type: ignore[arg-type]
    assert plain.usage is not None and plain.usage.completion_tokens == 1
    held = await client.completions.create(
        **GREEDY, prompt=PROMPT, logit_bias={"7": 100},
        extra_body={"stop_token_ids": [7], "min_tokens": 3},
    )  # fmt: skip
    assert held.usage is not None and held.usage.completion_tokens == 4
    assert held.choices[0].finish_reason == "stop"


async def test_skip_special_tokens_false_keeps_them(
    client: openai.AsyncOpenAI, engine: AsyncLLMEngine
) -> None:
    eos = engine.engine.eos_token_ids[0]
    forced: dict[str, Any] = {**GREEDY, "prompt": PROMPT, "max_tokens": 2,
                              "logit_bias": {str(eos): 100}}  # fmt: skip
    body = {"ignore_eos": True, "spaces_between_special_tokens": True}
    skipped = await client.completions.create(**forced, extra_body=body)
    kept = await client.completions.create(
        **forced, extra_body={**body, "skip_special_tokens": False}
    )
    special = engine.decode([eos])
    assert special not in skipped.choices[0].text
    assert kept.choices[0].text == special * 2


async def test_streamed_echo_sends_the_prompt_and_its_logprobs_first(
    client: openai.AsyncOpenAI,
) -> None:
    request = {**GREEDY, "prompt": PROMPT, "echo": True, "logprobs": 0}
    whole = await client.completions.create(**request)
    texts: list[str] = []
    values: list[float | None] = []
    async for chunk in await client.completions.create(**request, stream=True):
        for choice in chunk.choices:
            texts.append(choice.text)
            values += choice.logprobs.token_logprobs or [] if choice.logprobs else []
    assert "".join(texts) == whole.choices[0].text and texts[0].startswith(PROMPT)
    assert values[0] is None
    assert whole.choices[0].logprobs is not None
    assert values[1:] == pytest.approx(whole.choices[0].logprobs.token_logprobs[1:], abs=1e-5)
