"""Causal LMs the engine runs, and the factory that picks one from a Hugging Face config."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from fulcrum.errors import ConfigError
from fulcrum.llm.models.attention import AttentionMetadata

GPT2_TYPES = ("gpt2",)
LLAMA_TYPES = ("llama", "qwen2", "mistral")


class CausalLM(Protocol):
    """What the runner needs from a model: shapes of its KV cache, hidden states, logits."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int
    vocab_size: int
    transposed_weights: tuple[str, ...]

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def checkpoint_name(self, name: str) -> str: ...


def build_model(raw_config: dict[str, Any]) -> torch.nn.Module:
    """An uninitialised model for a Hugging Face `config.json` (by its `model_type`)."""
    model_type = raw_config.get("model_type")
    if model_type in GPT2_TYPES:
        from fulcrum.llm.models.gpt2 import GPT2Config, GPT2ForCausalLM

        return GPT2ForCausalLM(GPT2Config.from_hf(raw_config))
    if model_type in LLAMA_TYPES:
        from fulcrum.llm.models.llama import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig.from_hf(raw_config))
    supported = GPT2_TYPES + LLAMA_TYPES
    raise ConfigError(
        f"config.json: key 'model_type' = {model_type!r}: expected one of {supported}"
    )
