"""Verification of draft tokens against the target model's logits at the k + 1 positions that
score them: greedy takes the longest prefix of drafts equal to the argmax, then the argmax after
it; a random request uses rejection sampling for a deterministic (one-hot) draft, which keeps
the output distribution exactly the target's (Leviathan et al. 2023, Chen et al. 2023)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fulcrum.llm.logits_processors import apply_min_p
from fulcrum.llm.sampler import top_k_mask, top_p_mask

if TYPE_CHECKING:
    from fulcrum.llm.sampler import Sampler
    from fulcrum.llm.sampling_params import SamplingParams
    from fulcrum.llm.sequence import Sequence


def verify_greedy(logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """logits (k + 1, V) -> the accepted drafts plus the model's own next token."""
    targets: list[int] = logits.float().argmax(dim=-1).tolist()
    out: list[int] = []
    for draft, target in zip(drafts, targets, strict=False):
        out.append(target)
        if draft != target:
            return out
    out.append(targets[len(drafts)])
    return out


def target_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """logits (R, V) -> the probabilities the sampler draws a random row from (temperature,
    min_p, top_k, top_p; the rows that speculate use no other processor)."""
    scores = logits.float() / sampling.effective_temperature
    rows = scores.shape[0]
    if sampling.min_p:
        scores = apply_min_p(scores, torch.full((rows,), sampling.min_p, device=scores.device))
    vocab = scores.shape[-1]
    scores = top_k_mask(scores, min(sampling.top_k, vocab))
    scores = top_p_mask(scores, sampling.top_p)
    return scores.softmax(-1)


def verify_sampled(probs: torch.Tensor, drafts: list[int], generator: torch.Generator) -> list[int]:
    """probs (k + 1, V) target distributions -> accepted drafts plus one drawn token. Draft t at
    position i is accepted with probability p_i(t) (min(1, p/q) with q one-hot); on rejection the
    token comes from the residual max(0, p_i - q) renormalised: p_i without t."""
    k = len(drafts)
    uniforms = torch.rand(k, generator=generator, device=probs.device).tolist() if k else []
    out: list[int] = []
    for i, draft in enumerate(drafts):
        if uniforms[i] < float(probs[i, draft]):
            out.append(draft)
            continue
        residual = probs[i].clone()
        residual[draft] = 0.0
        if float(residual.sum()) <= 0.0:  # p(t) rounded to 1 yet u >= it: t is all there is
            out.append(draft)
            continue
        out.append(int(torch.multinomial(residual, 1, generator=generator).item()))
        return out
    out.append(int(torch.multinomial(probs[k], 1, generator=generator).item()))
    return out


def verify_drafts(logits: torch.Tensor, seq: Sequence, sampler: Sampler) -> list[int]:
    """logits (k + 1, V) of seq's last token and its k drafts -> the tokens it keeps."""
    drafts = seq.spec_token_ids
    if seq.sampling.is_greedy:
        return verify_greedy(logits, drafts)
    generator = sampler.generator_for(seq.seq_id, seq.sampling)
    return verify_sampled(target_probs(logits, seq.sampling), drafts, generator)
