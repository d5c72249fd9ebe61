"""Oracle for RoPE scaling and sliding windows: the engine's greedy tokens equal transformers'
greedy `generate`, token for token over 32 new tokens, for tiny Llama checkpoints saved by
transformers with each RoPE scaling (new `rope_parameters` and old `rope_scaling` forms) and
tiny Mistral / Qwen2 checkpoints with an 8-token sliding window; alone, and batched under
staggered arrivals, chunked prefill, preemption and prefix-cache hits."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
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
# Below this top-1/top-2 logit gap, float32 rounding differences between two correct
# implementations could flip the argmax; such a position and everything after it is not compared.

WINDOW = 8


def _llama(max_positions: int, rope: dict[str, Any]) -> Callable[[], Any]:
    return lambda: transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        rope_parameters={"rope_theta": 500.0, **rope},
        initializer_range=0.2,
        tie_word_embeddings=False,
    )


# name -> (transformers config, rewrite config.json into the old `rope_scaling` form)
CASES: dict[str, tuple[Callable[[], Any], bool]] = {
    "linear": (_llama(64, {"rope_type": "linear", "factor": 2.0}), False),
    "linear-old-form": (_llama(64, {"rope_type": "linear", "factor": 3.0}), True),
    # max_position_embeddings 32: prompts and generations cross it, so the base grows.
    "dynamic": (_llama(32, {"rope_type": "dynamic", "factor": 4.0}), False),
    "llama3": (
        _llama(
            256,
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
        False,
    ),
    "yarn-old-form": (
        _llama(128, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
        True,
    ),
    "yarn-mscale": (
        _llama(
            128,
            {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "beta_fast": 16.0,
                "beta_slow": 2.0,
                "mscale": 1.2,
                "mscale_all_dim": 0.8,
            },
        ),
        False,
    ),
    "longrope": (
        _llama(
            128,
            {
                "rope_type": "longrope",
                "original_max_position_embeddings": 32,
                "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 2.5, 3.0, 3.5],
                "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
            },
        ),
        False,
    ),
    "mistral-window": (
        lambda: transformers.MistralConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            sliding_window=WINDOW,
            initializer_range=0.2,
            tie_word_embeddings=False,
        ),
        False,
    ),
    # Layer 0 attends fully, layer 1 through the window (max_window_layers = 1).
    "qwen2-window": (
        lambda: transformers.Qwen2Config(
            vocab_size=VOCAB_SIZE,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            max_position_embeddings=256,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,
            initializer_range=0.2,
            tie_word_embeddings=True,
        ),
        False,
    ),
}


# Weight seeds under which no greedy step of these prompts is a near-tie in transformers, so
# every prompt is compared over all 32 tokens (1234 unless named).
SEEDS = {"llama3": 3, "longrope": 2, "mistral-window": 4, "qwen2-window": 3, "yarn-mscale": 2}


def _to_old_form(directory: Path) -> None:
    """config.json as checkpoints written before `rope_parameters` say it: `rope_scaling` with
    `type`, and `rope_theta` at the top level."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    config["rope_scaling"] = params
    path.write_text(json.dumps(config))


def _reset_dynamic_rope(model: Any) -> None:
    # transformers' dynamic RoPE keeps the frequencies of the longest sequence it has seen until
    # one shorter than the trained length comes; each prompt here starts from the trained ones,
    # so the reference is "the current sequence's length", not the previous prompt's.
    for module in model.modules():
        if hasattr(module, "original_inv_freq") and hasattr(module, "original_max_seq_len"):
            module.register_buffer("inv_freq", module.original_inv_freq.clone(), persistent=False)
            module.max_seq_len_cached = module.original_max_seq_len


@pytest.fixture(scope="module", params=sorted(CASES))
def reference(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Reference:
    make_config, old_form = CASES[request.param]
    torch.manual_seed(SEEDS.get(request.param, 1234))
    model = transformers.AutoModelForCausalLM.from_config(make_config()).eval()
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)  # safetensors
    write_tokenizer(directory, bos="<s>", eos="</s>")
    if old_form:
        _to_old_form(directory)
    # The reference reads the same config.json the engine does.
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    return Reference(directory, model, NUM_NEW_TOKENS, before_generate=_reset_dynamic_rope)


def _prompts(num: int, seed: int, *, shared_prefix_len: int = 0) -> list[list[int]]:
    return random_prompts(num, seed, VOCAB_SIZE, shared_prefix_len=shared_prefix_len)


def test_alone_matches_transformers(reference: Reference) -> None:
    engine = LLMEngine(load_checkpoint(reference.directory), EngineParams(num_kv_blocks=64))
    prompts = _prompts(4, seed=1)
    assert max(len(p) for p in prompts) > WINDOW + 16  # past the window and the trained 32
    for prompt, tokens in zip(
        prompts, run_alone(engine, prompts, reference.sampling()), strict=True
    ):
        reference.assert_matches(prompt, tokens)


def test_staggered_chunked_preempted_and_cached_match_transformers(reference: Reference) -> None:
    # Half share a 9-token system prompt (two full blocks): cache hits after the first, at
    # prompt lengths below and above the trained 32 of the dynamic and longrope cases.
    prompts = _prompts(6, seed=2, shared_prefix_len=9) + _prompts(6, seed=3)
    check_staggered(reference.directory, prompts, reference.sampling(), reference.assert_matches)
