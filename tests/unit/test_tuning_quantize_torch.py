"""`fulcrum quantize` on a tiny TorchScript model built here: INT8 dynamic Linear layers."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

from fulcrum.config import load_model_config
from fulcrum.tuning.quantize import QuantizeOptions, quantize_model
from fulcrum.tuning.quantize_torch import quantize_script

torch = pytest.importorskip("torch")

CONFIG = """\
# a tiny torch classifier
platform = "torch"
max_batch_size = 8

[[inputs]]
name = "x"
datatype = "FP32"
shape = [16]

[[outputs]]
name = "logits"
datatype = "FP32"
shape = [4]
"""


class _Tiny(torch.nn.Module):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))  # (B, 4)


def _save(path: Path) -> None:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit is deprecated in 2.13
        torch.jit.save(torch.jit.script(_Tiny().eval()), str(path))


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    version = tmp_path / "repo" / "tiny" / "1"
    version.mkdir(parents=True)
    _save(version / "model.pt")
    (version.parent / "config.toml").write_text(CONFIG)
    return tmp_path / "repo"


def _load(path: Path) -> torch.jit.ScriptModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.load(str(path))


def test_linear_layers_become_dynamic_int8(tmp_path: Path) -> None:
    _save(tmp_path / "m.pt")
    quantized, num_linear = quantize_script(tmp_path / "m.pt")
    assert num_linear == 2
    assert "quantized::linear_dynamic" in str(quantized.graph)


def test_int8_variant_is_written_measured_and_recorded(repo: Path) -> None:
    options = QuantizeOptions(precisions=("int8", "fp16"), measure=False, num_rows=16)
    report = quantize_model(repo, "tiny", options)
    version = repo / "tiny" / "1"
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32))
    with torch.inference_mode():
        reference = _load(version / "model.pt")(x).numpy()
        variant = _load(version / "model.int8.pt")(x).numpy()
    assert np.max(np.abs(variant - reference)) < 0.1 * np.max(np.abs(reference))
    int8, fp16 = report.rows[1:]
    assert int8.fidelity_metric == "top1" and int8.fidelity is not None
    assert int8.fidelity >= 0.9
    assert fp16.verdict == "unsupported on platform 'torch'"
    config = load_model_config(repo / "tiny" / "config.toml", dir_name="tiny")
    assert config.variants["int8"].parameters == {"model_file": "model.int8.pt"}
    assert config.variants["fp32"].parameters == {"model_file": "model.pt"}
    assert "fp16" not in config.variants  # nothing written, nothing declared


def test_eager_quantize_dynamic_leaves_a_script_module_unchanged(tmp_path: Path) -> None:
    """Why the TorchScript pass is used: torch.ao's eager quantize_dynamic finds no nn.Linear in
    a loaded ScriptModule and silently returns it as it was (torch 2.13)."""
    _save(tmp_path / "m.pt")
    module = _load(tmp_path / "m.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        same = torch.ao.quantization.quantize_dynamic(module, {torch.nn.Linear}, torch.qint8)
    assert "quantized::" not in str(same.graph)
