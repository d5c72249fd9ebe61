"""`fulcrum profile` on the real example models with tiny settings: minilm (ONNX, tokenizer timed
apart from the graph) and tiny-gpt2 (the LLM engine, sequences swept)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fulcrum.backends.onnx import OnnxBackend
from fulcrum.config import ModelConfig, load_model_config
from fulcrum.errors import InvalidInput
from fulcrum.tuning.profile import ProfileOptions, ProfileResult, measure


def load(example_repo: Path, name: str) -> tuple[ModelConfig, Path]:
    config = load_model_config(example_repo / name / "config.toml", dir_name=name)
    return config, example_repo / name / "1"


def test_minilm_profile_splits_tokenizer_and_model(example_repo: Path) -> None:
    config, version_dir = load(example_repo, "minilm")
    options = ProfileOptions(batch_sizes=(1, 2), lengths=(8, 24), warmup=1, repeats=1)
    result = measure(config, version_dir, options)
    # The knee rule's choice (1: batch 2 backed off 20%) was measured already.
    assert [(p.length, p.batch_size) for p in result.points] == [(8, 1), (8, 2), (24, 1), (24, 2)]
    for p in result.points:
        assert p.num_tokens == p.length  # generated text is exactly that many tokens
        assert p.encode_ms_p50 is not None and p.encode_ms_p50 > 0 and p.model_ms_p50 > 0
        # One run per point: its latency is exactly tokenizer + graph.
        assert p.latency_ms_p50 == pytest.approx(p.encode_ms_p50 + p.model_ms_p50)
        assert p.rss_mb_peak > 0  # the weights alone are ~90 MB above the pre-load baseline
    assert result.headline_length == 24
    assert result.latency_ms_b1 is not None and result.knee_batch in (1, 2)
    assert result.knee_throughput_rps > 0 and result.memory is not None
    assert ProfileResult.from_json(result.to_json()) == result


def test_minilm_lengths_over_the_tokenizer_limit_are_refused(example_repo: Path) -> None:
    config, version_dir = load(example_repo, "minilm")
    options = ProfileOptions(batch_sizes=(1,), lengths=(300,), warmup=0, repeats=1)
    with pytest.raises(InvalidInput, match=r"exceeds the model's tokenizer\.max_length"):
        measure(config, version_dir, options)


def test_onnx_backend_takes_pre_encoded_tokens(example_repo: Path) -> None:
    # The profile encodes the text itself and hands the graph the tokens; before, the ONNX
    # backend refused a batch without its text input.
    config, version_dir = load(example_repo, "minilm")
    backend = OnnxBackend(config, version_dir)
    assert backend.front is not None
    texts = np.array([[b"a short sentence"], [b"and a somewhat longer second one"]], dtype=object)
    from_text = backend.execute({"text": texts})["embedding"]
    from_tokens = backend.execute(backend.front.encode(texts))["embedding"]
    np.testing.assert_allclose(
        np.asarray(from_tokens, float), np.asarray(from_text, float), rtol=1e-6
    )
    with pytest.raises(InvalidInput, match="missing input 'text'"):
        backend.execute({"input_ids": np.ones((1, 3), dtype=np.int64)})


def test_llm_profile_sweeps_sequences(example_repo: Path) -> None:
    pytest.importorskip("torch")
    from fulcrum.tuning.profile_llm import LlmProfileOptions, measure_llm

    config, version_dir = load(example_repo, "tiny-gpt2")
    options = LlmProfileOptions(
        batch_sizes=(1, 2), prompt_tokens=8, output_tokens=4, warmup=1, repeats=1
    )
    result = measure_llm(config, version_dir, options)
    assert [p.batch_size for p in result.points][:1] == [1]
    for p in result.points:
        # Greedy with EOS ignored: every sequence makes exactly its output tokens.
        assert p.num_output_tokens == p.num_runs * p.batch_size * 4
        assert p.output_tokens_per_s > 0 and p.tpot_ms_p50 > 0
        assert 0 < p.ttft_ms_p50 <= p.latency_ms_p50
    assert result.knee_batch in (1, 2) and result.knee_tokens_per_s > 0
    assert result.tpot_ms_b1 is not None and result.version == "1"
    assert any("KV pool" in note for note in result.notes)
