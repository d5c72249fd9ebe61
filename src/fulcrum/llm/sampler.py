"""Next-token sampling: greedy, temperature, top-k, top-p, and a private generator per seeded
request, so a seeded request draws the same tokens whatever else shares its batches."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from fulcrum.llm.sampling_params import SamplingParams


def top_k_mask(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """logits (V,) with everything below the k-th largest set to -inf (top_k 0: unchanged)."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, top_k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_mask(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """logits (V,) keeping the smallest set of tokens whose probability reaches top_p."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    # Drop a token when the tokens before it already reach top_p; the first always stays.
    drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


class Sampler:
    """Picks one token per row of logits; owns the per-request generators of seeded requests."""

    def __init__(self, device: torch.device, *, seed: int | None = None) -> None:
        self._device = device
        self._shared = torch.Generator(device=device)
        if seed is None:
            self._shared.seed()
        else:
            self._shared.manual_seed(seed)
        self._generators: dict[int, torch.Generator] = {}

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], seq_ids: list[int]
    ) -> list[int]:
        """logits (B, V) -> one token id per row."""
        logits = logits.float()
        greedy = logits.argmax(dim=-1).tolist()
        out: list[int] = []
        for row, (sampling, seq_id) in enumerate(zip(params, seq_ids, strict=True)):
            if sampling.temperature == 0.0:
                out.append(int(greedy[row]))
                continue
            scores = top_p_mask(
                top_k_mask(logits[row] / sampling.temperature, sampling.top_k), sampling.top_p
            )
            probs = scores.softmax(-1)
            token = torch.multinomial(probs, 1, generator=self._generator(seq_id, sampling))
            out.append(int(token.item()))
        return out

    def release(self, seq_id: int) -> None:
        """Forget a finished request's generator."""
        self._generators.pop(seq_id, None)

    def _generator(self, seq_id: int, sampling: SamplingParams) -> torch.Generator:
        if sampling.seed is None:
            return self._shared
        generator = self._generators.get(seq_id)
        if generator is None:
            generator = torch.Generator(device=self._device)
            generator.manual_seed(sampling.seed)
            self._generators[seq_id] = generator
        return generator
