"""Log-probabilities of chosen tokens and their top alternatives, as vLLM reports them by default
("raw_logprobs"): the log-softmax of the model's logits before any processor, penalty or
temperature, computed for a batch of rows in one pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token's log-probability, its rank (1 = most likely) and the top alternatives."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


def token_logprobs(
    logits: torch.Tensor, token_ids: list[int], num_top: list[int]
) -> list[TokenLogprob]:
    """logits (R, V), the token each row chose and how many alternatives each row wants."""
    logprobs = logits.float().log_softmax(-1)  # (R, V)
    ids = torch.tensor(token_ids, dtype=torch.int64, device=logits.device)[:, None]
    chosen = logprobs.gather(1, ids)  # (R, 1)
    # Ties count in the token's favour, as vLLM's batched_count_greater_than does.
    ranks = ((logprobs > chosen).sum(-1) + 1).tolist()
    k = max(num_top, default=0)
    top_ids: list[list[int]] = [[] for _ in token_ids]
    top_values: list[list[float]] = [[] for _ in token_ids]
    if k > 0:
        values, indices = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
        top_ids, top_values = indices.tolist(), values.tolist()
    return [
        TokenLogprob(
            token_id=token,
            logprob=value,
            rank=int(rank),
            top=tuple(zip(top_ids[i][: num_top[i]], top_values[i][: num_top[i]], strict=True)),
        )
        for i, (token, value, rank) in enumerate(
            zip(token_ids, chosen[:, 0].tolist(), ranks, strict=True)
        )
    ]
