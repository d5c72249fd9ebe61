"""torch's fused int4 layout is probed, not assumed: its block size and row order follow the vector
width torch dispatches to (AVX-512, AVX2, none), and every reader must follow the probed one."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from fulcrum.llm import cpu_bf16, quant_int4_layout  # noqa: E402
from fulcrum.llm.quant_int4 import Int4Linear  # noqa: E402
from fulcrum.llm.quant_int4_layout import (  # noqa: E402
    from_kernel_layout,
    kernel_layout_rows,
    to_kernel_layout,
)

_ROUND_TRIP = """
import torch
from fulcrum.llm.quant_int4_layout import from_kernel_layout, kernel_layout_spec, to_kernel_layout
spec = kernel_layout_spec()
q = torch.randint(0, 16, (192, 64), generator=torch.Generator().manual_seed(1))
assert torch.equal(from_kernel_layout(to_kernel_layout(q)), q.to(torch.uint8))
print(spec.block_rows, spec.low_rows[:2].tolist(), spec.high_rows[:2].tolist())
"""


def test_a_few_rows_read_from_the_kernel_layout_match_the_whole_conversion() -> None:
    q = torch.randint(0, 16, (192, 96), generator=torch.Generator().manual_seed(2))
    packed = to_kernel_layout(q)
    ids = torch.tensor([0, 1, 15, 16, 31, 32, 33, 63, 64, 100, 191])
    assert torch.equal(kernel_layout_rows(packed, ids), q[ids].to(torch.uint8))
    assert torch.equal(from_kernel_layout(packed), q.to(torch.uint8))


@pytest.mark.parametrize("capability", ["default", "avx2"])
def test_each_vector_width_torch_packs_for_is_read_back(capability: str) -> None:
    # The layouts differ: "default" pairs rows 2j and 2j + 1 in a byte, AVX2 rows r and r + 16,
    # AVX-512 (not on every CI machine) rows r and r + 32 in blocks of 64.
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
    run = subprocess.run(
        [sys.executable, "-c", _ROUND_TRIP], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr


def test_a_layout_that_is_not_understood_keeps_the_layer_on_its_exact_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def scrambled(q: torch.Tensor) -> torch.Tensor:  # bytes in an order no block model gives
        packed = to_kernel_layout(q)
        flat = packed.reshape(-1)
        order = torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(0))
        return flat[order].reshape(packed.shape)

    quant_int4_layout.kernel_layout_spec.cache_clear()
    monkeypatch.setattr(quant_int4_layout, "to_kernel_layout", scrambled)
    try:
        assert quant_int4_layout.kernel_layout_spec() is None
        monkeypatch.setattr(cpu_bf16, "cpu_has_bf16", lambda: True)
        layer = Int4Linear.from_linear(torch.nn.Linear(64, 64), 32)
        layer(torch.randn(2, 64))
        assert layer._kernel is None  # the fused kernel was not used on an unreadable layout
    finally:
        quant_int4_layout.kernel_layout_spec.cache_clear()
