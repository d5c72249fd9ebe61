"""Int4 weight-only linear layers: group-wise (32/64/128/256 input columns share one float scale
and one integer zero point), asymmetric or symmetric, packed two per byte. The canonical layout
(`pack_int4`) is what files hold; on a CPU with native bfloat16 every step runs torch's fused
`_weight_int4pack_mm_for_cpu` kernel on a copy repacked to its layout, built on first use."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from fulcrum.errors import ConfigError
from fulcrum.llm import cpu_bf16
from fulcrum.llm.quant_int4_layout import (
    PAD_ROWS,
    from_kernel_layout,
    kernel_layout_rows,
    kernel_layout_spec,
    to_kernel_layout,
)
from fulcrum.llm.quant_matmul import CHUNK_ROWS, dequantized_linear

GROUP_SIZES = (32, 64, 128, 256)  # what torch's fused CPU kernel accepts
DEFAULT_GROUP_SIZE = 128
# Rows up to which the fused kernel runs (None: every row count); above it one dequantized bf16
# copy serves all rows. None, so that a row's result never depends on the rows beside it: the
# kernel computes each row alone (the same bits at 1 row and at 96), while the two paths round
# differently, and a prefix-cache hit (a few rows) would flip greedy tokens of a full prefill
# (many rows). Measured on a 2-core Zen 4, 1B layers: fused is 4-8x float32
# at 1-8 rows; at 256 rows it took 1.1-1.25x the dequantized path (benchmarks/llm_quant_rows.py
# measures the whole model's prefill cost).
FUSED_MAX_ROWS: int | None = None
_QMAX = 15
_SYM_ZERO = 8  # symmetric: q - 8 in [-8, 7]


@dataclass(frozen=True)
class Int4Weight:
    """One layer's int4 weights in the canonical layout.

    qweight (N, Kp/2) uint8: column k of row n in byte k//2, the low nibble for even k;
    scales (N, Kp/g) float32; zeros (N, Kp/g) uint8 in [0, 15]; w = (q - zero) * scale.
    Kp is the input width rounded up to the group size (padded columns are zero)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor

    @property
    def group_size(self) -> int:
        return 2 * int(self.qweight.shape[1]) // int(self.scales.shape[1])


def check_group_size(group_size: int) -> None:
    """ConfigError unless the fused kernel (and so this layer) takes `group_size`."""
    if group_size not in GROUP_SIZES:
        raise ConfigError(f"int4 group size {group_size}: expected one of {GROUP_SIZES}")


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(N, K) integers in [0, 15], K even -> (N, K/2) uint8, even columns in the low nibble."""
    q8 = q.to(torch.uint8)
    return q8[:, 0::2] | (q8[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """(N, K/2) uint8 -> (N, K) uint8 in [0, 15] (the inverse of `pack_int4`)."""
    low, high = packed & 0xF, packed >> 4
    return torch.stack((low, high), dim=-1).reshape(packed.shape[0], -1)


def quantize_int4(
    weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE, *, symmetric: bool = False
) -> Int4Weight:
    """weight (N, K) float -> int4 groups of `group_size` input columns (round to nearest)."""
    check_group_size(group_size)
    w = _pad_columns(weight.detach().float(), group_size)  # (N, Kp)
    n, kp = w.shape
    groups = w.reshape(n, kp // group_size, group_size)  # (N, G, g)
    if symmetric:
        scale = groups.abs().amax(dim=-1) / (_QMAX // 2)  # (N, G): q - 8 in [-7, 7]
        zero = torch.full_like(scale, _SYM_ZERO)
    else:
        low = groups.amin(dim=-1).clamp(max=0)  # the range holds 0, so padding is exact
        high = groups.amax(dim=-1).clamp(min=0)
        scale = (high - low) / _QMAX
        zero = torch.round(-low / torch.where(scale > 0, scale, 1.0)).clamp(0, _QMAX)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group stays 0
    q = torch.round(groups / scale[..., None]) + zero[..., None]
    q = q.clamp(0, _QMAX).reshape(n, kp)
    return Int4Weight(pack_int4(q), scale, zero.to(torch.uint8))


def dequantize_int4(weight: Int4Weight, in_features: int | None = None) -> torch.Tensor:
    """The float32 (N, K) weights an `Int4Weight` stands for (padding cut at `in_features`)."""
    q = unpack_int4(weight.qweight)
    return _dequantize(q, weight.scales, weight.zeros, torch.float32)[:, :in_features]


def _dequantize(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    n, kp = q.shape
    num_groups = scales.shape[1]
    groups = q.reshape(n, num_groups, kp // num_groups).to(dtype)  # (N, G, g)
    centred = groups - zeros.to(dtype)[..., None]
    return (centred * scales.to(dtype)[..., None]).reshape(n, kp)


def _pad_columns(w: torch.Tensor, group_size: int) -> torch.Tensor:
    pad = -w.shape[1] % group_size
    return F.pad(w, (0, pad)) if pad else w


def kernel_layout(qweight: torch.Tensor) -> torch.Tensor:
    """Canonical packed (N, Kp/2) -> the fused kernel's layout, `CHUNK_ROWS` rows at a time:
    64-row blocks convert independently, and the kernel's converter wants int32 input (4 bytes
    a weight, 1 GB at once for a 128k-row head)."""
    n = qweight.shape[0]
    if n % PAD_ROWS:
        return to_kernel_layout(unpack_int4(qweight))
    parts = [
        to_kernel_layout(unpack_int4(qweight[lo : lo + CHUNK_ROWS]))
        for lo in range(0, n, CHUNK_ROWS)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class Int4Linear(nn.Module):
    """`nn.Linear` with group-wise int4 weights (`Int4Weight`'s buffers, same names)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group_size: int) -> None:
        super().__init__()
        check_group_size(group_size)
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size
        padded = in_features + (-in_features % group_size)
        self.qweight: torch.Tensor
        self.scales: torch.Tensor
        self.zeros: torch.Tensor
        self.register_buffer("qweight", torch.zeros(out_features, padded // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.ones(out_features, padded // group_size))
        self.register_buffer(
            "zeros", torch.zeros(out_features, padded // group_size, dtype=torch.uint8)
        )
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        # The fused kernel's copy: (packed weights, (G, N, 2) bf16 scales and zeros). Once it
        # exists, `qweight` holds the kernel's layout (not the canonical one) so that the
        # weights sit in memory once; `weights()` gives the canonical layout back.
        self._kernel: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, group_size: int = DEFAULT_GROUP_SIZE, *, symmetric: bool = False
    ) -> Int4Linear:
        """The quantized twin of a float layer (same device)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group_size)
        layer.load(quantize_int4(linear.weight, group_size, symmetric=symmetric))
        if linear.bias is not None and layer.bias is not None:
            layer.bias.data = linear.bias.detach().float().clone()
        return layer.to(linear.weight.device)

    def load(self, weight: Int4Weight) -> None:
        """Fill the layer from canonical int4 weights (ConfigError on a shape mismatch)."""
        for name, tensor in (("qweight", weight.qweight), ("scales", weight.scales)):
            own: torch.Tensor = getattr(self, name)
            if own.shape != tensor.shape:
                raise ConfigError(
                    f"int4 {name} of shape {list(tensor.shape)}, expected {list(own.shape)}"
                )
        self.qweight = weight.qweight.to(torch.uint8).contiguous()
        self.scales = weight.scales.float().contiguous()
        self.zeros = weight.zeros.to(torch.uint8).contiguous()
        self._kernel = None

    def weights(self) -> Int4Weight:
        """This layer's weights in the canonical layout (as files hold them)."""
        if self._kernel is None:
            return Int4Weight(self.qweight, self.scales, self.zeros)
        q = from_kernel_layout(self.qweight)[: self.out_features]  # padding rows cut
        return Int4Weight(pack_int4(q), self.scales, self.zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        padded = 2 * self.qweight.shape[1]
        if padded != self.in_features:  # zero columns meet zero weights
            x2 = F.pad(x2, (0, padded - self.in_features))
        if _within(x2.shape[0], FUSED_MAX_ROWS) and self._fusable(x2):
            packed, scales_zeros = self._kernel_weights()
            # bf16 activations, as for int8: the kernel's float32 path is 4x slower than a
            # float32 matmul here, its bf16 path 8x faster.
            out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2.to(torch.bfloat16).contiguous(), packed, self.group_size, scales_zeros
            )[:, : self.out_features]  # (M, N)
        else:
            compute = _compute_dtype(x2)

            def read(lo: int, hi: int) -> torch.Tensor:
                return self._dequantized(compute, lo, hi)  # (rows, Kp)

            out = dequantized_linear(x2.to(compute), read, self.out_features)  # (M, N)
        out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias.to(x.dtype)
        return out.reshape(*lead, self.out_features)

    def _fusable(self, x2: torch.Tensor) -> bool:
        return (
            x2.device.type == "cpu"
            and x2.dtype in (torch.float32, torch.bfloat16)
            and cpu_bf16.cpu_has_bf16()
            and kernel_layout_spec() is not None
        )

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The dequantized weight rows `ids` (T,) -> (T, K) in the scales' dtype, from either
        layout: what a tied input embedding looks up."""
        if self._kernel is None:
            q = unpack_int4(self.qweight.index_select(0, ids))  # (T, Kp)
        else:
            q = kernel_layout_rows(self.qweight, ids)
        scales, zeros = self.scales.index_select(0, ids), self.zeros.index_select(0, ids)
        return _dequantize(q, scales, zeros, scales.dtype)[:, : self.in_features]

    def _kernel_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._kernel is None:
            # The kernel takes whole 64-row blocks: a layer of another width gets zero rows,
            # cut from its output, rather than another path (whose rounding differs).
            pad = -self.out_features % PAD_ROWS
            qweight, scales = _pad_rows(self.qweight, pad), _pad_rows(self.scales.float(), pad)
            # The kernel computes (q - 8) * scale + zero_f: zero_f moves our integer zero.
            zero_f = (_SYM_ZERO - _pad_rows(self.zeros, pad).float()) * scales  # (Np, G)
            scales_zeros = torch.stack((scales.t(), zero_f.t()), dim=-1)  # (G, Np, 2)
            packed = kernel_layout(qweight)
            self._kernel = (packed, scales_zeros.to(torch.bfloat16).contiguous())
            self.qweight = packed  # the canonical copy is dropped: see `_kernel`
        return self._kernel

    def _dequantized(self, dtype: torch.dtype, lo: int, hi: int) -> torch.Tensor:
        """Output rows [lo, hi) as float (rows, Kp); in the kernel's layout lo is a multiple of
        its 64-row blocks (`CHUNK_ROWS` is) and whole blocks are read, padding cut."""
        scales, zeros = self.scales[lo:hi], self.zeros[lo:hi]
        if self._kernel is None:
            return _dequantize(unpack_int4(self.qweight[lo:hi]), scales, zeros, dtype)
        pad = -(hi - lo) % PAD_ROWS
        packed = self.qweight[lo : hi + pad]
        scales, zeros = _pad_rows(scales, pad), _pad_rows(zeros, pad)
        if dtype == torch.bfloat16 and packed.is_cpu:
            from fulcrum.llm.quant_int4_kernel import dequantize_kernel_layout

            return dequantize_kernel_layout(packed, scales, zeros)[: hi - lo]
        return _dequantize(from_kernel_layout(packed), scales, zeros, dtype)[: hi - lo]


def _pad_rows(t: torch.Tensor, num_rows: int) -> torch.Tensor:
    """`t` with `num_rows` more rows of ones (scales) or zeros (weights, zero points)."""
    if not num_rows:
        return t
    fill = torch.ones if t.is_floating_point() else torch.zeros
    return torch.cat((t, fill(num_rows, *t.shape[1:], dtype=t.dtype, device=t.device)))


def _within(num_rows: int, max_rows: int | None) -> bool:
    return max_rows is None or num_rows <= max_rows


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return cpu_bf16.cpu_compute_dtype(x.dtype) if x.device.type == "cpu" else x.dtype
