"""Requests without stop strings take the output processor's direct path (the DecodeStream
stepped without IncrementalDetokenizer around it): each step's text must be byte for byte what
the engine's own detokenizer hands out, whatever the tokens (split UTF-8, special tokens kept or
skipped, several tokens a step)."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer

from fulcrum.llm.detokenizer import IncrementalDetokenizer
from fulcrum.llm.engine_front import load_tokenizer
from fulcrum.llm.engine_outputs import OutputProcessor
from fulcrum.llm.examples import build_tiny_llama
from fulcrum.llm.outputs import OutputRow
from fulcrum.llm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    directory = tmp_path_factory.mktemp("models")
    return load_tokenizer(directory / build_tiny_llama(directory) / "1")


def _steps(rng: random.Random, vocab_size: int) -> list[list[int]]:
    """Token ids in steps of 1-3 (accepted drafts); every id, special ones included."""
    return [[rng.randrange(vocab_size) for _ in range(rng.choice((1, 1, 1, 2, 3)))]
            for _ in range(rng.randint(1, 40))]  # fmt: skip


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_text_without_stop_strings_is_the_detokenizers_byte_for_byte(
    tokenizer: Tokenizer, skip_special_tokens: bool
) -> None:
    rng = random.Random(7)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    sampling = SamplingParams(max_tokens=200, skip_special_tokens=skip_special_tokens)
    assert not sampling.stop
    for case in range(200):
        processor = OutputProcessor(tokenizer)
        request_id = f"r{case}"
        processor.add(request_id, sampling, number=1)
        own = IncrementalDetokenizer.for_request(tokenizer, sampling)
        steps = _steps(rng, vocab_size)
        num_output = 0
        for i, token_ids in enumerate(steps):
            last = i == len(steps) - 1
            num_output += len(token_ids)
            row: OutputRow = (request_id, token_ids, "", "length" if last else None, 3,
                              num_output, 0, None, None, None)  # fmt: skip
            (out,) = processor.process([row], num_applied=1).outputs
            for token_id in token_ids:
                own.add(token_id)
            assert out.new_text == own.take(final=last), (case, i, token_ids)
            assert out.new_token_ids == token_ids and out.usage.completion_tokens == num_output
        assert len(processor) == 0  # finished: forgotten
