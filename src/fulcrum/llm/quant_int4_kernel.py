"""Dequantizing int4 weights held in torch's fused-kernel layout to bfloat16 for a prefill, in one
pass: a numba kernel looks every nibble up in a per-group table of its 16 bf16 values. Torch's
elementwise ops took 190-245 ms for one 8192x2048 layer here (unpack, convert, subtract, scale:
five passes), more than the bf16 matmul they feed."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from fulcrum.llm.quant_int4_layout import kernel_layout_spec

_LEVELS = 16

Kernel = Callable[[Any, Any, Any, Any, Any, int, int], None]


def dequantize_kernel_layout(
    packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> torch.Tensor:
    """packed (N, K/2) uint8 in the fused kernel's layout, scales (N, G), zeros (N, G) ->
    (N, K) bfloat16 weights, (q - zero) * scale rounded once."""
    n, half_k = packed.shape
    levels = torch.arange(_LEVELS, dtype=torch.float32)
    values = (levels - zeros.float()[..., None]) * scales.float()[..., None]  # (N, G, 16)
    table = values.to(torch.bfloat16).view(torch.int16).contiguous()
    out = torch.empty(n, 2 * half_k, dtype=torch.int16)
    spec = kernel_layout_spec()
    if spec is None:
        raise RuntimeError("torch's fused int4 layout on this CPU is not one Fulcrum can read")
    blocks = packed.reshape(n // spec.block_rows, 2 * half_k, spec.block_rows // 2)  # (B, K, half)
    rows = (spec.low_rows.numpy(), spec.high_rows.numpy())
    args = (blocks.numpy(), *rows, table.numpy(), out.numpy())
    num_blocks = blocks.shape[0]
    workers = max(1, min(torch.get_num_threads(), num_blocks))
    kernel = _kernel()
    if workers == 1:
        kernel(*args, 0, num_blocks)
    else:
        bounds = [num_blocks * i // workers for i in range(workers + 1)]
        futures = [
            _pool(workers).submit(kernel, *args, lo, hi) for lo, hi in itertools.pairwise(bounds)
        ]
        for future in futures:
            future.result()
    return out.view(torch.bfloat16)


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(workers, thread_name_prefix="fulcrum-int4")


@functools.cache
def _kernel() -> Kernel:
    import numba

    jit = numba.njit(nogil=True, boundscheck=False, cache=True)
    compiled: Kernel = jit(_dequantize_blocks)
    return compiled


def _dequantize_blocks(
    blocks: Any, low_rows: Any, high_rows: Any, table: Any, out: Any, lo: int, hi: int
) -> None:
    """out[row, k] = table[row, k // g, nibble] for blocks b in [lo, hi): byte r of column k
    holds block row low_rows[r] in its low half and high_rows[r] in its high half
    (`quant_int4_layout.KernelLayout`)."""
    num_k, half = blocks.shape[1], blocks.shape[2]
    group = num_k // table.shape[1]
    for b in range(lo, hi):
        for r in range(half):
            low_row = b * 2 * half + low_rows[r]
            high_row = b * 2 * half + high_rows[r]
            for k in range(num_k):
                byte = blocks[b, k, r]
                g = k // group
                out[low_row, k] = table[low_row, g, byte & 15]
                out[high_row, k] = table[high_row, g, byte >> 4]
