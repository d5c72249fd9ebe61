"""Llama-family decoder (Llama, Qwen2, Mistral): RoPE (with its scalings), RMSNorm, grouped-query
attention (with sliding windows), SwiGLU.

Module names follow Hugging Face's, so a checkpoint's state dict loads by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from fulcrum.errors import ConfigError
from fulcrum.llm.models.attention import AttentionMetadata, paged_attention
from fulcrum.llm.models.rope import RopeConfig, RopeTables, RotaryEmbedding, apply_rope


@dataclass(frozen=True)
class LlamaConfig:
    """The fields of a Hugging Face Llama/Qwen2/Mistral `config.json` the engine uses."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    attention_bias: bool
    tie_word_embeddings: bool
    # Per layer: its sliding attention window in tokens, 0 for full attention.
    layer_windows: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> LlamaConfig:
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"config.json: key 'hidden_act' = {raw['hidden_act']!r}: need silu")
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        head_dim = int(raw.get("head_dim") or hidden // heads)
        num_layers = int(raw["num_hidden_layers"])
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(raw, head_dim),
            # Qwen2 always has q/k/v biases; Llama (and Qwen3) say so with `attention_bias`.
            attention_bias=bool(raw.get("attention_bias", raw.get("model_type") == "qwen2")),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            layer_windows=layer_windows(raw, num_layers),
        )


# Families that window the layers `layer_types` names only when `use_sliding_window` is on.
QWEN_WINDOW_TYPES = ("qwen2", "qwen3", "qwen2_moe")


def layer_windows(raw: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention), as transformers applies the config:
    Mistral and Phi-3 window every layer by `sliding_window`; Qwen2/3 only with
    `use_sliding_window`, the layers `layer_types` names (default: those from
    `max_window_layers` on); Llama never."""
    model_type = raw.get("model_type")
    window = raw.get("sliding_window")
    qwen = model_type in QWEN_WINDOW_TYPES
    if qwen and not raw.get("use_sliding_window"):
        window = None  # transformers' Qwen2Config drops the window unless it is switched on
    if qwen:
        types = _qwen2_layer_types(raw, num_layers)
    elif model_type in ("mistral", "phi3"):
        types = ["sliding_attention"] * num_layers  # they window every layer (when windowed)
    else:
        return (0,) * num_layers
    if window is None:
        if "sliding_attention" in types and qwen:
            raise ConfigError(
                "config.json: key 'layer_types' names sliding_attention layers but "
                f"'use_sliding_window' = {raw.get('use_sliding_window')!r} leaves no window"
            )
        return (0,) * num_layers
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConfigError(f"config.json: key 'sliding_window' = {window!r}: expected an int >= 1")
    return tuple(window if kind == "sliding_attention" else 0 for kind in types)


def _qwen2_layer_types(raw: dict[str, Any], num_layers: int) -> list[str]:
    types = raw.get("layer_types")
    if types is None:
        first = int(raw.get("max_window_layers", 28))
        on = bool(raw.get("use_sliding_window")) and raw.get("sliding_window") is not None
        return [
            "sliding_attention" if on and i >= first else "full_attention"
            for i in range(num_layers)
        ]
    if not isinstance(types, list) or len(types) != num_layers:
        raise ConfigError(
            f"config.json: key 'layer_types' = {types!r}: expected {num_layers} entries"
        )
    for kind in types:
        if kind not in ("sliding_attention", "full_attention"):
            raise ConfigError(
                f"config.json: key 'layer_types' has {kind!r}: expected sliding_attention or "
                "full_attention"
            )
    return types


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / RMS(x) over the last axis, in float32 whatever the model dtype (as the reference
    implementations compute it); the families differ in how they scale and cast it back."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * rms_normalize(x, self.eps).to(x.dtype)


class LlamaAttention(nn.Module):
    """Grouped-query attention. Families vary it by attributes set after construction: q/k
    norms per head before RoPE (Qwen3, Gemma 3), the score scale, attention logit soft-capping
    (Gemma 2), or by overriding `project` (Phi-3's fused projection)."""

    def __init__(self, cfg: LlamaConfig, window: int, *, separate_qkv: bool = True) -> None:
        super().__init__()
        self.window = window  # sliding attention window in tokens; 0: full attention
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.softcap = 0.0  # > 0: scores become softcap * tanh(scores / softcap)
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        bias = cfg.attention_bias
        if separate_qkv:
            self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
            self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
            self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (T, C) -> q (T, H, D), k and v (T, Hkv, D)."""
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeTables,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.project(x)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # per head, over D
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        layout = meta.windowed(self.window) if self.window else meta
        out = paged_attention(
            q, k, v, kv[0], kv[1], layout, self.scale, softcap=self.softcap
        )  # (T, H, D)
        return self.o_proj(out.reshape(num_tokens, -1))  # type: ignore[no-any-return]


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # type: ignore[no-any-return]


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; a family passes its own attention or MLP (a mixture of experts)."""

    def __init__(
        self,
        cfg: LlamaConfig,
        window: int,
        *,
        attn: nn.Module | None = None,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attn if attn is not None else LlamaAttention(cfg, window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp if mlp is not None else LlamaMLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeTables,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x))  # type: ignore[no-any-return]


# Builds decoder layer `index` with its sliding window (0: none).
LayerFactory = Callable[[LlamaConfig, int, int], nn.Module]


def llama_layer(cfg: LlamaConfig, index: int, window: int) -> nn.Module:
    return LlamaDecoderLayer(cfg, window)


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig, make_layer: LayerFactory = llama_layer) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary_emb = RotaryEmbedding(cfg.rope, max(cfg.rope.max_model_len, 1))
        windows = cfg.layer_windows or (0,) * cfg.num_hidden_layers
        self.layers = nn.ModuleList(make_layer(cfg, i, w) for i, w in enumerate(windows))
        self.norm: nn.Module = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Llama-family LM: `forward` gives hidden states (T, C), `compute_logits` vocab scores."""

    transposed_weights: tuple[str, ...] = ()

    def __init__(self, cfg: LlamaConfig, make_layer: LayerFactory = llama_layer) -> None:
        super().__init__()
        self.config = cfg
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        # RoPE scaling extends the context (linear, dynamic, YaRN: by `factor`, as vLLM does).
        self.max_model_len = cfg.rope.max_model_len
        self.vocab_size = cfg.vocab_size
        self.model = LlamaModel(cfg, make_layer)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # (T, C)
        rotary = self.model.rotary_emb
        rope_lens = meta.rope_lens(positions) if rotary.config.length_dependent else None
        rope = rotary.tables(positions, rope_lens, x.dtype)  # shared by every layer
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, rope, kv, meta)
        return self.model.norm(x)  # type: ignore[no-any-return]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # type: ignore[no-any-return]

    def prefix_cache_key(self, num_prompt_tokens: int) -> str | None:
        """Salt for the prefix cache of a sequence whose K/V depend on its prompt's length."""
        return self.config.rope.prefix_key(num_prompt_tokens)

    def checkpoint_name(self, name: str) -> str:
        """Our parameter name for a checkpoint's (identical for this family)."""
        return name
