"""The flat inputs of one model step: the rows' order, their token ids, positions and context
lengths, and which rows sample. Decode rows (most of a saturated step) are laid out by a few
whole-list comprehensions; prefill chunks and verifications sequence by sequence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fulcrum.llm.scheduler import ScheduledBatch
    from fulcrum.llm.sequence import Sequence


@dataclass(slots=True)
class StepInputs:
    """One step's rows: tokens flat in step order (`step_order`), sequences and lengths per
    sequence in that order."""

    seqs: list[Sequence]
    query_lens: list[int]
    input_ids: list[int]
    positions: list[int]
    context_lens: list[int]
    sample_rows: list[int]  # index into the flat tokens of each sampling seq's last one
    sampling: list[int]  # indices into batch.seqs of the sampling sequences
    scored: list[tuple[Sequence, int, int]]  # wanting prompt logprobs: seq, first row, count


def step_inputs(batch: ScheduledBatch) -> StepInputs:
    """The rows of a non-empty batch, in `step_order`."""
    order, num_decodes = step_order(batch)
    seqs = [batch.seqs[i] for i in order]
    inputs = StepInputs(seqs, [batch.num_new_tokens[i] for i in order], [], [], [], [], [], [])
    decodes = seqs[:num_decodes]
    first = 0
    if decodes and all(seq.prompt_logprobs is None for seq in decodes):
        _add_decodes(inputs, order[:num_decodes], decodes)
        first = num_decodes
    for index, seq, num_new in zip(
        order[first:], seqs[first:], inputs.query_lens[first:], strict=True
    ):
        _add_rows(inputs, index, seq, num_new)
    return inputs


def _add_decodes(inputs: StepInputs, order: list[int], seqs: list[Sequence]) -> None:
    """Rows of one token each at position num_computed_tokens (no drafts: a sequence verifying
    k drafts computes k + 1 tokens), sampling when it is the sequence's last known token."""
    starts = [seq.num_computed_tokens for seq in seqs]
    inputs.input_ids = [seq.token_ids[c] for seq, c in zip(seqs, starts, strict=True)]
    inputs.positions = starts
    inputs.context_lens = [c + 1 for c in starts]
    rows = [
        r
        for r, (seq, c) in enumerate(zip(seqs, starts, strict=True))
        if c + 1 == len(seq.token_ids)
    ]
    inputs.sample_rows = rows
    inputs.sampling = [order[r] for r in rows]


def _add_rows(inputs: StepInputs, index: int, seq: Sequence, num_new: int) -> None:
    """The rows of sequence `index` of the batch computing num_new tokens."""
    start = seq.num_computed_tokens
    end = start + num_new
    input_ids = inputs.input_ids
    if seq.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
        inputs.scored.append((seq, len(input_ids), num_new))
    input_ids.extend(query_tokens(seq, start, end))
    inputs.positions.extend(range(start, end))
    inputs.context_lens.append(end)
    num_drafts = len(seq.spec_token_ids)
    if end == seq.num_tokens + num_drafts:  # the row of its last token
        inputs.sample_rows.append(len(input_ids) - num_drafts - 1)
        inputs.sampling.append(index)


def query_tokens(seq: Sequence, start: int, end: int) -> list[int]:
    """The tokens seq computes this step: with drafts, its last token and the drafts after it
    (scored like a prefill chunk over its KV), else token_ids[start:end]."""
    if seq.spec_token_ids:
        return [*seq.token_ids[start:], *seq.spec_token_ids]
    return seq.token_ids[start:end]


def step_order(batch: ScheduledBatch) -> tuple[list[int], int]:
    """Step row order: decodes (longest context first), decodes verifying drafts, fresh chunks
    (longest first), then continued chunks; and how many decodes lead it."""
    # Attention groups sequences the same way (`build_metadata(split_chunks=True)`, in-place
    # decodes and verifications first), so in this order every group's tokens are one
    # contiguous range of rows (sliced, not gathered). Each token's result depends only on its
    # own sequence's tokens, wherever its row sits.
    num_new_tokens = batch.num_new_tokens
    decodes = [i for i, n in enumerate(num_new_tokens) if n == 1]
    verifying: list[int] = []
    fresh: list[int] = []
    continued: list[int] = []
    if len(decodes) < len(num_new_tokens):
        for i, (seq, num_new) in enumerate(zip(batch.seqs, num_new_tokens, strict=True)):
            if num_new == 1:
                continue
            if seq.spec_token_ids:
                verifying.append(i)
            else:
                (continued if seq.num_computed_tokens else fresh).append(i)
    # Stable, reverse included: equal contexts keep batch order.
    num_computed = [seq.num_computed_tokens for seq in batch.seqs]
    decodes.sort(key=num_computed.__getitem__, reverse=True)
    fresh.sort(key=lambda i: -num_new_tokens[i])
    return decodes + verifying + fresh + continued, len(decodes)
