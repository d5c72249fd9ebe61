"""Sampler: top-k / top-p masks, greedy, and per-request seeded determinism."""

from __future__ import annotations

import math

import torch

from fulcrum.llm.sampler import Sampler, top_k_mask, top_p_mask
from fulcrum.llm.sampling_params import SamplingParams

CPU = torch.device("cpu")


def test_top_k_keeps_the_k_largest() -> None:
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0])
    kept = torch.isfinite(top_k_mask(logits, 2))
    assert kept.tolist() == [False, True, False, True, False]
    assert torch.equal(top_k_mask(logits, 0), logits)


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    assert torch.isfinite(top_p_mask(logits, 0.5)).tolist() == [True, False, False, False]
    assert torch.isfinite(top_p_mask(logits, 0.8)).tolist() == [True, True, False, False]
    assert torch.isfinite(top_p_mask(logits, 0.81)).tolist() == [True, True, True, False]
    # Order of the vocabulary does not matter.
    shuffled = logits[[2, 0, 3, 1]]
    assert torch.isfinite(top_p_mask(shuffled, 0.8)).tolist() == [False, True, False, True]


def test_greedy_takes_the_argmax() -> None:
    logits = torch.tensor([[0.1, 2.0, 0.3], [5.0, 0.0, 4.9]])
    greedy = SamplingParams(temperature=0.0)
    assert Sampler(CPU, seed=0).sample(logits, [greedy, greedy], [0, 1]) == [1, 0]


def test_top_k_one_is_greedy_at_any_temperature() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=2.0, top_k=1)] * 4
    assert Sampler(CPU).sample(logits, params, [0, 1, 2, 3]) == logits.argmax(-1).tolist()


def _draw(sampler: Sampler, params: list[SamplingParams], num_steps: int) -> list[list[int]]:
    logits = torch.zeros(len(params), 1000)  # uniform: every draw is pure chance
    rows = [sampler.sample(logits, params, list(range(len(params)))) for _ in range(num_steps)]
    return [list(col) for col in zip(*rows, strict=True)]


def test_seeded_requests_repeat_whatever_shares_their_batch() -> None:
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone = _draw(Sampler(CPU, seed=1), [seeded], 20)[0]
    crowded = _draw(Sampler(CPU, seed=2), [SamplingParams(), seeded, SamplingParams()], 20)
    assert crowded[1] == alone
    other_seed = _draw(Sampler(CPU), [SamplingParams(seed=43)], 20)[0]
    assert other_seed != alone  # 1000**-20 chance of a false failure


def test_release_restarts_a_seeded_stream() -> None:
    sampler = Sampler(CPU)
    params = [SamplingParams(seed=7)]
    first = _draw(sampler, params, 5)[0]
    sampler.release(0)
    assert _draw(sampler, params, 5)[0] == first


def test_sampling_follows_the_distribution() -> None:
    logits = torch.tensor([[math.log(0.9), math.log(0.1)]])
    sampler = Sampler(CPU, seed=0)
    draws = [sampler.sample(logits, [SamplingParams()], [0])[0] for _ in range(2000)]
    assert 0.85 < draws.count(0) / len(draws) < 0.95


def test_batched_masks_equal_the_masks_row_by_row() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 40, generator=gen)
    top_k = torch.tensor([0, 1, 5, 39, 40, 3])  # 0 and >= V: off
    top_p = torch.tensor([1.0, 0.5, 0.9, 0.01, 0.7, 1.0])  # 1: off
    by_k, by_p = top_k_mask(logits, top_k), top_p_mask(logits, top_p)
    for row in range(6):
        assert torch.equal(by_k[row], top_k_mask(logits[row], int(top_k[row])))
        assert torch.equal(by_p[row], top_p_mask(logits[row], float(top_p[row])))
    assert torch.equal(by_k[0], logits[0]) and torch.equal(by_p[5], logits[5])


def test_a_mixed_batch_keeps_greedy_rows_and_each_rows_own_masks() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, 1.0, -1.0]] * 4)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=5.0, top_k=2),  # hot, but only tokens 1 and 2 survive
        SamplingParams(temperature=1.0, top_p=0.01),  # only the top token survives
        SamplingParams(temperature=1.0, top_k=2, seed=3),
    ]
    sampler = Sampler(CPU, seed=0)
    draws = [sampler.sample(logits, params, [0, 1, 2, 3]) for _ in range(200)]
    assert {d[0] for d in draws} == {1}
    assert {d[1] for d in draws} == {1, 2}
    assert {d[2] for d in draws} == {1}
    assert {d[3] for d in draws} <= {1, 2}
