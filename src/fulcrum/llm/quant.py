"""Weight-only quantized linear layers for the LLM engine and the safetensors files that hold
them: int8 here (per-output-channel symmetric, one float scale per row), int4 in `quant_int4`.
Attention and MLP projections are quantized; embeddings, norms and biases stay float. A quantized
file is whole (it replaces model.safetensors), stores tensors under the engine's own module names
and layout, and says so in its metadata (`QUANT_KEY`)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from fulcrum.errors import ConfigError
from fulcrum.llm.cpu_bf16 import cpu_has_bf16
from fulcrum.llm.quant_int4 import DEFAULT_GROUP_SIZE, Int4Linear

QUANT_KEY = "fulcrum.quantization"  # safetensors metadata: absent on float checkpoints
SOURCE_KEY = "fulcrum.quantized_from"
INT8 = "int8"
INT4 = "int4"
NONE = "none"
QUANTIZATIONS = (NONE, INT8, INT4)
SCALE_SUFFIX = ".weight_scale"
INT4_SUFFIXES = (".qweight", ".scales", ".zeros")  # an int4 layer's tensors in a file
# Rows up to which the fused int8 kernel runs (decode steps); above it a prefill dequantizes once.
FUSED_MAX_ROWS = 32
_QMAX = 127  # symmetric: -128 is never used, so negating a weight never overflows


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (N, K) float -> int8 (N, K) and float32 scales (N,), one per output channel."""
    w32 = weight.detach().float()
    scale = w32.abs().amax(dim=1) / _QMAX  # (N,)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
    q = torch.round(w32 / scale[:, None]).clamp_(-_QMAX, _QMAX).to(torch.int8)
    return q, scale


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 (N, K) and scales (N,) -> float32 (N, K)."""
    return q.float() * scale.float()[:, None]


class Int8Linear(nn.Module):
    """`nn.Linear` with int8 weights: `y = (x @ q.T) * scale + bias`."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight: torch.Tensor
        self.weight_scale: torch.Tensor
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones(out_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """The quantized twin of a float layer (same device; scales in float32)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None)
        q, scale = quantize_weight(linear.weight)
        layer.weight = q
        layer.weight_scale = scale
        if linear.bias is not None and layer.bias is not None:
            layer.bias.data = linear.bias.detach().clone()
        return layer.to(linear.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        # torch's fused int8 kernel is fast in bfloat16 and slow in float32 (10x a float32
        # matmul in a decode step here): where the CPU has native bf16, float32 inputs are
        # computed in bf16, a rounding of the same order as the int8 weights' own (`fulcrum
        # quantize` measures the result).
        compute = _cpu_compute_dtype(x.dtype) if x2.device.type == "cpu" else x.dtype
        x2 = x2.to(compute).contiguous()  # the kernel wants 2-D, row-contiguous input
        scale = self.weight_scale.to(compute)
        if x2.device.type == "cpu" and x2.shape[0] <= FUSED_MAX_ROWS:
            # Decode steps: the fused kernel reads the int8 weights directly (no float copy).
            out = torch._weight_int8pack_mm(x2, self.weight, scale)  # (M, N)
        else:
            # Many rows (a prefill) or no fused kernel (GPU): a float copy of the weights costs
            # N*K once for all M rows, then the matmul runs at float speed. Between steps the
            # weights stay int8.
            out = F.linear(x2, self.weight.to(compute) * scale[:, None])  # (M, N)
        out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*lead, self.out_features)


def _cpu_compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if dtype == torch.float32 and cpu_has_bf16() else dtype


def quantizable_linears(module: nn.Module, *, include_lm_head: bool = False) -> list[str]:
    """Names of the linear layers to quantize: every projection inside the decoder layers, and
    the LM head when asked and not tied to the (float) embedding."""
    embeddings = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    names = []
    for name, child in module.named_modules():
        if not isinstance(child, nn.Linear):
            continue
        if name == "lm_head" and (not include_lm_head or id(child.weight) in embeddings):
            continue
        names.append(name)
    return names


def replace_linears(
    module: nn.Module,
    names: list[str],
    *,
    quantize: bool,
    precision: str = INT8,
    group_size: int = DEFAULT_GROUP_SIZE,
    symmetric: bool = False,
) -> None:
    """Swap the named `nn.Linear`s for `Int8Linear`s or `Int4Linear`s (`group_size` input
    columns a group, `symmetric` or not): quantized from their weights, or empty shells that a
    quantized checkpoint then fills."""
    for name in names:
        linear = linear_layer(module, name)
        if precision == INT4 and quantize:
            new: nn.Module = Int4Linear.from_linear(linear, group_size, symmetric=symmetric)
        elif precision == INT4:
            has_bias = linear.bias is not None
            new = Int4Linear(linear.in_features, linear.out_features, has_bias, group_size)
        elif quantize:
            new = Int8Linear.from_linear(linear)
        else:
            new = Int8Linear(linear.in_features, linear.out_features, linear.bias is not None)
        set_layer(module, name, new)


def linear_layer(module: nn.Module, name: str) -> nn.Linear:
    """The float linear layer `name`; ConfigError when there is none."""
    parent_name, _, attr = name.rpartition(".")
    parent = module.get_submodule(parent_name) if parent_name else module
    linear = getattr(parent, attr, None)
    if not isinstance(linear, nn.Linear):
        raise ConfigError(f"quantized weights name {name!r}, which is not a linear layer")
    return linear


def set_layer(module: nn.Module, name: str, layer: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(module.get_submodule(parent_name) if parent_name else module, attr, layer)


def install_shells(module: nn.Module, path: Path) -> None:
    """Empty quantized layers for every layer a quantized file holds, sized from the file (an
    int4 layer's group size is its padded width over its number of scales)."""
    from safetensors import safe_open

    precision = file_quantization(path)
    with safe_open(str(path), framework="pt") as handle:
        keys = list(handle.keys())
        if precision == INT8:
            replace_linears(module, scaled_layers(keys), quantize=False)
            return
        for name in [k.removesuffix(".scales") for k in keys if k.endswith(".scales")]:
            num_groups = handle.get_slice(f"{name}.scales").get_shape()[1]
            padded = 2 * handle.get_slice(f"{name}.qweight").get_shape()[1]
            group_size = padded // max(1, num_groups)
            replace_linears(module, [name], quantize=False, precision=INT4, group_size=group_size)


def loadable_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint fills, by name: parameters (a tied one once) and quantized layers'
    buffers (an int4 layer's in the canonical layout)."""
    tensors: dict[str, torch.Tensor] = dict(module.named_parameters())
    for name, child in module.named_modules():
        if isinstance(child, Int8Linear):
            tensors[f"{name}.weight"] = child.weight
            tensors[f"{name}{SCALE_SUFFIX}"] = child.weight_scale
        elif isinstance(child, Int4Linear):
            weights = child.weights()
            tensors[f"{name}.qweight"] = weights.qweight
            tensors[f"{name}.scales"] = weights.scales
            tensors[f"{name}.zeros"] = weights.zeros
    return tensors


def module_quantization(module: nn.Module) -> str:
    """ "int8" or "int4" when the module holds such layers, else "none"."""
    for child in module.modules():
        if isinstance(child, Int8Linear):
            return INT8
        if isinstance(child, Int4Linear):
            return INT4
    return NONE


def save_quantized(module: nn.Module, path: Path, *, source: str) -> None:
    """Write a quantized model's tensors to `path` (atomic), its precision in the metadata."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().contiguous().cpu() for k, v in loadable_tensors(module).items()}
    partial = path.with_name(f".{path.name}.partial")
    metadata = {"format": "pt", QUANT_KEY: module_quantization(module), SOURCE_KEY: source}
    save_file(tensors, str(partial), metadata=metadata)
    partial.replace(path)


def file_quantization(path: Path) -> str:
    """What a safetensors file holds: "none" (float), "int8" or "int4"; ConfigError for another
    mark."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    found = str(metadata.get(QUANT_KEY, NONE))
    if found not in QUANTIZATIONS:
        raise ConfigError(f"{path}: metadata {QUANT_KEY} = {found!r}: expected {QUANTIZATIONS}")
    return found


def scaled_layers(keys: list[str]) -> list[str]:
    """The layer names of a quantized file: those with a `<name>.weight_scale` tensor."""
    return [k.removesuffix(SCALE_SUFFIX) for k in keys if k.endswith(SCALE_SUFFIX)]
