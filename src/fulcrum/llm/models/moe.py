"""Qwen2-MoE and Qwen3-MoE (`qwen2_moe`, `qwen3_moe`): the Llama (Qwen3: q/k-norm) decoder with
sparse mixture-of-experts MLPs: a softmax router picks each token's top-k experts (weights
renormalised when `norm_topk_prob`), plus, in Qwen2-MoE, a shared expert scaled by a sigmoid gate.

Dispatch groups the step's tokens by expert: one matmul chain per expert that any token chose, over
just its tokens, so a CPU step costs about the active experts' weights, not every expert's. Expert
MLPs are `nn.Linear`s named as in the checkpoint (int8 quantization takes them); the routers are
plain weights, kept float so quantizing never changes which experts a token picks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from fulcrum.errors import ConfigError
from fulcrum.llm.models.llama import LlamaConfig, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from fulcrum.llm.models.qwen3 import qk_norm_attention


@dataclass(frozen=True)
class MoeConfig:
    """The mixture-of-experts keys of a Qwen-MoE `config.json`."""

    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    shared_intermediate_size: int  # 0: no shared expert
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or a dense MLP

    @classmethod
    def from_hf(cls, raw: dict[str, Any], num_layers: int) -> MoeConfig:
        num_experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
        top_k = int(raw.get("num_experts_per_tok", 0))
        if not 0 < top_k <= num_experts:
            raise ConfigError(
                f"config.json: key 'num_experts_per_tok' = {top_k!r}: expected 1 to "
                f"num_experts ({num_experts})"
            )
        step = int(raw.get("decoder_sparse_step", 1))
        dense = set(raw.get("mlp_only_layers") or [])
        shared = 0
        if raw.get("model_type") == "qwen2_moe":
            shared = int(raw.get("shared_expert_intermediate_size") or 0)
        return cls(
            num_experts=num_experts,
            top_k=top_k,
            moe_intermediate_size=int(raw["moe_intermediate_size"]),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            shared_intermediate_size=shared,
            sparse_layers=tuple(
                i not in dense and step > 0 and (i + 1) % step == 0 for i in range(num_layers)
            ),
        )


class Router(nn.Module):
    """A bias-free projection kept out of quantization (not an `nn.Linear`): (T, C) -> (T, N)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig, moe: MoeConfig) -> None:
        super().__init__()
        self.top_k = moe.top_k
        self.norm_topk_prob = moe.norm_topk_prob
        self.gate = Router(cfg.hidden_size, moe.num_experts)
        expert_cfg = dataclasses.replace(cfg, intermediate_size=moe.moe_intermediate_size)
        self.experts = nn.ModuleList(LlamaMLP(expert_cfg) for _ in range(moe.num_experts))
        self.shared_expert: nn.Module | None = None
        self.shared_expert_gate: nn.Module | None = None
        if moe.shared_intermediate_size:
            shared_cfg = dataclasses.replace(cfg, intermediate_size=moe.shared_intermediate_size)
            self.shared_expert = LlamaMLP(shared_cfg)
            self.shared_expert_gate = Router(cfg.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, C) -> (T, C)."""
        num_tokens, top_k = x.shape[0], self.top_k
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # (T, E)
        weights, chosen = torch.topk(probs, top_k, dim=-1)  # (T, k) each
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        # Each token's slots in expert order: transformers adds the experts' outputs in that
        # order, so the float sums below round as its do.
        chosen, slots = chosen.sort(dim=-1)
        weights = weights.gather(-1, slots).to(x.dtype).flatten()  # (T * k,)
        # Group the (token, slot) pairs by expert: a stable sort, then one slice per expert.
        order = torch.argsort(chosen.flatten(), stable=True)
        counts = torch.bincount(chosen.flatten(), minlength=len(self.experts)).tolist()
        outs = []
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                pairs = order[start : start + count]
                start += count
                outs.append(expert(x[pairs // top_k]) * weights[pairs, None])  # (count, C)
        # Back to (token, slot) order with one gather: torch's CPU index_add_ enters a parallel
        # region even for one row, milliseconds a call when the cores are busy.
        by_slot = torch.cat(outs).index_select(0, torch.argsort(order))
        by_slot = by_slot.view(num_tokens, top_k, -1)  # (T, k, C)
        out = by_slot[:, 0]
        for slot in range(1, top_k):
            out = out + by_slot[:, slot]
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def moe_config(raw: dict[str, Any]) -> LlamaConfig:
    """The Llama-shaped part of a Qwen-MoE config, refusing what it cannot serve exactly."""
    if raw.get("model_type") == "qwen3_moe" and raw.get("use_sliding_window"):
        raise ConfigError(
            "config.json: key 'use_sliding_window' = True: not served for qwen3_moe (transformers "
            "gives it no per-layer window to follow)"
        )
    cfg = LlamaConfig.from_hf(raw)
    if raw.get("model_type") == "qwen2_moe":  # Qwen2-MoE names its q/k/v biases `qkv_bias`
        cfg = dataclasses.replace(cfg, attention_bias=bool(raw.get("qkv_bias", True)))
    return cfg


def build_moe(raw: dict[str, Any]) -> LlamaForCausalLM:
    """A Qwen2-MoE or Qwen3-MoE model for a `config.json`."""
    cfg = moe_config(raw)
    moe = MoeConfig.from_hf(raw, cfg.num_hidden_layers)
    qk_norm = raw.get("model_type") == "qwen3_moe"

    def layer(cfg: LlamaConfig, index: int, window: int) -> nn.Module:
        mlp = SparseMoeBlock(cfg, moe) if moe.sparse_layers[index] else None
        attn = qk_norm_attention(cfg, window) if qk_norm else None
        return LlamaDecoderLayer(cfg, window, attn=attn, mlp=mlp)

    return LlamaForCausalLM(cfg, layer)
