"""Whether this CPU runs bfloat16 natively, and so the dtype the quantized layers compute in."""

from __future__ import annotations

import functools

import torch


@functools.cache
def cpu_has_bf16() -> bool:
    """True where oneDNN runs bfloat16 natively (AVX512-BF16, AMX)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def cpu_compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """bfloat16 for float32 inputs where the CPU has it natively (the fused int8/int4 kernels
    are fast in bf16 and slow in float32), else `dtype`."""
    return torch.bfloat16 if dtype == torch.float32 and cpu_has_bf16() else dtype
