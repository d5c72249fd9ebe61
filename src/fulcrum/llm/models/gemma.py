"""Gemma 2 and Gemma 3 text (`gemma2`, `gemma3_text`): the Llama attention and block shapes with
embeddings scaled by sqrt(hidden), RMSNorm scaling by (1 + weight), a GeGLU MLP, norms before and
after both attention and MLP, scores scaled by `query_pre_attn_scalar`, sliding-window layers
alternating with global ones (`layer_types`, or every `sliding_window_pattern`-th global), attention
and final logit soft-capping (Gemma 2), and per-head q/k norms with a local RoPE base for the
sliding layers (Gemma 3). Module names follow transformers', so checkpoints load by name."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from fulcrum.errors import ConfigError
from fulcrum.llm.models.attention import AttentionMetadata
from fulcrum.llm.models.llama import (
    LlamaAttention,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaMLP,
    rms_normalize,
)
from fulcrum.llm.models.rope import RopeConfig, RopeTables, RotaryEmbedding

# hidden_activation -> F.gelu's `approximate`, as transformers' ACT2FN defines them.
_ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class GemmaConfig:
    """A Gemma `config.json`: the Llama-shaped part, and what Gemma adds."""

    base: LlamaConfig  # its rope: the global layers'; its layer_windows: each layer's window
    local_rope: RopeConfig | None  # Gemma 3: the sliding layers' RoPE; None: `base.rope`
    approximate: str  # F.gelu's
    query_pre_attn_scalar: float
    attn_softcap: float  # 0: none
    final_softcap: float  # 0: none
    qk_norm: bool

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> GemmaConfig:
        gemma3 = raw.get("model_type") == "gemma3_text"
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in _ACTIVATIONS:
            raise ConfigError(
                f"config.json: key 'hidden_activation' = {act!r}: expected one of "
                f"{sorted(_ACTIVATIONS)}"
            )
        if raw.get("use_bidirectional_attention"):
            raise ConfigError(
                "config.json: key 'use_bidirectional_attention' = True: the engine serves "
                "causal decoders only"
            )
        heads = int(raw.get("num_attention_heads", 8))
        head_dim = int(raw.get("head_dim") or 256)  # transformers' default, not hidden / heads
        num_layers = int(raw["num_hidden_layers"])
        global_rope, local_rope = _ropes(raw, head_dim, gemma3)
        base = LlamaConfig(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            max_position_embeddings=global_rope.max_position_embeddings,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=global_rope,
            attention_bias=bool(raw.get("attention_bias", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
            layer_windows=_layer_windows(raw, num_layers, gemma3),
        )
        default_cap = None if gemma3 else 50.0
        return cls(
            base=base,
            local_rope=local_rope,
            approximate=_ACTIVATIONS[act],
            query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
            attn_softcap=_cap(raw, "attn_logit_softcapping", default_cap),
            final_softcap=_cap(raw, "final_logit_softcapping", None if gemma3 else 30.0),
            qk_norm=gemma3,
        )


def _cap(raw: dict[str, Any], key: str, default: float | None) -> float:
    value = raw.get(key, default)
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(f"config.json: key {key!r} = {value!r}: expected a number > 0 or null")
    return float(value)


def _ropes(
    raw: dict[str, Any], head_dim: int, gemma3: bool
) -> tuple[RopeConfig, RopeConfig | None]:
    """(global RoPE, Gemma 3's local one). Gemma 3 says them per layer type in
    `rope_parameters`, or (older form) `rope_theta` + `rope_scaling` for the global layers and
    `rope_local_base_freq` for the local ones, whose RoPE is never scaled."""
    mpe = int(raw.get("max_position_embeddings", 131072 if gemma3 else 8192))
    if not gemma3:
        return RopeConfig.from_hf(raw, head_dim), None
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and (FULL in params or SLIDING in params):
        global_raw = {"rope_parameters": params.get(FULL) or {"rope_theta": 1_000_000.0}}
        local_raw = {"rope_parameters": params.get(SLIDING) or {"rope_theta": 10_000.0}}
    else:
        global_raw = {
            "rope_scaling": raw.get("rope_scaling"),
            "rope_parameters": params,
            "rope_theta": raw.get("rope_theta", 1_000_000.0),
        }
        local_raw = {"rope_theta": raw.get("rope_local_base_freq", 10_000.0)}
    global_rope = RopeConfig.from_hf({**global_raw, "max_position_embeddings": mpe}, head_dim)
    local_rope = RopeConfig.from_hf({**local_raw, "max_position_embeddings": mpe}, head_dim)
    return global_rope, local_rope


def _layer_windows(raw: dict[str, Any], num_layers: int, gemma3: bool) -> tuple[int, ...]:
    """Each layer's window (0: global), as transformers' Gemma configs derive `layer_types`."""
    types = raw.get("layer_types")
    if types is None:
        pattern = int(raw.get("sliding_window_pattern", 6)) if gemma3 else 2
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or set(types) - {SLIDING, FULL}:
        raise ConfigError(
            f"config.json: key 'layer_types' = {types!r}: expected {num_layers} entries of "
            f"{SLIDING} or {FULL}"
        )
    window = raw.get("sliding_window", 4096)
    if SLIDING in types and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ConfigError(f"config.json: key 'sliding_window' = {window!r}: expected an int >= 1")
    return tuple(window if kind == SLIDING else 0 for kind in types)


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaling by (1 + weight), computed in float32 (weights start at zero)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_normalize(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)


class GemmaMLP(LlamaMLP):
    """GeGLU: down(gelu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig, approximate: str) -> None:
        super().__init__(cfg)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = F.gelu(self.gate_proj(x), approximate=self.approximate)
        return self.down_proj(gate * self.up_proj(x))  # type: ignore[no-any-return]


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: GemmaConfig, window: int) -> None:
        super().__init__()
        base, eps = cfg.base, cfg.base.rms_norm_eps
        attn = LlamaAttention(base, window)
        attn.scale = cfg.query_pre_attn_scalar**-0.5
        attn.softcap = cfg.attn_softcap
        if base.attention_bias:  # Gemma's output projection has the bias too
            attn.o_proj = nn.Linear(base.num_attention_heads * base.head_dim, base.hidden_size)
        if cfg.qk_norm:
            attn.q_norm = GemmaRMSNorm(base.head_dim, eps)
            attn.k_norm = GemmaRMSNorm(base.head_dim, eps)
        self.self_attn = attn
        self.mlp = GemmaMLP(base, cfg.approximate)
        self.input_layernorm = GemmaRMSNorm(base.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(base.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(base.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(base.hidden_size, eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeTables,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), rope, kv, meta)
        x = x + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(mlp)  # type: ignore[no-any-return]


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 / Gemma 3 text LM, laid out as transformers' (model.*, lm_head)."""

    def __init__(self, cfg: GemmaConfig) -> None:
        base = cfg.base
        # The Llama init would build a RoPE table for a scaled (multiplied) context: give it a
        # one-position one, replaced below by tables for the context Gemma states.
        stub = dataclasses.replace(
            base.rope, rope_type="default", params=(), max_position_embeddings=1
        )
        layer = lambda _, index, window: GemmaDecoderLayer(cfg, window)  # noqa: E731
        super().__init__(dataclasses.replace(base, rope=stub), layer)
        self.config = base
        self.gemma = cfg
        # Gemma 3 states its (RoPE-scaled) context already, as vLLM takes it: never multiplied.
        self.max_model_len = base.max_position_embeddings
        self.model.rotary_emb = RotaryEmbedding(base.rope, self.max_model_len)
        self.model.norm = GemmaRMSNorm(base.hidden_size, base.rms_norm_eps)
        self.local_rotary = (
            None if cfg.local_rope is None else RotaryEmbedding(cfg.local_rope, self.max_model_len)
        )
        self.sliding = tuple(w > 0 for w in base.layer_windows)
        # transformers rounds sqrt(hidden) to the weights' dtype before scaling.
        self.embed_scale = float(base.hidden_size**0.5)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # (T, C)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        global_rope = self._tables(self.model.rotary_emb, positions, meta, x.dtype)
        local_rope = global_rope
        if self.local_rotary is not None:
            local_rope = self._tables(self.local_rotary, positions, meta, x.dtype)
        layers = zip(self.model.layers, kv_caches, self.sliding, strict=True)
        for layer, kv, sliding in layers:
            x = layer(x, local_rope if sliding else global_rope, kv, meta)
        return self.model.norm(x)  # type: ignore[no-any-return]

    @staticmethod
    def _tables(
        rotary: RotaryEmbedding,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        dtype: torch.dtype,
    ) -> RopeTables:
        rope_lens = meta.rope_lens(positions) if rotary.config.length_dependent else None
        return rotary.tables(positions, rope_lens, dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.gemma.final_softcap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits  # type: ignore[no-any-return]

    def prefix_cache_key(self, num_prompt_tokens: int) -> str | None:
        local = self.gemma.local_rope
        key = local.prefix_key(num_prompt_tokens) if local is not None else None
        return key or self.gemma.base.rope.prefix_key(num_prompt_tokens)


def build_gemma(raw: dict[str, Any]) -> GemmaForCausalLM:
    """A Gemma 2 or Gemma 3 (text) model for a `config.json`."""
    return GemmaForCausalLM(GemmaConfig.from_hf(raw))
