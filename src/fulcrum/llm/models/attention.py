"""Paged attention: write a step's new K/V into the block pool, attend over each sequence's blocks.

A step is a flat, varlen batch: the new tokens of every scheduled sequence concatenated. Per layer,
one SDPA call per group (decode buckets; prefill chunks): queries viewed (or, for chunks of unequal
length, scattered) into a padded (B, H, max_q, D) batch, keys and values gathered from each
sequence's block table into (B, Hkv, max_blocks * block_size, D), and a mask keeps each query
causal within its chunk and full over the earlier context. Decodes of a grouped-query model fold
the query heads sharing a KV head into that head's query rows, (B, Hkv, H / Hkv, D): one SDPA row
block per KV head instead of a one-row block per query head (about 25% faster on CPU, same greedy
tokens). On the CPU in float32, decodes skip all of this: one group whose queries read each
sequence's own blocks in place (`decode_kernel.paged_decode`: no gather, no padding, no mask); a
decode verifying k drafts joins it as k + 1 decode rows (`build_metadata(in_place_queries=)`).
The layout is built once per step (`attention_metadata.build_metadata`); layers with a sliding
window attend through its windowed variant (`AttentionMetadata.windowed`): masks that also hide
keys `window` or more positions back, and in-place decodes that start reading there.

A layer's pool is head-major, (Hkv, num_blocks, block_size, D) (`kv_cache_shape`): gathering a
sequence's blocks then gives each KV head's keys as one contiguous (K, D) slab, which SDPA reads
faster than keys interleaved across heads (about 10% off a decode step's attention on CPU).

Attention logit soft-capping (Gemma 2: scores -> softcap * tanh(scores / softcap) before the
mask) is applied in the in-place decode path (`paged_decode(softcap=)`); SDPA cannot say it, so
other capped groups compute the scores explicitly (`_capped_sdpa`), as transformers' eager
attention does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fulcrum.llm.models.attention_metadata import (
    AttentionGroup,
    AttentionMetadata,
    build_metadata,
)
from fulcrum.llm.models.decode_kernel import paged_decode

__all__ = [
    "AttentionGroup",
    "AttentionMetadata",
    "build_metadata",
    "kv_cache_shape",
    "paged_attention",
]


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int]:
    """Shape of one layer's K (or V) block pool: head-major, (Hkv, num_blocks, block_size, D)."""
    return (num_kv_heads, num_blocks, block_size, head_dim)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    softcap: float = 0.0,
) -> torch.Tensor:
    """q (T, H, D), k/v (T, Hkv, D), caches (Hkv, num_blocks, block_size, D) -> (T, H, D);
    softcap > 0 caps the attention logits."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
    v_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
    if meta.groups_in_order:
        outs = [
            _attend(q[g.row_range[0] : g.row_range[1]], k_cache, v_cache, g, scale, softcap)
            for g in meta.groups
            if g.row_range is not None
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs)
    out = torch.empty_like(q)
    for group in meta.groups:
        rows = group.token_rows
        out[rows] = _attend(q[rows], k_cache, v_cache, group, scale, softcap)
    return out


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    softcap: float = 0.0,
) -> torch.Tensor:
    num_heads, head_dim = q.shape[1], q.shape[2]
    b, max_q = group.num_seqs, group.max_query_len
    num_kv_heads = k_cache.shape[0]
    if group.context_lens is not None:  # decodes read in place: (Bg, Hkv, H / Hkv, D) queries
        q_fold = q.view(b, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = paged_decode(
            q_fold,
            k_cache,
            v_cache,
            group.block_tables,
            group.context_lens,
            scale,
            skip=group.window_skip,
            softcap=softcap,
        )
        return out.view(b, num_heads, head_dim)
    if group.token_index is None:
        q_pad = q  # every member has max_q queries: already the padded layout
    else:
        q_pad = q.new_zeros(b * max_q, num_heads, head_dim)
        q_pad[group.token_index] = q
    q_pad = q_pad.view(b, max_q, num_heads, head_dim).transpose(1, 2)  # (Bg, H, max_q, D)
    # (Hkv, Bg * max_blocks, block_size, D) -> (Bg, Hkv, K, D), each (K, D) slab contiguous
    blocks = group.block_tables.flatten()
    keys = k_cache.index_select(1, blocks).view(num_kv_heads, b, -1, head_dim).transpose(0, 1)
    values = v_cache.index_select(1, blocks).view(num_kv_heads, b, -1, head_dim).transpose(0, 1)
    bias = group.attn_bias
    if bias is not None and bias.dtype != q.dtype:
        bias = bias.to(q.dtype)  # SDPA takes a float mask only in the query's dtype
    if softcap:
        out = _capped_sdpa(q_pad, keys, values, group.mask, scale, softcap)  # (Bg, H, max_q, D)
    elif max_q == 1 and num_heads != num_kv_heads:
        # Decode with grouped KV heads: the query heads sharing a KV head become that head's
        # query rows, (Bg, Hkv, H / Hkv, D), one SDPA row block per KV head instead of a
        # 1-row one per query head. The (Bg, 1, 1, K) mask broadcasts over the rows.
        q_fold = q_pad.reshape(b, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(q_fold, keys, values, attn_mask=bias, scale=scale)
        return out.reshape(b, num_heads, head_dim)  # one query each: nothing padded
    else:
        out = F.scaled_dot_product_attention(
            q_pad,
            keys,
            values,
            attn_mask=bias,
            is_causal=bias is None,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )  # (Bg, H, max_q, D)
    out = out.transpose(1, 2).reshape(b * max_q, num_heads, head_dim)
    return out if group.token_index is None else out[group.token_index]


def _capped_sdpa(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """SDPA with soft-capped logits: q (Bg, H, Q, D), keys/values (Bg, Hkv, K, D), mask
    (Bg, 1, Q, K) bool or None (causal from key 0) -> (Bg, H, Q, D)."""
    groups = q.shape[1] // keys.shape[1]
    if groups > 1:
        keys = keys.repeat_interleave(groups, dim=1)
        values = values.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, keys.transpose(2, 3)) * scale  # (Bg, H, Q, K)
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        num_q, num_k = scores.shape[2], scores.shape[3]
        mask = torch.ones(num_q, num_k, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), values)
