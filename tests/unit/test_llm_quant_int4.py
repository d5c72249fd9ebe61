"""Int4 weight-only LLM layers: packing, group-wise quantization, the fused and dequantized
matmuls, our own int4 files, and AWQ / GPTQ checkpoints unpacked at load. The AWQ and GPTQ
packers below are written here from the formats' descriptions (AutoAWQ's `WQLinear_GEMM`,
AutoGPTQ's `QuantLinear.pack`), independently of the unpacking under test."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fulcrum.errors import ConfigError  # noqa: E402
from fulcrum.llm import cpu_bf16, quant, quant_formats, quant_int4  # noqa: E402
from fulcrum.llm.loader import load_checkpoint  # noqa: E402
from fulcrum.llm.quant_int4 import Int4Linear, Int4Weight  # noqa: E402

CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
AWQ_ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: packed nibble i holds column order_map[i]


# --- reference packers (from the formats' descriptions) ----------------------------------


def _to_int32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(words.astype(np.uint32).view(np.int32).copy())


def awq_pack(intweight: np.ndarray, zeros: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoAWQ GEMM: intweight (K, N), zeros (K/g, N) -> qweight (K, N/8), qzeros (K/g, N/8)."""

    def pack(values: np.ndarray) -> torch.Tensor:
        rows, cols = values.shape
        out = np.zeros((rows, cols // 8), dtype=np.uint64)
        for col in range(cols // 8):
            for i in range(8):
                out[:, col] |= values[:, col * 8 + AWQ_ORDER_MAP[i]].astype(np.uint64) << (4 * i)
        return _to_int32(out)

    return pack(intweight), pack(zeros)


def gptq_pack(
    intweight: np.ndarray, zeros: np.ndarray, *, v1: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoGPTQ: intweight (K, N) -> qweight (K/8, N) packed along K; zeros (K/g, N) minus one
    (v1) -> qzeros (K/g, N/8) packed along N."""
    k, n = intweight.shape
    qweight = np.zeros((k // 8, n), dtype=np.uint64)
    for row in range(k // 8):
        for j in range(8):
            qweight[row] |= intweight[row * 8 + j].astype(np.uint64) << (4 * j)
    stored = (zeros - 1 if v1 else zeros).astype(np.int64) & 0xF
    qzeros = np.zeros((zeros.shape[0], n // 8), dtype=np.uint64)
    for col in range(n // 8):
        for j in range(8):
            qzeros[:, col] |= stored[:, col * 8 + j].astype(np.uint64) << (4 * j)
    return _to_int32(qweight), _to_int32(qzeros)


def random_layer(
    k: int, n: int, group: int, seed: int, *, min_zero: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """intweight (K, N), zeros (K/g, N) and float16-exact scales (K/g, N), in the (in, out)
    orientation both formats use."""
    rng = np.random.default_rng(seed)
    intweight = rng.integers(0, 16, size=(k, n))
    zeros = rng.integers(min_zero, 16, size=(k // group, n))
    scales = rng.uniform(0.001, 0.02, size=(k // group, n)).astype(np.float16)
    return intweight, zeros, scales


def reference_weight(intweight: np.ndarray, zeros: np.ndarray, scales: np.ndarray) -> torch.Tensor:
    """The float (N, K) weight the formats define: (q - zero) * scale per group of K rows."""
    group = intweight.shape[0] // zeros.shape[0]
    z = np.repeat(zeros, group, axis=0)
    s = np.repeat(scales.astype(np.float32), group, axis=0)
    return torch.from_numpy(((intweight - z) * s).T.astype(np.float32))


# --- packing and quantization ------------------------------------------------------------


def test_pack_unpack_round_trip_and_low_nibble_first() -> None:
    q = torch.randint(0, 16, (6, 10), generator=torch.Generator().manual_seed(0))
    packed = quant_int4.pack_int4(q)
    assert packed.shape == (6, 5) and packed.dtype == torch.uint8
    assert int(packed[0, 0]) == int(q[0, 0]) | (int(q[0, 1]) << 4)
    assert torch.equal(quant_int4.unpack_int4(packed), q.to(torch.uint8))


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [False, True])
def test_quantize_dequantize_is_within_half_a_step_of_each_group(
    group_size: int, symmetric: bool
) -> None:
    weight = torch.randn(16, 256, generator=torch.Generator().manual_seed(1))
    found = quant_int4.quantize_int4(weight, group_size, symmetric=symmetric)
    assert found.group_size == group_size and found.scales.shape == (16, 256 // group_size)
    if symmetric:
        assert bool((found.zeros == 8).all())
    step = found.scales.repeat_interleave(group_size, dim=1)  # (N, K)
    error = (quant_int4.dequantize_int4(found, 256) - weight).abs()
    assert bool((error <= step / 2 + 1e-6).all())
    assert float(error.max()) > 0  # really 4 bits: not a copy of the floats


def test_a_width_that_is_not_a_multiple_of_the_group_is_padded_with_zeros() -> None:
    weight = torch.randn(8, 176, generator=torch.Generator().manual_seed(2))
    found = quant_int4.quantize_int4(weight, 128)
    assert found.qweight.shape == (8, 128) and found.scales.shape == (8, 2)
    back = quant_int4.dequantize_int4(found)
    assert bool((back[:, 176:] == 0).all())
    assert float((back[:, :176] - weight).abs().max()) < float(found.scales.max())


def test_group_sizes_the_kernel_cannot_run_are_refused() -> None:
    with pytest.raises(ConfigError, match="int4 group size 48"):
        quant_int4.quantize_int4(torch.zeros(4, 96), 48)


def test_the_kernel_layout_converts_back_to_the_canonical_one() -> None:
    q = torch.randint(0, 16, (128, 256), generator=torch.Generator().manual_seed(3))
    packed = quant_int4.to_kernel_layout(q)
    assert not torch.equal(packed, quant_int4.pack_int4(q))  # a different layout...
    assert torch.equal(quant_int4.from_kernel_layout(packed), q.to(torch.uint8))  # ...same values


# --- the layer ---------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("num_rows", [1, 5, 39])
@pytest.mark.parametrize(("in_features", "out_features"), [(256, 128), (176, 64), (64, 176)])
def test_int4_linear_matches_the_dequantized_weights(
    monkeypatch: pytest.MonkeyPatch,
    fused: bool,
    num_rows: int,
    in_features: int,
    out_features: int,
) -> None:
    if fused and not cpu_bf16.cpu_has_bf16():
        pytest.skip("the fused int4 kernel runs here only with native bfloat16")
    monkeypatch.setattr(cpu_bf16, "cpu_has_bf16", lambda: fused)
    torch.manual_seed(4)
    linear = torch.nn.Linear(in_features, out_features)
    layer = Int4Linear.from_linear(linear, 64)
    x = torch.randn(num_rows, in_features)
    with torch.no_grad():
        want = x @ quant_int4.dequantize_int4(layer.weights(), in_features).t() + linear.bias
        got = layer(x)
    # float32 throughout when not fused; bf16 activations (8 bits of mantissa) when fused.
    bound = 2e-2 * float(want.abs().max()) if fused else 1e-4
    assert float((got - want).abs().max()) <= bound
    assert (layer._kernel is not None) is fused  # every row count, any width (padded)


@pytest.mark.parametrize("out_features", [64, 96])  # 96: the kernel's copy has 32 zero rows
def test_the_layer_keeps_its_weights_once_and_gives_the_canonical_layout_back(
    out_features: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not cpu_bf16.cpu_has_bf16():
        pytest.skip("the fused int4 kernel runs here only with native bfloat16")
    monkeypatch.setattr(quant_int4, "FUSED_MAX_ROWS", 32)  # 40 rows take the dequantized path
    linear = torch.nn.Linear(128, out_features, bias=False)
    layer = Int4Linear.from_linear(linear, 32)
    canonical = layer.weights()
    layer(torch.randn(1, 128))  # builds the kernel's copy
    assert layer._kernel is not None and layer.qweight is layer._kernel[0]  # one copy held
    again = layer.weights()
    assert torch.equal(again.qweight, canonical.qweight)
    big = torch.randn(40, 128)  # the dequantized (prefill) path reads the kernel layout right
    expected = big @ quant_int4.dequantize_int4(canonical).t()
    assert float((layer(big) - expected).abs().max()) < 2e-2 * float(expected.abs().max())


def test_the_prefill_dequantizes_the_kernel_layout_to_the_same_weights() -> None:
    from fulcrum.llm.quant_int4_kernel import dequantize_kernel_layout

    weight = torch.randn(128, 256, generator=torch.Generator().manual_seed(8))
    found = quant_int4.quantize_int4(weight, 64)
    packed = quant_int4.to_kernel_layout(quant_int4.unpack_int4(found.qweight))
    got = dequantize_kernel_layout(packed, found.scales, found.zeros)
    want = quant_int4.dequantize_int4(found).to(torch.bfloat16)  # rounded once, as the table
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


# --- our own int4 files ------------------------------------------------------------------


def _write_float(directory: Path, config: dict[str, object], seed: int = 0) -> None:
    from safetensors.torch import save_file

    from fulcrum.llm.examples import write_tokenizer
    from fulcrum.llm.models import build_model

    directory.mkdir(parents=True, exist_ok=True)
    config = {**config, "vocab_size": write_tokenizer(directory, bos="<s>", eos="</s>")}
    (directory / "config.json").write_text(json.dumps(config))
    model = build_model(config)
    torch.manual_seed(seed)
    tensors = {k: (torch.randn(p.shape) * 0.1) for k, p in model.named_parameters()}
    save_file(tensors, str(directory / "model.safetensors"))


def test_an_int4_file_is_marked_smaller_and_loads_the_same_weights(tmp_path: Path) -> None:
    _write_float(tmp_path, CONFIG)
    module = load_checkpoint(tmp_path).model
    names = quant.quantizable_linears(module)  # type: ignore[arg-type]
    quant.replace_linears(module, names, quantize=True, precision=quant.INT4, group_size=32)  # type: ignore[arg-type]
    path = tmp_path / "model.int4.safetensors"
    quant.save_quantized(module, path, source="model.safetensors")  # type: ignore[arg-type]
    assert quant.file_quantization(path) == "int4"
    loaded = load_checkpoint(tmp_path, model_file=path.name, quantization="int4").model
    for name in names:
        a, b = module.get_submodule(name), loaded.get_submodule(name)  # type: ignore[attr-defined]
        assert isinstance(b, Int4Linear) and b.group_size == 32
        assert torch.equal(a.weights().qweight, b.weights().qweight)
    with pytest.raises(ConfigError, match=r"key 'parameters\.quantization' = 'int8'"):
        load_checkpoint(tmp_path, model_file=path.name, quantization="int8")


# --- AWQ / GPTQ --------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_awq_gemm_unpacking_matches_the_reference_packer(seed: int) -> None:
    intweight, zeros, scales = random_layer(128, 64, 32, seed)
    qweight, qzeros = awq_pack(intweight, zeros)
    assert qweight.shape == (128, 8) and qweight.dtype == torch.int32
    found = quant_formats.convert_awq(qweight, qzeros, torch.from_numpy(scales))
    assert found.group_size == 32
    want = reference_weight(intweight, zeros, scales)
    assert torch.equal(quant_int4.dequantize_int4(found), want)


@pytest.mark.parametrize(("v1", "min_zero"), [(True, 1), (False, 0)])
def test_gptq_unpacking_matches_the_reference_packer(v1: bool, min_zero: int) -> None:
    intweight, zeros, scales = random_layer(128, 64, 32, 5, min_zero=min_zero)
    qweight, qzeros = gptq_pack(intweight, zeros, v1=v1)
    assert qweight.shape == (16, 64) and qzeros.shape == (4, 8)
    fmt = quant_formats.ExternalFormat("gptq", 32, 1 if v1 else 0)
    g_idx = torch.arange(128, dtype=torch.int32) // 32
    found = quant_formats.convert_gptq(qweight, qzeros, torch.from_numpy(scales), g_idx, fmt)
    want = reference_weight(intweight, zeros, scales)
    assert torch.equal(quant_int4.dequantize_int4(found), want)


def test_gptq_v1_zero_point_zero_stored_as_minus_one_reads_back_as_zero() -> None:
    intweight, zeros, scales = random_layer(64, 64, 32, 6)
    zeros[:] = 0  # symmetric-looking packers write -1 here; only its low nibble survives
    qweight, qzeros = gptq_pack(intweight, zeros, v1=True)
    fmt = quant_formats.ExternalFormat("gptq", 32, 1)
    found = quant_formats.convert_gptq(qweight, qzeros, torch.from_numpy(scales), None, fmt)
    assert bool((found.zeros == 0).all())


def test_act_order_g_idx_is_refused() -> None:
    intweight, zeros, scales = random_layer(64, 64, 32, 7)
    qweight, qzeros = gptq_pack(intweight, zeros, v1=True)
    g_idx = torch.randperm(64, generator=torch.Generator().manual_seed(0)) // 32
    fmt = quant_formats.ExternalFormat("gptq", 32, 1)
    with pytest.raises(ConfigError, match="act-order"):
        quant_formats.convert_gptq(qweight, qzeros, torch.from_numpy(scales), g_idx, fmt)


@pytest.mark.parametrize(
    ("qc", "key"),
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method"),
        ({"quant_method": "fp8"}, "quant_method"),
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits"),
        ({"quant_method": "gptq", "bits": 4, "group_size": -1}, "group_size"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "desc_act"),
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
            "checkpoint_format",
        ),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point"),
        ("awq", "quantization_config"),
    ],
)
def test_unsupported_quantization_configs_name_the_key(qc: object, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"key 'quantization_config(\.{key})?'"):
        quant_formats.external_format({"quantization_config": qc})


def test_supported_quantization_configs_are_read() -> None:
    awq = quant_formats.external_format(
        {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 64}}
    )
    gptq = quant_formats.external_format(
        {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}}
    )
    assert awq == quant_formats.ExternalFormat("awq", 64, 0)
    assert gptq == quant_formats.ExternalFormat("gptq", 128, 1)
    assert quant_formats.external_format({}) is None


def _write_external(directory: Path, method: str) -> dict[str, torch.Tensor]:
    """A float checkpoint plus its AWQ/GPTQ twin in `directory`/<method>; the twin's
    dequantized projection weights by our layer name."""
    from safetensors.torch import load_file, save_file

    _write_float(directory, CONFIG)
    floats = load_file(str(directory / "model.safetensors"))
    target = directory / method
    target.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (target / name).write_bytes((directory / name).read_bytes())
    qc = {"quant_method": method, "bits": 4, "group_size": 32, "desc_act": False, "sym": False}
    config = json.loads((directory / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    tensors: dict[str, torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}
    for key, value in floats.items():
        layer = key.removesuffix(".weight")
        if not layer.endswith(PROJECTIONS):
            tensors[key] = value.half()  # as the formats store them
            continue
        k, n = value.shape[1], value.shape[0]
        intweight, zeros, scales = random_layer(k, n, 32, len(tensors), min_zero=1)
        if method == "awq":
            qweight, qzeros = awq_pack(intweight, zeros)
        else:
            qweight, qzeros = gptq_pack(intweight, zeros, v1=True)
            tensors[f"{layer}.g_idx"] = torch.arange(k, dtype=torch.int32) // 32
        tensors[f"{layer}.qweight"], tensors[f"{layer}.qzeros"] = qweight, qzeros
        tensors[f"{layer}.scales"] = torch.from_numpy(scales)
        expected[layer] = reference_weight(intweight, zeros, scales)
    save_file(tensors, str(target / "model.safetensors"))
    return expected


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_awq_and_gptq_checkpoints_load_as_int4_layers(tmp_path: Path, method: str) -> None:
    expected = _write_external(tmp_path, method)
    model = load_checkpoint(tmp_path / method, quantization="int4").model
    for name, want in expected.items():
        layer = model.get_submodule(name)  # type: ignore[attr-defined]
        assert isinstance(layer, Int4Linear) and layer.group_size == 32
        assert torch.equal(quant_int4.dequantize_int4(layer.weights(), layer.in_features), want)
    assert quant.head_quantization(model) == "none"  # type: ignore[arg-type]  # as the file has it
    # The whole model runs: its logits equal a float model holding the dequantized weights.
    reference = load_checkpoint(tmp_path).model
    with torch.no_grad():
        for name, want in expected.items():
            reference.get_submodule(name).weight.copy_(want)  # type: ignore[attr-defined]
        emb = model.get_submodule("model.embed_tokens").weight  # type: ignore[attr-defined]
        reference.get_submodule("model.embed_tokens").weight.copy_(emb)  # type: ignore[attr-defined]
        head = model.get_submodule("lm_head").weight  # type: ignore[attr-defined]
        reference.get_submodule("lm_head").weight.copy_(head)  # type: ignore[attr-defined]
    from fulcrum.tuning.llm_fidelity import token_logits

    ids = [3, 9, 27, 4, 11, 5, 40, 2]
    cpu = torch.device("cpu")
    got, want_logits = token_logits(model, ids, cpu), token_logits(reference, ids, cpu)
    assert float((got - want_logits).abs().max()) < 0.05 * float(want_logits.abs().max())
    with pytest.raises(ConfigError, match=r"key 'parameters\.quantization' = 'int8'"):
        load_checkpoint(tmp_path / method, quantization="int8")


def test_an_int4_weight_of_the_wrong_shape_is_refused() -> None:
    layer = Int4Linear(64, 32, False, 32)
    wrong = Int4Weight(
        torch.zeros(32, 16, dtype=torch.uint8), torch.ones(32, 1), torch.zeros(32, 1)
    )
    with pytest.raises(ConfigError, match="int4 qweight of shape"):
        layer.load(wrong)
