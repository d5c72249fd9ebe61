"""Phi-3 / Phi-4 (`phi3`): the Llama decoder with fused projections (`qkv_proj`, `gate_up_proj`),
optionally a rotary width below the head's (`partial_rotary_factor`), longrope scaling with
short/long factors, and a sliding window over every layer when `sliding_window` is set.

The fused projections stay fused, as vLLM keeps them: one matmul instead of three (two) per
token, split in the forward pass; int8 quantization treats each as one linear layer, with its
scales per output row, so it is the same as quantizing the parts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from fulcrum.errors import ConfigError
from fulcrum.llm.models.llama import (
    LlamaAttention,
    LlamaConfig,
    LlamaDecoderLayer,
    LlamaForCausalLM,
)
from fulcrum.llm.models.rope import RopeConfig

# transformers' Phi3Config reads these older names as longrope.
_LONGROPE_ALIASES = ("su", "yarn")


class Phi3Attention(LlamaAttention):
    def __init__(self, cfg: LlamaConfig, window: int) -> None:
        super().__init__(cfg, window, separate_qkv=False)
        self.q_size = cfg.num_attention_heads * cfg.head_dim
        self.kv_size = cfg.num_key_value_heads * cfg.head_dim
        width = self.q_size + 2 * self.kv_size
        self.qkv_proj = nn.Linear(cfg.hidden_size, width, bias=cfg.attention_bias)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (
            q.reshape(num_tokens, self.num_heads, self.head_dim),
            k.reshape(num_tokens, self.num_kv_heads, self.head_dim),
            v.reshape(num_tokens, self.num_kv_heads, self.head_dim),
        )


class Phi3MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (T, I) each
        return self.down_proj(up * F.silu(gate))  # type: ignore[no-any-return]


def phi3_layer(cfg: LlamaConfig, index: int, window: int) -> nn.Module:
    return LlamaDecoderLayer(cfg, window, attn=Phi3Attention(cfg, window), mlp=Phi3MLP(cfg))


def phi3_config(raw: dict[str, Any]) -> LlamaConfig:
    """The Llama-shaped config of a Phi-3 `config.json`, its RoPE possibly partial."""
    raw = _with_longrope_aliases(raw)
    rope_raw = dict(raw)
    # LlamaConfig refuses a partial rotary factor; Phi-3 reads it (below).
    rope_raw.pop("partial_rotary_factor", None)
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(rope_raw.get(key), dict):
            rope_raw[key] = {k: v for k, v in rope_raw[key].items() if k != "partial_rotary_factor"}
    cfg = LlamaConfig.from_hf({**rope_raw, "rope_scaling": None, "rope_parameters": None})
    rope = RopeConfig.from_hf(raw, cfg.head_dim, partial_rotary=True)
    if rope.rope_type not in ("default", "longrope"):
        raise ConfigError(
            f"config.json: rope_type {rope.rope_type!r}: Phi-3 takes default or longrope RoPE"
        )
    return dataclasses.replace(cfg, rope=rope)


def _with_longrope_aliases(raw: dict[str, Any]) -> dict[str, Any]:
    raw = dict(raw)
    for key in ("rope_scaling", "rope_parameters"):
        given = raw.get(key)
        if isinstance(given, dict):
            kind = given.get("rope_type", given.get("type"))
            if kind in _LONGROPE_ALIASES:
                given = {k: v for k, v in given.items() if k != "type"}
                raw[key] = {**given, "rope_type": "longrope"}
    return raw


def build_phi3(raw: dict[str, Any]) -> LlamaForCausalLM:
    """A Phi-3 / Phi-4 model for a `config.json`."""
    return LlamaForCausalLM(phi3_config(raw), phi3_layer)
