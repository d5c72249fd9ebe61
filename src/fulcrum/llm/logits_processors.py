"""Per-request logits processors, applied to one step's batch of rows in vLLM's order:
allowed_token_ids, bad_words, min_tokens, logit_bias, then the repetition, frequency and presence
penalties; min_p after the temperature. Each is vectorised over the rows that use it and skipped
when none does, so a batch without them pays nothing."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from fulcrum.llm.sampling_params import MAX_ABS_LOGIT_BIAS

if TYPE_CHECKING:
    from fulcrum.llm.sampling_params import SamplingParams

_NEG_INF = float("-inf")


class TokenHistory(Protocol):
    """What a processor reads of a sequence: its tokens so far (a Sequence satisfies it)."""

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def eos_token_id(self) -> int | None: ...


def needs_processing(params: list[SamplingParams]) -> bool:
    """True when any row uses a processor before sampling (min_p aside)."""
    return any(s.uses_processors for s in params)


def apply_processors(
    logits: torch.Tensor, params: list[SamplingParams], histories: list[TokenHistory]
) -> torch.Tensor:
    """logits (S, V) float32, processed by each row's settings into a new tensor (the raw
    logits stay as they are: logprobs are taken from them)."""
    logits = logits.clone()  # the one copy; every processor below writes in place
    _ban(logits, _disallowed(logits, params))
    _ban_ids(logits, _bad_words(params, histories))
    _ban_ids(logits, _min_tokens(params, histories))
    _add_bias(logits, params)
    apply_penalties(logits, params, histories)
    return logits


def _disallowed(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor | None:
    """(S, V) True where a row's allowed_token_ids leave a token out; None when no row has one."""
    rows = [i for i, s in enumerate(params) if s.allowed_token_ids is not None]
    if not rows:
        return None
    mask = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    for row in rows:
        allowed = _allowed_ids(params[row]).to(logits.device)
        mask[row] = True
        mask[row, allowed] = False
    return mask


def _allowed_ids(sampling: SamplingParams) -> torch.Tensor:
    """The request's allowed ids as a tensor, built on its first step and kept with it (a long
    list would otherwise be converted on every step)."""
    cached: torch.Tensor | None = sampling.__dict__.get("_allowed_ids")
    if cached is None:
        cached = torch.tensor(sampling.allowed_token_ids or (), dtype=torch.int64)
        # SamplingParams is frozen; its __dict__ holds derived values, never fields.
        sampling.__dict__["_allowed_ids"] = cached
    return cached


def _ban(logits: torch.Tensor, mask: torch.Tensor | None) -> None:
    if mask is not None:
        logits.masked_fill_(mask, _NEG_INF)


def _ban_ids(logits: torch.Tensor, banned: list[tuple[int, int]]) -> None:
    """Set each (row, token id) pair of logits to -inf."""
    if banned:
        rows, cols = zip(*banned, strict=True)
        logits[list(rows), list(cols)] = _NEG_INF


def _bad_words(
    params: list[SamplingParams], histories: list[TokenHistory]
) -> list[tuple[int, int]]:
    """(row, token) pairs that would complete a bad word given the row's output so far."""
    banned: list[tuple[int, int]] = []
    for row, sampling in enumerate(params):
        if not sampling.bad_words_token_ids:
            continue
        history = histories[row]
        output = history.token_ids[history.num_prompt_tokens :]
        for word in sampling.bad_words_token_ids:
            prefix = list(word[:-1])
            # vLLM matches the prefix against generated tokens only, never the prompt.
            if len(prefix) <= len(output) and output[len(output) - len(prefix) :] == prefix:
                banned.append((row, word[-1]))
    return banned


def _min_tokens(
    params: list[SamplingParams], histories: list[TokenHistory]
) -> list[tuple[int, int]]:
    """(row, token) pairs of stop tokens (EOS included) a row may not yet end with."""
    banned: list[tuple[int, int]] = []
    for row, sampling in enumerate(params):
        if not sampling.min_tokens:
            continue
        history = histories[row]
        if len(history.token_ids) - history.num_prompt_tokens >= sampling.min_tokens:
            continue
        stops = set(sampling.stop_token_ids)
        if history.eos_token_id is not None and not sampling.ignore_eos:
            stops.add(history.eos_token_id)
        banned.extend((row, token) for token in sorted(stops))
    return banned


def _add_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    pairs = [(row, t, b) for row, s in enumerate(params) for t, b in s.logit_bias]
    if not pairs:
        return
    rows, cols, biases = zip(*pairs, strict=True)
    # vLLM clamps each bias to OpenAI's range rather than refusing it.
    values = torch.tensor(biases, dtype=logits.dtype, device=logits.device)
    values = values.clamp(-MAX_ABS_LOGIT_BIAS, MAX_ABS_LOGIT_BIAS)
    row_index = torch.tensor(rows, device=logits.device)
    col_index = torch.tensor(cols, device=logits.device)
    logits.index_put_((row_index, col_index), values, accumulate=True)


def _token_counts(sequences: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """(R, V) how many times each token occurs in each row's token list."""
    lengths = [len(tokens) for tokens in sequences]
    # One flat pass in numpy: row r's token t lands in bin r * V + t.
    flat = np.fromiter(itertools.chain.from_iterable(sequences), np.int64, sum(lengths))
    rows = np.repeat(np.arange(len(sequences), dtype=np.int64), lengths)
    counts = np.bincount(rows * vocab + flat, minlength=len(sequences) * vocab)
    return torch.from_numpy(counts.astype(np.float32)).view(len(sequences), vocab).to(device)


def apply_penalties(
    logits: torch.Tensor, params: list[SamplingParams], histories: list[TokenHistory]
) -> None:
    """vLLM's penalties, in place, on the rows that set any: repetition over prompt and output
    tokens (positive logits divided, negative ones multiplied), frequency and presence over the
    output."""
    rows = [i for i, s in enumerate(params) if s.has_penalties]
    if not rows:
        return
    device = logits.device
    vocab = logits.shape[-1]
    chosen = [params[i] for i in rows]
    outputs = [histories[i].token_ids[histories[i].num_prompt_tokens :] for i in rows]
    output_counts = _token_counts(outputs, vocab, device)  # (R, V)
    scores = logits[rows]  # (R, V), a copy
    if any(s.repetition_penalty != 1.0 for s in chosen):
        prompts = [histories[i].token_ids[: histories[i].num_prompt_tokens] for i in rows]
        seen = (_token_counts(prompts, vocab, device) > 0) | (output_counts > 0)
        repetition = torch.tensor([s.repetition_penalty for s in chosen], device=device)[:, None]
        penalised = torch.where(scores > 0, scores / repetition, scores * repetition)
        scores = torch.where(seen, penalised, scores)
    if any(s.frequency_penalty or s.presence_penalty for s in chosen):
        frequency = torch.tensor([s.frequency_penalty for s in chosen], device=device)[:, None]
        presence = torch.tensor([s.presence_penalty for s in chosen], device=device)[:, None]
        scores -= frequency * output_counts + presence * (output_counts > 0)
    logits[rows] = scores


def apply_min_p(scores: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """scores (R, V) after the temperature, without the tokens whose probability is below
    min_p (R,) times the row's largest; a row with min_p 0 is unchanged."""
    probs = scores.softmax(-1)
    threshold = probs.amax(-1, keepdim=True) * min_p[:, None]
    return scores.masked_fill(probs < threshold, _NEG_INF)


def bad_words_token_ids(
    encode: Callable[[str], list[int]], words: tuple[str, ...]
) -> tuple[tuple[int, ...], ...]:
    """Each bad word as token ids, as vLLM tokenises them: the word as given (stripped of leading
    space) and with one leading space, the latter only when it is a different token sequence of
    the same length (a word at the start of the text and one after a space)."""
    found: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(encode(word.lstrip()))
        if plain:
            found.append(plain)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            found.append(spaced)
    return tuple(dict.fromkeys(found))
