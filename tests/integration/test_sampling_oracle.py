"""Oracle: sampling features against transformers on a tiny random Llama saved by transformers
itself: logprobs and prompt logprobs equal the log-softmax of its logits (1e-4), and greedy
generation with repetition_penalty, or with min_tokens and an EOS, equals its `generate`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fulcrum.llm.examples import write_tokenizer
from fulcrum.llm.loader import load_checkpoint
from fulcrum.llm.params import EngineParams
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.sync_engine import LLMEngine

transformers = pytest.importorskip("transformers")

VOCAB_SIZE = 512
PROMPT = [5, 77, 300, 12, 9, 401, 33, 250, 18, 7]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    torch.manual_seed(1234)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.2, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    directory = tmp_path_factory.mktemp("llama")
    model.save_pretrained(directory)
    write_tokenizer(directory, bos="<s>", eos="</s>")
    return directory, model


def _run(directory: Path, sampling: SamplingParams, **params: Any) -> tuple[list[int], Any]:
    engine = LLMEngine(load_checkpoint(directory), EngineParams(num_kv_blocks=64, **params))
    engine.add_request("r", PROMPT, sampling)
    tokens: list[int] = []
    outputs = []
    while engine.has_unfinished():
        for output in engine.step():
            tokens += output.new_token_ids
            outputs.append(output)
    return tokens, outputs


@pytest.mark.parametrize("max_num_batched_tokens", [512, 4])  # whole prompt, then chunked
def test_logprobs_equal_transformers_log_softmax(
    reference: tuple[Path, Any], max_num_batched_tokens: int
) -> None:
    directory, model = reference
    sampling = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3,
                              prompt_logprobs=2)  # fmt: skip
    tokens, outputs = _run(directory, sampling, max_num_batched_tokens=max_num_batched_tokens)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + tokens])).logits[0].float()
    expected = logits.log_softmax(-1)  # (T, V)
    generated = [lp for out in outputs for lp in out.new_logprobs]
    assert [lp.token_id for lp in generated] == tokens
    for i, lp in enumerate(generated):
        row = expected[len(PROMPT) - 1 + i]
        assert lp.logprob == pytest.approx(float(row[lp.token_id]), abs=1e-4)
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()
    scored = outputs[0].prompt_logprobs
    assert scored is not None and scored[0] is None and len(scored) == len(PROMPT)
    for position, lp in enumerate(scored[1:], start=1):
        assert lp is not None and lp.token_id == PROMPT[position]
        value = float(expected[position - 1, PROMPT[position]])
        assert lp.logprob == pytest.approx(value, abs=1e-4)


def test_repetition_penalty_equals_transformers_generate(reference: tuple[Path, Any]) -> None:
    directory, model = reference
    sampling = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                              repetition_penalty=1.8)  # fmt: skip
    tokens, _ = _run(directory, sampling)
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False,
                             repetition_penalty=1.8, pad_token_id=0, eos_token_id=None)  # fmt: skip
    assert tokens == out[0, len(PROMPT) :].tolist()


def test_min_tokens_equals_transformers_min_new_tokens(reference: tuple[Path, Any]) -> None:
    directory, model = reference
    # Make the model's own first greedy token the EOS: without min_tokens it stops at once.
    with torch.no_grad():
        first = int(model(torch.tensor([PROMPT])).logits[0, -1].argmax())
    sampling = SamplingParams(max_tokens=10, temperature=0, min_tokens=4, stop_token_ids=(first,))
    tokens, outputs = _run(directory, sampling)
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=10, do_sample=False,
                             min_new_tokens=4, eos_token_id=first, pad_token_id=0)  # fmt: skip
    expected = out[0, len(PROMPT) :].tolist()
    assert len(tokens) >= 4 and first not in tokens[:4]
    assert tokens == expected[: len(tokens)]
    assert outputs[-1].finish_reason in ("stop", "length")
