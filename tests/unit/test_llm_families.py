"""Model families beyond Llama: each refuses a config it cannot serve exactly (naming the key),
soft-capped attention agrees across the decode kernel, the gather path and a plain reference,
mixture-of-experts dispatch equals a per-token loop, partial RoPE leaves the tail alone, and int8
quantization takes every family's projections (and leaves routers float)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from fulcrum.errors import ConfigError
from fulcrum.llm import quant
from fulcrum.llm.models import build_model
from fulcrum.llm.models.attention import build_metadata, kv_cache_shape, paged_attention
from fulcrum.llm.models.llama import LlamaConfig
from fulcrum.llm.models.moe import MoeConfig, SparseMoeBlock
from fulcrum.llm.models.rope import RopeConfig, RotaryEmbedding, apply_rope

SHAPE: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3": {"model_type": "qwen3", "head_dim": 16},
    "gemma2": {"model_type": "gemma2", "head_dim": 8, "sliding_window": 8},
    "gemma3_text": {"model_type": "gemma3_text", "head_dim": 8, "sliding_window": 8},
    "phi3": {"model_type": "phi3", "partial_rotary_factor": 0.5},
    "qwen2_moe": {
        "model_type": "qwen2_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 32,
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
    },
}
# family -> (a key it cannot serve exactly, its value), and the key the error must name
REFUSALS: dict[str, tuple[dict[str, Any], str]] = {
    "qwen3": ({"hidden_act": "gelu"}, "hidden_act"),
    "gemma2": ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    "gemma3_text": ({"hidden_activation": "relu"}, "hidden_activation"),
    "phi3": ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type"),
    "qwen2_moe": ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    "qwen3_moe": ({"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window"),
}


def _raw(family: str, **extra: Any) -> dict[str, Any]:
    return {**SHAPE, **FAMILIES[family], **extra}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_builds(family: str) -> None:
    model = build_model(_raw(family))
    assert model.num_layers == 2  # type: ignore[comparison-overlap]


@pytest.mark.parametrize("family", sorted(REFUSALS))
def test_a_config_it_cannot_serve_exactly_is_refused_naming_the_key(family: str) -> None:
    extra, key = REFUSALS[family]
    with pytest.raises(ConfigError, match=key):
        build_model(_raw(family, **extra))


def test_phi3_refuses_a_partial_rotary_factor_giving_an_odd_width() -> None:
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        build_model(_raw("phi3", partial_rotary_factor=0.4))  # int(8 * 0.4) = 3 dims


def test_unknown_model_type_lists_the_supported_families() -> None:
    with pytest.raises(ConfigError, match="gemma3_text") as info:
        build_model({**SHAPE, "model_type": "falcon"})
    for family in FAMILIES:
        assert family in str(info.value)


def test_gemma_layer_types_follow_the_sliding_window_pattern() -> None:
    model = build_model(_raw("gemma3_text", num_hidden_layers=6, sliding_window_pattern=3))
    windows = [layer.self_attn.window for layer in model.model.layers]
    assert windows == [8, 8, 0, 8, 8, 0]
    gemma2 = build_model(_raw("gemma2", num_hidden_layers=4))
    assert [layer.self_attn.window for layer in gemma2.model.layers] == [8, 0, 8, 0]


# Soft-capped attention


def _capped_reference(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, cap: float
) -> torch.Tensor:
    """q (H, D) of the last position over keys/values (K, Hkv, D), as transformers' eager path."""
    groups = q.shape[0] // keys.shape[1]
    k = keys.repeat_interleave(groups, dim=1).transpose(0, 1)  # (H, K, D)
    v = values.repeat_interleave(groups, dim=1).transpose(0, 1)
    scores = torch.einsum("hd,hkd->hk", q, k) * scale
    scores = torch.tanh(scores / cap) * cap
    return torch.einsum("hk,hkd->hd", torch.softmax(scores, dim=-1), v)


@pytest.mark.parametrize("in_place", [True, False])
def test_soft_capped_decode_matches_the_reference(in_place: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size, cap = 4, 2, 8, 4, 2.0
    lengths = [7, 13]
    shape = kv_cache_shape(16, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.zeros(shape), torch.zeros(shape)
    tables = [[1, 2], [3, 4, 5, 6]]
    # Large keys: scores well past the cap, where tanh bends them.
    keys = [torch.randn(n, num_kv_heads, head_dim, generator=gen) * 4 for n in lengths]
    values = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for n in lengths]
    prefill = build_metadata(lengths, lengths, tables, block_size, torch.device("cpu"))
    q_prefill = torch.zeros(sum(lengths), num_heads, head_dim)
    paged_attention(q_prefill, torch.cat(keys), torch.cat(values), k_cache, v_cache, prefill, 1.0)
    q = torch.randn(2, num_heads, head_dim, generator=gen)
    k_new = torch.randn(2, num_kv_heads, head_dim, generator=gen)
    v_new = torch.randn(2, num_kv_heads, head_dim, generator=gen)
    ctx = [n + 1 for n in lengths]
    meta = build_metadata(
        [1, 1], ctx, tables, block_size, torch.device("cpu"), in_place_decode=in_place
    )
    scale = head_dim**-0.5
    got = paged_attention(q, k_new, v_new, k_cache, v_cache, meta, scale, softcap=cap)
    for i in range(2):
        all_k = torch.cat([keys[i], k_new[i : i + 1]])
        all_v = torch.cat([values[i], v_new[i : i + 1]])
        want = _capped_reference(q[i], all_k, all_v, scale, cap)
        torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-5)
    uncapped = paged_attention(q, k_new, v_new, k_cache, v_cache, meta, scale)
    assert not torch.allclose(uncapped, got, atol=1e-3)  # the cap changed the result


def test_soft_capped_prefill_matches_the_reference() -> None:
    gen = torch.Generator().manual_seed(1)
    num_heads, num_kv_heads, head_dim, block_size, cap = 4, 2, 8, 4, 2.0
    n = 9
    k_cache = torch.zeros(kv_cache_shape(8, block_size, num_kv_heads, head_dim))
    v_cache = torch.zeros_like(k_cache)
    q = torch.randn(n, num_heads, head_dim, generator=gen) * 3
    k = torch.randn(n, num_kv_heads, head_dim, generator=gen) * 3
    v = torch.randn(n, num_kv_heads, head_dim, generator=gen)
    meta = build_metadata([n], [n], [[0, 1, 2]], block_size, torch.device("cpu"))
    got = paged_attention(q, k, v, k_cache, v_cache, meta, 0.5, softcap=cap)
    for t in range(n):  # each query sees keys up to its own position
        want = _capped_reference(q[t], k[: t + 1], v[: t + 1], 0.5, cap)
        torch.testing.assert_close(got[t], want, rtol=1e-4, atol=1e-5)


# Mixture of experts


def _moe_block(norm_topk_prob: bool, shared: int) -> SparseMoeBlock:
    cfg = LlamaConfig.from_hf({**SHAPE, "model_type": "llama"})
    moe = MoeConfig(4, 2, 16, norm_topk_prob, shared, (True, True))
    block = SparseMoeBlock(cfg, moe)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return block


@pytest.mark.parametrize(("norm_topk_prob", "shared"), [(False, 32), (True, 0)])
def test_moe_dispatch_equals_a_per_token_loop(norm_topk_prob: bool, shared: int) -> None:
    block = _moe_block(norm_topk_prob, shared)
    x = torch.randn(11, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = block(x)
        for t in range(x.shape[0]):
            probs = torch.softmax(block.gate(x[t]), dim=-1)
            weights, chosen = torch.topk(probs, 2)
            if norm_topk_prob:
                weights = weights / weights.sum()
            want = sum(
                w * block.experts[int(e)](x[t : t + 1])[0]
                for w, e in zip(weights, chosen, strict=True)
            )
            if block.shared_expert is not None and block.shared_expert_gate is not None:
                gate = torch.sigmoid(block.shared_expert_gate(x[t]))
                want = want + gate * block.shared_expert(x[t : t + 1])[0]
            torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-6)


def test_moe_runs_only_the_experts_its_tokens_chose() -> None:
    block = _moe_block(False, 0)
    calls: list[int] = []
    for i, expert in enumerate(block.experts):
        expert.register_forward_hook(lambda *_, i=i: calls.append(i))
    with torch.no_grad():
        chosen = torch.topk(block.gate(torch.ones(1, 32)), 2).indices[0].tolist()
        block(torch.ones(1, 32))
    assert sorted(calls) == sorted(chosen)  # one call each, the other two never run


# Partial RoPE and quantization


def test_partial_rope_rotates_only_the_leading_dims() -> None:
    raw = {"max_position_embeddings": 16, "partial_rotary_factor": 0.5}
    rope = RopeConfig.from_hf(raw, 16, partial_rotary=True)
    assert rope.head_dim == 8
    tables = RotaryEmbedding(rope, 16).tables(torch.tensor([5]), None, torch.float32)
    x = torch.randn(1, 2, 16)
    out = apply_rope(x, tables)
    assert torch.equal(out[..., 8:], x[..., 8:])
    torch.testing.assert_close(out[..., :8], apply_rope(x[..., :8], tables))
    assert not torch.allclose(out[..., :8], x[..., :8])
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        RopeConfig.from_hf(raw, 16)  # families that rotate the whole head refuse it


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_int8_quantization_takes_every_projection(family: str) -> None:
    model = build_model(_raw(family))
    before = {n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"}
    quant.replace_linears(model, quant.quantizable_linears(model), quantize=True)
    int8 = {n for n, m in model.named_modules() if isinstance(m, quant.Int8Linear)}
    assert int8 == before
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "down_proj")
    for name in before:
        assert name.rsplit(".", 1)[-1] in (*projections, "gate_proj", "up_proj", "gate_up_proj")
    assert any(n.endswith(("q_proj", "qkv_proj")) for n in int8)
    if "moe" in family:
        assert any(".experts.3." in n for n in int8)
        routers = [n for n, _ in model.named_parameters() if n.endswith("mlp.gate.weight")]
        assert routers  # the routers stay float parameters
