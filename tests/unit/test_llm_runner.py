"""ModelRunner and paged attention: slot mapping, paged == dense attention, sampling rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from fulcrum.errors import ConfigError
from fulcrum.llm.examples import build_tiny_llama
from fulcrum.llm.loader import LoadedLLM, load_checkpoint
from fulcrum.llm.models.attention import build_metadata, kv_cache_shape, paged_attention
from fulcrum.llm.runner import ModelRunner, kv_block_bytes, num_blocks_for_budget
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.scheduler import ScheduledBatch
from fulcrum.llm.sequence import Sequence

CPU = torch.device("cpu")


def test_slot_mapping_follows_block_tables() -> None:
    # seq 0: 3 tokens cached, 3 new at positions 3..5 over blocks [5, 2]; seq 1: 2 new at 0..1.
    meta = build_metadata([3, 2], [6, 2], [[5, 2], [7]], block_size=4, device=CPU)
    assert meta.slot_mapping.tolist() == [5 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 7 * 4 + 0, 7 * 4 + 1]
    (group,) = meta.groups
    assert group.token_index.tolist() == [0, 1, 2, 3, 4]  # max_q = 3: seq 1 starts at row 3
    assert group.block_tables.tolist() == [[5, 2], [7, 0]]


def test_decodes_and_prefill_chunks_are_separate_groups() -> None:
    meta = build_metadata([1, 6, 1], [9, 6, 3], [[4, 1, 8], [2, 3], [0]], block_size=4, device=CPU)
    decode, prefill = meta.groups
    assert decode.token_rows.tolist() == [0, 7]
    assert (decode.num_seqs, decode.max_query_len) == (2, 1)  # not padded to the chunk of 6
    assert decode.block_tables.tolist() == [[4, 1, 8], [0, 0, 0]]
    assert prefill.token_rows.tolist() == [1, 2, 3, 4, 5, 6]
    assert meta.slot_mapping.tolist()[0] == 8 * 4 + 0  # position 8 of seq 0: block 2 = id 8


def test_mask_is_causal_within_chunk_and_full_over_context() -> None:
    meta = build_metadata([2], [5], [[0, 1]], block_size=4, device=CPU)
    # queries at positions 3 and 4 see keys 0..3 and 0..4; key slots 5..7 are never seen.
    mask = meta.groups[0].mask
    assert mask[0, 0, 0].tolist() == [True] * 4 + [False] * 4
    assert mask[0, 0, 1].tolist() == [True] * 5 + [False] * 3


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2)])
def test_paged_attention_equals_dense_causal_attention(num_heads: int, num_kv_heads: int) -> None:
    torch.manual_seed(0)
    block_size, head_dim = 4, 8
    lengths = [8, 6]  # seq 0: a chunk of 7, then one decode step; seq 1: two chunks
    chunks = [[7, 1], [2, 4]]
    tables = [[9, 3, 5], [1, 6]]  # scattered, non-contiguous blocks
    k_cache = torch.zeros(kv_cache_shape(10, block_size, num_kv_heads, head_dim))
    v_cache = torch.zeros_like(k_cache)
    q = [torch.randn(n, num_heads, head_dim) for n in lengths]
    k = [torch.randn(n, num_kv_heads, head_dim) for n in lengths]
    v = [torch.randn(n, num_kv_heads, head_dim) for n in lengths]
    outs: list[list[torch.Tensor]] = [[], []]
    done = [0, 0]
    for step in range(2):
        q_lens = [chunks[i][step] for i in range(2)]
        ctx = [done[i] + q_lens[i] for i in range(2)]
        meta = build_metadata(q_lens, ctx, tables, block_size, CPU)
        sl = [slice(done[i], ctx[i]) for i in range(2)]
        out = paged_attention(
            torch.cat([q[i][sl[i]] for i in range(2)]),
            torch.cat([k[i][sl[i]] for i in range(2)]),
            torch.cat([v[i][sl[i]] for i in range(2)]),
            k_cache,
            v_cache,
            meta,
            head_dim**-0.5,
        )
        outs[0].append(out[: q_lens[0]])
        outs[1].append(out[q_lens[0] :])
        done = ctx
    for i in range(2):
        dense = F.scaled_dot_product_attention(
            q[i].transpose(0, 1),
            k[i].transpose(0, 1).repeat_interleave(num_heads // num_kv_heads, 0),
            v[i].transpose(0, 1).repeat_interleave(num_heads // num_kv_heads, 0),
            is_causal=True,
        ).transpose(0, 1)
        torch.testing.assert_close(torch.cat(outs[i]), dense, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> LoadedLLM:
    directory: Path = tmp_path_factory.mktemp("models")
    name = build_tiny_llama(directory)
    return load_checkpoint(directory / name / "1")


def _seq(seq_id: int, prompt: list[int], block_table: list[int]) -> Sequence:
    seq = Sequence(seq_id, prompt, SamplingParams(temperature=0.0), arrival_s=0.0)
    seq.block_table = block_table
    return seq


def test_run_samples_only_sequences_that_reach_their_end(tiny_llama: LoadedLLM) -> None:
    runner = ModelRunner(tiny_llama.model, block_size=4, num_kv_blocks=16, device=CPU)
    whole = _seq(0, list(range(10, 20)), [0, 1, 2])
    partial = _seq(1, list(range(30, 40)), [3, 4, 5])
    sampled = runner.run(ScheduledBatch(seqs=[whole, partial], num_new_tokens=[10, 6]))
    assert sampled[1] is None
    assert isinstance(sampled[0], int)


def test_chunked_prefill_gives_the_same_token_as_one_chunk(tiny_llama: LoadedLLM) -> None:
    prompt = [
        int(t) for t in torch.randint(2, 400, (13,), generator=torch.Generator().manual_seed(3))
    ]
    one = ModelRunner(tiny_llama.model, block_size=4, num_kv_blocks=8, device=CPU)
    expected = one.run(ScheduledBatch(seqs=[_seq(0, prompt, [0, 1, 2, 3])], num_new_tokens=[13]))
    two = ModelRunner(tiny_llama.model, block_size=4, num_kv_blocks=8, device=CPU)
    seq = _seq(0, prompt, [7, 2, 5, 0])  # other physical blocks: results must not depend on them
    assert two.run(ScheduledBatch(seqs=[seq], num_new_tokens=[8])) == [None]
    seq.num_computed_tokens = 8
    assert two.run(ScheduledBatch(seqs=[seq], num_new_tokens=[5])) == expected


def test_empty_batch_runs_nothing(tiny_llama: LoadedLLM) -> None:
    runner = ModelRunner(tiny_llama.model, block_size=4, num_kv_blocks=2, device=CPU)
    assert runner.run(ScheduledBatch()) == []


def test_kv_pool_is_sized_from_the_memory_budget(tiny_llama: LoadedLLM) -> None:
    model = tiny_llama.model
    per_block = kv_block_bytes(model, 16, torch.float32)
    # 2 (K, V) x 2 layers x 16 tokens x 2 kv heads x 16 dims x 4 bytes
    assert per_block == 2 * model.num_layers * 16 * model.num_kv_heads * model.head_dim * 4
    assert num_blocks_for_budget(model, 16, 1.0, torch.float32) == 2**20 // per_block
    with pytest.raises(ConfigError, match="kv_cache_memory_mb"):
        num_blocks_for_budget(model, 16, 1e-6, torch.float32)


def test_in_place_decode_block_tables_are_cut_and_padded_to_the_longest_context() -> None:
    # Contexts 5, 9 and 2 in blocks of 4: 3 blocks wide. The first table holds a block past its
    # context, the last one a single block: cut to 3 / padded with block 0.
    meta = build_metadata(
        [1, 1, 1],
        [5, 9, 2],
        [[4, 1, 6, 2], [7, 3, 5], [8]],
        block_size=4,
        device=CPU,
        in_place_decode=True,
    )
    (group,) = meta.groups
    assert group.block_tables.tolist() == [[4, 1, 6], [7, 3, 5], [8, 0, 0]]
    assert group.context_lens.tolist() == [5, 9, 2]
    assert group.row_range == (0, 3)
    assert meta.slot_mapping.tolist() == [1 * 4 + 0, 5 * 4 + 0, 8 * 4 + 1]
