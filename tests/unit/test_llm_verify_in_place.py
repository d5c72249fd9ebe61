"""Decodes verifying drafts attend in place: a q-query chunk that continues its sequence becomes
q decode rows of `decode_kernel.paged_decode` (context lengths L - q + 1 .. L) instead of a
chunk whose KV blocks are gathered; outputs equal dense attention, with and without a sliding
window and logit soft-capping."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from fulcrum.llm import runner as runner_module
from fulcrum.llm.examples import build_tiny_llama
from fulcrum.llm.loader import LoadedLLM, load_checkpoint
from fulcrum.llm.models.attention import (
    AttentionMetadata,
    build_metadata,
    kv_cache_shape,
    paged_attention,
)
from fulcrum.llm.runner import ModelRunner
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.scheduler import ScheduledBatch
from fulcrum.llm.sequence import Sequence

CPU = torch.device("cpu")
BLOCK_SIZE, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS = 4, 8, 4, 2
SCALE = HEAD_DIM**-0.5


def test_a_verifying_chunk_joins_the_in_place_group_as_decode_rows() -> None:
    # Two decodes, a decode verifying 4 drafts (5 queries over 23 positions), a fresh prompt.
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(4)]
    meta = build_metadata(
        [1, 1, 5, 6], [12, 30, 23, 6], tables, BLOCK_SIZE, CPU,
        split_chunks=True, in_place_decode=True, in_place_queries=5,
    )  # fmt: skip
    in_place, fresh = meta.groups
    assert in_place.context_lens is not None
    assert in_place.context_lens.tolist() == [12, 30, 19, 20, 21, 22, 23]
    assert in_place.mask is None and in_place.token_index is None
    assert in_place.num_seqs == 7 and in_place.max_query_len == 1
    assert in_place.row_range == (0, 7)
    assert in_place.block_tables[2:].tolist() == [tables[2][:8]] * 5
    assert fresh.context_lens is None and fresh.row_range == (7, 13)
    assert meta.groups_in_order


def test_longer_chunks_and_the_gather_path_keep_chunk_groups() -> None:
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(2)]
    # 6 queries > in_place_queries: still a (masked) chunk; so is everything without in-place.
    for kwargs in ({"in_place_decode": True, "in_place_queries": 5}, {"in_place_queries": 6}):
        meta = build_metadata([1, 6], [12, 23], tables, BLOCK_SIZE, CPU, **kwargs)  # type: ignore[arg-type]
        chunk = meta.groups[-1]
        assert chunk.context_lens is None and chunk.max_query_len == 6
        assert chunk.mask is not None


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, softcap: float
) -> torch.Tensor:
    """Dense causal attention of one whole sequence: q (n, H, D), k/v (n, Hkv, D)."""
    group = NUM_HEADS // NUM_KV_HEADS
    keys = k.transpose(0, 1).repeat_interleave(group, 0)  # (H, n, D)
    values = v.transpose(0, 1).repeat_interleave(group, 0)
    scores = torch.matmul(q.transpose(0, 1), keys.transpose(1, 2)) * SCALE  # (H, n, n)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    n = q.shape[0]
    pos = torch.arange(n)
    seen = pos[None, :] <= pos[:, None]
    if window:
        seen &= pos[None, :] > pos[:, None] - window
    scores = scores.masked_fill(~seen, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), values).transpose(0, 1)


@pytest.mark.parametrize("window", [0, 6])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("in_place_queries", [1, 5])
def test_verifying_rows_equal_dense_attention(
    window: int, softcap: float, in_place_queries: int
) -> None:
    # Sequence 0 decodes its last token, sequence 1 verifies 4 drafts after 17 cached tokens,
    # sequence 2 checks 3 (a chunk shorter than the longest); their K/V written in this step.
    lengths, num_new = [21, 22, 9], [1, 5, 3]
    gen = torch.Generator().manual_seed(3)
    q = [torch.randn(n, NUM_HEADS, HEAD_DIM, generator=gen) for n in lengths]
    k = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen) for n in lengths]
    v = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen) for n in lengths]
    ids = list(range(sum(-(-n // BLOCK_SIZE) for n in lengths)))
    random.Random(0).shuffle(ids)
    tables = [[ids.pop() for _ in range(-(-n // BLOCK_SIZE))] for n in lengths]
    shape = kv_cache_shape(len(tables[0]) + len(tables[1]) + len(tables[2]), BLOCK_SIZE,
                           NUM_KV_HEADS, HEAD_DIM)  # fmt: skip
    caches = torch.zeros(shape), torch.zeros(shape)

    def step(starts: list[int], ends: list[int], queries: int) -> list[torch.Tensor]:
        meta: AttentionMetadata = build_metadata(
            [e - s for s, e in zip(starts, ends, strict=True)], ends, tables, BLOCK_SIZE, CPU,
            split_chunks=True, in_place_decode=True, in_place_queries=queries,
        )  # fmt: skip
        if window:
            meta = meta.windowed(window)
        rows = [slice(s, e) for s, e in zip(starts, ends, strict=True)]
        out = paged_attention(
            *(torch.cat([t[i][r] for i, r in enumerate(rows)]) for t in (q, k, v)),
            *caches, meta, SCALE, softcap=softcap,
        )  # fmt: skip
        return list(torch.split(out, [e - s for s, e in zip(starts, ends, strict=True)]))

    ends = [n - m for n, m in zip(lengths, num_new, strict=True)]
    first = step([0, 0, 0], ends, 1)
    second = step(ends, lengths, in_place_queries)
    for i in range(3):
        want = _reference(q[i], k[i], v[i], window, softcap)
        got = torch.cat([first[i], second[i]])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_in_place_rows_apart_in_the_step_match_the_gather_path() -> None:
    # A verifying chunk, a fresh prompt, then a decode: the in-place rows are not one range.
    q_lens, ctx_lens = [5, 6, 1], [23, 6, 12]
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(3)]
    gen = torch.Generator().manual_seed(5)
    shape = kv_cache_shape(24, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    q = torch.randn(12, NUM_HEADS, HEAD_DIM, generator=gen)
    k, v = (torch.randn(12, NUM_KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
    outs = []
    for queries in (5, 1):
        meta = build_metadata(q_lens, ctx_lens, tables, BLOCK_SIZE, CPU, split_chunks=True,
                              in_place_decode=True, in_place_queries=queries)  # fmt: skip
        if queries == 5:
            assert meta.groups[0].row_range is None and not meta.groups_in_order
            assert meta.groups[0].token_rows.tolist() == [0, 1, 2, 3, 4, 11]
        outs.append(paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, SCALE))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> LoadedLLM:
    directory: Path = tmp_path_factory.mktemp("models")
    return load_checkpoint(directory / build_tiny_llama(directory) / "1")


class _RecordingBuild:
    """build_metadata as the runner calls it, keeping each step's metadata."""

    def __init__(self) -> None:
        self.built: list[AttentionMetadata] = []

    def __call__(self, *args: object, **kwargs: object) -> AttentionMetadata:
        meta = build_metadata(*args, **kwargs)  # type: ignore[arg-type]
        self.built.append(meta)
        return meta


def _verify_step(loaded: LoadedLLM, in_place: bool) -> list[object]:
    """A batch of a decode-with-drafts and a plain decode after their prompts, on one runner."""
    runner = ModelRunner(loaded.model, block_size=4, num_kv_blocks=32, device=CPU)
    runner.in_place_verify = in_place
    seqs = []
    for i, length in enumerate([14, 9]):
        prompt = [5 + (11 * i + 3 * j) % 300 for j in range(length)]
        seq = Sequence(i, prompt, SamplingParams(temperature=0.0), arrival_s=0.0)
        seq.block_table = list(range(8 * i, 8 * i + 8))
        runner.run(ScheduledBatch(seqs=[seq], num_new_tokens=[length - 1]))
        seq.num_computed_tokens = length - 1
        seqs.append(seq)
    seqs[0].spec_token_ids = [17, 23, 5]
    return runner.run(ScheduledBatch(seqs=seqs, num_new_tokens=[4, 1]))


def test_runner_verifies_drafts_in_place_with_the_tokens_of_the_gather_path(
    tiny_llama: LoadedLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    recording = _RecordingBuild()
    monkeypatch.setattr(runner_module, "build_metadata", recording)
    gathered = _verify_step(tiny_llama, in_place=False)
    in_place = _verify_step(tiny_llama, in_place=True)
    assert in_place == gathered
    assert isinstance(in_place[0], list) and isinstance(in_place[1], int)
    # The plain decode's row comes first, then the 4 rows of the verifying one: its last token
    # (position 13) and its 3 drafts.
    (group,) = recording.built[-1].groups
    assert group.context_lens is not None
    assert group.context_lens.tolist() == [9, 14, 15, 16, 17]
    assert group.row_range == (0, 5)
    assert len(recording.built[-4].groups) == 2  # gather path: the decode and the chunk
