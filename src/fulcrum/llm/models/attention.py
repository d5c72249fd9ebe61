"""Paged attention: write a step's new K/V into the block pool, attend over each sequence's blocks.

A step is a flat, varlen batch: the new tokens of every scheduled sequence concatenated. Per layer,
one SDPA call per group (decodes; prefill chunks): queries scattered into a padded
(B, H, max_q, D) view, keys and values gathered from each sequence's block table into
(B, Hkv, max_blocks * block_size, D), and a boolean mask keeps each query causal within its chunk
and full over the earlier context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionGroup:
    """Sequences attended in one SDPA call, padded to the group's longest query chunk."""

    token_rows: torch.Tensor  # (Tg,) rows of this group's tokens in the flat step
    token_index: torch.Tensor  # (Tg,) row of each token in the padded (Bg * max_q) view
    block_tables: torch.Tensor  # (Bg, max_blocks) int64, padded with block 0
    mask: torch.Tensor  # (Bg, 1, max_q, max_blocks * block_size) bool: True = may attend
    num_seqs: int
    max_query_len: int


@dataclass
class AttentionMetadata:
    """Per-step layout shared by every layer; built once by the runner."""

    slot_mapping: torch.Tensor  # (T,) int64: cache slot of each new token
    # Decodes (one query each) and prefill chunks are separate groups, so a long prefill chunk
    # does not pad every decode's query to its length.
    groups: list[AttentionGroup]


def build_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Slot mapping, padded block tables and attention masks for one step."""
    q_len = torch.tensor(query_lens, dtype=torch.int64)
    ctx_len = torch.tensor(context_lens, dtype=torch.int64)
    tables = _pad_tables(block_tables)
    seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens)), q_len)  # (T,)
    starts = torch.cumsum(q_len, 0) - q_len
    offset_in_chunk = torch.arange(int(q_len.sum())) - starts[seq_of_token]  # (T,)
    positions = ctx_len[seq_of_token] - q_len[seq_of_token] + offset_in_chunk  # (T,)
    slot_mapping = (
        tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    )
    groups = []
    for members in (q_len == 1, q_len > 1):
        seq_ids = members.nonzero().flatten()
        if len(seq_ids) == 0:
            continue
        rows = members[seq_of_token].nonzero().flatten()
        groups.append(
            _group(
                seq_ids,
                rows,
                q_len,
                ctx_len,
                tables,
                seq_of_token,
                offset_in_chunk,
                block_size,
                device,
            )
        )
    return AttentionMetadata(slot_mapping=slot_mapping.to(device), groups=groups)


def _pad_tables(block_tables: list[list[int]]) -> torch.Tensor:
    max_blocks = max(len(t) for t in block_tables)
    return torch.tensor([t + [0] * (max_blocks - len(t)) for t in block_tables], dtype=torch.int64)


def _group(
    seq_ids: torch.Tensor,
    rows: torch.Tensor,
    q_len: torch.Tensor,
    ctx_len: torch.Tensor,
    tables: torch.Tensor,
    seq_of_token: torch.Tensor,
    offset_in_chunk: torch.Tensor,
    block_size: int,
    device: torch.device,
) -> AttentionGroup:
    g_q, g_ctx = q_len[seq_ids], ctx_len[seq_ids]
    max_q = int(g_q.max())
    num_blocks = int((g_ctx.max() + block_size - 1) // block_size)
    # Position of each member sequence inside the group (sequence id -> group slot).
    slot_of_seq = torch.full((len(q_len),), -1, dtype=torch.int64)
    slot_of_seq[seq_ids] = torch.arange(len(seq_ids))
    token_index = slot_of_seq[seq_of_token[rows]] * max_q + offset_in_chunk[rows]
    # Query j of a sequence sits at absolute position ctx_len - q_len + j and sees keys <= it.
    query_pos = (g_ctx - g_q)[:, None] + torch.arange(max_q)[None, :]  # (Bg, max_q)
    key_pos = torch.arange(num_blocks * block_size)  # (K,)
    mask = key_pos[None, None, :] <= query_pos[:, :, None]  # (Bg, max_q, K)
    # Padding query rows would attend nothing and give NaN; let them see key 0 (output dropped).
    mask[:, :, 0] = True
    return AttentionGroup(
        token_rows=rows.to(device),
        token_index=token_index.to(device),
        block_tables=tables[seq_ids, :num_blocks].to(device),
        mask=mask[:, None].to(device),
        num_seqs=len(seq_ids),
        max_query_len=max_q,
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q (T, H, D), k/v (T, Hkv, D), caches (num_blocks, block_size, Hkv, D) -> (T, H, D)."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim)[meta.slot_mapping] = k
    v_cache.view(-1, num_kv_heads, head_dim)[meta.slot_mapping] = v
    if len(meta.groups) == 1:
        return _attend(q, k_cache, v_cache, meta.groups[0], scale)
    out = torch.empty_like(q)
    for group in meta.groups:
        out[group.token_rows] = _attend(q[group.token_rows], k_cache, v_cache, group, scale)
    return out


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
) -> torch.Tensor:
    num_heads, head_dim = q.shape[1], q.shape[2]
    b, max_q = group.num_seqs, group.max_query_len
    q_pad = q.new_zeros(b * max_q, num_heads, head_dim)
    q_pad[group.token_index] = q
    q_pad = q_pad.view(b, max_q, num_heads, head_dim).transpose(1, 2)  # (Bg, H, max_q, D)
    # (Bg * max_blocks, block_size, Hkv, D) -> (Bg, Hkv, K, D)
    blocks = group.block_tables.flatten()
    num_kv_heads = k_cache.shape[2]
    keys = k_cache.index_select(0, blocks).view(b, -1, num_kv_heads, head_dim).transpose(1, 2)
    values = v_cache.index_select(0, blocks).view(b, -1, num_kv_heads, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q_pad,
        keys,
        values,
        attn_mask=group.mask,
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )  # (Bg, H, max_q, D)
    out = out.transpose(1, 2).reshape(b * max_q, num_heads, head_dim)
    return out[group.token_index]
