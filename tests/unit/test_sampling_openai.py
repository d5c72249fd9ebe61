"""OpenAI requests mapped to engine requests (fulcrum.service_openai): SamplingParams fields,
per-choice seeds, batched prompts, truncation, and the merged streams of a request's choices
(an early close aborts every choice, a failing choice fails the merge)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest

from fulcrum.errors import InvalidInput, ModelError
from fulcrum.llm.outputs import RequestOutput, Usage
from fulcrum.llm.sampling_params import MAX_SEED, MIN_SEED, SamplingParams
from fulcrum.protocol.openai import ChatCompletionRequest, CompletionRequest, check_unsupported
from fulcrum.service_openai import (
    MAX_N,
    child_params,
    completion_prompts,
    merge_choices,
    num_choices_per_prompt,
    sampling_params,
    truncate_prompt,
)


def _completion(**fields: object) -> CompletionRequest:
    body = msgspec.json.encode({"model": "m", "prompt": "hi", **fields})
    return msgspec.json.decode(body, type=CompletionRequest)


def _chat(**fields: object) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return msgspec.json.decode(msgspec.json.encode(body), type=ChatCompletionRequest)


def test_nulls_mean_the_defaults() -> None:
    request = _completion(presence_penalty=None, n=None, logit_bias=None, echo=None, top_p=None)
    assert sampling_params(request, 16) == SamplingParams(max_tokens=16)
    assert num_choices_per_prompt(request) == 1


def test_fields_map_to_sampling_params() -> None:
    request = _completion(
        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2, min_p=0.1,
        min_tokens=2, logit_bias={"3": 5}, allowed_token_ids=[1, 2], bad_words=["no"],
        logprobs=2, include_stop_str_in_output=True, skip_special_tokens=False, top_k=-1,
    )  # fmt: skip
    params = sampling_params(request, 8)
    assert params.logit_bias == ((3, 5.0),) and params.allowed_token_ids == (1, 2)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
    assert (params.repetition_penalty, params.min_p, params.min_tokens) == (1.2, 0.1, 2)
    assert params.bad_words == ("no",) and params.logprobs == 2 and params.top_k == -1
    assert params.include_stop_str_in_output and not params.skip_special_tokens


def test_echo_scores_the_prompt_with_the_logprobs_count() -> None:
    assert sampling_params(_completion(echo=True, logprobs=3), 4).prompt_logprobs == 3
    assert sampling_params(_completion(echo=True), 4).prompt_logprobs is None


def test_chat_logprobs_come_from_logprobs_and_top_logprobs() -> None:
    assert sampling_params(_chat(logprobs=True, top_logprobs=4), 4).logprobs == 4
    assert sampling_params(_chat(logprobs=True), 4).logprobs == 0
    assert sampling_params(_chat(logprobs=False, top_logprobs=0), 4).logprobs is None


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (_chat(top_logprobs=2), "top_logprobs"),
        (_chat(logprobs=True, top_logprobs=21), "top_logprobs"),
        (_completion(stream_options={"include_usage": True}), "stream_options"),
        (_completion(stream=True, prompt_logprobs=1), "prompt_logprobs"),
        (_completion(suffix="x"), "suffix"),
    ],
)
def test_conflicting_fields_are_refused(
    request_: CompletionRequest | ChatCompletionRequest, field: str
) -> None:
    with pytest.raises(InvalidInput, match=field):
        check_unsupported(request_)


def test_logit_bias_keys_must_be_token_ids() -> None:
    with pytest.raises(InvalidInput, match="logit_bias"):
        sampling_params(_completion(logit_bias={"abc": 1}), 4)


@pytest.mark.parametrize(("fields", "field"), [
    ({"n": 0}, "n"), ({"n": MAX_N + 1}, "n"), ({"n": 2, "best_of": 3}, "best_of"),
])  # fmt: skip
def test_n_and_best_of_are_bounded(fields: dict[str, int], field: str) -> None:
    with pytest.raises(InvalidInput, match=field):
        num_choices_per_prompt(_completion(**fields))


def test_best_of_equal_to_n_is_accepted() -> None:
    assert num_choices_per_prompt(_completion(n=3, best_of=3)) == 3


def test_choices_draw_from_seed_plus_index_and_wrap() -> None:
    params = SamplingParams(seed=7)
    assert [child_params(params, i).seed for i in range(3)] == [7, 8, 9]
    assert child_params(SamplingParams(seed=MAX_SEED), 1).seed == MIN_SEED
    unseeded = SamplingParams()
    assert child_params(unseeded, 2) is unseeded


def test_batched_prompts() -> None:
    assert completion_prompts(_completion(prompt=["a", "b"])) == ["a", "b"]
    assert completion_prompts(_completion(prompt=[[1, 2], [3]])) == [[1, 2], [3]]
    assert completion_prompts(_completion(prompt=[1, 2])) == [[1, 2]]
    for bad in ([[1], "a"], [], [[]], [True]):
        with pytest.raises(InvalidInput, match="prompt"):
            completion_prompts(_completion(prompt=bad))


def test_truncate_prompt_keeps_the_last_tokens() -> None:
    assert truncate_prompt([1, 2, 3, 4], 2, 10) == [3, 4]
    assert truncate_prompt([1, 2, 3, 4], -1, 3) == [2, 3, 4]
    assert truncate_prompt([1, 2], None, 3) == [1, 2]
    for bad in (0, -2, 11):
        with pytest.raises(InvalidInput, match="truncate_prompt_tokens"):
            truncate_prompt([1], bad, 10)


def _output(text: str, finish: str | None = None) -> RequestOutput:
    return RequestOutput("r", [1], text, finish, Usage(1, 1, 0))


async def _stream(*texts: str, fail: bool = False) -> AsyncIterator[RequestOutput]:
    for i, text in enumerate(texts):
        await asyncio.sleep(0)  # let the other choice interleave
        yield _output(text, "stop" if i == len(texts) - 1 else None)
    if fail:
        raise ModelError("boom")


async def test_merge_tags_every_output_with_its_choice() -> None:
    aborted: list[bool] = []
    merged = merge_choices([_stream("a", "b"), _stream("c")], lambda: aborted.append(True))
    got = [(item.index, item.output.new_text) async for item in merged]
    assert sorted(got) == [(0, "a"), (0, "b"), (1, "c")]
    assert not aborted  # every choice finished: nothing to abort


async def test_a_failing_choice_fails_the_merge_and_aborts_the_rest() -> None:
    aborted: list[bool] = []
    merged = merge_choices(
        [_stream("a", fail=True), _stream(*"bcdefg")], lambda: aborted.append(True)
    )
    with pytest.raises(ModelError, match="boom"):
        async for _ in merged:
            pass
    assert aborted == [True]


async def test_closing_the_merge_early_aborts_every_choice() -> None:
    aborted: list[bool] = []
    merged = merge_choices([_stream("a", "b"), _stream("c", "d")], lambda: aborted.append(True))
    await anext(merged)
    await merged.aclose()
    assert aborted == [True]
