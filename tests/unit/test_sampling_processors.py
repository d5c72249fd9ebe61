"""Per-request logits processors against hand computations and against transformers' own
LogitsProcessors (the oracle): penalties, min_p, min_tokens, logit_bias, allowed_token_ids and
bad_words, each on its own rows of a mixed batch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from fulcrum.errors import InvalidInput
from fulcrum.llm.logits_processors import (
    apply_min_p,
    apply_processors,
    bad_words_token_ids,
    needs_processing,
)
from fulcrum.llm.logprobs import token_logprobs
from fulcrum.llm.sampler import Sampler
from fulcrum.llm.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
VOCAB = 12


@dataclass
class History:
    """A hand-written TokenHistory: prompt then output tokens."""

    prompt: list[int]
    output: list[int] = field(default_factory=list)
    eos_token_id: int | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_no_processor_is_applied_to_a_plain_batch() -> None:
    logits = _logits(2)
    params = [SamplingParams(), SamplingParams(temperature=0)]
    assert not needs_processing(params)
    assert torch.equal(apply_processors(logits, params, [History([1]), History([2])]), logits)


def test_penalties_by_hand() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    history = History(prompt=[0], output=[1, 1, 2])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    got = apply_processors(logits, [params], [history])[0]
    # token 0: prompt only -> 2 / 2; token 1: output twice -> -1 * 2 - 0.5 * 2 - 0.25;
    # token 2: output once -> 0.5 / 2 - 0.5 - 0.25; token 3: unseen.
    assert got.tolist() == pytest.approx([1.0, -3.25, -0.5, 3.0])


def test_penalties_touch_only_their_own_row() -> None:
    logits = _logits(2)
    params = [SamplingParams(presence_penalty=1.0), SamplingParams()]
    got = apply_processors(logits, params, [History([0], [3]), History([0], [3])])
    assert torch.equal(got[1], logits[1])
    assert got[0, 3] == pytest.approx(float(logits[0, 3]) - 1.0)


def test_repetition_penalty_equals_transformers() -> None:
    logits = _logits(1, seed=3)
    history = History(prompt=[1, 4, 4], output=[7, 1])
    ours = apply_processors(logits, [SamplingParams(repetition_penalty=1.7)], [history])
    oracle = transformers.RepetitionPenaltyLogitsProcessor(1.7)
    theirs = oracle(torch.tensor([history.token_ids]), logits.clone())
    assert torch.allclose(ours, theirs)


@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.9])
def test_min_p_equals_transformers(min_p: float) -> None:
    scores = _logits(3, seed=4)
    ours = apply_min_p(scores, torch.full((3,), min_p))
    theirs = transformers.MinPLogitsWarper(min_p)(torch.zeros(3, 1, dtype=torch.long), scores)
    assert torch.equal(ours.isinf(), theirs.isinf())


def test_min_tokens_equals_transformers_until_reached() -> None:
    eos = 5
    params = SamplingParams(min_tokens=3, max_tokens=8)
    oracle = transformers.MinNewTokensLengthLogitsProcessor(
        prompt_length_to_skip=2, min_new_tokens=3, eos_token_id=eos
    )
    for num_output in range(5):
        history = History([1, 2], list(range(6, 6 + num_output)), eos_token_id=eos)
        logits = _logits(1, seed=num_output)
        ours = apply_processors(logits, [params], [history])
        theirs = oracle(torch.tensor([history.token_ids]), logits.clone())
        assert torch.equal(ours, theirs), num_output
        assert bool(ours[0, eos].isinf()) == (num_output < 3)


def test_min_tokens_masks_stop_token_ids_too() -> None:
    params = SamplingParams(min_tokens=2, stop_token_ids=(3, 4))
    got = apply_processors(_logits(1), [params], [History([1], [])])
    assert got[0, 3].isinf() and got[0, 4].isinf() and not got[0, 2].isinf()


def test_logit_bias_adds_and_clamps_to_100() -> None:
    logits = torch.zeros(1, VOCAB)
    params = SamplingParams(logit_bias=((2, 1.5), (3, 500.0), (4, -7.0)))
    got = apply_processors(logits, [params], [History([0])])[0]
    assert got[2] == 1.5 and got[3] == 100.0 and got[4] == -7.0 and got[0] == 0.0


def test_allowed_token_ids_leave_only_those() -> None:
    params = [SamplingParams(allowed_token_ids=(1, 7)), SamplingParams()]
    got = apply_processors(_logits(2), params, [History([0]), History([0])])
    assert (~got[0].isinf()).nonzero().flatten().tolist() == [1, 7]
    assert not got[1].isinf().any()


def test_bad_words_ban_the_last_token_after_their_prefix() -> None:
    params = SamplingParams(bad_words_token_ids=((3,), (5, 6, 7)))
    after_prefix = apply_processors(_logits(1), [params], [History([5, 6], [5, 6])])[0]
    assert after_prefix[3].isinf() and after_prefix[7].isinf()
    # The prefix must be generated: in the prompt only, the word's last token stays allowed.
    in_prompt = apply_processors(_logits(1), [params], [History([5, 6], [])])[0]
    assert in_prompt[3].isinf() and not in_prompt[7].isinf()


def test_bad_words_are_tokenised_with_and_without_a_leading_space() -> None:
    vocab = {"hello": [10], " hello": [11], "a b": [1, 2], " a b": [3, 2], "x": [4], " x": [4]}
    words = bad_words_token_ids(lambda text: vocab[text], ("hello", "a b", "x"))
    assert words == ((10,), (11,), (1, 2), (3, 2), (4,))


def test_sampler_applies_processors_to_greedy_rows() -> None:
    logits = _logits(1, seed=9)
    best = int(logits.argmax())
    params = SamplingParams(temperature=0, logit_bias=((best, -100.0),))
    assert Sampler(CPU).sample(logits, [params], [0]) != [best]


def test_logprobs_are_the_raw_log_softmax_with_rank_and_top() -> None:
    logits = _logits(2, seed=5)
    found = token_logprobs(logits, [3, 0], [2, 0])
    expected = logits.log_softmax(-1)
    assert found[0].logprob == pytest.approx(float(expected[0, 3]))
    assert found[0].rank == 1 + int((expected[0] > expected[0, 3]).sum())
    assert [t for t, _ in found[0].top] == expected[0].topk(2).indices.tolist()
    assert found[1].top == ()


def test_sampled_logprobs_ignore_the_processors() -> None:
    logits = _logits(1, seed=6)
    params = SamplingParams(temperature=0, logprobs=1, presence_penalty=2.0, logit_bias=((0, 5.0),))
    token = Sampler(CPU).sample_tokens(logits, [params], [0], [History([1], [2])])[0]
    assert token.logprob is not None
    assert token.logprob.logprob == pytest.approx(float(logits.log_softmax(-1)[0, token.token_id]))


@pytest.mark.parametrize(
    ("params", "field_name"),
    [
        (SamplingParams(presence_penalty=2.5), "presence_penalty"),
        (SamplingParams(frequency_penalty=math.nan), "frequency_penalty"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        (SamplingParams(min_p=1.5), "min_p"),
        (SamplingParams(min_tokens=20, max_tokens=10), "min_tokens"),
        (SamplingParams(logit_bias=tuple((i, 1.0) for i in range(301))), "logit_bias"),
        (SamplingParams(allowed_token_ids=()), "allowed_token_ids"),
        (SamplingParams(bad_words=tuple("w" for _ in range(65))), "bad_words"),
        (SamplingParams(logprobs=21), "logprobs"),
        (SamplingParams(prompt_logprobs=-1), "prompt_logprobs"),
    ],
)
def test_hostile_values_are_refused_naming_the_field(
    params: SamplingParams, field_name: str
) -> None:
    with pytest.raises(InvalidInput, match=field_name):
        params.validate()


def test_ids_outside_the_vocabulary_are_refused() -> None:
    with pytest.raises(InvalidInput, match="logit_bias"):
        SamplingParams(logit_bias=((VOCAB, 1.0),)).check_vocabulary(VOCAB)
    with pytest.raises(InvalidInput, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=(0, VOCAB)).check_vocabulary(VOCAB)
