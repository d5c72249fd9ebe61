"""GPT-2 over a paged KV cache; module names follow Hugging Face's so checkpoints load by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from fulcrum.llm.models.attention import AttentionMetadata, paged_attention


@dataclass(frozen=True)
class GPT2Config:
    """The fields of a Hugging Face GPT-2 `config.json` the engine uses."""

    vocab_size: int
    n_positions: int
    n_embd: int
    n_layer: int
    n_head: int
    n_inner: int | None = None
    layer_norm_epsilon: float = 1e-5

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> GPT2Config:
        return cls(
            vocab_size=int(raw["vocab_size"]),
            n_positions=int(raw.get("n_positions", 1024)),
            n_embd=int(raw["n_embd"]),
            n_layer=int(raw["n_layer"]),
            n_head=int(raw["n_head"]),
            n_inner=raw.get("n_inner"),
            layer_norm_epsilon=float(raw.get("layer_norm_epsilon", 1e-5)),
        )


class GPT2Attention(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.num_heads = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(
        self, x: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.c_attn(x).view(num_tokens, 3, self.num_heads, self.head_dim).unbind(1)
        out = paged_attention(q, k, v, kv[0], kv[1], meta, self.head_dim**-0.5)  # (T, H, D)
        return self.c_proj(out.reshape(num_tokens, -1))  # type: ignore[no-any-return]


class GPT2MLP(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        inner = cfg.n_inner or 4 * cfg.n_embd
        self.c_fc = nn.Linear(cfg.n_embd, inner)
        self.c_proj = nn.Linear(inner, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))  # type: ignore[no-any-return]


class GPT2Block(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = GPT2Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = GPT2MLP(cfg)

    def forward(
        self, x: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv, meta)
        return x + self.mlp(self.ln_2(x))  # type: ignore[no-any-return]


class GPT2Model(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.h = nn.ModuleList(GPT2Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)


class GPT2ForCausalLM(nn.Module):
    """GPT-2 LM: `forward` returns hidden states (T, C); `compute_logits` the vocab scores."""

    # GPT-2 checkpoints store these as Conv1D (in, out) weights: the loader transposes them.
    transposed_weights = ("c_attn.weight", "c_proj.weight", "c_fc.weight")

    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.config = cfg
        self.num_layers = cfg.n_layer
        self.num_kv_heads = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.max_model_len = cfg.n_positions
        self.vocab_size = cfg.vocab_size
        self.transformer = GPT2Model(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # GPT-2 always ties

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        t = self.transformer
        x = t.wte(input_ids) + t.wpe(positions)  # (T, C)
        for block, kv in zip(t.h, kv_caches, strict=True):
            x = block(x, kv, meta)
        return t.ln_f(x)  # type: ignore[no-any-return]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # type: ignore[no-any-return]

    def checkpoint_name(self, name: str) -> str:
        """Our parameter name for a checkpoint's (some GPT-2 files omit `transformer.`)."""
        return name if name.startswith(("transformer.", "lm_head.")) else f"transformer.{name}"
