"""A matmul against quantized weights dequantized a slice of output rows at a time (the path of
steps with many rows, a prefill): each float slice is used while it sits in cache and freed,
so the float copy of a large layer (an LM head: 128k x 2048) never exists whole."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F

# Output rows dequantized at a time: a multiple of the int4 kernel's 64-row blocks, 32 MB of
# bf16 at 2048 inputs, and at least a 1B model's widest projection (8192 rows), which so runs
# as one matmul as before. On the 1B shape's LM head (128256 x 2048, 64 rows) 8192-row slices
# ran in 0.6-0.8x the time of dequantizing it whole (0.5 GB of bf16 written twice); 1024-row
# slices were faster on an idle machine but 2x slower than whole when the cores were
# oversubscribed (a parallel region per slice).
CHUNK_ROWS = 8192

# (first row, end row) -> the dequantized (rows, K) weights of those output rows.
SliceReader = Callable[[int, int], torch.Tensor]


def dequantized_linear(x: torch.Tensor, read: SliceReader, num_out: int) -> torch.Tensor:
    """x (M, K) @ W.T for W (num_out, K) read `CHUNK_ROWS` output rows at a time -> (M, N)."""
    if num_out <= CHUNK_ROWS:
        return F.linear(x, read(0, num_out))
    parts = [
        F.linear(x, read(lo, min(lo + CHUNK_ROWS, num_out)))  # (M, rows)
        for lo in range(0, num_out, CHUNK_ROWS)
    ]
    return torch.cat(parts, dim=1)
