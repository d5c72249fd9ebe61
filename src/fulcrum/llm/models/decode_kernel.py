"""Paged decode attention on the CPU, reading the KV block pool in place.

Gathering each decode's blocks into a padded batch before SDPA moves every cached key and value
three times a step (read and write in the gather, read again in SDPA), and on a CPU those copies
are most of a decode step's attention. Here three small numba kernels read each key and each value
once, straight from the pool, over each sequence's own keys: scores = q.K into one flat buffer
(each (sequence, KV head, query row) a ragged row of its own length: no padding to the longest,
no -inf fill), a softmax over each row in place (its exp in float operations, which vectorise,
where numba's math.exp is a scalar libm call), then the weighted sum of V. While one block is
read, the next block's cache lines are prefetched (`prefetch`): a sequence's blocks lie anywhere
in the pool, where the hardware prefetcher cannot follow. The kernels are compiled on first use and
cached on disk. Float32 only; other dtypes and CUDA use the gather path.
A sliding window is given by the caller as a block table that starts at the window's first block
and a count of that block's leading slots to skip: those keys get no score at all. Soft-capped
logits (Gemma 2) are capped in torch over the flat scores between the score and softmax kernels
(in the score kernel's inner loop, tanh tripled that kernel's time)."""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import torch

from fulcrum.llm.models.prefetch import prefetch
from fulcrum.llm.models.prefetch import register as register_prefetch


class Kernels(NamedTuple):
    """The compiled kernels (`_qk`, `_softmax`, `_pv`)."""

    qk: Callable[..., None]
    softmax: Callable[..., None]
    pv: Callable[..., None]


def supported(cache: torch.Tensor) -> bool:
    """True when `paged_decode` can run over this KV pool."""
    return cache.device.type == "cpu" and cache.dtype == torch.float32


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    skip: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """One query per sequence over its cached context.

    q (B, Hkv, G, D): the G query heads sharing each KV head; caches (Hkv, num_blocks,
    block_size, D); block_tables (B, max_blocks) int64; context_lens (B,) int64, each >= 1: the
    keys read from the table; skip (B,) int64, each < its context length: leading keys of those
    not attended (a window); softcap > 0: each scaled score s becomes softcap * tanh(s / softcap).
    Returns (B, Hkv, G, D).
    """
    kernels = _kernels()
    b, num_kv_heads, group, head_dim = q.shape
    q_np = (q * scale).contiguous().numpy()
    tables, lens = block_tables.numpy(), context_lens.numpy()
    starts = np.zeros_like(lens) if skip is None else skip.numpy()
    num_keys = lens - starts
    # Row r of sequence i starts at offsets[i] + r * num_keys[i]; rows are (KV head, query row).
    offsets = np.cumsum(num_keys) - num_keys
    offsets *= num_kv_heads * group
    scores = _scores_buffer(int(num_keys.sum()) * num_kv_heads * group)
    out = torch.empty(b, num_kv_heads, group, head_dim)
    k_np, v_np, out_np = k_cache.numpy(), v_cache.numpy(), out.numpy()
    ragged = (tables, starts, lens, offsets)
    _split(lambda lo, hi: kernels.qk(q_np, k_np, *ragged, scores, lo, hi), b)
    if softcap:
        # softcap * tanh(s / softcap) as softcap * (2 * sigmoid(2 s / softcap) - 1): equal to
        # float32 rounding, and torch's CPU sigmoid is about 6x faster than its tanh.
        flat = torch.from_numpy(scores)
        torch.sigmoid(flat.mul_(2.0 / softcap), out=flat).mul_(2.0 * softcap).sub_(softcap)
    rows = num_kv_heads * group
    _split(lambda lo, hi: kernels.softmax(scores, starts, lens, offsets, rows, lo, hi), b)
    _split(lambda lo, hi: kernels.pv(scores, v_np, *ragged, out_np, lo, hi), b)
    return out


def warm_up() -> None:
    """Compile (or load from the disk cache) the kernels now rather than on the first step."""
    cache = torch.zeros(1, 1, 1, 1)
    ones = torch.ones(1, 1, dtype=torch.int64)
    paged_decode(torch.zeros(1, 1, 1, 1), cache, cache, ones * 0, ones[0], 1.0)


_local = threading.local()


def _scores_buffer(size: int) -> np.ndarray[Any, np.dtype[np.float32]]:
    """This thread's flat score buffer, at least `size` floats, kept between calls, so a large
    step (6 MB of scores at 256 sequences, head_dim 64) does not page-fault a fresh one in on
    every layer. Grows, never shrinks: it is a small fraction of the KV pool it indexes."""
    buffer: np.ndarray[Any, np.dtype[np.float32]] | None = getattr(_local, "scores", None)
    if buffer is None or buffer.shape[0] < size:
        buffer = np.empty(max(size, 1), np.float32)
        _local.scores = buffer
    return buffer[:size]


# Below this many sequences, one thread runs the kernels (splitting costs more than it saves).
_MIN_SEQS_PER_THREAD = 16


def _split(run: Callable[[int, int], None], num_seqs: int) -> None:
    """Run kernel(lo, hi) over sequence ranges on torch's intra-op thread count (they drop the
    GIL)."""
    workers = min(torch.get_num_threads(), num_seqs // _MIN_SEQS_PER_THREAD)
    if workers <= 1:
        run(0, num_seqs)
        return
    bounds = [num_seqs * i // workers for i in range(workers + 1)]
    pool = _pool(workers)
    for future in [pool.submit(run, lo, hi) for lo, hi in itertools.pairwise(bounds)]:
        future.result()


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(workers, thread_name_prefix="fulcrum-decode")


@functools.cache
def _kernels() -> Kernels:
    import numba
    from numba.extending import register_jitable

    options: dict[str, Any] = {"fastmath": True, "nogil": True, "boundscheck": False}
    register_prefetch()
    register_jitable(**options)(_prefetch_next)  # compiled into the kernels that call it
    jit = numba.njit(cache=True, **options)
    return Kernels(jit(_qk), jit(_softmax), jit(_pv))


# The kernels, as plain Python that numba compiles (they also run, slowly, uncompiled). Sequence
# b reads keys starts[b] <= t < lens[b] of its table; its rows are m = lens[b] - starts[b] long.

_LOG2_E = 1.4426950408889634
_LN_2 = 0.6931471805599453
# exp(x) for x below this is under float32's smallest normal (2 ** -126): taken as that. After
# the max is subtracted, such a weight is < 1.2e-38 of the largest (1.0): invisible in a sum.
_MIN_EXPONENT = -87.3


# Head dims below this take four key slots a pass in both kernels: numba vectorises a loop over d
# 32 floats a pass (4 x 8 lanes) and only 4 wide below that, so one head_dim-16 dot product is a
# chain of dependent multiply-adds; four independent ones keep the FMA units busy (score kernel
# ~1.5x, value kernel ~1.3x faster at head_dim 16). At head_dim 64 four at once measured slower.
_WIDE = 32
# Floats per 64-byte cache line: the stride of the prefetch hints.
_LINE_FLOATS = 16


def _prefetch_next(pool: Any, tables: Any, starts: Any, h: int, b: int, j: int, last: int,
                   hi: int) -> None:  # fmt: skip
    """Hint the block read after block j of (b, h): the next in b's table, else the first of the
    next KV head or sequence (below hi). Blocks lie anywhere in the pool, where the hardware
    prefetcher cannot follow; a block right after the current one in the pool it streams by
    itself, and hinting it too cost more than it saved (~10% at head_dim 64)."""
    if j + 1 < last:
        if tables[b, j + 1] == tables[b, j] + 1:
            return
        ahead = pool[h, tables[b, j + 1]]
    elif h + 1 < pool.shape[0]:
        ahead = pool[h + 1, tables[b, starts[b] // pool.shape[2]]]
    elif b + 1 < hi:
        ahead = pool[0, tables[b + 1, starts[b + 1] // pool.shape[2]]]
    else:
        return
    for i in range(0, ahead.size, _LINE_FLOATS):
        prefetch(ahead, i)


def _qk(q: Any, k: Any, tables: Any, starts: Any, lens: Any, offsets: Any, scores: Any,
        lo: int, hi: int) -> None:  # fmt: skip
    """scores[row (h, g) of b, t - starts[b]] = q[b, h, g] . k[h, block of t, slot of t]."""
    num_kv_heads, group, head_dim = q.shape[1], q.shape[2], q.shape[3]
    block_size = k.shape[2]
    for b in range(lo, hi):
        first, n = starts[b], lens[b]
        m = n - first
        for h in range(num_kv_heads):
            # (G, m) rows of this KV head, as a view: indexing a view from 0 keeps numba's
            # negative-index wraparound check out of the loop.
            rows = scores[offsets[b] + h * group * m : offsets[b] + (h + 1) * group * m]
            last = (n + block_size - 1) // block_size
            for j in range(first // block_size, last):
                _prefetch_next(k, tables, starts, h, b, j, last, hi)
                block = k[h, tables[b, j]]
                base = j * block_size
                slot, end = max(first - base, 0), min(block_size, n - base)
                while slot + 4 <= end and head_dim < _WIDE:  # four dot products a pass
                    r0, r1, r2, r3 = block[slot], block[slot + 1], block[slot + 2], block[slot + 3]
                    col = base + slot - first
                    for g in range(group):
                        a0 = a1 = a2 = a3 = np.float32(0.0)
                        for d in range(head_dim):
                            qd = q[b, h, g, d]
                            a0 += qd * r0[d]
                            a1 += qd * r1[d]
                            a2 += qd * r2[d]
                            a3 += qd * r3[d]
                        row = rows[g * m + col : g * m + col + 4]
                        row[0], row[1], row[2], row[3] = a0, a1, a2, a3
                    slot += 4
                for s in range(slot, end):
                    col = base + s - first
                    for g in range(group):
                        acc = np.float32(0.0)
                        for d in range(head_dim):
                            acc += q[b, h, g, d] * block[s, d]
                        rows[g * m + col] = acc


def _softmax(scores: Any, starts: Any, lens: Any, offsets: Any, num_rows: int,
             lo: int, hi: int) -> None:  # fmt: skip
    """Each row of sequences lo..hi-1 in place: exp(s - max) / sum, as torch.softmax computes it
    (the sum's reciprocal times each term), with exp from a float64 polynomial (< 1 float32
    ulp)."""
    longest = 0
    for b in range(lo, hi):
        longest = max(longest, lens[b] - starts[b])
    powers = np.empty(longest, np.int32)  # 2 ** k of each exp, as float32 bits
    for b in range(lo, hi):
        m = lens[b] - starts[b]
        for r in range(num_rows):
            row = scores[offsets[b] + r * m : offsets[b] + (r + 1) * m]
            bits = powers[:m]
            top = row[0]
            for i in range(1, m):
                top = max(top, row[i])
            for i in range(m):
                # exp(x) = 2 ** k * exp(x - k ln 2), |x - k ln 2| <= ln(2) / 2: Taylor to degree
                # 7 errs < 6e-9 relative there, under float32's 6e-8 rounding.
                x = max(np.float64(row[i] - top), _MIN_EXPONENT)
                k = np.rint(x * _LOG2_E)
                z = x - k * _LN_2
                p = 1.0 + z * (1.0 + z * (0.5 + z * (1.0 / 6.0 + z * (1.0 / 24.0 + z * (
                    1.0 / 120.0 + z * (1.0 / 720.0 + z * (1.0 / 5040.0)))))))  # fmt: skip
                row[i] = np.float32(p)
                bits[i] = (np.int32(k) + 127) << 23
            scale = bits.view(np.float32)
            total = np.float32(0.0)
            for i in range(m):
                row[i] *= scale[i]  # exact: a power of two in float32's normal range
                total += row[i]
            inverse = np.float32(1.0) / total
            for i in range(m):
                row[i] *= inverse


def _pv(probs: Any, v: Any, tables: Any, starts: Any, lens: Any, offsets: Any, out: Any,
        lo: int, hi: int) -> None:  # fmt: skip
    """out[b, h, g] = sum over starts[b] <= t < lens[b] of probs[row (h, g) of b, t - starts[b]]
    * v[h, block of t, slot of t]."""
    num_kv_heads, group, head_dim = out.shape[1], out.shape[2], out.shape[3]
    block_size = v.shape[2]
    acc = np.empty((group, head_dim), np.float32)
    for b in range(lo, hi):
        first, n = starts[b], lens[b]
        m = n - first
        for h in range(num_kv_heads):
            rows = probs[offsets[b] + h * group * m : offsets[b] + (h + 1) * group * m]
            acc[:, :] = 0.0
            last = (n + block_size - 1) // block_size
            for j in range(first // block_size, last):
                _prefetch_next(v, tables, starts, h, b, j, last, hi)
                block = v[h, tables[b, j]]
                base = j * block_size
                slot, end = max(first - base, 0), min(block_size, n - base)
                while slot + 4 <= end and head_dim < _WIDE:  # a quarter of acc's loads, stores
                    r0, r1, r2, r3 = block[slot], block[slot + 1], block[slot + 2], block[slot + 3]
                    col = base + slot - first
                    for g in range(group):
                        w = rows[g * m + col : g * m + col + 4]
                        for d in range(head_dim):
                            acc[g, d] += (w[0] * r0[d] + w[1] * r1[d]) + (
                                w[2] * r2[d] + w[3] * r3[d]
                            )
                    slot += 4
                for s in range(slot, end):
                    col = base + s - first
                    for g in range(group):
                        w0 = rows[g * m + col]
                        for d in range(head_dim):
                            acc[g, d] += w0 * block[s, d]
            out[b, h] = acc
