"""Paged KV bookkeeping: which physical blocks each sequence owns, and prefix caching of full blocks
(chained content hashes with a tenant salt, reference counts, LRU eviction of free cached blocks).
No tensors here: the runner writes token p of a sequence to slot
block_table[p // block_size] * block_size + p % block_size."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from fulcrum.errors import ConfigError, FulcrumError
from fulcrum.llm.sequence import Sequence

# (parent block hash or None for the first block, the block's token ids, cache salt) -> hash
HashFn = Callable[[bytes | None, tuple[int, ...], str | None], bytes]


def hash_block(parent_hash: bytes | None, token_ids: tuple[int, ...], salt: str | None) -> bytes:
    """SHA-256 of the parent hash and the tokens; the first block of a chain carries the salt."""
    # A cryptographic hash makes chain collisions infeasible even for crafted prompts; the stored
    # tokens are compared on every hit as well.
    if parent_hash is None:
        seed = b"root" if salt is None else b"salt:" + salt.encode("utf-8", "surrogatepass")
        digest = hashlib.sha256(hashlib.sha256(seed).digest())
    else:
        digest = hashlib.sha256(parent_hash)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


@dataclass
class PrefixCacheStats:
    """Cumulative prefix-cache lookups in tokens (vLLM's `prefix_cache_queries` / `_hits`)."""

    num_requests: int = 0  # admissions that looked up the cache
    num_queries: int = 0  # tokens looked up
    num_hits: int = 0  # of those, tokens found in the cache


class _Block:
    """One physical KV block: its references and, when cached, the content it holds."""

    __slots__ = ("block_id", "hash", "parent_hash", "ref_count", "salt", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None  # set while the block is in the prefix cache
        self.parent_hash: bytes | None = None
        self.salt: str | None = None
        self.token_ids: tuple[int, ...] = ()

    def holds(
        self, parent_hash: bytes | None, token_ids: tuple[int, ...], salt: str | None
    ) -> bool:
        """True when the cached content is exactly this block of that chain."""
        return self.token_ids == token_ids and self.parent_hash == parent_hash and self.salt == salt


class BlockManager:
    """Allocates KV blocks to sequences and shares full blocks with equal prefixes."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        hash_fn: HashFn = hash_block,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ConfigError(
                f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = PrefixCacheStats()
        self._hash_fn = hash_fn
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free_uncached: deque[int] = deque(range(num_blocks))
        # Free blocks still in the prefix cache, least recently used first: evicted only when
        # no uncached block is left, so cached prefixes live as long as memory allows.
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        self._num_committed: dict[int, int] = {}  # seq_id -> leading blocks already registered

    def num_free_blocks(self) -> int:
        """Blocks no sequence references (free cached blocks included: they can be evicted)."""
        return len(self._free_uncached) + len(self._free_cached)

    def usage(self) -> float:
        """Fraction of blocks referenced by some sequence."""
        return 1.0 - self.num_free_blocks() / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        """How many sequences reference the block."""
        return self._blocks[block_id].ref_count

    def num_cached_blocks(self) -> int:
        """Blocks currently registered in the prefix cache (referenced or free)."""
        return len(self._cached)

    def match_prefix(self, seq: Sequence) -> None:
        """Take the longest run of cached full blocks of seq's tokens as its computed prefix."""
        self._take_prefix(seq, self._find_prefix(seq))

    def admit(self, seq: Sequence, max_num_new_tokens: int) -> int:
        """Match the prefix, then allocate the next chunk: its size, or 0 (no change) if full."""
        hit_ids = self._find_prefix(seq)
        num_new_tokens = min(seq.num_tokens - len(hit_ids) * self.block_size, max_num_new_tokens)
        num_hit_tokens = len(hit_ids) * self.block_size
        num_needed = self._num_blocks_for(num_hit_tokens + num_new_tokens) - len(hit_ids)
        # Hit blocks that sit in the free pool stop being free once taken.
        num_free_after_hits = self.num_free_blocks() - sum(
            1 for b in hit_ids if self._blocks[b].ref_count == 0
        )
        if num_new_tokens < 1 or num_needed > num_free_after_hits:
            return 0
        self._take_prefix(seq, hit_ids)
        if not self.allocate_slots(seq, num_new_tokens):
            raise FulcrumError(
                "block accounting is inconsistent: admitted a sequence that didn't fit"
            )
        return num_new_tokens

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Extend seq's block table to cover its next num_new_tokens; False (no change) if full."""
        num_needed = self._num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(
            seq.block_table
        )
        if num_needed > self.num_free_blocks():
            return False
        for _ in range(num_needed):
            seq.block_table.append(self._pop_free_block())
        return True

    def commit(self, seq: Sequence) -> None:
        """Register the blocks that became full and computed in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        start = self._num_committed.get(seq.seq_id, 0)
        if num_full <= start:
            return  # no block became full: the common decode step (called per sequence per step)
        self._extend_hashes(seq, num_full)
        for i in range(start, num_full):
            block = self._blocks[seq.block_table[i]]
            # An equal block computed concurrently by another sequence stays the cached one.
            if block.hash is not None or seq.block_hashes[i] in self._cached:
                continue
            block.hash = seq.block_hashes[i]
            block.parent_hash = seq.block_hashes[i - 1] if i > 0 else None
            block.salt = seq.cache_salt
            block.token_ids = self._block_tokens(seq, i)
            self._cached[block.hash] = block.block_id
        self._num_committed[seq.seq_id] = max(start, num_full)

    def trim(self, seq: Sequence) -> None:
        """Free the blocks past seq's computed tokens (slots of rejected draft tokens). They were
        allocated this step and never committed, so none is shared or in the prefix cache."""
        num_keep = self._num_blocks_for(seq.num_computed_tokens)
        for block_id in seq.block_table[num_keep:]:
            block = self._blocks[block_id]
            if block.ref_count != 1 or block.hash is not None:
                raise FulcrumError(f"block {block_id} past the computed tokens is shared or cached")
            block.ref_count = 0
            self._free_uncached.append(block_id)
        del seq.block_table[num_keep:]

    def free(self, seq: Sequence) -> None:
        """Drop seq's references; unreferenced cached blocks stay reusable until evicted."""
        # Tail blocks first, so they are evicted before the prefixes they depend on.
        for block_id in reversed(seq.block_table):
            block = self._blocks[block_id]
            if block.ref_count < 1:
                raise FulcrumError(f"block {block_id} freed with no reference (double free)")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None:
                    self._free_cached[block_id] = None
                else:
                    self._free_uncached.append(block_id)
        seq.block_table = []
        self._num_committed.pop(seq.seq_id, None)

    def _num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_tokens(self, seq: Sequence, index: int) -> tuple[int, ...]:
        start = index * self.block_size
        return tuple(seq.token_ids[start : start + self.block_size])

    def _extend_hashes(self, seq: Sequence, num_blocks: int) -> None:
        for i in range(len(seq.block_hashes), num_blocks):
            parent = seq.block_hashes[i - 1] if i > 0 else None
            seq.block_hashes.append(
                self._hash_fn(parent, self._block_tokens(seq, i), seq.cache_salt)
            )

    def _find_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the cached prefix, without taking them."""
        if seq.block_table:
            raise FulcrumError(f"sequence {seq.seq_id} already holds blocks")
        if not self.enable_prefix_caching:
            return []
        # The last known token is never taken from the cache: computing it yields the logits.
        num_candidates = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, num_candidates)
        hit_ids: list[int] = []
        for i in range(num_candidates):
            block_id = self._cached.get(seq.block_hashes[i])
            if block_id is None:
                break
            parent = seq.block_hashes[i - 1] if i > 0 else None
            if not self._blocks[block_id].holds(parent, self._block_tokens(seq, i), seq.cache_salt):
                break  # a hash collision: never serve another prefix's K/V
            hit_ids.append(block_id)
        return hit_ids

    def _take_prefix(self, seq: Sequence, hit_ids: list[int]) -> None:
        for block_id in hit_ids:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._free_cached[block_id]
            block.ref_count += 1
        num_hit_tokens = len(hit_ids) * self.block_size
        seq.block_table = list(hit_ids)
        seq.num_computed_tokens = num_hit_tokens
        self._num_committed[seq.seq_id] = len(hit_ids)
        if seq.num_preemptions == 0:  # usage reports what the client's prompt saved, once
            seq.num_cached_tokens = num_hit_tokens
        if self.enable_prefix_caching:
            self.stats.num_requests += 1
            self.stats.num_queries += seq.num_tokens
            self.stats.num_hits += num_hit_tokens

    def _pop_free_block(self) -> int:
        if self._free_uncached:
            block_id = self._free_uncached.popleft()
        else:
            block_id, _ = self._free_cached.popitem(last=False)
            self._evict(self._blocks[block_id])
        self._blocks[block_id].ref_count = 1
        return block_id

    def _evict(self, block: _Block) -> None:
        if block.hash is not None:
            del self._cached[block.hash]
        block.hash = block.parent_hash = block.salt = None
        block.token_ids = ()
