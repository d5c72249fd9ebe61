"""SamplingParams validation and the sampler on the values that used to kill the engine thread
(issue 9, finding 1): huge top_k, subnormal temperature, tiny top_p; capped stop lists."""

from __future__ import annotations

import math

import pytest
import torch

from fulcrum.errors import InvalidInput
from fulcrum.llm.sampler import Sampler, top_p_mask
from fulcrum.llm.sampling_params import (
    MAX_NUM_STOP,
    MAX_NUM_STOP_TOKEN_IDS,
    MAX_STOP_CHARS,
    MAX_TOP_K,
    MIN_TEMPERATURE,
    SamplingParams,
)

CPU = torch.device("cpu")


@pytest.mark.parametrize("top_k", [2**63, 2**64, MAX_TOP_K + 1, -2])
def test_top_k_out_of_range_is_refused_naming_the_field(top_k: int) -> None:
    with pytest.raises(InvalidInput, match="top_k"):
        SamplingParams(temperature=1.0, top_k=top_k).validate()


@pytest.mark.parametrize("top_k", [-1, 0, 1, 50, MAX_TOP_K])
def test_top_k_in_range_passes(top_k: int) -> None:
    SamplingParams(temperature=1.0, top_k=top_k).validate()


def test_top_k_beyond_the_vocabulary_is_off_and_minus_one_too() -> None:
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(0))
    for top_k in (MAX_TOP_K, -1, 40):
        draws = {Sampler(CPU, seed=s).sample(logits, [SamplingParams(top_k=top_k)], [0])[0]
                 for s in range(60)}  # fmt: skip
        assert len(draws) > 5  # not truncated to a few tokens


@pytest.mark.parametrize("temperature", [1e-308, 5e-324, 1e-6])
def test_a_temperature_too_small_to_divide_by_is_greedy(temperature: float) -> None:
    params = SamplingParams(temperature=temperature)
    params.validate()
    assert params.is_greedy
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    assert Sampler(CPU).sample(logits, [params] * 3, [0, 1, 2]) == logits.argmax(-1).tolist()


def test_a_small_random_temperature_is_raised_to_the_minimum_as_vllm_does() -> None:
    params = SamplingParams(temperature=1e-4)
    assert not params.is_greedy
    assert params.effective_temperature == MIN_TEMPERATURE
    logits = torch.tensor([[0.0, 1000.0, 999.0]])  # / 1e-4 would overflow float32 to inf - inf
    drawn = {Sampler(CPU, seed=s).sample(logits, [params], [0])[0] for s in range(20)}
    assert drawn == {1}


@pytest.mark.parametrize("top_p", [1e-300, 1e-45, 1e-8])
def test_a_tiny_top_p_keeps_the_top_token_and_never_yields_nan(top_p: float) -> None:
    logits = torch.tensor([[0.5, 3.0, 2.9, -1.0]])
    masked = top_p_mask(logits, torch.tensor([top_p]))
    assert torch.isfinite(masked).tolist() == [[False, True, False, False]]
    params = SamplingParams(temperature=1.0, top_p=top_p)
    params.validate()
    assert {Sampler(CPU, seed=s).sample(logits, [params], [0])[0] for s in range(20)} == {1}


@pytest.mark.parametrize("top_p", [0.0, -0.1, 1.5, math.nan, math.inf])
def test_top_p_outside_0_1_is_refused(top_p: float) -> None:
    with pytest.raises(InvalidInput, match="top_p"):
        SamplingParams(top_p=top_p).validate()


def test_stop_lists_are_capped_in_number_and_length() -> None:
    SamplingParams(stop=("x",) * MAX_NUM_STOP).validate()
    with pytest.raises(InvalidInput, match=f"stop: at most {MAX_NUM_STOP} strings"):
        SamplingParams(stop=("x",) * (MAX_NUM_STOP + 1)).validate()
    SamplingParams(stop=("y" * MAX_STOP_CHARS,)).validate()
    with pytest.raises(InvalidInput, match=f"at most {MAX_STOP_CHARS} characters"):
        SamplingParams(stop=("y" * (MAX_STOP_CHARS + 1),)).validate()
    SamplingParams(stop_token_ids=(1,) * MAX_NUM_STOP_TOKEN_IDS).validate()
    with pytest.raises(InvalidInput, match="stop_token_ids: at most"):
        SamplingParams(stop_token_ids=(1,) * (MAX_NUM_STOP_TOKEN_IDS + 1)).validate()
    with pytest.raises(InvalidInput, match="stop: at most"):
        SamplingParams(stop=tuple(str(i) for i in range(100_000))).validate()
