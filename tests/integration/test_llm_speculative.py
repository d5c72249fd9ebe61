"""Speculative decoding end to end: greedy tokens with n-gram drafts equal the engine's without
them and transformers' greedy `generate` (32 tokens, tiny Llama built offline), alone and under
staggered arrivals with chunked prefill, preemption and prefix-cache hits."""

from __future__ import annotations

import pytest
import torch

from fulcrum.llm.examples import write_tokenizer
from fulcrum.llm.loader import load_checkpoint
from fulcrum.llm.params import EngineParams
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.speculative import SpeculativeConfig
from fulcrum.llm.sync_engine import LLMEngine
from llm_oracle_runs import Reference, run_alone, run_staggered

transformers = pytest.importorskip("transformers")

VOCAB_SIZE = 512
NUM_NEW_TOKENS = 32
SPEC = SpeculativeConfig(
    num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3, disable_by_batch_size=64
)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    torch.manual_seed(1234)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=500.0,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    directory = tmp_path_factory.mktemp("llama")
    model.save_pretrained(directory)
    write_tokenizer(directory, bos="<s>", eos="</s>")
    return Reference(directory, model, NUM_NEW_TOKENS)


def _repetitive_prompts(num: int, seed: int, *, shared: int = 0) -> list[list[int]]:
    """Patterns of 3-6 random ids repeated 3-5 times (after a shared prefix): text the
    continuation tends to repeat, so the proposer finds drafts."""
    generator = torch.Generator().manual_seed(seed)
    prefix = torch.randint(2, VOCAB_SIZE, (shared,), generator=generator).tolist()
    prompts = []
    for _ in range(num):
        width = int(torch.randint(3, 7, (1,), generator=generator))
        times = int(torch.randint(3, 6, (1,), generator=generator))
        pattern = torch.randint(2, VOCAB_SIZE, (width,), generator=generator).tolist()
        prompts.append(prefix + pattern * times)
    return prompts


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)


def _engine(reference: Reference, params: EngineParams) -> LLMEngine:
    return LLMEngine(load_checkpoint(reference.directory), params)


def test_alone_matches_transformers_and_the_engine_without_drafts(reference: Reference) -> None:
    prompts = _repetitive_prompts(4, seed=1)
    on = _engine(reference, EngineParams(num_kv_blocks=64, speculative=SPEC))
    off = _engine(reference, EngineParams(num_kv_blocks=64))
    with_drafts = run_alone(on, prompts, _greedy())
    assert with_drafts == run_alone(off, prompts, _greedy())
    for prompt, tokens in zip(prompts, with_drafts, strict=True):
        expected = reference.greedy(prompt)
        assert len(expected) >= NUM_NEW_TOKENS // 2, "too many near-ties: pick another seed"
        assert tokens[: len(expected)] == expected
        assert len(tokens) == NUM_NEW_TOKENS
    assert on.speculation is not None
    assert on.speculation.stats.num_accepted_tokens > 0  # drafts were verified and kept


def test_staggered_chunked_preempted_and_cached_equal_without_drafts(
    reference: Reference,
) -> None:
    def params(spec: SpeculativeConfig | None) -> EngineParams:
        return EngineParams(
            block_size=4,
            num_kv_blocks=60,  # 240 slots for 10 sequences of up to ~70 tokens: preemption
            max_num_batched_tokens=24,  # below the longest prompts: chunked prefill
            max_num_seqs=6,
            speculative=spec,
        )

    prompts = _repetitive_prompts(5, seed=2, shared=13) + _repetitive_prompts(5, seed=3)
    on = _engine(reference, params(SPEC))
    with_drafts = run_staggered(on, prompts, _greedy(), every=2)
    off = _engine(reference, params(None))
    assert with_drafts == run_staggered(off, prompts, _greedy(), every=2)
    assert on.scheduler.num_preemptions > 0
    assert on.block_manager.stats.num_hits > 0
    assert on.speculation is not None
    assert on.speculation.stats.num_accepted_tokens > 0
    assert on.block_manager.num_free_blocks() == on.block_manager.num_blocks  # all returned


def test_sampled_requests_speculate_and_respect_max_tokens(reference: Reference) -> None:
    engine = _engine(reference, EngineParams(num_kv_blocks=64, speculative=SPEC))
    sampling = SamplingParams(max_tokens=20, temperature=0.8, top_k=3, seed=7, ignore_eos=True)
    outputs = run_alone(engine, _repetitive_prompts(3, seed=4), sampling)
    assert [len(tokens) for tokens in outputs] == [20, 20, 20]
    assert engine.speculation is not None
    assert engine.speculation.stats.num_drafts > 0


def test_streamed_text_and_token_counts_equal_without_drafts(reference: Reference) -> None:
    from prometheus_client import CollectorRegistry

    from fulcrum.llm.metrics import LLMMetrics

    def texts(spec: SpeculativeConfig | None) -> tuple[list[str], float | None]:
        registry = CollectorRegistry()
        params = EngineParams(num_kv_blocks=64, speculative=spec)
        engine = LLMEngine(
            load_checkpoint(reference.directory), params, metrics=LLMMetrics(registry, "m")
        )
        out = {}
        for i, prompt in enumerate(_repetitive_prompts(3, seed=5)):
            engine.add_request(str(i), prompt, _greedy())
            out[str(i)] = ""
        while engine.has_unfinished():
            for output in engine.step():
                out[output.request_id] += output.new_text
        labels = {"model": "m", "version": "1", "variant": "default"}
        return list(out.values()), registry.get_sample_value(
            "fulcrum_llm_generation_tokens_total", labels
        )

    with_drafts, counted = texts(SPEC)
    assert (with_drafts, counted) == texts(None)
    assert counted == 3 * NUM_NEW_TOKENS
