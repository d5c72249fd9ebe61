"""The safetensors reader the loader fills parameters with: the same tensors safetensors' own
reader gives, read into a given tensor in place, and a clear ConfigError for a broken file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from fulcrum.errors import ConfigError  # noqa: E402
from fulcrum.llm.weight_file import WeightFile  # noqa: E402


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(3, 5, generator=gen),
        "bf16": torch.randn(4, 6, generator=gen).to(torch.bfloat16),
        "f16": torch.randn(7, generator=gen).to(torch.float16),
        "i8": torch.randint(-128, 127, (2, 3, 4), generator=gen, dtype=torch.int8),
        "u8": torch.randint(0, 255, (9,), generator=gen, dtype=torch.uint8),
        "i64": torch.arange(6, dtype=torch.int64),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }


def test_every_tensor_reads_as_safetensors_stores_it(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    tensors = _tensors()
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path), metadata={"fulcrum.quantization": "int8"})
    with WeightFile(path) as handle:
        assert set(handle.names()) == set(tensors)
        assert handle.metadata == {"fulcrum.quantization": "int8"}
        for key, want in tensors.items():
            got = handle.read(key)
            assert got.dtype == want.dtype and got.shape == want.shape, key
            assert torch.equal(got, want), key


def test_a_read_fills_the_given_tensor_in_place(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    tensors = _tensors()
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    target = torch.zeros(4, 6, dtype=torch.bfloat16)
    address = target.data_ptr()
    with WeightFile(path) as handle:
        handle.read_into("bf16", target)
        with pytest.raises(ValueError, match="read into"):
            handle.read_into("bf16", torch.zeros(4, 6))  # another dtype
        with pytest.raises(ValueError, match="non-contiguous"):
            handle.read_into("f32", torch.zeros(5, 3).t())
    assert target.data_ptr() == address and torch.equal(target, tensors["bf16"])


def test_a_truncated_file_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    save_file({"a": torch.ones(64), "b": torch.ones(64)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[:-8])
    with WeightFile(path) as handle, pytest.raises(ConfigError, match=r"truncated.*'b'"):
        for key in handle.names():
            handle.read(key)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "not a safetensors file"),
        ((5).to_bytes(8, "little") + b"[1,2]", "not a safetensors file"),
        ((4).to_bytes(8, "little") + b"{oops", "not a safetensors file"),
    ],
)
def test_a_file_that_is_not_safetensors_is_refused(
    tmp_path: Path, content: bytes, message: str
) -> None:
    path = tmp_path / "w.safetensors"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        WeightFile(path)


def test_an_entry_whose_bytes_do_not_match_its_shape_is_refused(tmp_path: Path) -> None:
    header = json.dumps({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}).encode()
    path = tmp_path / "w.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(12))
    with pytest.raises(ConfigError, match=r"'a' of shape \[4\] spans 12 bytes"):
        WeightFile(path)
