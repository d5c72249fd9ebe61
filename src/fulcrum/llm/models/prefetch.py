"""A software prefetch hint for numba kernels: `prefetch(array, index)` asks the CPU to start
loading the cache line holding array.flat[index] (a no-op when the kernel runs as plain Python).

The decode kernels read the KV pool block by block, and a sequence's blocks lie anywhere in the
pool: each block's first lines miss every cache level, and the hardware prefetcher, which follows
strides, cannot guess the next block. Hinting the next block's lines while the current one is
computed hides that latency (about a third of the score kernel's time on this machine).
"""

from __future__ import annotations

import functools
from typing import Any


def prefetch(array: Any, index: int) -> None:
    """Hint that array.ravel()[index] will be read soon (compiled: `llvm.prefetch`)."""


@functools.cache
def register() -> None:
    """Give `prefetch` its numba implementation; call before compiling a kernel that uses it."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic, overload

    @intrinsic
    def _hint(typingctx: Any, array: Any, index: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            array_type = signature.args[0]
            data = context.make_array(array_type)(context, builder, args[0]).data
            address = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(8).as_pointer())
            i32 = ir.IntType(32)
            # (address, 0 = read, 3 = keep in all cache levels, 1 = data cache)
            hint_type = ir.FunctionType(ir.VoidType(), [address.type, i32, i32, i32])
            hint = builder.module.declare_intrinsic("llvm.prefetch", [address.type], hint_type)
            builder.call(hint, [address, i32(0), i32(3), i32(1)])
            return context.get_dummy_value()

        if not isinstance(array, types.Array) or not isinstance(index, types.Integer):
            return None
        return types.void(array, index), codegen

    @overload(prefetch)
    def _prefetch(array: Any, index: Any) -> Any:
        def implementation(array: Any, index: Any) -> None:
            _hint(array, index)  # type: ignore[call-arg]  # numba supplies typingctx

        return implementation
