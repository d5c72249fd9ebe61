"""Oracle for the model families beyond Llama: the engine's greedy tokens equal transformers'
greedy `generate`, token for token over 32 new tokens, for tiny random checkpoints saved by
transformers itself (Qwen3, Gemma 2, Gemma 3 text, Phi-3, Qwen2-MoE, Qwen3-MoE), each with the
features of its family switched on (sliding windows, soft-capping, partial rotary, longrope,
shared experts); alone, and batched under staggered arrivals, chunked prefill, preemption and
prefix-cache hits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from fulcrum.llm.examples import write_tokenizer
from fulcrum.llm.loader import load_checkpoint
from fulcrum.llm.params import EngineParams
from fulcrum.llm.sync_engine import LLMEngine
from llm_oracle_runs import Reference, check_staggered, random_prompts, run_alone

transformers = pytest.importorskip("transformers")

VOCAB_SIZE = 512
NUM_NEW_TOKENS = 32
WINDOW = 8
SHAPE: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "initializer_range": 0.2,
    "pad_token_id": 0,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def _longrope(partial: float, short: list[float], long: list[float]) -> dict[str, Any]:
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": partial,
        "short_factor": short,
        "long_factor": long,
    }


CASES: dict[str, Callable[[], Any]] = {
    # head_dim 32 (not hidden / heads); layer 1 through an 8-token window.
    "qwen3": lambda: transformers.Qwen3Config(
        **SHAPE,
        head_dim=32,
        max_position_embeddings=256,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,
        tie_word_embeddings=False,
    ),
    # Layer 0 slides, layer 1 is global; small caps so tanh bends the scores and logits.
    "gemma2": lambda: transformers.Gemma2Config(
        **SHAPE,
        head_dim=16,
        max_position_embeddings=256,
        sliding_window=WINDOW,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=3.0,
        final_logit_softcapping=8.0,
    ),
    # Layer 0 slides with the local RoPE base, layer 1 is global with linear scaling.
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **SHAPE,
        head_dim=16,
        max_position_embeddings=256,
        sliding_window=WINDOW,
        query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
        },
    ),
    # Half of each 16-wide head rotates by longrope's short factors (the trained length is the
    # whole context, 128), every layer through a 16-token window.
    "phi3": lambda: transformers.Phi3Config(
        **SHAPE,
        max_position_embeddings=128,
        original_max_position_embeddings=128,
        sliding_window=2 * WINDOW,
        rope_parameters=_longrope(0.5, [1.0, 1.2, 1.5, 2.0], [1.0, 2.0, 4.0, 8.0]),
        tie_word_embeddings=False,
    ),
    # Trained length 2: every prompt is past it, so long factors (and their attention factor)
    # from the first token; 12 of 16 dims rotate.
    "phi3-long": lambda: transformers.Phi3Config(
        **SHAPE,
        max_position_embeddings=128,
        original_max_position_embeddings=2,
        rope_parameters=_longrope(
            0.75, [1.0, 1.1, 1.2, 1.5, 2.0, 2.5], [1.0, 1.5, 2.0, 3.0, 6.0, 12.0]
        ),
        tie_word_embeddings=False,
    ),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **SHAPE,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    ),
    # Layer 0 dense (mlp_only_layers), layer 1 sparse with renormalised top-k weights.
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **SHAPE,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=True,
        mlp_only_layers=[0],
        max_position_embeddings=256,
        tie_word_embeddings=False,
    ),
}

# Weight seeds under which no greedy step of these prompts is a near-tie in transformers, so
# every prompt is compared over all 32 tokens (1234 unless named).
SEEDS = {"phi3": 1, "phi3-long": 3, "qwen3_moe": 1}


def _perturb_norms(model: Any) -> None:
    # Norm weights start at 1 (Gemma: 0); random ones check that each is read and applied.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)


@pytest.fixture(scope="module", params=sorted(CASES))
def reference(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Reference:
    torch.manual_seed(SEEDS.get(request.param, 1234))
    model = transformers.AutoModelForCausalLM.from_config(CASES[request.param]()).eval()
    _perturb_norms(model)
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)  # safetensors
    write_tokenizer(directory, bos="<s>", eos="</s>")
    # The reference reads the same config.json the engine does, through eager attention: a
    # transformers whose default for Gemma 2 is SDPA skips its attention soft-capping (the
    # H200's image parted from our engine on its CPU and its GPU alike; stop 40).
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, attn_implementation="eager"
    ).eval()
    return Reference(directory, model, NUM_NEW_TOKENS)


def _prompts(num: int, seed: int, *, shared_prefix_len: int = 0) -> list[list[int]]:
    return random_prompts(num, seed, VOCAB_SIZE, shared_prefix_len=shared_prefix_len)


def test_alone_matches_transformers(reference: Reference) -> None:
    engine = LLMEngine(load_checkpoint(reference.directory), EngineParams(num_kv_blocks=64))
    prompts = _prompts(4, seed=1)
    assert max(len(p) for p in prompts) > WINDOW + 16  # past the window and longrope's 32
    for prompt, tokens in zip(
        prompts, run_alone(engine, prompts, reference.sampling()), strict=True
    ):
        reference.assert_matches(prompt, tokens)


def test_staggered_chunked_preempted_and_cached_match_transformers(reference: Reference) -> None:
    # Half share a 9-token system prompt (two full blocks): cache hits after the first.
    prompts = _prompts(6, seed=2, shared_prefix_len=9) + _prompts(6, seed=3)
    check_staggered(reference.directory, prompts, reference.sampling(), reference.assert_matches)
