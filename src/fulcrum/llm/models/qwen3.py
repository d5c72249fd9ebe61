"""Qwen3: the Llama decoder with an RMSNorm over each query and key head before RoPE (q_norm,
k_norm), `head_dim` from the config, and no q/k/v biases unless `attention_bias` says so."""

from __future__ import annotations

from typing import Any

from torch import nn

from fulcrum.llm.models.llama import (
    LlamaAttention,
    LlamaConfig,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    RMSNorm,
)


def qk_norm_attention(cfg: LlamaConfig, window: int) -> LlamaAttention:
    """Llama attention with Qwen3's per-head q/k RMSNorm (weights of width head_dim)."""
    attn = LlamaAttention(cfg, window)
    attn.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
    attn.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
    return attn


def qwen3_layer(cfg: LlamaConfig, index: int, window: int) -> nn.Module:
    return LlamaDecoderLayer(cfg, window, attn=qk_norm_attention(cfg, window))


def build_qwen3(raw: dict[str, Any]) -> LlamaForCausalLM:
    """A Qwen3 model for a `config.json` (sliding windows as Qwen2 reads them)."""
    return LlamaForCausalLM(LlamaConfig.from_hf(raw), qwen3_layer)
