"""The LLM engine on CUDA: greedy tokens equal the CPU engine's, float32 and bfloat16 runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fulcrum.llm.examples import build_tiny_llama
from fulcrum.llm.loader import load_checkpoint
from fulcrum.llm.params import EngineParams
from fulcrum.llm.sampler import top_k_mask, top_p_mask
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.sync_engine import LLMEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _generate(directory: Path, **params: object) -> dict[str, list[int]]:
    engine = LLMEngine.from_checkpoint(
        directory,
        EngineParams(num_kv_blocks=64, block_size=4, max_num_batched_tokens=32, **params),  # type: ignore[arg-type]
    )
    for i in range(6):
        prompt = list(range(5 + i, 40 + 3 * i))
        engine.add_request(
            str(i), prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, seed=i)
        )
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def test_cuda_matches_cpu(tmp_path: Path) -> None:
    directory = tmp_path / build_tiny_llama(tmp_path) / "1"
    cpu = _generate(directory, device="cpu")
    assert _generate(directory, device="cuda") == cpu
    half = _generate(directory, device="cuda", dtype="bfloat16")
    assert sum(len(t) for t in half.values()) == 6 * 12


def test_an_engine_on_cuda_moves_a_model_loaded_on_the_cpu(tmp_path: Path) -> None:
    """`load_checkpoint` loads onto the CPU unless told; the engine's device decides."""
    directory = tmp_path / build_tiny_llama(tmp_path) / "1"
    loaded = load_checkpoint(directory)
    engine = LLMEngine(loaded, EngineParams(num_kv_blocks=64, block_size=4, device="cuda"))
    assert next(loaded.model.parameters()).device.type == "cuda"  # type: ignore[attr-defined]
    engine.add_request("a", list(range(5, 30)), SamplingParams(max_tokens=8, temperature=0.0))
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None
            tokens.extend(out.new_token_ids)
    assert len(tokens) == 8


def test_top_k_and_top_p_masks_take_plain_numbers_on_cuda() -> None:
    """Speculative verification of a sampled request passes one int and one float for every
    row: on CUDA those once became CPU tensors, and the request failed its first draft."""
    logits = torch.randn(3, 50, device="cuda")
    kept = top_k_mask(logits, 5)
    assert kept.device.type == "cuda" and kept.isfinite().sum(-1).tolist() == [5, 5, 5]
    nucleus = top_p_mask(logits, 0.5)
    assert nucleus.device.type == "cuda" and bool((nucleus.isfinite().sum(-1) >= 1).all())
