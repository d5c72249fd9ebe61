"""Weight-only quantized linear layers for the LLM engine and the safetensors files that hold
them: int8 here (per-output-channel symmetric, one float scale per row), int4 in `quant_int4`.
Attention and MLP projections are quantized, and the LM head (int8 by default, tied or not: a
tied embedding then reads its rows from the quantized head); norms, biases and an untied input
embedding stay float. A quantized file is whole (it replaces model.safetensors), stores tensors
under the engine's own module names and layout, and says so in its metadata (`QUANT_KEY`)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from fulcrum.errors import ConfigError
from fulcrum.llm.cpu_bf16 import cpu_has_bf16
from fulcrum.llm.quant_embedding import TiedQuantizedEmbedding
from fulcrum.llm.quant_int4 import DEFAULT_GROUP_SIZE, Int4Linear
from fulcrum.llm.quant_matmul import dequantized_linear

QUANT_KEY = "fulcrum.quantization"  # safetensors metadata: absent on float checkpoints
SOURCE_KEY = "fulcrum.quantized_from"
INT8 = "int8"
INT4 = "int4"
NONE = "none"
QUANTIZATIONS = (NONE, INT8, INT4)
LM_HEAD = "lm_head"
SCALE_SUFFIX = ".weight_scale"
INT4_SUFFIXES = (".qweight", ".scales", ".zeros")  # an int4 layer's tensors in a file
# Rows up to which the fused int8 kernel runs on a CPU computing in bf16 (None: every row
# count); above it a prefill dequantizes once. None: the kernel computes each row alone, so a
# row's result never depends on the rows beside it (see `quant_int4.FUSED_MAX_ROWS`: a
# prefix-cache hit must not change a greedy token). Its cost is in prefills: at 256 rows of a
# 1B layer it took 1.3-2.15x the dequantized matmul here (benchmarks/llm_quant_rows.py).
FUSED_MAX_ROWS: int | None = None
# The same where it computes in float32 (no native bf16): the kernel is slow there, so prefill
# steps keep the dequantized matmul, and rows are not batch-invariant.
FLOAT32_FUSED_MAX_ROWS = 32
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
        max_rows = FUSED_MAX_ROWS if compute == torch.bfloat16 else FLOAT32_FUSED_MAX_ROWS
        fused_rows = max_rows is None or x2.shape[0] <= max_rows
        if x2.device.type == "cpu" and fused_rows:
            # The fused kernel reads the int8 weights directly (no float copy).
            out = torch._weight_int8pack_mm(x2, self.weight, scale)  # (M, N)
        else:
            # Many rows (a prefill) or no fused kernel (GPU): a float copy of the weights costs
            # N*K once for all M rows, then the matmul runs at float speed. Between steps the
            # weights stay int8.
            def read(lo: int, hi: int) -> torch.Tensor:
                return self.weight[lo:hi].to(compute) * scale[lo:hi, None]  # (rows, K)

            out = dequantized_linear(x2, read, self.out_features)  # (M, N)
        out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*lead, self.out_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The dequantized weight rows `ids` (T,) -> (T, K) in the scales' dtype: what a tied
        input embedding looks up."""
        scale = self.weight_scale.index_select(0, ids)  # (T,)
        return self.weight.index_select(0, ids).to(scale.dtype) * scale[:, None]


def _cpu_compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if dtype == torch.float32 and cpu_has_bf16() else dtype


def quantizable_linears(module: nn.Module, *, include_lm_head: bool = False) -> list[str]:
    """Names of the linear layers to quantize: every projection inside the decoder layers, and
    the LM head (tied to the input embedding or not) when asked."""
    return [
        name
        for name, child in module.named_modules()
        if isinstance(child, nn.Linear) and (include_lm_head or name != LM_HEAD)
    ]


def quantize_model(
    module: nn.Module,
    precision: str,
    *,
    lm_head: str = INT8,
    group_size: int = DEFAULT_GROUP_SIZE,
    symmetric: bool = False,
) -> list[str]:
    """Quantize a float model in place: its projections to `precision`, its LM head to
    `lm_head` ("none": float); the names of the layers quantized."""
    for key, value in (("precision", precision), ("lm_head", lm_head)):
        if value not in QUANTIZATIONS or (key == "precision" and value == NONE):
            raise ConfigError(f"{key} {value!r}: expected one of {QUANTIZATIONS}")
    names = quantizable_linears(module)
    replace_linears(
        module,
        names,
        quantize=True,
        precision=precision,
        group_size=group_size,
        symmetric=symmetric,
    )
    if lm_head == NONE or not isinstance(getattr(module, LM_HEAD, None), nn.Linear):
        return names
    replace_linears(
        module,
        [LM_HEAD],
        quantize=True,
        precision=lm_head,
        group_size=group_size,
        symmetric=symmetric,
    )
    return [*names, LM_HEAD]


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
        new = _quantized_layer(linear, quantize, precision, group_size, symmetric)
        set_layer(module, name, new)
        _retie(module, linear.weight, new)


def _quantized_layer(
    linear: nn.Linear, quantize: bool, precision: str, group_size: int, symmetric: bool
) -> Int8Linear | Int4Linear:
    if precision == INT4 and quantize:
        return Int4Linear.from_linear(linear, group_size, symmetric=symmetric)
    has_bias = linear.bias is not None
    if precision == INT4:
        return Int4Linear(linear.in_features, linear.out_features, has_bias, group_size)
    if quantize:
        return Int8Linear.from_linear(linear)
    return Int8Linear(linear.in_features, linear.out_features, has_bias)


def _retie(module: nn.Module, weight: torch.Tensor, layer: Int8Linear | Int4Linear) -> None:
    """An input embedding that shared `weight` with the layer now replaced (a tied LM head)
    reads its rows from the quantized layer instead, and its float matrix is dropped."""
    tied = [
        name
        for name, child in module.named_modules()
        if isinstance(child, nn.Embedding) and child.weight is weight
    ]
    for name in tied:
        embedding = TiedQuantizedEmbedding(layer.rows, layer.out_features, layer.in_features)
        set_layer(module, name, embedding)


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
    """Empty quantized layers for every layer a quantized file holds, int8 or int4 whatever the
    file's precision (an int4 file's head may be int8), sized from the file (an int4 layer's
    group size is its padded width over its number of scales)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        keys = list(handle.keys())
        replace_linears(module, scaled_layers(keys), quantize=False)
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
    """ "int8" or "int4": the precision of the module's quantized projections (its head's
    when only the head is); "none" when it holds no quantized layer."""
    head = NONE
    for name, child in module.named_modules():
        found = _layer_quantization(child)
        if found != NONE and name != LM_HEAD:
            return found
        head = found if name == LM_HEAD else head
    return head


def tied_head(module: nn.Module) -> bool:
    """Whether the LM head is tied to the input embedding (shares its float weight, or is the
    quantized head the embedding reads its rows from)."""
    head = getattr(module, LM_HEAD, None)
    head_weight = head.weight if isinstance(head, nn.Linear) else None
    return any(
        isinstance(child, TiedQuantizedEmbedding)
        or (isinstance(child, nn.Embedding) and child.weight is head_weight)
        for child in module.modules()
    )


def head_quantization(module: nn.Module) -> str:
    """The LM head's precision: "int8", "int4" or "none" (float)."""
    return _layer_quantization(getattr(module, LM_HEAD, None))


def _layer_quantization(layer: object) -> str:
    if isinstance(layer, Int8Linear):
        return INT8
    return INT4 if isinstance(layer, Int4Linear) else NONE


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
