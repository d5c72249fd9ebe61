"""Causal LMs the engine runs, and the factory that picks one from a Hugging Face config."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from fulcrum.errors import ConfigError
from fulcrum.llm.models.attention import AttentionMetadata

GPT2_TYPES = ("gpt2",)
LLAMA_TYPES = ("llama", "qwen2", "mistral")
QWEN3_TYPES = ("qwen3",)
GEMMA_TYPES = ("gemma2", "gemma3_text")
PHI3_TYPES = ("phi3",)
MOE_TYPES = ("qwen2_moe", "qwen3_moe")
SUPPORTED_TYPES = GPT2_TYPES + LLAMA_TYPES + QWEN3_TYPES + GEMMA_TYPES + PHI3_TYPES + MOE_TYPES


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
    if model_type in QWEN3_TYPES:
        from fulcrum.llm.models.qwen3 import build_qwen3

        return build_qwen3(raw_config)
    if model_type in GEMMA_TYPES:
        from fulcrum.llm.models.gemma import build_gemma

        return build_gemma(raw_config)
    if model_type in PHI3_TYPES:
        from fulcrum.llm.models.phi3 import build_phi3

        return build_phi3(raw_config)
    if model_type in MOE_TYPES:
        from fulcrum.llm.models.moe import build_moe

        return build_moe(raw_config)
    hint = ""
    if model_type == "gemma3":
        hint = " (a Gemma 3 vision-language checkpoint: serve its text model, gemma3_text)"
    raise ConfigError(
        f"config.json: key 'model_type' = {model_type!r}: expected one of {SUPPORTED_TYPES}{hint}"
    )
