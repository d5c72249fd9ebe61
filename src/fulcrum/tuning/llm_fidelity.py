"""How faithful a quantized LLM is to its float reference, both scored through the engine's own
model forward: greedy-token agreement, TEACHER-FORCED (the reference's engine generates a greedy
continuation of each prompt; both models are then fed the same tokens and must pick the same next
token at every position, so one early flip does not count every later token as a miss), and the
perplexity ratio (variant / reference) on a text sample."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.nn import functional as F

from fulcrum.llm.models.attention import build_metadata, kv_cache_shape

if TYPE_CHECKING:
    from fulcrum.llm.loader import LoadedLLM
    from fulcrum.llm.models import CausalLM
    from fulcrum.llm.params import EngineParams

_BLOCK_SIZE = 16  # the scratch KV cache's block size (any works: one sequence, one chunk)


@dataclass(frozen=True)
class LlmFidelity:
    """Teacher-forced agreement with the reference's greedy tokens, and perplexities."""

    agreement: float  # fraction of the reference's generated tokens the variant also picks
    worst_prompt: float  # the lowest agreement of one prompt
    num_tokens: int  # generated tokens compared
    perplexity_reference: float
    perplexity_variant: float
    num_text_tokens: int  # tokens scored for perplexity

    @property
    def perplexity_ratio(self) -> float:
        return self.perplexity_variant / self.perplexity_reference


@torch.inference_mode()
def token_logits(model: CausalLM, token_ids: list[int], device: torch.device) -> torch.Tensor:
    """Logits (T, V) at every position of one sequence, run as one prefill chunk."""
    num_tokens = len(token_ids)
    num_blocks = -(-num_tokens // _BLOCK_SIZE)
    shape = kv_cache_shape(num_blocks, _BLOCK_SIZE, model.num_kv_heads, model.head_dim)
    dtype = next(iter(_float_tensors(model))).dtype
    caches = [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(model.num_layers)
    ]
    meta = build_metadata(
        [num_tokens], [num_tokens], [list(range(num_blocks))], _BLOCK_SIZE, device
    )
    ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
    positions = torch.arange(num_tokens, device=device)
    hidden = model(ids, positions, meta, caches)  # (T, C)
    return model.compute_logits(hidden).float()  # (T, V)


def _float_tensors(model: CausalLM) -> list[torch.Tensor]:
    module: torch.nn.Module = model  # type: ignore[assignment]
    return [p for p in module.parameters() if p.is_floating_point()]


def greedy_continuations(
    loaded: LoadedLLM, params: EngineParams, prompts: list[list[int]], num_tokens: int
) -> list[list[int]]:
    """Each prompt's greedy continuation of `num_tokens` tokens (EOS ignored), all prompts run
    together through the engine."""
    from fulcrum.llm.sampling_params import SamplingParams
    from fulcrum.llm.sync_engine import LLMEngine

    engine = LLMEngine(loaded, params)
    sampling = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, sampling)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for output in engine.step():
            if output.error is not None:
                raise output.error
            tokens[output.request_id].extend(output.new_token_ids)
    return [tokens[str(i)] for i in range(len(prompts))]


def teacher_forced_agreement(
    reference: CausalLM,
    variant: CausalLM,
    sequences: list[tuple[list[int], list[int]]],
    device: torch.device,
) -> list[float]:
    """Per (prompt, continuation): the fraction of continuation positions where both models,
    fed the same prefix, pick the same next token (argmax)."""
    per_prompt = []
    for prompt, continuation in sequences:
        ids = prompt + continuation
        rows = slice(len(prompt) - 1, len(ids) - 1)  # the rows that predict each new token
        picked_ref = token_logits(reference, ids, device)[rows].argmax(dim=-1)  # (N,)
        picked_var = token_logits(variant, ids, device)[rows].argmax(dim=-1)  # (N,)
        per_prompt.append(float((picked_ref == picked_var).float().mean()))
    return per_prompt


def perplexity(model: CausalLM, chunks: list[list[int]], device: torch.device) -> float:
    """exp(mean negative log-likelihood) of every next token in `chunks`."""
    total_nll = 0.0
    count = 0
    for chunk in chunks:
        logits = token_logits(model, chunk, device)  # (T, V)
        target = torch.tensor(chunk[1:], device=logits.device)
        total_nll += float(F.cross_entropy(logits[:-1], target, reduction="sum"))
        count += len(chunk) - 1
    return math.exp(total_nll / count)


def text_chunks(token_ids: list[int], chunk_tokens: int, max_chunks: int) -> list[list[int]]:
    """Consecutive chunks of at least two tokens (each is scored on its own)."""
    chunks = [token_ids[i : i + chunk_tokens] for i in range(0, len(token_ids), chunk_tokens)]
    return [c for c in chunks if len(c) >= 2][:max_chunks]


def compare_llms(
    reference: LoadedLLM,
    variant: LoadedLLM,
    params: EngineParams,
    prompts: list[list[int]],
    text: list[list[int]],
    *,
    num_tokens: int,
) -> LlmFidelity:
    """Agreement over `prompts` (continued by `num_tokens` reference tokens) and perplexities
    over `text`; `params` runs the reference's generation."""
    device = torch.device(params.resolve_device())
    continuations = greedy_continuations(reference, params, prompts, num_tokens)
    sequences = list(zip(prompts, continuations, strict=True))
    per_prompt = teacher_forced_agreement(reference.model, variant.model, sequences, device)
    num_compared = sum(len(c) for c in continuations)
    agreement = sum(a * len(c) for a, c in zip(per_prompt, continuations, strict=True))
    return LlmFidelity(
        agreement=agreement / num_compared,
        worst_prompt=min(per_prompt),
        num_tokens=num_compared,
        perplexity_reference=perplexity(reference.model, text, device),
        perplexity_variant=perplexity(variant.model, text, device),
        num_text_tokens=sum(len(c) - 1 for c in text),
    )
