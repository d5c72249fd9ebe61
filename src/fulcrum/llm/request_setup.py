"""What the engine settles about a request before it is queued, from what only the model knows:
its sampling settings completed (extra EOS ids as stop tokens, bad words as token ids) and the
prefix-cache salt it runs under (a private one when its prompt must be computed to be scored)."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Sequence

from fulcrum.llm.logits_processors import bad_words_token_ids
from fulcrum.llm.sampling_params import SamplingParams


def complete_sampling(
    sampling: SamplingParams, eos_token_ids: Sequence[int], encode: Callable[[str], list[int]]
) -> SamplingParams:
    """sampling with the model's further EOS ids as stops (the first stops through the
    sequence's own EOS) and its bad words tokenised by `encode` (no special tokens)."""
    more_eos = tuple(eos_token_ids[1:])
    if more_eos and not sampling.ignore_eos:
        stops = tuple(dict.fromkeys(sampling.stop_token_ids + more_eos))
        sampling = dataclasses.replace(sampling, stop_token_ids=stops)
    if sampling.bad_words:
        words = bad_words_token_ids(encode, sampling.bad_words)
        sampling = dataclasses.replace(sampling, bad_words_token_ids=words)
    return sampling


def scoring_salt(sampling: SamplingParams, cache_salt: str | None) -> str | None:
    """The salt of a request that wants prompt_logprobs is its own, so no prefix-cache hit
    skips computing (and scoring) any prompt token; any other request keeps its salt."""
    if sampling.prompt_logprobs is None:
        return cache_salt
    return f"{cache_salt or ''}/prompt-logprobs-{uuid.uuid4().hex}"
