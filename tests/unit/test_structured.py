"""Structured output: the grammar compiler (llguidance, cached, bounded, off the loop), the
per-sequence matchers' lifecycle (hand-written fake matchers), and the grammar mask in the
sampler, including the rows other restrictions would leave with no token (the grammar wins)."""

from __future__ import annotations

import asyncio
import json
import threading

import numpy as np
import pytest
import torch

from fulcrum.errors import InvalidInput, ModelError
from fulcrum.llm import structured
from fulcrum.llm.examples import build_tokenizer
from fulcrum.llm.sampler import SampledToken, Sampler
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.sequence import Sequence
from fulcrum.llm.structured import (
    GrammarCompiler,
    GrammarMasks,
    Matcher,
    StructuredOutputs,
    apply_grammar,
)
from fulcrum.llm.structured_spec import MAX_SOURCE_BYTES, StructuredSpec

CPU = torch.device("cpu")
VOCAB = 16
EOS = 0


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    tokenizer = build_tokenizer(["<|endoftext|>"])
    return GrammarCompiler(tokenizer, int(tokenizer.get_vocab_size()), [EOS])


# --- the compiler ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        (StructuredSpec("regex", "(ab"), "unclosed group"),
        (StructuredSpec("json_schema", '{"type": "strin"}'), "Invalid type: strin"),
        (StructuredSpec("json_schema", '{"not": {"type": "string"}}'), "Unimplemented keys"),
        (StructuredSpec("json_schema", "{not json"), "invalid json_schema"),
        (StructuredSpec("grammar", "start: undefined_rule"), "undefined_rule"),
        (StructuredSpec("choice", "[]"), "non-empty list"),
        (StructuredSpec("regex", "a" * (MAX_SOURCE_BYTES + 1)), "at most 65536"),
    ],
)
def test_a_bad_grammar_is_invalid_input_naming_the_field(
    compiler: GrammarCompiler, spec: StructuredSpec, needle: str
) -> None:
    with pytest.raises(InvalidInput) as caught:
        compiler.compile(spec, "guided_regex")
    assert caught.value.param == "guided_regex"
    assert needle in caught.value.message


def test_compiled_grammars_are_cached_and_bounded(
    compiler: GrammarCompiler, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = compiler.compile(StructuredSpec("regex", "[0-9]+"))
    assert compiler.compile(StructuredSpec("regex", "[0-9]+")) is first
    monkeypatch.setattr(structured, "MAX_CACHED_GRAMMARS", 2)
    for n in range(3):
        compiler.compile(StructuredSpec("regex", f"x{{{n + 1}}}"))
    assert compiler.compile(StructuredSpec("regex", "[0-9]+")) is not first  # evicted


async def test_a_compile_that_takes_too_long_is_refused_without_blocking_the_loop(
    compiler: GrammarCompiler, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()

    def slow(spec: StructuredSpec, field: str = "structured") -> Matcher:
        release.wait(30)  # a pathological grammar, on its compile thread
        raise InvalidInput(f"{field}: never reached")

    monkeypatch.setattr(compiler, "compile", slow)
    monkeypatch.setattr(structured, "COMPILE_TIMEOUT_S", 0.05)
    ticks = 0

    async def tick() -> None:  # the loop keeps running while the compile is stuck
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    ticker = asyncio.create_task(tick())
    try:
        with pytest.raises(InvalidInput) as caught:
            await compiler.compile_async(StructuredSpec("regex", "a+"), "guided_regex")
    finally:
        release.set()
        ticker.cancel()
    assert caught.value.param == "guided_regex"
    assert "did not compile within" in caught.value.message
    assert ticks > 1


# --- matchers with fakes --------------------------------------------------------------------


class FakeMatcher:
    """Allows the tokens of `allowed`; stops after `length` tokens; records what it consumed."""

    def __init__(self, allowed: set[int], length: int = 3) -> None:
        self.allowed = allowed
        self.length = length
        self.consumed: list[int] = []
        self.error = ""
        self.fill_threads: list[str] = []

    def deep_copy(self) -> FakeMatcher:
        return FakeMatcher(self.allowed, self.length)

    def consume_token(self, sampled_token: int) -> bool:
        if sampled_token not in self.allowed or self.is_stopped():
            self.error = f"token {sampled_token} not allowed"
            return False
        self.consumed.append(sampled_token)
        return True

    def rollback(self, num_tokens: int) -> bool:
        del self.consumed[len(self.consumed) - num_tokens :]
        return True

    def is_stopped(self) -> bool:
        return len(self.consumed) >= self.length

    def is_error(self) -> bool:
        return bool(self.error)

    def get_error(self) -> str:
        return self.error


def fake_fill(matchers: list[Matcher], bitmask: np.ndarray) -> None:
    for row, matcher in enumerate(matchers):
        assert isinstance(matcher, FakeMatcher)
        matcher.fill_threads.append(threading.current_thread().name)
        for token in matcher.allowed:
            bitmask[row, token // 32] |= np.int32(1 << (token % 32))


def _outputs(template: FakeMatcher) -> StructuredOutputs:
    return StructuredOutputs(lambda spec, field: template, VOCAB, fill=fake_fill)


REGEX = StructuredSpec("regex", "x")


def _seq(seq_id: int, spec: StructuredSpec | None = REGEX) -> Sequence:
    return Sequence(seq_id, [1, 2, 3], SamplingParams(structured=spec), arrival_s=0.0)


def test_each_sequence_gets_its_own_matcher_until_released() -> None:
    outputs = _outputs(FakeMatcher({4, 5}))
    first, second, plain = _seq(0), _seq(1), _seq(2, spec=None)
    for seq in (first, second, plain):
        outputs.add(seq)
    assert 0 in outputs and 1 in outputs and 2 not in outputs
    pending = outputs.start_fill([first, plain, second])
    assert pending is not None and pending.rows == [0, 2]
    masks = pending.result()
    assert masks.allowed.shape == (2, VOCAB)
    assert torch.nonzero(masks.allowed[0]).flatten().tolist() == [4, 5]
    tokens = outputs.accept(
        [first, plain, second], [SampledToken(4), SampledToken(9), SampledToken(5)]
    )
    assert not any(isinstance(t, ModelError) for t in tokens)
    outputs.release(0)
    assert 0 not in outputs and 1 in outputs
    outputs.reset()
    assert 1 not in outputs


def test_a_batch_without_structured_rows_starts_nothing() -> None:
    outputs = _outputs(FakeMatcher({4}))
    plain = _seq(0, spec=None)
    outputs.add(plain)
    assert outputs.start_fill([plain]) is None
    assert outputs._worker is None  # no thread, no mask: unconstrained batches pay nothing


def test_the_mask_is_filled_on_a_worker_thread() -> None:
    template = FakeMatcher({4})
    outputs = _outputs(template)
    seq = _seq(0)
    outputs.add(seq)
    pending = outputs.start_fill([seq])
    assert pending is not None
    pending.result()
    matcher = outputs._tracked[0].matcher
    assert isinstance(matcher, FakeMatcher)
    assert matcher.fill_threads and matcher.fill_threads[0] != threading.current_thread().name


def test_a_rejected_token_fails_its_row_alone() -> None:
    outputs = _outputs(FakeMatcher({4}))
    good, bad = _seq(0), _seq(1)
    outputs.add(good)
    outputs.add(bad)
    tokens = outputs.accept([good, bad], [SampledToken(4), SampledToken(7)])
    assert tokens[0] == SampledToken(4)
    assert isinstance(tokens[1], ModelError) and "token 7" in tokens[1].message


def test_completion_is_reported_once_the_grammar_stops() -> None:
    outputs = _outputs(FakeMatcher({4}, length=2))
    seq = _seq(0)
    outputs.add(seq)
    for _ in range(2):
        assert not outputs.is_complete(0)
        outputs.accept([seq], [SampledToken(4)])
        seq.append_token(4)
    assert outputs.is_complete(0)


def test_a_preempted_sequence_keeps_a_matcher_that_agrees_with_its_tokens() -> None:
    outputs = _outputs(FakeMatcher({4, 5}, length=10))
    seq = _seq(0)
    outputs.add(seq)
    for token in (4, 5):
        outputs.accept([seq], [SampledToken(token)])
        seq.append_token(token)
    # Preemption by recompute: the KV is dropped, the tokens are kept and computed again.
    seq.num_computed_tokens = 0
    seq.num_preemptions += 1
    outputs.start_fill([seq])
    matcher = outputs._tracked[0].matcher
    assert isinstance(matcher, FakeMatcher)
    assert matcher.consumed == [4, 5]  # neither rebuilt nor replayed twice


def test_a_matcher_out_of_step_with_its_sequence_is_rolled_back_or_replayed() -> None:
    outputs = _outputs(FakeMatcher({4, 5}, length=10))
    seq = _seq(0)
    outputs.add(seq)
    for token in (4, 5, 4):
        outputs.accept([seq], [SampledToken(token)])
    seq.append_token(4)  # the sequence kept one of the three tokens
    outputs.start_fill([seq])
    matcher = outputs._tracked[0].matcher
    assert isinstance(matcher, FakeMatcher) and matcher.consumed == [4]
    seq.append_token(5)
    seq.append_token(5)  # two tokens the matcher never saw
    outputs.start_fill([seq])
    assert matcher.consumed == [4, 5, 5]


# --- the sampler ----------------------------------------------------------------------------


def _masks(rows: list[int], allowed: list[list[int]]) -> GrammarMasks:
    mask = torch.zeros(len(rows), VOCAB, dtype=torch.bool)
    for i, tokens in enumerate(allowed):
        mask[i, tokens] = True
    return GrammarMasks(rows, mask)


def test_the_grammar_mask_applies_to_its_rows_only() -> None:
    logits = torch.arange(2 * VOCAB, dtype=torch.float32).view(2, VOCAB)
    masked = apply_grammar(logits, _masks([1], [[3, 5]]))
    assert torch.equal(masked[0], logits[0])
    assert torch.isfinite(masked[1]).nonzero().flatten().tolist() == [3, 5]
    greedy = SamplingParams(temperature=0.0)
    sampled = Sampler(CPU).sample_tokens(
        logits, [greedy, greedy], [0, 1], None, _masks([1], [[3, 5]])
    )
    assert [t.token_id for t in sampled] == [VOCAB - 1, 5]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize(
    "restriction",
    [
        {"allowed_token_ids": (7, 8)},
        {"bad_words_token_ids": ((3,), (5,))},
        {"logit_bias": ((3, -100.0), (5, -100.0))},
    ],
)
def test_restrictions_that_leave_no_grammar_token_give_way_to_the_grammar(
    temperature: float, restriction: dict[str, object]
) -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 50.0  # what the model wants, outside the grammar
    params = SamplingParams(temperature=temperature, seed=0, **restriction)  # type: ignore[arg-type,unused-ignore]
    for _ in range(20):
        (token,) = Sampler(CPU).sample_tokens(logits, [params], [0], None, _masks([0], [[3, 5]]))
        assert token.token_id in (3, 5)


def test_min_tokens_gives_way_when_the_grammar_allows_only_eos() -> None:
    class History:
        def __init__(self) -> None:
            self.token_ids = [1, 2, 3]
            self.num_prompt_tokens = 3
            self.eos_token_id = EOS

    params = SamplingParams(temperature=1.0, min_tokens=5, max_tokens=8)
    logits = torch.randn(1, VOCAB)
    (token,) = Sampler(CPU).sample_tokens(logits, [params], [0], [History()], _masks([0], [[EOS]]))
    assert token.token_id == EOS


def test_logprobs_stay_those_of_the_raw_logits() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0] + [0.0] * (VOCAB - 4)])
    params = SamplingParams(temperature=0.0, logprobs=0)
    (token,) = Sampler(CPU).sample_tokens(logits, [params], [0], None, _masks([0], [[1]]))
    assert token.token_id == 1 and token.logprob is not None
    expected = torch.log_softmax(logits[0], -1)[1].item()
    assert token.logprob.logprob == pytest.approx(expected, abs=1e-6)


def test_choice_source_must_be_a_list_of_strings(compiler: GrammarCompiler) -> None:
    with pytest.raises(InvalidInput):
        compiler.compile(StructuredSpec("choice", json.dumps(["a", 3])))
    compiler.compile(StructuredSpec("choice", json.dumps(["yes", "no"])))
