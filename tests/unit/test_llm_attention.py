"""Paged-attention layout: decode buckets, causal groups of fresh chunks, any row order; each
must give the same output as dense causal attention over each sequence alone."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from fulcrum.llm.examples import build_tiny_llama
from fulcrum.llm.loader import LoadedLLM, load_checkpoint
from fulcrum.llm.models.attention import build_metadata, kv_cache_shape, paged_attention
from fulcrum.llm.runner import ModelRunner
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.scheduler import ScheduledBatch
from fulcrum.llm.sequence import Sequence

CPU = torch.device("cpu")
BLOCK_SIZE, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS = 4, 8, 4, 2


class _Seqs:
    """Random q/k/v of whole sequences, a scattered block table each, and a shared KV pool."""

    def __init__(self, lengths: list[int], seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.q = [torch.randn(n, NUM_HEADS, HEAD_DIM, generator=gen) for n in lengths]
        self.k = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen) for n in lengths]
        self.v = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen) for n in lengths]
        num_blocks = [-(-n // BLOCK_SIZE) for n in lengths]
        ids = list(range(sum(num_blocks)))
        random.Random(seed).shuffle(ids)
        self.tables = [[ids.pop() for _ in range(n)] for n in num_blocks]
        shape = kv_cache_shape(sum(num_blocks), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        self.k_cache, self.v_cache = torch.zeros(shape), torch.zeros(shape)

    def step(
        self, order: list[int], starts: list[int], ends: list[int], *, split_chunks: bool
    ) -> tuple[dict[int, torch.Tensor], int]:
        """Attend tokens starts[i]:ends[i] of each sequence i, flattened in `order`."""
        q_lens = [ends[i] - starts[i] for i in order]
        meta = build_metadata(
            q_lens,
            [ends[i] for i in order],
            [self.tables[i] for i in order],
            BLOCK_SIZE,
            CPU,
            split_chunks=split_chunks,
        )
        q, k, v = (
            torch.cat([t[i][starts[i] : ends[i]] for i in order]) for t in (self.q, self.k, self.v)
        )
        out = paged_attention(q, k, v, self.k_cache, self.v_cache, meta, HEAD_DIM**-0.5)
        return dict(zip(order, torch.split(out, q_lens), strict=True)), len(meta.groups)

    def dense(self, i: int) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            self.q[i].transpose(0, 1),
            self.k[i].transpose(0, 1).repeat_interleave(NUM_HEADS // NUM_KV_HEADS, 0),
            self.v[i].transpose(0, 1).repeat_interleave(NUM_HEADS // NUM_KV_HEADS, 0),
            is_causal=True,
        ).transpose(0, 1)


def _prefill_then_decode(lengths: list[int], order: list[int], *, split_chunks: bool) -> int:
    """Prefill all but each sequence's last token, decode it, check vs dense; decode's groups."""
    seqs = _Seqs(lengths)
    n = len(lengths)
    prefill, _ = seqs.step(order, [0] * n, [x - 1 for x in lengths], split_chunks=split_chunks)
    decode, num_groups = seqs.step(
        order, [x - 1 for x in lengths], lengths, split_chunks=split_chunks
    )
    for i in range(n):
        got = torch.cat([prefill[i], decode[i]])
        torch.testing.assert_close(got, seqs.dense(i), rtol=1e-5, atol=1e-5)
    return num_groups


def test_decodes_of_very_different_lengths_are_bucketed() -> None:
    # 16 long and 16 short contexts: one padded group would gather 32 x 50 blocks.
    context_lens = [200] * 16 + [4] * 16
    meta = build_metadata(
        [1] * 32, context_lens, [list(range(50))] * 32, BLOCK_SIZE, CPU, split_chunks=True
    )
    assert [g.num_seqs for g in meta.groups] == [16, 16]
    assert [g.block_tables.shape[1] for g in meta.groups] == [50, 1]
    assert meta.groups_in_order
    assert [g.row_range for g in meta.groups] == [(0, 16), (16, 32)]


def test_fresh_chunks_of_very_different_lengths_are_bucketed() -> None:
    # One 200-token prompt and 16 of 8: one padded group would attend 17 x 200 x 200 positions.
    q_lens = [200] + [8] * 16
    first = -(-200 // BLOCK_SIZE)
    tables = [list(range(first))] + [[first + 2 * i, first + 2 * i + 1] for i in range(16)]
    meta = build_metadata(q_lens, q_lens, tables, BLOCK_SIZE, CPU, split_chunks=True)
    assert [g.num_seqs for g in meta.groups] == [1, 16]
    assert [g.max_query_len for g in meta.groups] == [200, 8]
    assert all(g.mask is None for g in meta.groups)  # both causal: SDPA's own mask
    assert meta.groups_in_order


def test_fresh_chunks_in_buckets_equal_dense_attention() -> None:
    lengths = [150, 9, 130, 12, 7, 140, 10, 8]
    by_len = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    seqs = _Seqs(lengths)
    n = len(lengths)
    got, num_groups = seqs.step(by_len, [0] * n, lengths, split_chunks=True)
    assert num_groups > 1
    for i in range(n):
        torch.testing.assert_close(got[i], seqs.dense(i), rtol=1e-5, atol=1e-5)


def test_similar_decodes_share_one_group() -> None:
    meta = build_metadata([1] * 8, [30, 31, 29, 32, 30, 28, 31, 32], [list(range(8))] * 8, 4, CPU)
    assert [g.num_seqs for g in meta.groups] == [8]
    assert meta.groups[0].token_index is None  # decodes need no query padding


def test_bucketed_decodes_equal_dense_attention() -> None:
    lengths = [120, 3, 90, 5, 7, 110, 2, 64]
    by_len = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    assert _prefill_then_decode(lengths, by_len, split_chunks=True) > 1  # really bucketed


def test_decodes_in_any_row_order_equal_dense_attention() -> None:
    # Rows of a bucket are not contiguous here: the gather/scatter path runs.
    lengths = [120, 3, 90, 5, 7, 110, 2, 64]
    assert _prefill_then_decode(lengths, list(range(8)), split_chunks=True) > 1


def test_fresh_chunks_form_a_causal_group_apart_from_continued_ones() -> None:
    # seq 0 and 2 start at position 0 (causal group); seq 1 continues after 4 cached tokens.
    meta = build_metadata(
        [5, 3, 2], [5, 7, 2], [[0, 1], [2, 3], [4]], BLOCK_SIZE, CPU, split_chunks=True
    )
    fresh, continued = meta.groups
    assert fresh.token_rows.tolist() == [0, 1, 2, 3, 4, 8, 9]
    assert fresh.mask is None and fresh.attn_bias is None
    assert fresh.token_index is not None  # chunks of 5 and 2 are padded to 5
    assert continued.token_rows.tolist() == [5, 6, 7]
    assert continued.mask is not None and continued.attn_bias is not None


@pytest.mark.parametrize("split_chunks", [True, False])
def test_chunked_prefill_groups_equal_dense_attention(split_chunks: bool) -> None:
    seqs = _Seqs([13, 6, 9])
    # Step 1: seq 0 and 1 start (fresh chunks of unequal length); step 2: seq 0 continues,
    # seq 1 decodes, seq 2 starts; step 3: everyone finishes.
    plan = [([0, 0, 0], [8, 5, 0]), ([8, 5, 0], [12, 6, 9]), ([12, 6, 9], [13, 6, 9])]
    outs: list[list[torch.Tensor]] = [[], [], []]
    for starts, ends in plan:
        active = [i for i in range(3) if ends[i] > starts[i]]
        got, _ = seqs.step(active, starts, ends, split_chunks=split_chunks)
        for i in active:
            outs[i].append(got[i])
    for i in range(3):
        torch.testing.assert_close(torch.cat(outs[i]), seqs.dense(i), rtol=1e-5, atol=1e-5)


def test_bfloat16_queries_get_a_bias_of_their_dtype() -> None:
    seqs = _Seqs([9, 3])
    meta = build_metadata([1, 1], [9, 3], seqs.tables, BLOCK_SIZE, CPU)
    q = torch.stack([seqs.q[0][8], seqs.q[1][2]]).bfloat16()
    k = torch.stack([seqs.k[0][8], seqs.k[1][2]]).bfloat16()
    out = paged_attention(
        q,
        k,
        k.clone(),
        seqs.k_cache.bfloat16(),
        seqs.v_cache.bfloat16(),
        meta,
        HEAD_DIM**-0.5,
    )
    assert out.dtype == torch.bfloat16
    assert out.shape == (2, NUM_HEADS, HEAD_DIM)
    assert bool(torch.isfinite(out.float()).all())


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(6, 2), (3, 3), (4, 1)])
def test_decode_equals_dense_attention_for_any_head_grouping(
    num_heads: int, num_kv_heads: int
) -> None:
    # Grouped KV heads take the folded decode path (query heads as rows), equal heads the plain.
    gen = torch.Generator().manual_seed(1)
    lengths, tables = [7, 2, 5], [[3, 0], [1], [4, 2]]
    k_cache = torch.randn(kv_cache_shape(5, BLOCK_SIZE, num_kv_heads, HEAD_DIM), generator=gen)
    v_cache = torch.randn(kv_cache_shape(5, BLOCK_SIZE, num_kv_heads, HEAD_DIM), generator=gen)
    q = torch.randn(3, num_heads, HEAD_DIM, generator=gen)
    k = torch.randn(3, num_kv_heads, HEAD_DIM, generator=gen)
    v = torch.randn(3, num_kv_heads, HEAD_DIM, generator=gen)
    meta = build_metadata([1, 1, 1], lengths, tables, BLOCK_SIZE, CPU)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, HEAD_DIM**-0.5)
    for i, (n, table) in enumerate(zip(lengths, tables, strict=True)):
        keys = k_cache[:, table].flatten(1, 2)[:, :n]  # (Hkv, n, D), new token in
        values = v_cache[:, table].flatten(1, 2)[:, :n]
        group = num_heads // num_kv_heads
        want = F.scaled_dot_product_attention(
            q[i][:, None],
            keys.repeat_interleave(group, 0),
            values.repeat_interleave(group, 0),
        )[:, 0]
        torch.testing.assert_close(out[i], want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> LoadedLLM:
    directory: Path = tmp_path_factory.mktemp("models")
    return load_checkpoint(directory / build_tiny_llama(directory) / "1")


def _seq(seq_id: int, prompt: list[int], first_block: int) -> Sequence:
    seq = Sequence(seq_id, prompt, SamplingParams(temperature=0.0), arrival_s=0.0)
    seq.block_table = list(range(first_block, first_block + 8))
    return seq


def test_runner_maps_reordered_rows_back_to_batch_order(tiny_llama: LoadedLLM) -> None:
    # The runner puts decodes first (longest context first) and chunks last; each sequence must
    # still get the token it gets when it runs alone.
    prompts = [
        [5 + (7 * i + j) % 300 for j in range(length)] for i, length in enumerate([9, 20, 3])
    ]
    alone: list[int | None] = []
    for i, prompt in enumerate(prompts):
        runner = ModelRunner(tiny_llama.model, block_size=4, num_kv_blocks=32, device=CPU)
        alone += runner.run(ScheduledBatch(seqs=[_seq(i, prompt, 0)], num_new_tokens=[len(prompt)]))
    runner = ModelRunner(tiny_llama.model, block_size=4, num_kv_blocks=32, device=CPU)
    seqs = [_seq(i, p, 8 * i) for i, p in enumerate(prompts)]
    # seq 0 and 1 computed all but their last token earlier: they decode; seq 2 is a fresh chunk.
    for seq in seqs[:2]:
        assert runner.run(ScheduledBatch(seqs=[seq], num_new_tokens=[seq.num_tokens - 1])) == [None]
        seq.num_computed_tokens = seq.num_tokens - 1
    mixed = runner.run(ScheduledBatch(seqs=[seqs[2], seqs[0], seqs[1]], num_new_tokens=[3, 1, 1]))
    assert mixed == [alone[2], alone[0], alone[1]]
