"""AWQ and GPTQ int4 checkpoints (config.json `quantization_config`, safetensors written by
AutoAWQ / AutoGPTQ / GPTQModel / optimum): their packed int32 qweight / qzeros and float16 scales
are unpacked into `quant_int4`'s canonical layout at load. Layouts, from the formats' packers:

- AWQ "gemm": qweight (K, N/8) and qzeros (K/g, N/8) int32, eight output columns a word in the
  order 0 2 4 6 1 3 5 7 (column `AWQ_ORDER[i]` at bits 4i); scales (K/g, N).
- GPTQ: qweight (K/8, N) int32, eight input rows a word in order (row 8w + i at bits 4i);
  qzeros (K/g, N/8) int32 packed along N in order, holding zero - 1 ("gptq" checkpoints; the
  "gptq_v2" format holds the zero itself); scales (K/g, N); g_idx (K,) the group of each row."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fulcrum.errors import ConfigError
from fulcrum.llm import quant
from fulcrum.llm.quant_int4 import Int4Linear, Int4Weight, check_group_size, pack_int4

if TYPE_CHECKING:
    from fulcrum.llm.models import CausalLM

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # the eight nibbles of an int32 word
PACKED_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")


@dataclass(frozen=True)
class ExternalFormat:
    """A checkpoint's `quantization_config`, validated: "awq" or "gptq", 4 bits."""

    method: str
    group_size: int
    zero_offset: int  # added to a stored zero point: 1 for GPTQ v1 checkpoints, else 0


def external_format(raw_config: dict[str, Any]) -> ExternalFormat | None:
    """The checkpoint's quantization, or None for float weights; ConfigError, naming the key,
    for a quantization this engine cannot serve exactly."""
    qc = raw_config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ConfigError("config.json key 'quantization_config': expected an object")
    method = qc.get("quant_method")
    if method not in ("awq", "gptq"):
        raise ConfigError(
            f"config.json key 'quantization_config.quant_method' = {method!r}: "
            "the engine reads 'awq' and 'gptq' int4 checkpoints"
        )
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ConfigError(f"config.json key 'quantization_config.bits' = {bits!r}: expected 4")
    group_size = qc.get("group_size", qc.get("q_group_size"))
    if not isinstance(group_size, int) or group_size <= 0:
        raise ConfigError(
            f"config.json key 'quantization_config.group_size' = {group_size!r}: expected one "
            "of 32, 64, 128, 256 (per-channel -1 is not served)"
        )
    check_group_size(group_size)
    if method == "awq":
        _check_awq(qc)
        return ExternalFormat("awq", group_size, 0)
    _check_gptq(qc)
    v2 = qc.get("checkpoint_format", "gptq") == "gptq_v2"
    return ExternalFormat("gptq", group_size, 0 if v2 else 1)


def _check_awq(qc: dict[str, Any]) -> None:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ConfigError(
            f"config.json key 'quantization_config.version' = {version!r}: only AWQ 'gemm' "
            "packing is read"
        )
    if qc.get("zero_point", True) is not True:
        raise ConfigError("config.json key 'quantization_config.zero_point' = false: unsupported")


def _check_gptq(qc: dict[str, Any]) -> None:
    if qc.get("desc_act", False):
        raise ConfigError(
            "config.json key 'quantization_config.desc_act' = true: act-order GPTQ (rows "
            "permuted by g_idx) is not served; use a desc_act=false checkpoint"
        )
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ConfigError(
            f"config.json key 'quantization_config.checkpoint_format' = {fmt!r}: "
            "expected 'gptq' or 'gptq_v2'"
        )


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 (R, C) -> (R, 8C) nibbles in [0, 15], word c's nibble i at column 8c + i."""
    nibbles = (packed.to(torch.int32)[:, :, None] >> _SHIFTS) & 0xF  # (R, C, 8)
    return nibbles.reshape(packed.shape[0], -1)


def _awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """AWQ-packed int32 (R, N/8) -> (R, N) values in column order."""
    nibbles = unpack_rows(packed)  # (R, N): column 8c + i holds column 8c + AWQ_ORDER[i]
    inverse = torch.tensor([AWQ_ORDER.index(c) for c in range(8)])
    index = (torch.arange(nibbles.shape[1]).reshape(-1, 8)[:, inverse]).reshape(-1)
    return nibbles[:, index]


def convert_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> Int4Weight:
    """An AWQ GEMM layer's tensors -> canonical int4 weights (N, K)."""
    q = _awq_columns(qweight).t()  # (N, K)
    zeros = _awq_columns(qzeros).t()  # (N, K/g)
    return _canonical(q, zeros, scales.t())


def convert_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    fmt: ExternalFormat,
) -> Int4Weight:
    """A GPTQ layer's tensors -> canonical int4 weights (N, K); ConfigError when g_idx is not
    the contiguous grouping (an act-order checkpoint not marked desc_act)."""
    q = unpack_rows(qweight.t().contiguous()).contiguous()  # (N, K): rows packed along K
    num_in = q.shape[1]
    if g_idx is not None:
        contiguous = torch.arange(num_in, dtype=torch.int64) // fmt.group_size
        if not torch.equal(g_idx.to(torch.int64), contiguous):
            raise ConfigError(
                "GPTQ g_idx is not contiguous groups of 'quantization_config.group_size' rows "
                "(act-order / desc_act=true weights are not served)"
            )
    zeros = (unpack_rows(qzeros) + fmt.zero_offset) & 0xF  # (K/g, N); v1's zero 0 is stored -1
    return _canonical(q, zeros.t(), scales.t())


def _canonical(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> Int4Weight:
    num_out, num_in = q.shape
    if scales.shape[0] != num_out or zeros.shape != scales.shape:
        raise ConfigError(
            f"int4 layer of {num_out}x{num_in} weights with scales {list(scales.shape)} "
            f"and zeros {list(zeros.shape)}: inconsistent packing"
        )
    return Int4Weight(
        pack_int4(q.contiguous()),
        scales.float().contiguous(),
        zeros.to(torch.uint8).contiguous(),
    )


def convert_layer(tensors: dict[str, torch.Tensor], fmt: ExternalFormat) -> Int4Weight:
    """One layer's packed tensors by suffix ("qweight", "qzeros", "scales", "g_idx")."""
    missing = [s for s in ("qweight", "qzeros", "scales") if s not in tensors]
    if missing:
        raise ConfigError(f"{fmt.method} layer without its {missing} tensors")
    if fmt.method == "awq":
        return convert_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"])
    return convert_gptq(
        tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors.get("g_idx"), fmt
    )


def load_external(
    module: torch.nn.Module,
    model: CausalLM,
    files: list[Path],
    fmt: ExternalFormat,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Fill `module` (built on the meta device) from an AWQ/GPTQ checkpoint: each packed layer
    becomes an `Int4Linear`, converted as soon as its tensors are read; every other tensor is
    read into its parameter as from a float checkpoint; ConfigError when one is missing."""
    from fulcrum.llm.loader import _IGNORED_SUFFIXES, fill, materialize
    from fulcrum.llm.weight_file import WeightFile

    loaded: set[str] = set()
    for file in files:  # packed layers first: no float shell of theirs is ever allocated
        with WeightFile(file) as handle:
            layers: dict[str, list[str]] = {}
            for key in handle.names():
                if key.endswith(PACKED_SUFFIXES):
                    layers.setdefault(key.rpartition(".")[0], []).append(key)
            for layer, keys in layers.items():
                tensors = {key.rpartition(".")[2]: handle.read(key) for key in keys}
                loaded |= _install_int4(module, model, layer, tensors, fmt)
    materialize(module, dtype)
    params = quant.loadable_tensors(module)
    with torch.no_grad():
        for file in files:
            with WeightFile(file) as handle:
                for key in handle.names():
                    if key.endswith(PACKED_SUFFIXES) or key.endswith(_IGNORED_SUFFIXES):
                        continue
                    name = model.checkpoint_name(key)
                    if name not in params:
                        raise ConfigError(f"{file}: unexpected weight {key!r}")
                    transposed = name.endswith(model.transposed_weights)
                    fill(
                        params[name],
                        handle,
                        key,
                        transposed=transposed and name != "lm_head.weight",
                    )
                    loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ConfigError(f"{files[0].parent}: weights missing from the checkpoint: {missing[:5]}")


def _install_int4(
    module: torch.nn.Module,
    model: CausalLM,
    layer: str,
    tensors: dict[str, torch.Tensor],
    fmt: ExternalFormat,
) -> set[str]:
    """Swap one packed layer's float shell for a filled `Int4Linear`; the names it filled."""
    name = model.checkpoint_name(f"{layer}.weight").removesuffix(".weight")
    linear = quant.linear_layer(module, name)
    shell = Int4Linear(
        linear.in_features, linear.out_features, linear.bias is not None, fmt.group_size
    )
    try:
        shell.load(convert_layer(tensors, fmt))
    except ConfigError as exc:
        raise ConfigError(f"{fmt.method} layer {layer!r}: {exc.message}") from exc
    quant.set_layer(module, name, shell)
    return {f"{name}{suffix}" for suffix in quant.INT4_SUFFIXES}
