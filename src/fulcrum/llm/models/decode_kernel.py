"""Paged decode attention on the CPU, reading the KV block pool in place.

Gathering each decode's blocks into a padded batch before SDPA moves every cached key and value
three times a step (read and write in the gather, read again in SDPA), and on a CPU those copies
are most of a decode step's attention. Here two small numba kernels read each key and each value
once, straight from the pool, over each sequence's own length (no padding to the longest):
scores = q.K over the sequence's blocks, softmax in torch, then the weighted sum of V. They are
compiled on first use and cached on disk. Float32 only; other dtypes and CUDA use the gather path.
A sliding window is given by the caller as a block table that starts at the window's first block
and a count of that block's leading slots to skip: their scores are set to -inf before the softmax
(weight 0), so the kernels themselves stay those of full attention. Soft-capped logits (Gemma 2)
are capped in torch between the kernels, vectorised over the scores (in the score kernel's inner
loop, tanh tripled that kernel's time).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

Kernels = tuple[Callable[..., None], Callable[..., None]]


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
    keys read from the table; skip (B,) int64: leading keys of those not attended (a window);
    softcap > 0: each scaled score s becomes softcap * tanh(s / softcap). Returns (B, Hkv, G, D).
    """
    qk, pv = _kernels()
    b, num_kv_heads, group, head_dim = q.shape
    max_keys = block_tables.shape[1] * k_cache.shape[2]
    q_np = (q * scale).contiguous().numpy()
    tables, lens = block_tables.numpy(), context_lens.numpy()
    scores = torch.full((b, num_kv_heads, group, max_keys), float("-inf"))
    out = torch.empty(b, num_kv_heads, group, head_dim)
    k_np, v_np, scores_np, out_np = k_cache.numpy(), v_cache.numpy(), scores.numpy(), out.numpy()
    _split(lambda lo, hi: qk(q_np, k_np, tables, lens, scores_np, lo, hi), b)
    if softcap:
        # softcap * tanh(s / softcap) as softcap * (2 * sigmoid(2 s / softcap) - 1): equal to
        # float32 rounding, and torch's CPU sigmoid is about 6x faster than its tanh. It maps
        # the unread keys' -inf to -softcap, so they are masked out again.
        scores = torch.sigmoid(scores.mul_(2.0 / softcap)).mul_(2.0 * softcap).sub_(softcap)
        unread = torch.arange(max_keys) >= context_lens[:, None, None, None]
        scores.masked_fill_(unread, float("-inf"))
    if skip is not None:
        scores.masked_fill_(torch.arange(max_keys) < skip[:, None, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).numpy()
    _split(lambda lo, hi: pv(probs, v_np, tables, lens, out_np, lo, hi), b)
    return out


def warm_up() -> None:
    """Compile (or load from the disk cache) the kernels now rather than on the first step."""
    cache = torch.zeros(1, 1, 1, 1)
    ones = torch.ones(1, 1, dtype=torch.int64)
    paged_decode(torch.zeros(1, 1, 1, 1), cache, cache, ones * 0, ones[0], 1.0)


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

    jit = numba.njit(fastmath=True, nogil=True, boundscheck=False, cache=True)
    return jit(_qk), jit(_pv)


# The kernels, as plain Python that numba compiles (they also run, slowly, uncompiled).


def _qk(q: Any, k: Any, tables: Any, lens: Any, scores: Any, lo: int, hi: int) -> None:
    """scores[b, h, g, t] = q[b, h, g] . k[h, block of t, slot of t] for t < lens[b]."""
    num_kv_heads, group, head_dim = q.shape[1], q.shape[2], q.shape[3]
    block_size = k.shape[2]
    for b in range(lo, hi):
        n = lens[b]
        for h in range(num_kv_heads):
            for j in range((n + block_size - 1) // block_size):
                block = k[h, tables[b, j]]
                base = j * block_size
                for slot in range(min(block_size, n - base)):
                    for g in range(group):
                        acc = np.float32(0.0)
                        for d in range(head_dim):
                            acc += q[b, h, g, d] * block[slot, d]
                        scores[b, h, g, base + slot] = acc


def _pv(probs: Any, v: Any, tables: Any, lens: Any, out: Any, lo: int, hi: int) -> None:
    """out[b, h, g] = sum over t < lens[b] of probs[b, h, g, t] * v[h, block of t, slot of t]."""
    num_kv_heads, group, head_dim = out.shape[1], out.shape[2], out.shape[3]
    block_size = v.shape[2]
    acc = np.empty((group, head_dim), np.float32)
    for b in range(lo, hi):
        n = lens[b]
        for h in range(num_kv_heads):
            acc[:, :] = 0.0
            for j in range((n + block_size - 1) // block_size):
                block = v[h, tables[b, j]]
                base = j * block_size
                for slot in range(min(block_size, n - base)):
                    for g in range(group):
                        w = probs[b, h, g, base + slot]
                        for d in range(head_dim):
                            acc[g, d] += w * block[slot, d]
            out[b, h] = acc
