"""PyTorch variants: INT8 dynamic quantisation of a TorchScript model's Linear layers.

What works in torch 2.13: `torch.ao.quantization.quantize_dynamic` swaps `nn.Linear` children
of an `nn.Module`; handed a loaded ScriptModule it finds none (its children are
RecursiveScriptModules) and returns the model unchanged, silently. The TorchScript pass
`quantize_jit.quantize_dynamic_jit` does rewrite a ScriptModule's `aten::linear` calls into
`quantized::linear_dynamic` with prepacked int8 weights, and the result saves and loads as
TorchScript: that is what is used. Both are deprecated in 2.13 (torchao replaces them, and its
pt2e flow is what a `torch.export` `.pt2` program would need), so `.pt2` models and the other
precisions are reported as unsupported rather than attempted.
"""

from __future__ import annotations

import importlib
import warnings
from pathlib import Path
from typing import Any

from fulcrum.errors import ConfigError, ModelError
from fulcrum.extras import check_torch_version, require
from fulcrum.tuning.quantize import QuantizeJob, VariantFile, model_path
from fulcrum.tuning.quantize_batch import BatchQuantizer


class TorchQuantizer(BatchQuantizer):
    """INT8 dynamic (per-channel int8 weights, activations quantised per batch at run time)."""

    supported = ("int8",)
    default_model_file = "model.pt"

    def __init__(self) -> None:
        super().__init__()
        torch = require("torch", "torch", feature="fulcrum quantize (PyTorch models)")
        check_torch_version(torch.__version__, extra="torch", feature="fulcrum quantize")

    def write(self, job: QuantizeJob, precision: str) -> VariantFile:
        import torch

        source = model_path(job.config, job.version_dir, self.default_model_file)
        if source.suffix != ".pt":
            raise ConfigError(
                f"{source.name}: only TorchScript (.pt) models can be quantized; "
                "a torch.export program needs torchao's pt2e flow"
            )
        target = source.with_name(f"{source.name.split('.')[0]}.{precision}.pt")
        quantized, num_linear = quantize_script(source)
        if num_linear == 0:
            raise ModelError(f"{source.name}: no Linear layer to quantize")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.jit.save(quantized, str(target))
        relative = str(target.relative_to(job.version_dir))
        note = f"{num_linear} Linear layers int8 (quantize_dynamic_jit, per-channel weights)"
        return VariantFile(precision, {"model_file": relative}, (target,), (note,))


def quantize_script(source: Path) -> tuple[Any, int]:
    """The TorchScript model at `source` with its Linear layers dynamic-int8, and how many."""
    import torch

    with warnings.catch_warnings():
        # torch.jit and torch.ao.quantization warn of their deprecation on every call.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        module = torch.jit.load(str(source), map_location="cpu").eval()  # type: ignore[no-untyped-call]
        quantize_jit = importlib.import_module("torch.ao.quantization.quantize_jit")
        qconfig = importlib.import_module("torch.ao.quantization").per_channel_dynamic_qconfig
        try:
            quantized = quantize_jit.quantize_dynamic_jit(module, {"": qconfig})
        except Exception as exc:  # the JIT passes raise RuntimeError for graphs they cannot read
            raise ModelError(f"{source.name}: dynamic int8 quantisation failed: {exc}") from exc
    graph = str(quantized.graph) + "".join(str(m.graph) for m in _submodules(quantized))
    return quantized, graph.count("quantized::linear_dynamic")


def _submodules(module: Any) -> list[Any]:
    found = []
    for child in module.children():
        if hasattr(child, "graph"):
            found.append(child)
        found.extend(_submodules(child))
    return found
