"""What a checkpoint load allocates: the model is built on the meta device, a quantized layer is
read straight into its int8 / int4 buffers (no float copy of it ever exists), and a float
weight is read from the file into its parameter in place."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch.overrides import TorchFunctionMode  # noqa: E402

from fulcrum.errors import ConfigError  # noqa: E402
from fulcrum.llm import loader, quant  # noqa: E402
from fulcrum.llm.loader import load_checkpoint  # noqa: E402
from fulcrum.llm.quant_int4 import Int4Linear  # noqa: E402
from fulcrum.llm.weight_file import WeightFile  # noqa: E402

VOCAB, HIDDEN, INTERMEDIATE = 160, 64, 96
LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": INTERMEDIATE,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
GPT2: dict[str, Any] = {
    "model_type": "gpt2",
    "vocab_size": VOCAB,
    "n_positions": 48,
    "n_embd": HIDDEN,
    "n_layer": 2,
    "n_head": 4,
}


class FloatAllocations(TorchFunctionMode):
    """Records the shape of every floating-point tensor with real memory (not on the meta
    device) that a torch function returns while it is active: factories, copies, casts."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        result = func(*args, **(kwargs or {}))
        found = result if isinstance(result, tuple | list) else (result,)
        for tensor in found:
            real = isinstance(tensor, torch.Tensor) and not tensor.is_meta
            if real and tensor.is_floating_point():
                self.shapes.append(tuple(tensor.shape))
        return result


def _write(directory: Path, config: dict[str, Any], seed: int) -> Path:
    from safetensors.torch import save_file

    from fulcrum.llm.examples import write_tokenizer
    from fulcrum.llm.models import build_model

    directory.mkdir()
    write_tokenizer(directory, bos="<s>", eos="</s>")
    (directory / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(seed)
    model = build_model(config)
    tensors = {k: torch.randn(p.shape, generator=gen) for k, p in model.named_parameters()}
    for key in [k for k in tensors if k.endswith(model.transposed_weights)]:
        tensors[key] = tensors[key].t().contiguous()  # GPT-2's Conv1D (in, out) layout
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(tmp_path_factory.mktemp("loadmem") / "llama", LLAMA, 0)


def _quantized(directory: Path, precision: str) -> str:
    name = f"model.{precision}.safetensors"
    if not (directory / name).is_file():
        module = load_checkpoint(directory).model
        quant.quantize_model(module, precision, lm_head=quant.INT8, group_size=32)  # type: ignore[arg-type]
        quant.save_quantized(module, directory / name, source="model.safetensors")  # type: ignore[arg-type]
    return name


# --- the finding: a quantized load built the whole float model first -----------------------


@pytest.mark.parametrize("precision", [quant.INT8, quant.INT4])
def test_a_quantized_load_never_allocates_a_float_copy_of_a_quantized_layer(
    llama_dir: Path, precision: str
) -> None:
    name = _quantized(llama_dir, precision)
    counter = FloatAllocations()
    with counter:
        module: torch.nn.Module = load_checkpoint(llama_dir, model_file=name).model  # type: ignore[assignment]
    layers = [m for m in module.modules() if isinstance(m, quant.Int8Linear | Int4Linear)]
    assert len(layers) == 2 * 7 + 1  # every projection and the (tied) head
    quantized_shapes = {(m.out_features, m.in_features) for m in layers}
    assert quantized_shapes == {(64, 64), (32, 64), (96, 64), (64, 96), (VOCAB, HIDDEN)}
    floats = [s for s in counter.shapes if s in quantized_shapes or s[::-1] in quantized_shapes]
    assert floats == []
    assert counter.shapes  # the hook saw the load's real allocations (norms, RoPE tables)


def test_the_counting_hook_sees_a_float_layer_being_built() -> None:
    counter = FloatAllocations()
    with counter:
        torch.nn.Linear(HIDDEN, INTERMEDIATE)
    assert (INTERMEDIATE, HIDDEN) in counter.shapes


# --- float loads: read in place, equal to the file ----------------------------------------


class SpyFile(WeightFile):
    """A `WeightFile` that counts the reads that allocate a tensor of their own."""

    num_buffered = 0

    def read(self, key: str) -> torch.Tensor:
        SpyFile.num_buffered += 1
        return super().read(key)


def test_float_weights_are_read_into_their_parameters_in_place(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.torch import load_file

    monkeypatch.setattr(loader, "WeightFile", SpyFile)
    SpyFile.num_buffered = 0
    module: torch.nn.Module = load_checkpoint(llama_dir).model  # type: ignore[assignment]
    assert SpyFile.num_buffered == 0
    params = dict(module.named_parameters())
    stored = load_file(str(llama_dir / "model.safetensors"))
    assert set(stored) == set(params)
    assert all(torch.equal(params[k], v) for k, v in stored.items())
    assert module.lm_head.weight is module.model.embed_tokens.weight  # tied: one tensor
    assert not any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def test_a_bf16_load_and_a_transposed_weight_go_through_one_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.torch import load_file

    directory = _write(tmp_path / "gpt2", GPT2, 1)
    monkeypatch.setattr(loader, "WeightFile", SpyFile)
    SpyFile.num_buffered = 0
    module: torch.nn.Module = load_checkpoint(directory, dtype="bfloat16").model  # type: ignore[assignment]
    params = dict(module.named_parameters())
    stored = load_file(str(directory / "model.safetensors"))
    assert SpyFile.num_buffered == len(stored)  # every one cast to bf16
    for key, value in stored.items():
        name = module.checkpoint_name(key)  # type: ignore[operator]
        want = value.t() if name.endswith(module.transposed_weights) else value  # type: ignore[arg-type]
        assert params[name].dtype == torch.bfloat16
        assert torch.equal(params[name], want.to(torch.bfloat16)), key


def test_a_weight_of_the_wrong_shape_is_refused_naming_it(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    directory = _write(tmp_path / "llama", LLAMA, 2)
    tensors = load_file(str(directory / "model.safetensors"))
    tensors["model.norm.weight"] = torch.ones(HIDDEN + 1)
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"model.norm.weight.*\[65\], expected \[64\]"):
        load_checkpoint(directory)


def test_the_model_is_built_without_memory_but_with_real_rope_tables() -> None:
    module = loader.build_empty(LLAMA)
    assert all(p.is_meta for p in module.parameters())
    rotary = module.model.rotary_emb  # type: ignore[union-attr]
    assert not rotary.cos.is_meta and bool((rotary.cos[0] == 1).all())
