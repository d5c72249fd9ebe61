"""Sequence bookkeeping and SamplingParams validation."""

from __future__ import annotations

import math

import pytest

from fulcrum.errors import InvalidInput
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.sequence import FinishReason, Sequence, SequenceStatus


def test_new_sequence_holds_the_prompt_and_nothing_computed() -> None:
    seq = Sequence(7, [5, 6, 7], SamplingParams(), arrival_s=1.5, priority=2, cache_salt="t")
    assert seq.seq_id == 7
    assert seq.token_ids == [5, 6, 7]
    assert seq.num_tokens == seq.num_prompt_tokens == 3
    assert seq.num_computed_tokens == seq.num_cached_tokens == 0
    assert seq.block_table == []
    assert seq.status is SequenceStatus.WAITING
    assert seq.finish_reason is None
    assert not seq.is_finished
    assert (seq.priority, seq.arrival_s, seq.cache_salt) == (2, 1.5, "t")


def test_append_token_grows_the_output_only() -> None:
    prompt = [1, 2]
    seq = Sequence(0, prompt, SamplingParams(), arrival_s=0.0)
    seq.append_token(9)
    seq.append_token(8)
    assert seq.token_ids == [1, 2, 9, 8]
    assert seq.output_token_ids == [9, 8]
    assert seq.num_output_tokens == 2
    assert seq.num_tokens == 4
    assert seq.num_prompt_tokens == 2
    assert prompt == [1, 2]  # the caller's list is not aliased


def test_output_token_ids_is_a_copy() -> None:
    seq = Sequence(0, [1], SamplingParams(), arrival_s=0.0)
    seq.append_token(3)
    seq.output_token_ids.append(4)
    assert seq.output_token_ids == [3]


def test_finished_status_and_reason_values() -> None:
    seq = Sequence(0, [1], SamplingParams(), arrival_s=0.0)
    seq.status = SequenceStatus.FINISHED
    assert seq.is_finished
    assert [r.value for r in FinishReason] == ["stop", "length", "abort"]


def test_sort_key_orders_priority_then_arrival_then_id() -> None:
    params = SamplingParams()
    seqs = [
        Sequence(3, [1], params, arrival_s=2.0, priority=0),
        Sequence(1, [1], params, arrival_s=1.0, priority=1),
        Sequence(2, [1], params, arrival_s=2.0, priority=0),
        Sequence(4, [1], params, arrival_s=5.0, priority=-1),
    ]
    assert [s.seq_id for s in sorted(seqs, key=lambda s: s.sort_key)] == [4, 2, 3, 1]


@pytest.mark.parametrize("prompt", [[], [1, -2], [2**63]])
def test_bad_prompt_is_invalid_input(prompt: list[int]) -> None:
    with pytest.raises(InvalidInput):
        Sequence(0, prompt, SamplingParams(), arrival_s=0.0)


def test_default_and_typical_sampling_params_are_valid() -> None:
    SamplingParams().validate()
    SamplingParams(
        max_tokens=1,
        temperature=0,
        top_k=40,
        top_p=0.5,
        seed=-(2**63),
        stop=("\n",),
        stop_token_ids=(0, 2),
        ignore_eos=True,
    ).validate()
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_k": -2}, "top_k"),  # -1, like 0, means off (vLLM)
        ({"top_k": 2**63}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": 2**64}, "seed"),
        ({"seed": "1"}, "seed"),
        ({"stop": ("",)}, "stop"),
        ({"stop": ["x"]}, "stop"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"stop_token_ids": (False,)}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_bad_sampling_param_names_the_field(kwargs: dict[str, object], field: str) -> None:
    params = SamplingParams(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match=field):
        params.validate()
