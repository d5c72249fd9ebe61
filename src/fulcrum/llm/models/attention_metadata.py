"""Per-step paged-attention layout: cache slots of the new tokens, and the SDPA groups (decodes
bucketed by context length, prefill chunks) with their block tables and masks. Built once per step
from plain lists, shared by every layer; layers with a sliding window share a windowed variant,
built on first use in the step."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

# Per-layer cost of one more SDPA group (its gather and SDPA calls, mask, output copy) measured
# on CPU as about the cost of gathering and attending this many padded (sequence, block) rows.
# A decode bucket is split off only when it saves more padding than this.
GROUP_COST_BLOCK_ROWS = 48
# The same for chunks that start a prompt, whose padded work grows with max_query_len ** 2: one
# more group costs about as much as attending a padded 128-token chunk.
GROUP_COST_SQUARED_QUERIES = 128**2
MAX_GROUPS = 4  # per kind (decodes, fresh chunks)


@dataclass
class AttentionGroup:
    """Sequences attended in one SDPA call, padded to the group's longest query chunk."""

    token_rows: torch.Tensor  # (Tg,) rows of this group's tokens in the flat step
    # (start, end) when token_rows is that contiguous range: a slice instead of a gather.
    row_range: tuple[int, int] | None
    # (Tg,) row of each token in the padded (Bg * max_q) view; None when nothing is padded
    # (every member has max_q queries), so queries and outputs need no scatter or gather.
    token_index: torch.Tensor | None
    block_tables: torch.Tensor  # (Bg, max_blocks) int64, padded with block 0
    # (Bg, 1, max_q, max_blocks * block_size) bool: True = may attend. None for a causal group:
    # chunks that start at position 0, so SDPA's own causal mask is exact (and skips the upper
    # triangle instead of computing and masking it); padding query rows are dropped anyway.
    mask: torch.Tensor | None
    attn_bias: torch.Tensor | None  # the mask as SDPA's additive float mask (0 / -inf), built once
    num_seqs: int
    max_query_len: int
    # (Bg,) int64 context lengths of a decode group attended in place (`decode_kernel`): no
    # gather, no mask, no padding. None for the gather-and-SDPA path.
    context_lens: torch.Tensor | None = None
    # (Bg,) int64, windowed in-place decodes: their block tables start at the window's first
    # block and context_lens count keys from there; this many leading keys are outside the
    # window. None: no window.
    window_skip: torch.Tensor | None = None


@dataclass(frozen=True)
class StepLayout:
    """What a step's metadata is built from, kept to derive its windowed variants."""

    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    block_size: int
    device: torch.device
    split_chunks: bool
    in_place_decode: bool
    # Each sequence's prompt length (length-dependent RoPE); None: each step's sequences are
    # whole prompts (a one-shot prefill).
    prompt_lens: list[int] | None = None
    # With in_place_decode: chunks of 2..in_place_queries queries that continue a sequence (a
    # decode verifying drafts) are attended in place too, as that many decode rows.
    in_place_queries: int = 1


@dataclass
class AttentionMetadata:
    """Per-step layout shared by every layer; built once by the runner."""

    slot_mapping: torch.Tensor  # (T,) int64: cache slot of each new token
    # Decodes (one query each) and prefill chunks are separate groups, so a long prefill chunk
    # does not pad every decode's query to its length; decodes of very different context lengths
    # are split into buckets, so a short one does not gather a long one's worth of padding.
    groups: list[AttentionGroup]
    # True when the groups' row ranges tile the step in order: outputs concatenate.
    groups_in_order: bool
    layout: StepLayout | None = None
    _windowed: dict[int, AttentionMetadata] = field(default_factory=dict, repr=False)

    def windowed(self, window: int) -> AttentionMetadata:
        """This step for layers whose queries see only the last `window` positions (theirs
        included), as transformers' sliding-window mask: key k is seen by query q iff
        q - window < k <= q. Built once per step and window; K/V blocks outside every window
        stay allocated (freeing them is left for later)."""
        cached = self._windowed.get(window)
        if cached is None:
            layout = self.layout
            if layout is None:
                raise ValueError("a windowed layout needs metadata made by build_metadata")
            if max(layout.context_lens, default=0) <= window:
                cached = self  # no sequence is longer than the window: it hides nothing
            else:
                cached = _build(layout, window)
            self._windowed[window] = cached
        return cached

    def rope_lens(self, positions: torch.Tensor) -> torch.Tensor:
        """(T,) int64: each token's sequence length when transformers computes it (the prompt's
        for a prompt token, its own position + 1 for a generated one)."""
        layout = self.layout
        if layout is None:
            raise ValueError("RoPE lengths need metadata made by build_metadata")
        prompt_lens = layout.prompt_lens or layout.context_lens
        per_token = np.repeat(np.array(prompt_lens, dtype=np.int64), layout.query_lens)
        return torch.maximum(torch.from_numpy(per_token).to(positions.device), positions + 1)


def build_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    *,
    split_chunks: bool = False,
    in_place_decode: bool = False,
    prompt_lens: list[int] | None = None,
    in_place_queries: int = 1,
) -> AttentionMetadata:
    """Slot mapping, padded block tables and attention masks for one step."""
    # in_place_decode: all decodes form one group for `decode_kernel.paged_decode`, which reads
    # each sequence's own blocks in place (so no buckets, masks or padding are needed).
    # split_chunks: chunks that start at position 0 form their own groups (bucketed by length),
    # attended with SDPA's causal mask; the others (continued prompts, prefix-cache hits) keep
    # the explicit mask.
    # Off by default: one padded group for all chunks, as callers that lay out rows expect.
    # prompt_lens: each sequence's prompt length, for RoPE whose rotation depends on it.
    # in_place_queries > 1 (with in_place_decode): a chunk of q <= in_place_queries tokens after
    # cached context L - q (a decode verifying q - 1 drafts) joins the in-place group as q decode
    # rows over its block table, of context lengths L - q + 1 .. L: causal by construction, as
    # its K/V is written before attention, and no gather, mask or padding.
    layout = StepLayout(
        query_lens,
        context_lens,
        block_tables,
        block_size,
        device,
        split_chunks,
        in_place_decode,
        prompt_lens,
        in_place_queries if in_place_decode else 1,
    )
    return _build(layout, window=0)


def _build(layout: StepLayout, window: int) -> AttentionMetadata:
    """The metadata of a step; window > 0: for layers attending only that many positions."""
    query_lens, context_lens = layout.query_lens, layout.context_lens
    block_size, device = layout.block_size, layout.device
    row_starts = [0, *itertools.accumulate(query_lens)]
    groups: list[AttentionGroup] = []
    if layout.in_place_decode:
        in_place = _in_place_members(layout)
        if in_place:
            groups.append(_in_place_group(in_place, layout, row_starts, window))
        taken = set(in_place)
        members: list[list[int]] = []
    else:
        taken = {i for i, n in enumerate(query_lens) if n == 1}
        sizes = [-(-n // block_size) for n in context_lens]
        members = _buckets(sorted(taken), sizes, GROUP_COST_BLOCK_ROWS)
    chunks = [i for i in range(len(query_lens)) if i not in taken]
    if chunks:
        fresh = (
            [i for i in chunks if query_lens[i] == context_lens[i]] if layout.split_chunks else []
        )
        rest = [i for i in chunks if i not in fresh]
        members += _buckets(fresh, [n * n for n in query_lens], GROUP_COST_SQUARED_QUERIES)
        members += [rest] if rest else []
    groups += [_group(m, layout, row_starts, window) for m in members]
    return AttentionMetadata(
        slot_mapping=_int_tensor(_slots(layout), device),
        groups=groups,
        groups_in_order=_tile_in_order(groups),
        layout=layout,
    )


def _in_place_members(layout: StepLayout) -> list[int]:
    """The sequences whose queries are attended in place: decodes, and short chunks that
    continue their sequence (decodes verifying drafts)."""
    # One comprehension, not a call per sequence: this runs for every sequence every step.
    max_q = layout.in_place_queries
    return [
        i
        for i, (q_len, ctx_len) in enumerate(
            zip(layout.query_lens, layout.context_lens, strict=True)
        )
        if q_len == 1 or (q_len <= max_q and q_len < ctx_len)
    ]


def _slots(layout: StepLayout) -> list[int]:
    """The cache slot of each new token, in step order."""
    block_size = layout.block_size
    query_lens, context_lens, tables = layout.query_lens, layout.context_lens, layout.block_tables
    if all(q_len == 1 for q_len in query_lens):  # a decode-only step: one slot per sequence
        return [
            table[(ctx_len - 1) // block_size] * block_size + (ctx_len - 1) % block_size
            for ctx_len, table in zip(context_lens, tables, strict=True)
        ]
    slots: list[int] = []
    for q_len, ctx_len, table in zip(query_lens, context_lens, tables, strict=True):
        if q_len == 1:  # most tokens of a step are decodes: skip the per-block loop
            pos = ctx_len - 1
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        else:
            _extend_slots(slots, table, ctx_len - q_len, ctx_len, block_size)
    return slots


def _in_place_group(
    members: list[int], layout: StepLayout, row_starts: list[int], window: int
) -> AttentionGroup:
    """One group for `decode_kernel.paged_decode`: a decode row per query of each member (query
    j of a q-query chunk over context L sees the first L - q + 1 + j keys)."""
    block_size, device = layout.block_size, layout.device
    query_lens, context_lens = layout.query_lens, layout.context_lens
    tables: list[list[int]] = []
    lens: list[int] = []
    if all(query_lens[i] == 1 for i in members):  # decodes only: a row each
        tables = [layout.block_tables[i] for i in members]
        lens = [context_lens[i] for i in members]
    else:
        for i in members:
            q_len, ctx_len = query_lens[i], context_lens[i]
            tables += [layout.block_tables[i]] * q_len
            lens += range(ctx_len - q_len + 1, ctx_len + 1)
    skip = None
    if window > 0 and max(lens) > window:  # read from each window's first block on
        first = [max(0, n - window) // block_size for n in lens]
        tables = [table[f:] for table, f in zip(tables, first, strict=True)]
        skip = [max(0, n - window) - f * block_size for n, f in zip(lens, first, strict=True)]
        lens = [n - f * block_size for n, f in zip(lens, first, strict=True)]
    num_blocks = -(-max(lens) // block_size)
    token_rows, row_range = _rows(members, layout.query_lens, row_starts, device)
    return AttentionGroup(
        token_rows=token_rows,
        row_range=row_range,
        token_index=None,
        block_tables=_padded_tables(tables, num_blocks, device),
        mask=None,
        attn_bias=None,
        num_seqs=len(lens),
        max_query_len=1,
        context_lens=_int_tensor(lens, device),
        window_skip=None if skip is None else _int_tensor(skip, device),
    )


def _padded_tables(tables: list[list[int]], num_blocks: int, device: torch.device) -> torch.Tensor:
    """(B, num_blocks) int64: each table cut or padded with block 0 to num_blocks (padding is
    never read: a row reads only its own context's blocks)."""
    lens = list(map(len, tables))
    if max(lens) > num_blocks:  # a table longer than the group reads (drafts' blocks): cut
        tables = [table[:num_blocks] for table in tables]
        lens = list(map(len, tables))
    # All blocks flat, scattered into a zeroed matrix (a boolean mask fills in row-major
    # order): about half the cost of padding a Python list per row and converting those.
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int64, count=sum(lens))
    out = np.zeros((len(tables), num_blocks), dtype=np.int64)
    out[np.arange(num_blocks)[None, :] < np.array(lens, dtype=np.int64)[:, None]] = flat
    return torch.from_numpy(out).to(device)


def _rows(
    members: list[int], query_lens: list[int], row_starts: list[int], device: torch.device
) -> tuple[torch.Tensor, tuple[int, int] | None]:
    """The step rows of the members' tokens, and their (start, end) when that is one range."""
    first_row, num_rows = row_starts[members[0]], sum(query_lens[i] for i in members)
    # Contiguous when each member's rows start where the previous member's end: so when the
    # members are consecutive sequences (the common case, checked in O(1)), or else pairwise.
    if members[-1] - members[0] == len(members) - 1 and members == sorted(members):
        return torch.arange(first_row, first_row + num_rows, device=device), (
            first_row,
            first_row + num_rows,
        )
    if all(row_starts[i] + query_lens[i] == row_starts[j] for i, j in itertools.pairwise(members)):
        return torch.arange(first_row, first_row + num_rows, device=device), (
            first_row,
            first_row + num_rows,
        )
    rows = [r for i in members for r in range(row_starts[i], row_starts[i] + query_lens[i])]
    return _int_tensor(rows, device), None


def _tile_in_order(groups: list[AttentionGroup]) -> bool:
    end = 0
    for group in groups:
        if group.row_range is None or group.row_range[0] != end:
            return False
        end = group.row_range[1]
    return True


def _extend_slots(
    slots: list[int], table: list[int], first_pos: int, end_pos: int, block_size: int
) -> None:
    """Append the cache slots of positions first_pos..end_pos-1, one range per block."""
    for j in range(first_pos // block_size, (end_pos - 1) // block_size + 1):
        base = table[j] * block_size - j * block_size
        lo, hi = max(first_pos, j * block_size), min(end_pos, (j + 1) * block_size)
        slots.extend(range(base + lo, base + hi))


def _buckets(members: list[int], sizes: list[int], group_cost: int) -> list[list[int]]:
    """Members split into buckets of similar padded size (largest first) when padding the
    smaller ones to the largest costs more than another group; sizes[i] is member i's work."""
    if not members:
        return []
    by_size = sorted(members, key=lambda i: -sizes[i])  # stable: ties keep batch order
    ordered = [sizes[i] for i in by_size]
    starts = [0]
    while len(starts) < MAX_GROUPS:
        start = starts[-1]
        # Splitting at j saves (head size - size at j) padded work for each member from j.
        best_saving, best_j = 0, 0
        for j in range(start + 1, len(by_size)):
            saving = (ordered[start] - ordered[j]) * (len(by_size) - j)
            if saving > best_saving:
                best_saving, best_j = saving, j
        if best_saving <= group_cost:
            break
        starts.append(best_j)
    ends = [*starts[1:], len(by_size)]
    return [by_size[s:e] for s, e in zip(starts, ends, strict=True)]


def _group(
    members: list[int], layout: StepLayout, row_starts: list[int], window: int
) -> AttentionGroup:
    """A group attended by gathering its blocks into a padded SDPA batch."""
    block_size, device = layout.block_size, layout.device
    g_q = [layout.query_lens[i] for i in members]
    g_ctx = [layout.context_lens[i] for i in members]
    max_q = max(g_q)
    # A window that hides some key needs an explicit mask (SDPA's causal one cannot say it).
    windowed = window > 0 and max(g_ctx) > window
    num_blocks = -(-max(g_ctx) // block_size)
    token_index = None
    if any(n != max_q for n in g_q):
        token_index = _int_tensor(
            [slot * max_q + j for slot, n in enumerate(g_q) for j in range(n)], device
        )
    padding = [0] * num_blocks
    tables = [(layout.block_tables[i] + padding)[:num_blocks] for i in members]
    mask = bias = None
    if max_q == 1 or g_q != g_ctx or windowed:
        mask = _mask(g_q, g_ctx, max_q, num_blocks * block_size, window).to(device)
        bias = torch.zeros(mask.shape, device=device).masked_fill_(~mask, float("-inf"))
    token_rows, row_range = _rows(members, layout.query_lens, row_starts, device)
    return AttentionGroup(
        token_rows=token_rows,
        row_range=row_range,
        token_index=token_index,
        block_tables=_int_tensor(tables, device),
        mask=mask,
        attn_bias=bias,
        num_seqs=len(members),
        max_query_len=max_q,
    )


def _int_tensor(values: list[int] | list[list[int]], device: torch.device) -> torch.Tensor:
    """An int64 tensor of (nested, rectangular) lists of ints."""
    # Via numpy: torch.tensor converts a Python list element by element, about 4x slower.
    return torch.from_numpy(np.array(values, dtype=np.int64)).to(device)


def _mask(
    g_q: list[int], g_ctx: list[int], max_q: int, num_keys: int, window: int = 0
) -> torch.Tensor:
    """(Bg, 1, max_q, K) bool: query j of a chunk sees keys up to its position (and, with a
    window, none `window` or more positions before it)."""
    q_len, ctx_len = torch.tensor(g_q), torch.tensor(g_ctx)
    key_pos = torch.arange(num_keys)  # (K,)
    if max_q == 1:
        mask = key_pos[None, :] < ctx_len[:, None]  # (Bg, K)
        if window:
            mask &= key_pos[None, :] >= (ctx_len - window)[:, None]
        return mask[:, None, None, :]  # (Bg, 1, 1, K)
    # Query j of a sequence sits at absolute position ctx_len - q_len + j and sees keys <= it.
    query_pos = (ctx_len - q_len)[:, None] + torch.arange(max_q)[None, :]  # (Bg, max_q)
    mask = key_pos[None, None, :] <= query_pos[:, :, None]  # (Bg, max_q, K)
    if window:
        mask &= key_pos[None, None, :] > query_pos[:, :, None] - window
    # Padding query rows would attend nothing and give NaN; let them see key 0 (output dropped).
    # Only those: a real row's window may exclude key 0.
    mask[:, :, 0] |= torch.arange(max_q)[None, :] >= q_len[:, None]
    return mask[:, None]
