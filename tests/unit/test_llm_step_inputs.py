"""Step inputs: row order, tokens, positions, context lengths and sampling rows of a step, the
decode rows laid out in bulk exactly as sequence by sequence."""

from __future__ import annotations

import random

from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.scheduler import ScheduledBatch
from fulcrum.llm.sequence import Sequence
from fulcrum.llm.step_inputs import StepInputs, _add_rows, step_inputs, step_order


def seq_with(seq_id: int, tokens: list[int], num_prompt: int, num_computed: int) -> Sequence:
    """A sequence of `tokens` (the first num_prompt its prompt), num_computed of them cached."""
    seq = Sequence(seq_id, tokens[:num_prompt], SamplingParams(), arrival_s=0.0)
    seq.token_ids = list(tokens)
    seq.num_computed_tokens = num_computed
    return seq


def batch_of(*rows: tuple[Sequence, int]) -> ScheduledBatch:
    batch = ScheduledBatch()
    for seq, num_new in rows:
        batch.add(seq, num_new)
    return batch


def one_by_one(batch: ScheduledBatch) -> StepInputs:
    """The reference: every sequence through the general per-sequence path."""
    order, _ = step_order(batch)
    seqs = [batch.seqs[i] for i in order]
    inputs = StepInputs(seqs, [batch.num_new_tokens[i] for i in order], [], [], [], [], [], [])
    for index, seq, num_new in zip(order, seqs, inputs.query_lens, strict=True):
        _add_rows(inputs, index, seq, num_new)
    return inputs


def test_decodes_lead_longest_context_first_then_verifications_and_chunks() -> None:
    short = seq_with(0, [5, 6, 7], 2, 2)  # decode at position 2
    long = seq_with(1, [1, 2, 3, 4, 8], 3, 4)  # decode at position 4
    fresh = seq_with(2, [9, 9, 9], 3, 0)  # a whole prompt
    tied = seq_with(3, [4, 4, 4], 2, 2)  # decode, same context as `short`
    drafting = seq_with(4, [1, 2, 3], 2, 2)
    drafting.spec_token_ids = [7, 8]
    inputs = step_inputs(batch_of((short, 1), (long, 1), (fresh, 3), (tied, 1), (drafting, 3)))
    assert [s.seq_id for s in inputs.seqs] == [1, 0, 3, 4, 2]  # ties keep batch order
    assert inputs.input_ids == [8, 7, 4, 3, 7, 8, 9, 9, 9]
    assert inputs.positions == [4, 2, 2, 2, 3, 4, 0, 1, 2]
    assert inputs.context_lens == [5, 3, 3, 5, 3]
    # Every sequence samples: decodes at their row, the drafting one at its last known token.
    assert inputs.sample_rows == [0, 1, 2, 3, 8]
    assert inputs.sampling == [1, 0, 3, 4, 2]


def test_a_one_token_chunk_mid_prompt_does_not_sample() -> None:
    mid = seq_with(0, [1, 2, 3, 4], 4, 1)  # prompt token 1 of 4: a budget of one token
    last = seq_with(1, [1, 2, 3, 4], 4, 3)  # its last prompt token: samples
    inputs = step_inputs(batch_of((mid, 1), (last, 1)))
    assert [s.seq_id for s in inputs.seqs] == [1, 0]
    assert inputs.input_ids == [4, 2]
    assert inputs.sample_rows == [0]
    assert inputs.sampling == [1]


def test_decodes_wanting_prompt_logprobs_are_scored() -> None:
    plain = seq_with(0, [1, 2, 3], 3, 2)
    scored = Sequence(1, [4, 5, 6], SamplingParams(prompt_logprobs=1), arrival_s=0.0)
    scored.num_computed_tokens = 1  # a one-token chunk of its prompt
    inputs = step_inputs(batch_of((plain, 1), (scored, 1)))
    assert inputs.scored == [(scored, 1, 1)]
    assert inputs.input_ids == [3, 5]
    assert inputs.sampling == [0]


def test_bulk_decode_rows_equal_the_per_sequence_rows() -> None:
    rng = random.Random(0)
    for _ in range(50):
        rows = []
        for seq_id in range(rng.randint(1, 12)):
            num_prompt = rng.randint(1, 8)
            tokens = [rng.randrange(100) for _ in range(num_prompt + rng.randint(0, 6))]
            num_computed = rng.randint(0, len(tokens) - 1)
            seq = seq_with(seq_id, tokens, num_prompt, num_computed)
            decode = rng.random() < 0.7
            rows.append((seq, 1 if decode else len(tokens) - num_computed))
        batch = batch_of(*rows)
        assert step_inputs(batch) == one_by_one(batch)
