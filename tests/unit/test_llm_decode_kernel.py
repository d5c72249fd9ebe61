"""The in-place paged decode kernels against gather + SDPA."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from fulcrum.llm.models import decode_kernel
from fulcrum.llm.models.attention import build_metadata, kv_cache_shape, paged_attention


def _case(
    lengths: list[int], num_kv_heads: int, group: int, head_dim: int, block_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random queries, a pool with scattered blocks per sequence, block tables, lengths."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = [-(-n // block_size) for n in lengths]
    pool_blocks = sum(num_blocks) + 3
    order = torch.randperm(pool_blocks, generator=gen).tolist()
    tables = [[order.pop() for _ in range(n)] for n in num_blocks]
    width = max(num_blocks)
    shape = kv_cache_shape(pool_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    q = torch.randn(len(lengths), num_kv_heads, group, head_dim, generator=gen)
    table_tensor = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    return q, k_cache, v_cache, table_tensor, torch.tensor(lengths)


def _reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    outs = []
    for i, n in enumerate(lengths.tolist()):
        keys = k_cache[:, tables[i]].flatten(1, 2)[:, :n]  # (Hkv, n, D)
        values = v_cache[:, tables[i]].flatten(1, 2)[:, :n]
        outs.append(F.scaled_dot_product_attention(q[i], keys, values, scale=scale))
    return torch.stack(outs)


@pytest.mark.parametrize(
    ("num_kv_heads", "group", "head_dim", "block_size"),
    [(2, 2, 16, 16), (1, 4, 8, 4), (3, 1, 64, 8), (2, 3, 32, 16)],
)
def test_paged_decode_equals_gathered_attention(
    num_kv_heads: int, group: int, head_dim: int, block_size: int
) -> None:
    # Lengths of 1, exact block multiples and ragged tails, in one batch.
    lengths = [1, block_size, block_size + 1, 3 * block_size - 1, 57, 2]
    q, k_cache, v_cache, tables, lens = _case(
        lengths, num_kv_heads, group, head_dim, block_size, seed=head_dim
    )
    scale = head_dim**-0.5
    got = decode_kernel.paged_decode(q, k_cache, v_cache, tables, lens, scale)
    want = _reference(q, k_cache, v_cache, tables, lens, scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("two_threads")
def test_sequences_split_across_threads_give_the_same_result() -> None:
    lengths = [(i * 37) % 200 + 1 for i in range(64)]  # enough sequences for two workers
    q, k_cache, v_cache, tables, lens = _case(lengths, 2, 2, 16, 16, seed=3)
    got = decode_kernel.paged_decode(q, k_cache, v_cache, tables, lens, 0.25)
    torch.testing.assert_close(got, _reference(q, k_cache, v_cache, tables, lens, 0.25))


def _ragged(
    lens: torch.Tensor, starts: torch.Tensor, num_rows: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """starts, lens, row offsets and an empty flat score buffer, as paged_decode lays them out."""
    num_keys = (lens - starts).numpy()
    offsets = (np.cumsum(num_keys) - num_keys) * num_rows
    scores = np.empty(int(num_keys.sum()) * num_rows, np.float32)
    return starts.numpy(), lens.numpy(), offsets, scores


def test_uncompiled_kernels_agree_with_compiled_ones() -> None:
    # The plain-Python source numba compiles is the specification; run both on a small case,
    # with a window skipping leading keys of two sequences.
    q, k_cache, v_cache, tables, lens = _case([5, 9, 1, 12], 2, 2, 8, 4, seed=5)
    starts, lens_np, offsets, scores = _ragged(lens, torch.tensor([0, 6, 0, 3]), 4)
    ragged = (tables.numpy(), starts, lens_np, offsets)
    kernels = decode_kernel._kernels()
    outs = []
    for qk, softmax, pv in (
        kernels,
        (decode_kernel._qk, decode_kernel._softmax, decode_kernel._pv),
    ):
        out = np.zeros((4, 2, 2, 8), np.float32)
        qk(q.numpy(), k_cache.numpy(), *ragged, scores, 0, 4)
        softmax(scores, starts, lens_np, offsets, 4, 0, 4)
        pv(scores, v_cache.numpy(), *ragged, out, 0, 4)
        outs.append((scores.copy(), out))
    np.testing.assert_allclose(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(outs[0][1], outs[1][1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spread", [1.0, 30.0, 300.0])
def test_softmax_rows_match_torch_to_float32_rounding(spread: float) -> None:
    # Rows of 1-300 scores; a spread of 300 puts most terms under exp's smallest normal.
    gen = torch.Generator().manual_seed(int(spread))
    lens = torch.tensor([1, 2, 17, 300, 64])
    starts, lens_np, offsets, scores = _ragged(lens, torch.zeros(5, dtype=torch.int64), 3)
    scores[:] = (torch.rand(scores.shape[0], generator=gen) * spread - spread / 2).numpy()
    want = [
        torch.softmax(torch.from_numpy(scores[o : o + 3 * n].reshape(3, n)), dim=-1)
        for o, n in zip(offsets.tolist(), lens.tolist(), strict=True)
    ]
    decode_kernel._kernels().softmax(scores, starts, lens_np, offsets, 3, 0, 5)
    for o, n, rows in zip(offsets.tolist(), lens.tolist(), want, strict=True):
        got = torch.from_numpy(scores[o : o + 3 * n].reshape(3, n))
        torch.testing.assert_close(
            got, rows, rtol=1.2e-6, atol=1e-37
        )  # a few float32 ulps (6e-8 each)
        torch.testing.assert_close(got.sum(-1), torch.ones(3))


def test_a_window_attends_only_its_keys() -> None:
    lengths = [7, 40, 33, 16]
    skip = torch.tensor([0, 5, 32, 15])  # down to a single key read
    q, k_cache, v_cache, tables, lens = _case(lengths, 2, 2, 16, 16, seed=11)
    got = decode_kernel.paged_decode(q, k_cache, v_cache, tables, lens, 0.3, skip=skip)
    for i, (n, first) in enumerate(zip(lengths, skip.tolist(), strict=True)):
        keys = k_cache[:, tables[i]].flatten(1, 2)[:, first:n]  # (Hkv, n - first, D)
        values = v_cache[:, tables[i]].flatten(1, 2)[:, first:n]
        want = F.scaled_dot_product_attention(q[i], keys, values, scale=0.3)
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)


def test_prefetch_is_a_no_op_in_python_and_compiles_in_numba() -> None:
    import numba

    from fulcrum.llm.models.prefetch import prefetch, register

    values = np.arange(64, dtype=np.float32).reshape(4, 16)
    assert prefetch(values, 16) is None
    register()

    @numba.njit
    def total_with_hints(array: np.ndarray) -> float:
        acc = 0.0
        for i in range(array.shape[0]):
            prefetch(array, (i + 1) * array.shape[1] % array.size)
            acc += array[i].sum()
        return acc

    assert total_with_hints(values) == values.sum()


def test_only_float32_cpu_pools_are_supported() -> None:
    assert decode_kernel.supported(torch.zeros(1, 1, 1, 1))
    assert not decode_kernel.supported(torch.zeros(1, 1, 1, 1, dtype=torch.bfloat16))
    assert not decode_kernel.supported(torch.zeros(1, 1, 1, 1, device="meta"))


def test_in_place_decodes_form_one_unmasked_group_and_match_the_gather_path() -> None:
    block_size, num_heads, num_kv_heads, head_dim = 4, 4, 2, 8
    context_lens = [30, 3, 17, 1, 9]
    num_blocks = [-(-n // block_size) for n in context_lens]
    starts = np.cumsum([0, *num_blocks]).tolist()
    tables = [list(range(s, s + n)) for s, n in zip(starts, num_blocks, strict=False)]
    gen = torch.Generator().manual_seed(7)
    shape = kv_cache_shape(sum(num_blocks), block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    q = torch.randn(5, num_heads, head_dim, generator=gen)
    k = torch.randn(5, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(5, num_kv_heads, head_dim, generator=gen)
    outs = []
    for in_place in (True, False):
        meta = build_metadata(
            [1] * 5, context_lens, tables, block_size, torch.device("cpu"), in_place_decode=in_place
        )
        if in_place:
            (group,) = meta.groups
            assert group.mask is None and group.attn_bias is None
            assert group.context_lens is not None
            assert group.context_lens.tolist() == context_lens
        else:
            assert all(g.context_lens is None for g in meta.groups)
        outs.append(
            paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, head_dim**-0.5)
        )
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
