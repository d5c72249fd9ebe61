"""The byte layout of torch's fused CPU int4 kernel, as this machine's torch packs it.

`torch.ops.aten._convert_weight_to_int4pack_for_cpu` packs output rows in blocks whose size and
order follow the vector width torch dispatches to: on AVX-512, blocks of 64 rows with rows r and
r + 32 sharing a byte; on AVX2 (and without vectors), blocks of 32 with rows 2j and 2j + 1
sharing one. Reading the packed weights back (a prefill's dequantized copy, a tied embedding's
rows, the canonical layout for saving) must follow the same layout, so it is probed once from
torch itself rather than assumed: four small conversions whose nibbles spell out each byte's row
and column. A layout that does not fit the block model below is reported as None, and the layers
then keep to their dequantized path, which is exact on every CPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# Blocks this module can describe divide this many rows; layers pad their rows to a multiple.
PAD_ROWS = 64
_PROBE_COLS = 32  # the smallest group size: a width every converter takes


@dataclass(frozen=True)
class KernelLayout:
    """Blocks of `block_rows` output rows, each stored as (K, block_rows / 2) bytes: byte j of a
    column holds row `low_rows[j]` of the block in its low nibble, `high_rows[j]` in its high."""

    block_rows: int
    low_rows: torch.Tensor  # (block_rows / 2,) int64
    high_rows: torch.Tensor  # (block_rows / 2,) int64
    byte_of_row: torch.Tensor  # (block_rows,) int64: the byte (within a column) of each row
    shift_of_row: torch.Tensor  # (block_rows,) uint8: 0 for a low nibble, 4 for a high one


def to_kernel_layout(q: torch.Tensor) -> torch.Tensor:
    """(N, K) in [0, 15] -> the fused CPU kernel's packed (N, K/2) uint8."""
    packed: torch.Tensor = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        q.to(torch.int32).contiguous(), 1
    )
    return packed


@functools.cache
def kernel_layout_spec() -> KernelLayout | None:
    """This machine's layout, probed from torch once (None: not one this module can read)."""
    rows = 2 * PAD_ROWS
    n = torch.arange(rows)[:, None].expand(rows, _PROBE_COLS)
    k = torch.arange(_PROBE_COLS)[None, :].expand(rows, _PROBE_COLS)
    try:
        digits = [to_kernel_layout(v).reshape(-1) for v in (n % 16, n // 16, k % 16, k // 16)]
    except RuntimeError:  # no fused int4 kernel in this build of torch
        return None
    low = [(d & 0xF).long() for d in digits]
    high = [(d >> 4).long() for d in digits]
    row_low, row_high = low[0] + 16 * low[1], high[0] + 16 * high[1]
    col_low, col_high = low[2] + 16 * low[3], high[2] + 16 * high[3]
    later = (col_low != 0).nonzero()
    if not len(later):
        return None
    half = int(later[0])  # the first block's first column: half a block of bytes
    block = 2 * half
    if block == 0 or PAD_ROWS % block:
        return None
    low_rows, high_rows = row_low[:half].clone(), row_high[:half].clone()
    order = torch.cat((low_rows, high_rows))
    if not torch.equal(order.sort().values, torch.arange(block)):
        return None
    # Every byte of the probe must be where the block model puts it.
    pos = torch.arange(rows * _PROBE_COLS // 2)
    base, within = (pos // (_PROBE_COLS * half)) * block, pos % (_PROBE_COLS * half)
    col, j = within // half, within % half
    if not (
        torch.equal(row_low, base + low_rows[j])
        and torch.equal(row_high, base + high_rows[j])
        and torch.equal(col_low, col)
        and torch.equal(col_high, col)
    ):
        return None
    byte_of_row = torch.empty(block, dtype=torch.int64)
    byte_of_row[low_rows] = torch.arange(half)
    byte_of_row[high_rows] = torch.arange(half)
    shift_of_row = torch.zeros(block, dtype=torch.uint8)
    shift_of_row[high_rows] = 4
    return KernelLayout(block, low_rows, high_rows, byte_of_row, shift_of_row)


def _spec() -> KernelLayout:
    spec = kernel_layout_spec()
    if spec is None:
        raise RuntimeError("torch's fused int4 layout on this CPU is not one Fulcrum can read")
    return spec


def from_kernel_layout(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `to_kernel_layout` for N a multiple of `PAD_ROWS`: (N, K) uint8."""
    spec = _spec()
    n, half_k = packed.shape
    half = spec.block_rows // 2
    blocks = packed.reshape(n // spec.block_rows, 2 * half_k, half)  # (B, K, half)
    out = torch.empty(n // spec.block_rows, spec.block_rows, 2 * half_k, dtype=torch.uint8)
    out[:, spec.low_rows] = (blocks & 0xF).transpose(1, 2)
    out[:, spec.high_rows] = (blocks >> 4).transpose(1, 2)
    return out.reshape(n, 2 * half_k)


def kernel_layout_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (T,) of weights in the fused kernel's layout -> (T, K) uint8 in [0, 15]
    (the layout of `from_kernel_layout`, read for a few rows only)."""
    spec = _spec()
    n, half_k = packed.shape
    blocks = packed.reshape(n // spec.block_rows, 2 * half_k, spec.block_rows // 2)
    within = ids % spec.block_rows  # (T,)
    picked = blocks[ids // spec.block_rows, :, spec.byte_of_row[within]]  # (T, K)
    return (picked >> spec.shift_of_row[within][:, None]) & 0xF
