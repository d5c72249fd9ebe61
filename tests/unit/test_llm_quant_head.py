"""The quantized LM head: `fulcrum quantize` writes it int8 (int4 on request) in both variants,
a tied input embedding reads its rows from it (no float [vocab, hidden] matrix left), large
layers dequantize a slice of rows at a time, and every family loads and runs quantized with
logits equal to a float model holding the dequantized weights."""

from __future__ import annotations

import gc
import json
import shutil
import weakref
from pathlib import Path
from typing import Any

import msgspec
import pytest

torch = pytest.importorskip("torch")

from fulcrum.config import load_model_config  # noqa: E402
from fulcrum.errors import ConfigError  # noqa: E402
from fulcrum.llm import cpu_bf16, quant, quant_int4  # noqa: E402
from fulcrum.llm.loader import load_checkpoint  # noqa: E402
from fulcrum.llm.params import EngineParams  # noqa: E402
from fulcrum.llm.quant_embedding import TiedQuantizedEmbedding  # noqa: E402
from fulcrum.llm.quant_int4 import Int4Linear  # noqa: E402
from fulcrum.llm.quant_matmul import CHUNK_ROWS  # noqa: E402
from fulcrum.llm.sampling_params import SamplingParams  # noqa: E402
from fulcrum.llm.sync_engine import LLMEngine  # noqa: E402
from fulcrum.tuning.llm_fidelity import token_logits  # noqa: E402
from fulcrum.tuning.quantize import QuantizeJob  # noqa: E402
from fulcrum.tuning.quantize_llm import FILES, LlmFidelityOptions, LlmQuantizer  # noqa: E402
from fulcrum.tuning.validation_set import ValidationSet  # noqa: E402

FAST = LlmFidelityOptions(num_prompts=4, continuation_tokens=16, max_chunks=2)
VOCAB, HIDDEN = 128, 64
SHAPE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
# Tied where the family's small models tie (Llama 3.2, Qwen, Gemma); untied where they do not.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {**SHAPE, "model_type": "llama", "tie_word_embeddings": True},
    "llama-untied": {**SHAPE, "model_type": "llama", "tie_word_embeddings": False},
    "mistral": {**SHAPE, "model_type": "mistral", "sliding_window": 8},
    "qwen2": {**SHAPE, "model_type": "qwen2", "tie_word_embeddings": True},
    "qwen3": {**SHAPE, "model_type": "qwen3", "tie_word_embeddings": True},
    # A low final cap, so that soft-capping changes every logit measurably.
    "gemma2": {
        **SHAPE,
        "model_type": "gemma2",
        "sliding_window": 8,
        "final_logit_softcapping": 2.0,
    },
    "gemma3_text": {**SHAPE, "model_type": "gemma3_text", "sliding_window": 8},
    "phi3": {**SHAPE, "model_type": "phi3", "partial_rotary_factor": 0.5},
    "qwen2_moe": {**SHAPE, **MOE, "model_type": "qwen2_moe", "shared_expert_intermediate_size": 32},
    "qwen3_moe": {**SHAPE, **MOE, "model_type": "qwen3_moe", "tie_word_embeddings": True},
    "gpt2": {
        "model_type": "gpt2",
        "vocab_size": VOCAB,
        "n_positions": 96,  # not the vocabulary size: no table shaped as the head
        "n_embd": HIDDEN,
        "n_layer": 2,
        "n_head": 4,
    },
}
TIED = {"llama", "qwen2", "qwen3", "gemma2", "gemma3_text", "qwen3_moe", "gpt2"}


def _float_vocab_matrices(module: torch.nn.Module) -> list[str]:
    """Names of float tensors of the head's shape (vocab, hidden) the module holds."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return [n for n, t in tensors if t.is_floating_point() and t.shape == (VOCAB, HIDDEN)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A random float checkpoint per family (named as the engine names its weights)."""
    from safetensors.torch import save_file

    from fulcrum.llm.examples import write_tokenizer
    from fulcrum.llm.models import build_model

    root = tmp_path_factory.mktemp("head")
    found = {}
    for family, config in FAMILIES.items():
        directory = root / family
        directory.mkdir()
        write_tokenizer(directory, bos="<s>", eos="</s>")
        (directory / "config.json").write_text(json.dumps(config))
        gen = torch.Generator().manual_seed(len(found))
        model = build_model(config)
        tensors = {
            k: torch.randn(p.shape, generator=gen) * 0.2 for k, p in model.named_parameters()
        }
        for key in [k for k in tensors if k.endswith(model.transposed_weights)]:
            tensors[key] = tensors[key].t().contiguous()  # GPT-2's Conv1D (in, out) layout
        save_file(tensors, str(directory / "model.safetensors"))
        found[family] = directory
    return found


def _quantized_file(directory: Path, precision: str, lm_head: str) -> str:
    name = f"model.{precision}-{lm_head}-head.safetensors"
    if not (directory / name).is_file():
        module = load_checkpoint(directory).model
        quant.quantize_model(module, precision, lm_head=lm_head, group_size=32)  # type: ignore[arg-type]
        quant.save_quantized(module, directory / name, source="model.safetensors")  # type: ignore[arg-type]
    return name


def _dequantized_twin(directory: Path, quantized: torch.nn.Module) -> torch.nn.Module:
    """The float model with every quantized layer's weights replaced by their dequantized
    values (a tied head's, so, its embedding's too): what the quantized model must compute."""
    reference: torch.nn.Module = load_checkpoint(directory).model  # type: ignore[assignment]
    with torch.no_grad():
        for name, layer in quantized.named_modules():
            if isinstance(layer, quant.Int8Linear):
                weight = quant.dequantize_weight(layer.weight, layer.weight_scale)
            elif isinstance(layer, Int4Linear):
                weight = quant_int4.dequantize_int4(layer.weights(), layer.in_features)
            else:
                continue
            reference.get_submodule(name).weight.copy_(weight)  # type: ignore[operator]
    return reference


# --- the finding: the head stays float in `fulcrum quantize`'s variants ---------------------


@pytest.fixture(scope="module")
def gpt2_dir(example_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("head-quantize") / "tiny-gpt2"
    shutil.copytree(example_repo / "tiny-gpt2", target)
    return target


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_fulcrum_quantize_writes_a_tied_head_quantized_and_no_float_vocab_matrix(
    gpt2_dir: Path, precision: str
) -> None:
    config = load_model_config(gpt2_dir / "config.toml", dir_name="tiny-gpt2")
    ref = msgspec.structs.replace(
        config, parameters={**config.parameters, "model_file": "model.safetensors"}
    )
    job = QuantizeJob(ref, "fp32", gpt2_dir / "1", ValidationSet({}, None, "corpus"), 0.9, "auto")
    variant = LlmQuantizer(FAST).write(job, precision)
    assert "LM head int8 (per-channel symmetric), tied" in variant.notes[0]
    model: torch.nn.Module = load_checkpoint(job.version_dir, model_file=FILES[precision]).model  # type: ignore[assignment]
    assert isinstance(model.get_submodule("lm_head"), quant.Int8Linear)
    assert isinstance(model.get_submodule("transformer.wte"), TiedQuantizedEmbedding)
    tensors = [*model.named_parameters(), *model.named_buffers()]
    floats = [n for n, t in tensors if t.is_floating_point() and t.shape == (512, 64)]
    # The head's and embedding's float32 (vocab, hidden) matrix is gone; tiny-gpt2's table of
    # 512 positions happens to have its shape.
    assert floats == ["transformer.wpe.weight"]
    assert variant.fidelity is not None and variant.fidelity.value >= 0.5


def test_an_untied_head_is_quantized_and_its_embedding_stays_float(
    checkpoints: dict[str, Path],
) -> None:
    directory = checkpoints["llama-untied"]
    model = load_checkpoint(directory, model_file=_quantized_file(directory, "int4", "int8")).model
    assert quant.module_quantization(model) == "int4"  # type: ignore[arg-type]
    assert quant.head_quantization(model) == "int8"  # type: ignore[arg-type]
    assert not quant.tied_head(model)  # type: ignore[arg-type]
    assert _float_vocab_matrices(model) == ["model.embed_tokens.weight"]  # type: ignore[arg-type]


def test_quantizing_a_tied_model_frees_its_float_embedding(checkpoints: dict[str, Path]) -> None:
    model: torch.nn.Module = load_checkpoint(checkpoints["llama"]).model  # type: ignore[assignment]
    float_weight = weakref.ref(model.get_submodule("model.embed_tokens").weight)  # type: ignore[arg-type]
    names = quant.quantize_model(model, quant.INT8)
    gc.collect()
    assert names[-1] == "lm_head" and float_weight() is None
    assert _float_vocab_matrices(model) == []


@pytest.mark.parametrize("lm_head", ["int8", "int4", "none"])
def test_the_head_precision_is_chosen_and_none_keeps_it_float(
    checkpoints: dict[str, Path], lm_head: str
) -> None:
    model: torch.nn.Module = load_checkpoint(checkpoints["qwen2"]).model  # type: ignore[assignment]
    quant.quantize_model(model, quant.INT4, lm_head=lm_head, group_size=32)
    assert quant.head_quantization(model) == lm_head
    assert quant.module_quantization(model) == "int4"
    embedding = model.get_submodule("model.embed_tokens")
    assert isinstance(embedding, TiedQuantizedEmbedding) is (lm_head != "none")
    with pytest.raises(ConfigError, match="lm_head 'int2'"):
        quant.quantize_model(model, quant.INT8, lm_head="int2")


# --- tied lookups read dequantized rows ----------------------------------------------------


def _head(kind: str) -> quant.Int8Linear | Int4Linear:
    linear = torch.nn.Linear(80, 192, bias=False)  # 3 blocks of the int4 kernel's 64 rows
    with torch.no_grad():
        linear.weight.copy_(torch.randn(192, 80, generator=torch.Generator().manual_seed(5)))
    if kind == "int8":
        return quant.Int8Linear.from_linear(linear)
    layer = Int4Linear.from_linear(linear, 32)
    if kind == "int4-kernel":
        layer._kernel_weights()  # the layout after a decode step: rows read from it
        assert layer._kernel is not None
    return layer


@pytest.mark.parametrize("kind", ["int8", "int4", "int4-kernel"])
def test_tied_embedding_lookups_equal_the_dequantized_rows(kind: str) -> None:
    head = _head(kind)
    if isinstance(head, quant.Int8Linear):
        table = quant.dequantize_weight(head.weight, head.weight_scale)
    else:
        table = quant_int4.dequantize_int4(head.weights(), head.in_features)
    embedding = TiedQuantizedEmbedding(head.rows, head.out_features, head.in_features)
    # Rows from both halves of every 64-row block (the kernel layout's two nibbles), repeated.
    ids = torch.tensor([[0, 31, 32, 63], [64, 127, 150, 191], [5, 5, 191, 0]])
    got = embedding(ids)
    assert got.shape == (3, 4, 80) and got.dtype == torch.float32
    assert torch.equal(got, table[ids])


def test_a_bf16_model_looks_up_bf16_rows() -> None:
    head = _head("int8").to(torch.bfloat16)
    rows = TiedQuantizedEmbedding(head.rows, 192, 80)(torch.tensor([3, 4]))
    assert rows.dtype == torch.bfloat16


# --- large layers: a slice of rows dequantized at a time ------------------------------------


def test_the_kernel_layout_converts_a_slice_of_rows_at_a_time() -> None:
    num_rows = 2 * CHUNK_ROWS + 64  # three slices, the last one partial
    q = torch.randint(0, 16, (num_rows, 64), generator=torch.Generator().manual_seed(6))
    canonical = quant_int4.pack_int4(q)
    assert torch.equal(quant_int4.kernel_layout(canonical), quant_int4.to_kernel_layout(q))


@pytest.mark.parametrize("kind", ["int8", "int4", "int4-kernel"])
def test_a_many_row_matmul_over_many_output_rows_matches_the_dequantized_weights(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The dequantized path (the CPU ships the fused kernel for every row count).
    monkeypatch.setattr(quant, "FUSED_MAX_ROWS", 32)
    monkeypatch.setattr(quant_int4, "FUSED_MAX_ROWS", 32)
    num_out = 2 * CHUNK_ROWS + 64
    linear = torch.nn.Linear(64, num_out)
    layer: quant.Int8Linear | Int4Linear
    if kind == "int8":
        layer = quant.Int8Linear.from_linear(linear)
        weight = quant.dequantize_weight(layer.weight, layer.weight_scale)
    else:
        layer = Int4Linear.from_linear(linear, 32)
        weight = quant_int4.dequantize_int4(layer.weights(), 64)
        if kind == "int4-kernel":
            layer._kernel_weights()
    x = torch.randn(40, 64)
    with torch.no_grad():
        want = x @ weight.t() + linear.bias
        got = layer(x)
    # bf16 compute where the CPU has it (8 bits of mantissa), else float32.
    bound = 2e-2 if cpu_bf16.cpu_has_bf16() else 1e-5
    assert float((got - want).abs().max()) <= bound * float(want.abs().max())


# --- every family, quantized -----------------------------------------------------------------


@pytest.fixture
def float32_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    """Quantized layers compute in float32 (no bf16 rounding): equal to the dequantized twin."""
    monkeypatch.setattr(quant, "cpu_has_bf16", lambda: False)
    monkeypatch.setattr(cpu_bf16, "cpu_has_bf16", lambda: False)


@pytest.mark.usefixtures("float32_compute")
@pytest.mark.parametrize("precision", ["int8", "int4"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_loads_quantized_with_the_logits_of_its_dequantized_twin(
    checkpoints: dict[str, Path], family: str, precision: str
) -> None:
    directory = checkpoints[family]
    loaded = load_checkpoint(directory, model_file=_quantized_file(directory, precision, "int8"))
    model: torch.nn.Module = loaded.model  # type: ignore[assignment]
    assert quant.module_quantization(model) == precision
    assert quant.head_quantization(model) == "int8"
    assert quant.tied_head(model) is (family in TIED)
    if family in TIED:
        assert _float_vocab_matrices(model) == []
    twin = _dequantized_twin(directory, model)
    ids = [3, 9, 27, 4, 11, 5, 40, 2, 100, 127]
    cpu = torch.device("cpu")
    got, want = token_logits(loaded.model, ids, cpu), token_logits(twin, ids, cpu)  # type: ignore[arg-type]
    # The same float32 arithmetic but for the int8 kernel's (scale after the dot product)
    # and the summation order; the embedding scale (Gemma) and the final soft-cap (Gemma 2)
    # apply to both.
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())
    if family == "gemma2":
        assert float(got.abs().max()) <= 2.0  # capped at final_logit_softcapping


@pytest.mark.parametrize("lm_head", ["int8", "int4"])
@pytest.mark.parametrize("family", ["gemma2", "gpt2", "qwen3_moe", "phi3"])
def test_every_family_serves_quantized_through_the_engine(
    checkpoints: dict[str, Path], family: str, lm_head: str
) -> None:
    directory = checkpoints[family]
    model_file = _quantized_file(directory, "int4", lm_head)
    params = EngineParams(model_file=model_file, device="cpu", kv_cache_memory_mb=4)
    engine = LLMEngine.from_checkpoint(directory, params)
    assert quant.head_quantization(engine.runner.model) == lm_head  # type: ignore[arg-type]
    sampling = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], sampling)
    engine.add_request("b", [9, 10, 11, 12, 13], sampling)
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id].extend(output.new_token_ids)
    assert [len(t) for t in tokens.values()] == [6, 6]
    assert all(0 <= t < VOCAB for ts in tokens.values() for t in ts)
