"""Next-token sampling: the per-request processors (fulcrum.llm.logits_processors), greedy,
temperature, min-p, top-k, top-p, a private generator per seeded request (so a seeded request
draws the same tokens whatever else shares its batches), and the chosen tokens' logprobs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fulcrum.llm.logits_processors import apply_min_p, apply_processors, needs_processing
from fulcrum.llm.logprobs import TokenLogprob, token_logprobs
from fulcrum.llm.structured import apply_grammar, keep_grammar_tokens

if TYPE_CHECKING:
    from fulcrum.llm.logits_processors import TokenHistory
    from fulcrum.llm.sampling_params import SamplingParams
    from fulcrum.llm.structured import GrammarMasks


@dataclass(slots=True)  # one per sampled row per step: a frozen __init__ costs several times more
class SampledToken:
    """A drawn token and, when its request asked for them, its logprobs."""

    token_id: int
    logprob: TokenLogprob | None = None


class _NoHistory:
    """The history of a row sampled without one: nothing generated, no prompt."""

    token_ids: list[int] = []  # noqa: RUF012 - read-only, never mutated
    num_prompt_tokens = 0
    eos_token_id = None


def top_k_mask(logits: torch.Tensor, top_k: torch.Tensor | int) -> torch.Tensor:
    """logits (..., V) with everything below each row's k-th largest set to -inf; top_k per row
    (a tensor of logits.shape[:-1]) or one int for all, 0 or >= V: that row unchanged."""
    vocab = logits.shape[-1]
    k = torch.as_tensor(top_k, device=logits.device).expand(logits.shape[:-1])
    off = (k <= 0) | (k >= vocab)
    if bool(off.all()):
        return logits
    largest = torch.topk(logits, int(k[~off].max()), dim=-1).values  # (..., k_max)
    kth = largest.gather(-1, (k.clamp(min=1) - 1).clamp(max=largest.shape[-1] - 1)[..., None])
    kth = kth.masked_fill(off[..., None], float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_mask(logits: torch.Tensor, top_p: torch.Tensor | float) -> torch.Tensor:
    """logits (..., V) keeping, per row, the smallest set of tokens whose probability reaches
    top_p (a tensor of logits.shape[:-1], or one float for all; 1: that row unchanged)."""
    p = torch.as_tensor(top_p, dtype=logits.dtype, device=logits.device).expand(logits.shape[:-1])
    off = p >= 1.0
    if bool(off.all()):
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    # Drop a token when the tokens before it already reach top_p; the first always stays, even
    # for a top_p that rounds to 0 in float32 (an all -inf row would sample NaN).
    drop_sorted = ((probs.cumsum(-1) - probs) >= p[..., None]) & ~off[..., None]
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
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
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        seq_ids: list[int],
        histories: list[TokenHistory] | None = None,
    ) -> list[int]:
        """logits (B, V) -> one token id per row (see sample_tokens)."""
        return [t.token_id for t in self.sample_tokens(logits, params, seq_ids, histories)]

    def sample_tokens(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        seq_ids: list[int],
        histories: list[TokenHistory] | None = None,
        masks: GrammarMasks | None = None,
    ) -> list[SampledToken]:
        """logits (B, V) -> one token per row: the structured rows masked by their grammar,
        processed by each row's settings, then the random rows masked and drawn as one batch (a
        seeded request draws from its own generator)."""
        raw = logits
        logits = logits.float()
        guided = None
        if masks is not None:
            logits = guided = apply_grammar(logits, masks)
        if needs_processing(params):
            rows_history = histories or [_NoHistory()] * len(params)
            logits = apply_processors(logits, params, rows_history)
            if masks is not None and guided is not None:  # the grammar wins (keep_grammar_tokens)
                logits = keep_grammar_tokens(logits, guided, masks)
        out: list[int] = logits.argmax(dim=-1).tolist()
        rows = [i for i, sampling in enumerate(params) if not sampling.is_greedy]
        if rows:
            self._draw(logits, params, seq_ids, rows, out)
        return self._with_logprobs(raw, params, out)

    def _draw(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        seq_ids: list[int],
        rows: list[int],
        out: list[int],
    ) -> None:
        chosen = [params[i] for i in rows]
        device = logits.device
        temperature = torch.tensor([s.effective_temperature for s in chosen], device=device)
        scores = logits[rows] / temperature[:, None]
        if any(s.min_p for s in chosen):
            scores = apply_min_p(scores, torch.tensor([s.min_p for s in chosen], device=device))
        vocab = logits.shape[-1]  # a larger top_k is off; clamped, any int fits the tensor
        top_k = torch.tensor([min(s.top_k, vocab) for s in chosen], device=device)
        scores = top_k_mask(scores, top_k)
        scores = top_p_mask(scores, torch.tensor([s.top_p for s in chosen], device=device))
        probs = scores.softmax(-1)
        shared = [j for j, s in enumerate(chosen) if s.seed is None]
        if shared:
            drawn = torch.multinomial(probs[shared], 1, generator=self._shared)[:, 0].tolist()
            for j, token in zip(shared, drawn, strict=True):
                out[rows[j]] = int(token)
        for j, sampling in enumerate(chosen):
            if sampling.seed is not None:
                generator = self._seeded(seq_ids[rows[j]], sampling.seed)
                out[rows[j]] = int(torch.multinomial(probs[j], 1, generator=generator).item())

    @staticmethod
    def _with_logprobs(
        raw: torch.Tensor, params: list[SamplingParams], tokens: list[int]
    ) -> list[SampledToken]:
        rows = [i for i, s in enumerate(params) if s.logprobs is not None]
        sampled = [SampledToken(t) for t in tokens]
        if rows:
            num_top = [params[i].logprobs or 0 for i in rows]
            found = token_logprobs(raw[rows], [tokens[i] for i in rows], num_top)
            for i, logprob in zip(rows, found, strict=True):
                sampled[i] = SampledToken(tokens[i], logprob)
        return sampled

    def generator_for(self, seq_id: int, sampling: SamplingParams) -> torch.Generator:
        """The generator a row of this request draws from: its own when seeded, else shared."""
        return self._shared if sampling.seed is None else self._seeded(seq_id, sampling.seed)

    def release(self, seq_id: int) -> None:
        """Forget a finished request's generator."""
        self._generators.pop(seq_id, None)

    def _seeded(self, seq_id: int, seed: int) -> torch.Generator:
        """The request's own generator, created from its seed on its first draw."""
        generator = self._generators.get(seq_id)
        if generator is None:
            generator = torch.Generator(device=self._device)
            generator.manual_seed(seed)
            self._generators[seq_id] = generator
        return generator
