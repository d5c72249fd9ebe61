"""BlockManager: block accounting, prefix caching (hits, salts, collisions), ref counts, LRU."""

from __future__ import annotations

import pytest

from fulcrum.errors import ConfigError, FulcrumError
from fulcrum.llm.block_manager import BlockManager, hash_block
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.sequence import Sequence

BLOCK_SIZE = 4


def make_seq(seq_id: int, tokens: list[int], salt: str | None = None) -> Sequence:
    return Sequence(seq_id, tokens, SamplingParams(), arrival_s=0.0, cache_salt=salt)


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    """Admit seq and 'compute' every known token, as one prefill step would."""
    bm.match_prefix(seq)
    assert bm.allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)


def test_bad_sizes_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        BlockManager(0, 4)
    with pytest.raises(ConfigError):
        BlockManager(4, 0)


def test_allocate_covers_tokens_and_accounts_blocks() -> None:
    bm = BlockManager(8, BLOCK_SIZE)
    seq = make_seq(0, list(range(10)))
    assert bm.allocate_slots(seq, 10)
    assert len(seq.block_table) == 3  # ceil(10 / 4)
    assert len(set(seq.block_table)) == 3
    assert bm.num_free_blocks() == 5
    seq.num_computed_tokens = 10
    assert bm.allocate_slots(seq, 2)  # tokens 10 and 11 fit in block 2
    assert len(seq.block_table) == 3
    assert bm.allocate_slots(seq, 3)
    assert len(seq.block_table) == 4
    assert bm.usage() == pytest.approx(4 / 8)
    assert all(bm.ref_count(b) == 1 for b in seq.block_table)


def test_failed_allocation_changes_nothing() -> None:
    bm = BlockManager(2, BLOCK_SIZE)
    seq = make_seq(0, list(range(6)))
    assert bm.allocate_slots(seq, 6)
    other = make_seq(1, list(range(20)))
    assert not bm.allocate_slots(other, 5)
    assert other.block_table == []
    assert bm.num_free_blocks() == 0


def test_free_returns_blocks_and_never_double_frees() -> None:
    bm = BlockManager(4, BLOCK_SIZE)
    seq = make_seq(0, list(range(8)))
    assert bm.allocate_slots(seq, 8)
    bm.free(seq)
    assert seq.block_table == []
    assert bm.num_free_blocks() == 4
    assert bm.usage() == 0.0
    bm.free(seq)  # a second free has nothing left to drop
    assert bm.num_free_blocks() == 4
    assert all(bm.ref_count(b) == 0 for b in range(4))


def test_prefix_hit_takes_only_full_blocks() -> None:
    bm = BlockManager(16, BLOCK_SIZE)
    tokens = list(range(10))  # 2 full blocks + 2 tokens
    first = make_seq(0, tokens)
    compute_all(bm, first)
    second = make_seq(1, [*tokens, 99])
    bm.match_prefix(second)
    assert second.block_table == first.block_table[:2]
    assert second.num_computed_tokens == second.num_cached_tokens == 8
    assert bm.stats.num_queries == 10 + 11
    assert bm.stats.num_hits == 8
    assert bm.stats.num_requests == 2


def test_whole_prompt_is_never_cached_last_token_is_computed() -> None:
    bm = BlockManager(16, BLOCK_SIZE)
    tokens = list(range(8))  # exactly 2 full blocks
    compute_all(bm, make_seq(0, tokens))
    again = make_seq(1, tokens)
    bm.match_prefix(again)
    assert again.num_computed_tokens == 4  # the second block holds the last token: recomputed
    assert len(again.block_table) == 1


def test_match_stops_at_the_first_miss() -> None:
    bm = BlockManager(16, BLOCK_SIZE)
    compute_all(bm, make_seq(0, [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 0]))
    seq = make_seq(1, [1, 1, 1, 1, 9, 9, 9, 9, 3, 3, 3, 3, 0])
    bm.match_prefix(seq)
    assert seq.num_computed_tokens == 4  # block 2 equals, but its parent differs


def test_salt_separates_tenants() -> None:
    bm = BlockManager(16, BLOCK_SIZE)
    tokens = list(range(9))
    compute_all(bm, make_seq(0, tokens, salt="tenant-a"))
    for seq_id, salt in [(1, "tenant-b"), (2, None)]:
        other = make_seq(seq_id, tokens, salt=salt)
        bm.match_prefix(other)
        assert other.num_computed_tokens == 0
    same = make_seq(3, tokens, salt="tenant-a")
    bm.match_prefix(same)
    assert same.num_computed_tokens == 8


def test_forced_hash_collision_is_not_a_hit() -> None:
    def constant_hash(parent: bytes | None, tokens: tuple[int, ...], salt: str | None) -> bytes:
        return b"same"

    bm = BlockManager(16, BLOCK_SIZE, hash_fn=constant_hash)
    compute_all(bm, make_seq(0, [1, 2, 3, 4, 5]))
    other = make_seq(1, [7, 7, 7, 7, 5])
    bm.match_prefix(other)
    assert other.num_computed_tokens == 0
    assert other.block_table == []
    # The same content under the colliding hash is still found.
    same = make_seq(2, [1, 2, 3, 4, 6])
    bm.match_prefix(same)
    assert same.num_computed_tokens == 4


def test_hash_chain_depends_on_parent_tokens_and_salt() -> None:
    root = hash_block(None, (1, 2), None)
    assert root == hash_block(None, (1, 2), None)
    assert root != hash_block(None, (1, 2), "t")
    assert root != hash_block(None, (2, 1), None)
    assert hash_block(root, (3, 4), None) != hash_block(hash_block(None, (9,), None), (3, 4), None)


def test_shared_blocks_are_ref_counted() -> None:
    bm = BlockManager(8, BLOCK_SIZE)
    tokens = list(range(9))
    first = make_seq(0, tokens)
    compute_all(bm, first)
    second = make_seq(1, tokens)
    bm.match_prefix(second)
    shared = first.block_table[:2]
    assert all(bm.ref_count(b) == 2 for b in shared)
    assert bm.num_free_blocks() == 8 - 3  # sharing costs no extra block
    bm.free(first)
    assert all(bm.ref_count(b) == 1 for b in shared)
    assert bm.num_free_blocks() == 8 - 2
    bm.free(second)
    assert bm.num_free_blocks() == 8
    assert bm.num_cached_blocks() == 2  # free, but still cached


def test_free_cached_blocks_are_reused_on_a_later_hit() -> None:
    bm = BlockManager(8, BLOCK_SIZE)
    tokens = list(range(9))
    first = make_seq(0, tokens)
    compute_all(bm, first)
    cached = first.block_table[:2]
    bm.free(first)
    later = make_seq(1, tokens)
    bm.match_prefix(later)
    assert later.block_table == cached
    assert bm.num_free_blocks() == 6


def test_uncached_blocks_go_first_then_lru_eviction() -> None:
    bm = BlockManager(4, BLOCK_SIZE)
    old = make_seq(0, [1, 1, 1, 1, 0])
    new = make_seq(1, [2, 2, 2, 2, 0])
    compute_all(bm, old)
    compute_all(bm, new)
    bm.free(old)
    bm.free(new)
    assert bm.num_cached_blocks() == 2
    grab = make_seq(2, [5] * 8)
    assert bm.allocate_slots(grab, 8)  # the two uncached blocks: nothing evicted
    assert bm.num_cached_blocks() == 2
    grab.num_computed_tokens = 8
    assert bm.allocate_slots(grab, 1)  # evicts the least recently used: `old`'s block
    assert bm.num_cached_blocks() == 1
    for seq_id, tokens, hit in [(3, [1, 1, 1, 1, 0], 0), (4, [2, 2, 2, 2, 0], 4)]:
        probe = make_seq(seq_id, tokens)
        bm.match_prefix(probe)
        assert probe.num_computed_tokens == hit


def test_a_hit_refreshes_lru_position() -> None:
    bm = BlockManager(4, BLOCK_SIZE)
    a = make_seq(0, [1, 1, 1, 1, 0])
    b = make_seq(1, [2, 2, 2, 2, 0])
    compute_all(bm, a)
    bm.free(a)
    compute_all(bm, b)
    bm.free(b)
    reuse_a = make_seq(2, [1, 1, 1, 1, 0])
    compute_all(bm, reuse_a)  # a's block is used again, then freed: now the most recent
    bm.free(reuse_a)
    filler = make_seq(3, [7] * 12)
    assert bm.allocate_slots(filler, 8)
    assert bm.num_cached_blocks() == 2
    filler.num_computed_tokens = 8
    assert bm.allocate_slots(filler, 4)  # the uncached blocks are gone: evicts b (LRU), not a
    probe_a = make_seq(4, [1, 1, 1, 1, 0])
    bm.match_prefix(probe_a)
    assert probe_a.num_computed_tokens == 4
    probe_b = make_seq(5, [2, 2, 2, 2, 0])
    bm.match_prefix(probe_b)
    assert probe_b.num_computed_tokens == 0


def test_duplicate_content_keeps_the_first_cached_block() -> None:
    bm = BlockManager(8, BLOCK_SIZE)
    a = make_seq(0, [1, 2, 3, 4, 0])
    b = make_seq(1, [1, 2, 3, 4, 0])
    for seq in (a, b):  # both admitted before either computed: no hit
        bm.match_prefix(seq)
        assert bm.allocate_slots(seq, 5)
    for seq in (a, b):
        seq.num_computed_tokens = 5
        bm.commit(seq)
    assert bm.num_cached_blocks() == 1
    first_of_a, first_of_b = a.block_table[0], b.block_table[0]
    assert first_of_a != first_of_b
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks() == 8
    probe = make_seq(2, [1, 2, 3, 4, 0])
    bm.match_prefix(probe)
    assert probe.block_table == [first_of_a]


def test_generated_tokens_are_cached_too() -> None:
    bm = BlockManager(8, BLOCK_SIZE)
    seq = make_seq(0, [1, 2, 3])
    compute_all(bm, seq)
    seq.append_token(4)
    seq.append_token(5)
    assert bm.allocate_slots(seq, 2)
    seq.num_computed_tokens = 5
    bm.commit(seq)
    probe = make_seq(1, [1, 2, 3, 4, 5])
    bm.match_prefix(probe)
    assert probe.num_computed_tokens == 4


def test_prefix_caching_disabled_never_hits() -> None:
    bm = BlockManager(8, BLOCK_SIZE, enable_prefix_caching=False)
    tokens = list(range(9))
    compute_all(bm, make_seq(0, tokens))
    probe = make_seq(1, tokens)
    bm.match_prefix(probe)
    assert probe.num_computed_tokens == 0
    assert bm.num_cached_blocks() == 0
    assert bm.stats.num_queries == 0


def test_admit_allocates_the_chunk_after_the_hit() -> None:
    bm = BlockManager(8, BLOCK_SIZE)
    compute_all(bm, make_seq(0, list(range(9))))
    seq = make_seq(1, list(range(20)))
    assert bm.admit(seq, 5) == 5
    assert seq.num_computed_tokens == 8
    assert len(seq.block_table) == 4  # 2 hit + ceil(5 / 4) new
    assert seq.num_cached_tokens == 8


def test_admit_that_does_not_fit_changes_nothing() -> None:
    bm = BlockManager(4, BLOCK_SIZE)
    donor = make_seq(0, list(range(9)))
    compute_all(bm, donor)
    bm.free(donor)  # two cached blocks, all four free
    seq = make_seq(1, list(range(30)))
    queries_before = bm.stats.num_queries
    # the 2 hit blocks leave 2 free, but 8 + 12 tokens need 5 blocks
    assert bm.admit(seq, 12) == 0
    assert seq.block_table == []
    assert seq.num_computed_tokens == 0
    assert bm.num_free_blocks() == 4
    assert bm.num_cached_blocks() == 2
    assert bm.stats.num_queries == queries_before
    assert bm.admit(seq, 8) == 8  # 8 hit + 8 new tokens need 4 blocks


def test_readmission_after_preemption_keeps_first_cached_count() -> None:
    bm = BlockManager(8, BLOCK_SIZE)
    seq = make_seq(0, list(range(6)))
    bm.match_prefix(seq)
    assert seq.num_cached_tokens == 0
    assert bm.allocate_slots(seq, 6)
    seq.num_computed_tokens = 6
    bm.commit(seq)
    bm.free(seq)
    seq.num_computed_tokens = 0
    seq.num_preemptions = 1
    bm.match_prefix(seq)
    assert seq.num_computed_tokens == 4  # its own block comes back from the cache
    assert seq.num_cached_tokens == 0  # usage still reports the first admission


def test_match_prefix_on_a_seq_holding_blocks_is_an_error() -> None:
    bm = BlockManager(4, BLOCK_SIZE)
    seq = make_seq(0, [1, 2])
    assert bm.allocate_slots(seq, 2)
    with pytest.raises(FulcrumError):
        bm.match_prefix(seq)
