"""Scheduler: token budget, admission order, chunked prefill, preemption, aborts, stopping.

A fake model writes a fingerprint of each computed token's prefix into a paged "KV cache" (one
entry per slot) and, before it samples, checks that every slot of the sequence holds its own
prefix: so wrong block tables, bad prefix hits or overwritten shared blocks fail the tests.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from fulcrum.errors import ConfigError, FulcrumError, InvalidInput, QueueFull
from fulcrum.llm.block_manager import BlockManager
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.scheduler import ScheduledBatch, Scheduler
from fulcrum.llm.sequence import FinishReason, Sequence, SequenceStatus

VOCAB = 23
EOS = 0


def next_token(token_ids: list[int]) -> int:
    """The fake model's deterministic choice, a function of the whole sequence."""
    return hash(tuple(token_ids)) % VOCAB


class FakeModel:
    """Writes and checks per-slot prefix fingerprints, like a paged-attention model would."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.kv: dict[int, tuple[str | None, int]] = {}
        self.num_steps = 0

    def slot(self, seq: Sequence, position: int) -> int:
        block = seq.block_table[position // self.block_size]
        return block * self.block_size + position % self.block_size

    def fingerprint(self, seq: Sequence, position: int) -> tuple[str | None, int]:
        return (seq.cache_salt, hash(tuple(seq.token_ids[: position + 1])))

    def run(self, batch: ScheduledBatch) -> list[int | None]:
        self.num_steps += 1
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            assert len(seq.block_table) * self.block_size >= start + num_new
            for position in range(start, start + num_new):
                self.kv[self.slot(seq, position)] = self.fingerprint(seq, position)
        # All writes land before any read, as in a real step: a write into another sequence's
        # block shows up here.
        sampled: list[int | None] = []
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if seq.num_computed_tokens + num_new < seq.num_tokens:
                sampled.append(None)
                continue
            for position in range(seq.num_tokens):
                assert self.kv[self.slot(seq, position)] == self.fingerprint(seq, position)
            sampled.append(next_token(seq.token_ids))
        return sampled


def reference_output(prompt: list[int], params: SamplingParams) -> list[int]:
    """What the fake model generates for a sequence run alone."""
    tokens = list(prompt)
    output: list[int] = []
    while True:
        token = next_token(tokens)
        tokens.append(token)
        output.append(token)
        stop = (token == EOS and not params.ignore_eos) or token in params.stop_token_ids
        if stop or len(output) >= params.max_tokens:
            return output


@dataclass
class Harness:
    """A scheduler, its block manager and the fake model, stepped together."""

    scheduler: Scheduler
    block_manager: BlockManager
    model: FakeModel

    def step(self) -> tuple[ScheduledBatch, list[Sequence]]:
        was_running = {s.seq_id for s in self.scheduler._running}
        batch = self.scheduler.schedule()
        check_batch(self.scheduler, batch)
        if batch.preempted:  # memory is short: no admissions in that step
            assert {s.seq_id for s in batch.seqs} <= was_running
        # Among sequences already running, decodes come before any prefill chunk.
        chunk_seen = False
        for seq in batch.seqs:
            if seq.seq_id in was_running:
                is_decode = seq.num_computed_tokens + 1 == seq.num_tokens
                assert not (is_decode and chunk_seen)
                chunk_seen = chunk_seen or not is_decode
        return batch, self.scheduler.update(batch, self.model.run(batch))

    def run_to_end(self, max_num_steps: int = 1000) -> None:
        for _ in range(max_num_steps):
            if not self.scheduler.has_unfinished:
                return
            self.step()
        raise AssertionError("sequences did not finish")


def make_harness(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    max_num_waiting: int = 100,
) -> Harness:
    bm = BlockManager(num_blocks, block_size)
    scheduler = Scheduler(
        bm,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_waiting=max_num_waiting,
    )
    return Harness(scheduler, bm, FakeModel(block_size))


def make_seq(
    seq_id: int,
    prompt: list[int],
    *,
    max_tokens: int = 4,
    arrival_s: float | None = None,
    priority: int = 0,
    salt: str | None = None,
    ignore_eos: bool = True,
    stop_token_ids: tuple[int, ...] = (),
) -> Sequence:
    params = SamplingParams(
        max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=stop_token_ids
    )
    arrival = float(seq_id) if arrival_s is None else arrival_s
    return Sequence(
        seq_id, prompt, params, arrival_s=arrival, priority=priority, cache_salt=salt,
        eos_token_id=EOS,
    )  # fmt: skip


def check_batch(scheduler: Scheduler, batch: ScheduledBatch) -> None:
    """Invariants of every scheduled step."""
    assert batch.num_batched_tokens <= scheduler.max_num_batched_tokens
    assert len(batch.seqs) <= scheduler.max_num_seqs
    assert scheduler.num_running <= scheduler.max_num_seqs
    assert len({s.seq_id for s in batch.seqs}) == len(batch.seqs)
    for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
        assert seq.status is SequenceStatus.RUNNING
        assert 1 <= num_new <= seq.num_tokens - seq.num_computed_tokens
    for seq in batch.preempted:
        assert seq.status is SequenceStatus.WAITING
        assert seq.block_table == []
        assert seq.num_computed_tokens == 0


def prompt_of(length: int, start: int = 1) -> list[int]:
    return [(start + i) % VOCAB for i in range(length)]


# --- configuration and admission -------------------------------------------------------------


def test_bad_limits_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        Scheduler(BlockManager(4, 4), max_num_seqs=0, max_num_batched_tokens=8, max_num_waiting=1)


def test_queue_full_beyond_max_num_waiting() -> None:
    h = make_harness(max_num_waiting=2)
    h.scheduler.add(make_seq(0, [1, 2]))
    h.scheduler.add(make_seq(1, [1, 2]))
    with pytest.raises(QueueFull):
        h.scheduler.add(make_seq(2, [1, 2]))
    assert h.scheduler.num_waiting == 2
    h.step()  # admission empties the queue, so there is room again
    h.scheduler.add(make_seq(2, [1, 2]))
    assert h.scheduler.num_waiting == 1


def test_duplicate_or_oversized_sequences_are_invalid() -> None:
    h = make_harness(num_blocks=4, block_size=4)
    h.scheduler.add(make_seq(0, [1, 2]))
    with pytest.raises(InvalidInput):
        h.scheduler.add(make_seq(0, [3]))
    with pytest.raises(InvalidInput):  # 14 + 4 - 1 KV tokens > 16 slots
        h.scheduler.add(make_seq(1, prompt_of(14), max_tokens=4))
    h.scheduler.add(make_seq(2, prompt_of(13), max_tokens=4))  # exactly 16 slots
    bad_params = Sequence(3, [1], SamplingParams(max_tokens=0), arrival_s=0.0)
    with pytest.raises(InvalidInput, match="max_tokens"):
        h.scheduler.add(bad_params)
    assert h.scheduler.num_waiting == 2


def test_priorities_then_arrival_order_admission() -> None:
    h = make_harness(max_num_seqs=1)
    h.scheduler.add(make_seq(0, [1], priority=5, max_tokens=1))
    h.scheduler.add(make_seq(1, [1], priority=0, max_tokens=1, arrival_s=3.0))
    h.scheduler.add(make_seq(2, [1], priority=0, max_tokens=1, arrival_s=2.0))
    h.scheduler.add(make_seq(3, [1], priority=-1, max_tokens=1, arrival_s=9.0))
    order = [h.step()[0].seqs[0].seq_id for _ in range(4)]
    assert order == [3, 2, 1, 0]


# --- the token budget ------------------------------------------------------------------------


def test_running_before_waiting_and_budget_respected() -> None:
    h = make_harness(max_num_batched_tokens=10, max_num_seqs=8)
    for i in range(3):
        h.scheduler.add(make_seq(i, prompt_of(3, i), max_tokens=10))
    first, _ = h.step()
    assert first.num_new_tokens == [3, 3, 3]
    h.scheduler.add(make_seq(3, prompt_of(20), max_tokens=2))
    batch, _ = h.step()
    assert [s.seq_id for s in batch.seqs] == [0, 1, 2, 3]
    assert batch.num_new_tokens == [1, 1, 1, 7]  # decodes first, the prompt gets what is left
    assert batch.num_batched_tokens == 10


def test_long_prompt_is_chunked_while_others_keep_decoding() -> None:
    h = make_harness(max_num_batched_tokens=8, num_blocks=64)
    decoders = [make_seq(i, prompt_of(2, i), max_tokens=50) for i in range(3)]
    for seq in decoders:
        h.scheduler.add(seq)
    h.step()
    long_seq = make_seq(9, prompt_of(40), max_tokens=3)
    h.scheduler.add(long_seq)
    outputs_before = [s.num_output_tokens for s in decoders]
    num_steps = 0
    while long_seq.num_output_tokens == 0:
        batch, updated = h.step()
        num_steps += 1
        assert {0, 1, 2} <= {s.seq_id for s in updated}  # everyone's next token, every step
        chunk = dict(zip([s.seq_id for s in batch.seqs], batch.num_new_tokens, strict=True))
        assert chunk[9] == 5
    assert num_steps == 8  # 40 prompt tokens in chunks of 8 - 3 decodes
    after = [s.num_output_tokens for s in decoders]
    assert [a - b for a, b in zip(after, outputs_before, strict=True)] == [8, 8, 8]
    h.run_to_end()
    assert long_seq.output_token_ids == reference_output(prompt_of(40), long_seq.sampling)


def test_budget_smaller_than_running_set_rotates_nobody_out_of_order() -> None:
    h = make_harness(max_num_batched_tokens=2, max_num_seqs=4)
    for i in range(4):
        h.scheduler.add(make_seq(i, [i + 1], max_tokens=3))
    h.run_to_end()
    assert h.model.num_steps > 0
    assert h.block_manager.num_free_blocks() == h.block_manager.num_blocks


def test_max_num_seqs_limits_running() -> None:
    h = make_harness(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(5):
        h.scheduler.add(make_seq(i, prompt_of(3, i), max_tokens=2))
    batch, _ = h.step()
    assert len(batch.seqs) == 2
    assert (h.scheduler.num_running, h.scheduler.num_waiting) == (2, 3)


def test_set_limits_lowers_the_budget_and_running_limit_of_later_steps() -> None:
    h = make_harness(max_num_batched_tokens=32, max_num_seqs=8)
    for i in range(3):
        h.scheduler.add(make_seq(i, prompt_of(2, i), max_tokens=30))
    h.step()
    h.scheduler.add(make_seq(9, prompt_of(40), max_tokens=2))
    h.scheduler.set_limits(8, 4)  # what the SLO controller decides after a slow step
    batch, _ = h.step()
    assert batch.num_new_tokens == [1, 1, 1, 5]  # the prompt's chunk shrinks, decodes stay
    h.scheduler.add(make_seq(10, [1, 2], max_tokens=2))
    batch, _ = h.step()
    assert h.scheduler.num_running == 4 and 10 not in {s.seq_id for s in batch.seqs}
    h.scheduler.set_limits(10_000, 10_000)  # never beyond the configured maxima
    assert (h.scheduler.token_budget, h.scheduler.max_running) == (32, 8)
    with pytest.raises(FulcrumError):
        h.scheduler.set_limits(0, 4)
    h.run_to_end()
    assert h.block_manager.num_free_blocks() == h.block_manager.num_blocks


def test_decoding_and_queued_token_counts_feed_the_controller() -> None:
    h = make_harness(max_num_batched_tokens=8, max_num_seqs=8)
    h.scheduler.add(make_seq(0, prompt_of(3), max_tokens=10))
    h.step()  # seq 0 prefilled: it decodes from now on
    h.scheduler.add(make_seq(1, prompt_of(20, 5), max_tokens=2))
    h.scheduler.add(make_seq(2, prompt_of(6, 7), max_tokens=2))
    assert (h.scheduler.num_decoding, h.scheduler.num_queued_tokens) == (1, 26)
    h.step()  # seq 1 gets 7 prompt tokens; seq 2 waits behind it
    assert (h.scheduler.num_decoding, h.scheduler.num_queued_tokens) == (1, 13 + 6)


# --- preemption --------------------------------------------------------------------------------


def test_preempts_newest_when_blocks_run_out_and_resumes_it_correctly() -> None:
    # 4 blocks of 4 slots; two sequences of 4 prompt tokens growing to 11 tokens each.
    h = make_harness(num_blocks=4, block_size=4, max_num_batched_tokens=16)
    old = make_seq(0, prompt_of(4, 1), max_tokens=8)
    new = make_seq(1, prompt_of(4, 7), max_tokens=8)
    h.scheduler.add(old)
    h.scheduler.add(new)
    preempted: list[Sequence] = []
    for _ in range(200):
        if not h.scheduler.has_unfinished:
            break
        batch, _ = h.step()
        preempted.extend(batch.preempted)
        if batch.preempted:
            assert new in batch.preempted
            assert new not in batch.seqs
            assert new.num_computed_tokens == 0
    assert preempted
    assert old not in preempted
    assert h.scheduler.num_preemptions == len(preempted) == new.num_preemptions
    for seq in (old, new):
        assert seq.finish_reason is FinishReason.LENGTH
        assert seq.output_token_ids == reference_output(seq.token_ids[:4], seq.sampling)
    assert h.block_manager.num_free_blocks() == 4


def test_lowest_priority_is_preempted_before_newer_higher_priority() -> None:
    h = make_harness(num_blocks=4, block_size=4, max_num_batched_tokens=16)
    low_old = make_seq(0, prompt_of(4, 1), max_tokens=8, priority=3)
    high_new = make_seq(1, prompt_of(4, 7), max_tokens=8, priority=0)
    h.scheduler.add(low_old)
    h.scheduler.add(high_new)
    seen: set[int] = set()
    for _ in range(200):
        if not h.scheduler.has_unfinished:
            break
        batch, _ = h.step()
        seen |= {s.seq_id for s in batch.preempted}
    assert seen == {0}
    assert high_new.output_token_ids == reference_output(prompt_of(4, 7), high_new.sampling)
    assert low_old.output_token_ids == reference_output(prompt_of(4, 1), low_old.sampling)


def test_preempted_sequences_resume_in_order_ahead_of_later_arrivals() -> None:
    h = make_harness(num_blocks=6, block_size=2, max_num_batched_tokens=32, max_num_seqs=3)
    seqs = [make_seq(i, prompt_of(2, 3 * i + 1), max_tokens=6) for i in range(3)]
    for seq in seqs:
        h.scheduler.add(seq)
    preempted: list[int] = []
    for _ in range(20):
        batch, _ = h.step()
        preempted.extend(s.seq_id for s in batch.preempted)
        if len(preempted) == 2:
            break
    assert preempted == [2, 1]  # newest first
    assert seqs[0].num_computed_tokens > 0
    h.scheduler.add(make_seq(7, [5, 5], max_tokens=1))
    waiting_order = [s.seq_id for s in h.scheduler._waiting]
    assert waiting_order == [1, 2, 7]
    h.run_to_end()
    for seq in seqs:
        assert seq.output_token_ids == reference_output(seq.token_ids[:2], seq.sampling)


# --- abort, finish and stop conditions -----------------------------------------------------------


def test_abort_running_and_waiting_frees_blocks_at_once() -> None:
    h = make_harness(max_num_seqs=1)
    running = make_seq(0, prompt_of(9), max_tokens=5)
    waiting = make_seq(1, prompt_of(3), max_tokens=5)
    h.scheduler.add(running)
    h.scheduler.add(waiting)
    h.step()
    assert running.block_table
    free_before = h.block_manager.num_free_blocks()
    assert h.scheduler.abort(0) is running
    assert running.block_table == []
    assert h.block_manager.num_free_blocks() == free_before + 3
    assert running.status is SequenceStatus.FINISHED
    assert running.finish_reason is FinishReason.ABORT
    assert h.scheduler.abort(1) is waiting
    assert waiting.finish_reason is FinishReason.ABORT
    assert h.scheduler.abort(1) is None
    assert (h.scheduler.num_running, h.scheduler.num_waiting) == (0, 0)
    assert h.block_manager.usage() == 0.0


def test_abort_between_schedule_and_update_drops_the_token() -> None:
    h = make_harness()
    seq = make_seq(0, prompt_of(3), max_tokens=5)
    h.scheduler.add(seq)
    batch = h.scheduler.schedule()
    sampled = h.model.run(batch)
    h.scheduler.abort(0)
    assert h.scheduler.update(batch, sampled) == []
    assert seq.num_output_tokens == 0
    assert h.block_manager.num_free_blocks() == h.block_manager.num_blocks


def test_finish_for_a_stop_string_frees_blocks() -> None:
    h = make_harness()
    seq = make_seq(0, prompt_of(3), max_tokens=5)
    h.scheduler.add(seq)
    h.step()
    h.scheduler.finish(0, FinishReason.STOP)
    assert seq.finish_reason is FinishReason.STOP
    assert h.block_manager.usage() == 0.0
    h.scheduler.finish(0, FinishReason.STOP)  # already gone: nothing to do
    assert not h.scheduler.has_unfinished


def test_update_finishes_on_max_tokens() -> None:
    h = make_harness()
    seq = make_seq(0, prompt_of(3), max_tokens=3)
    h.scheduler.add(seq)
    finished_at = None
    for step in range(1, 10):
        _, updated = h.step()
        assert updated == [seq]
        if seq.is_finished:
            finished_at = step
            break
    assert finished_at == 3
    assert seq.finish_reason is FinishReason.LENGTH
    assert seq.num_output_tokens == 3
    assert h.block_manager.usage() == 0.0


def find_prompt(predicate: object, params: SamplingParams) -> list[int]:
    """A prompt whose reference output (with stop rules off) satisfies predicate."""
    for start in range(VOCAB):
        prompt = prompt_of(3, start)
        if predicate(reference_output(prompt, params)):  # type: ignore[operator]
            return prompt
    raise AssertionError("no prompt found")


def test_update_finishes_on_eos_unless_ignored() -> None:
    open_params = SamplingParams(max_tokens=30, ignore_eos=True)
    prompt = find_prompt(lambda out: EOS in out[:-1], open_params)
    eos_at = reference_output(prompt, open_params).index(EOS)
    h = make_harness()
    stops = make_seq(0, prompt, max_tokens=30, ignore_eos=False)
    ignores = make_seq(1, prompt, max_tokens=30, ignore_eos=True)
    h.scheduler.add(stops)
    h.scheduler.add(ignores)
    h.run_to_end()
    assert stops.finish_reason is FinishReason.STOP
    assert stops.num_output_tokens == eos_at + 1
    assert stops.output_token_ids[-1] == EOS
    assert ignores.finish_reason is FinishReason.LENGTH
    assert ignores.num_output_tokens == 30


def test_update_finishes_on_stop_token_ids() -> None:
    open_params = SamplingParams(max_tokens=30, ignore_eos=True)
    prompt = find_prompt(lambda out: len(set(out)) > 3, open_params)
    target = reference_output(prompt, open_params)[2]
    h = make_harness()
    seq = make_seq(0, prompt, max_tokens=30, stop_token_ids=(target,))
    h.scheduler.add(seq)
    h.run_to_end()
    assert seq.finish_reason is FinishReason.STOP
    assert seq.output_token_ids[-1] == target
    assert target not in seq.output_token_ids[:-1]


def test_update_rejects_sampled_counts_that_break_the_contract() -> None:
    h = make_harness(max_num_batched_tokens=4)
    seq = make_seq(0, prompt_of(10), max_tokens=3)
    h.scheduler.add(seq)
    batch = h.scheduler.schedule()
    with pytest.raises(FulcrumError):
        h.scheduler.update(batch, [])
    with pytest.raises(FulcrumError):  # a token in the middle of a prefill chunk
        h.scheduler.update(batch, [5])


def test_prefix_hit_on_admission_is_reported_and_skips_computation() -> None:
    h = make_harness(block_size=4, max_num_batched_tokens=64)
    system = prompt_of(12)
    first = make_seq(0, [*system, 1, 2], max_tokens=2)
    h.scheduler.add(first)
    h.run_to_end()
    second = make_seq(1, [*system, 3, 4], max_tokens=2)
    h.scheduler.add(second)
    batch, _ = h.step()
    assert second.num_cached_tokens == 12
    assert batch.num_new_tokens == [2]
    h.run_to_end()
    assert second.output_token_ids == reference_output([*system, 3, 4], second.sampling)
    assert h.block_manager.stats.num_hits == 12


# --- randomized workloads ------------------------------------------------------------------------

SYSTEM_PROMPTS = [prompt_of(8, 1), prompt_of(6, 5), prompt_of(11, 9)]


@dataclass(frozen=True)
class Request:
    """One generated request of a random workload."""

    arrival_step: int
    prompt: list[int]
    max_tokens: int
    priority: int
    salt: str | None
    abort_after_steps: int | None


@st.composite
def workloads(draw: st.DrawFn) -> list[Request]:
    """Requests with shared system prompts, tenants, priorities and some aborts."""
    requests = []
    for _ in range(draw(st.integers(1, 14))):
        prefix = draw(st.sampled_from([[], *SYSTEM_PROMPTS]))
        suffix = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12))
        requests.append(
            Request(
                arrival_step=draw(st.integers(0, 12)),
                prompt=prefix + suffix,
                max_tokens=draw(st.integers(1, 12)),
                priority=draw(st.integers(0, 2)),
                salt=draw(st.sampled_from([None, None, "tenant"])),
                abort_after_steps=draw(st.sampled_from([None, None, None, 0, 3])),
            )
        )
    return requests


def check_blocks(h: Harness) -> None:
    """Free + referenced == total, and each block's ref count equals its owners."""
    owners: dict[int, int] = {}
    for seq in [*h.scheduler._running, *h.scheduler._waiting]:
        for block_id in seq.block_table:
            owners[block_id] = owners.get(block_id, 0) + 1
    bm = h.block_manager
    assert len(owners) + bm.num_free_blocks() == bm.num_blocks
    for block_id in range(bm.num_blocks):
        assert bm.ref_count(block_id) == owners.get(block_id, 0)


def arrive_or_abort(h: Harness, workload: list[Request], step: int) -> list[Sequence]:
    """Add the requests arriving at this step and abort those due; returns the added ones."""
    added = []
    for seq_id, request in enumerate(workload):
        if request.arrival_step == step:
            seq = make_seq(
                seq_id, request.prompt, max_tokens=request.max_tokens,
                priority=request.priority, salt=request.salt, arrival_s=float(step),
                ignore_eos=False,
            )  # fmt: skip
            with contextlib.suppress(InvalidInput):  # it can never fit in this pool
                h.scheduler.add(seq)
                added.append(seq)
        abort_after = request.abort_after_steps
        if abort_after is not None and request.arrival_step + abort_after == step:
            h.scheduler.abort(seq_id)
    return added


def check_outputs(seq: Sequence) -> None:
    """The output equals the solo reference (a prefix of it when aborted)."""
    assert seq.is_finished
    expected = reference_output(seq.token_ids[: seq.num_prompt_tokens], seq.sampling)
    if seq.finish_reason is FinishReason.ABORT:
        assert seq.output_token_ids == expected[: seq.num_output_tokens]
        return
    assert seq.output_token_ids == expected
    assert seq.num_cached_tokens <= seq.num_prompt_tokens - 1


@settings(max_examples=300, deadline=None)
@given(
    workload=workloads(),
    num_blocks=st.integers(8, 24),
    block_size=st.sampled_from([2, 4]),
    max_num_batched_tokens=st.integers(4, 24),
    max_num_seqs=st.integers(1, 6),
)
def test_random_workloads_finish_with_reference_outputs(
    workload: list[Request],
    num_blocks: int,
    block_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
) -> None:
    h = make_harness(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
    )
    seqs: list[Sequence] = []
    for step in range(2000):
        seqs += arrive_or_abort(h, workload, step)
        if step > 15 and not h.scheduler.has_unfinished:
            break
        batch, _ = h.step()
        check_blocks(h)
        if batch.preempted:
            event("preemption")
    assert not h.scheduler.has_unfinished
    assert h.block_manager.num_free_blocks() == h.block_manager.num_blocks
    for seq in seqs:
        check_outputs(seq)
        event(f"finish: {seq.finish_reason}")
    if h.block_manager.stats.num_hits:
        event("prefix hit")


def test_a_step_with_budget_left_schedules_every_running_sequence_after_preemptions() -> None:
    # Tight memory (preemptions in most steps) and a budget the prefills exhaust: the budget
    # the scheduler tracks through its running loop must give a preempted sequence's tokens
    # back to the sequences after it, never leave budget unused while one of them waits.
    h = make_harness(num_blocks=7, block_size=4, max_num_batched_tokens=12)
    for i in range(4):
        h.scheduler.add(make_seq(i, prompt_of(5 + i, i + 1), max_tokens=9))
    num_preempted = 0
    for _ in range(300):
        if not h.scheduler.has_unfinished:
            break
        batch, _ = h.step()
        num_preempted += len(batch.preempted)
        if batch.num_batched_tokens < h.scheduler.max_num_batched_tokens:
            assert set(h.scheduler._running) <= set(batch.seqs)
    assert num_preempted > 0
    assert not h.scheduler.has_unfinished
    assert h.block_manager.num_free_blocks() == 7


def test_decodes_take_a_block_only_when_their_last_one_is_full() -> None:
    # Prompts of 3 and 4 tokens in blocks of 4: after the prefill step the first decode still
    # fits its block, the second needs a new one; both run, and only the second's table grows.
    h = make_harness(num_blocks=8, block_size=4)
    room, full = make_seq(0, prompt_of(3), max_tokens=4), make_seq(1, prompt_of(4), max_tokens=4)
    h.scheduler.add(room)
    h.scheduler.add(full)
    h.step()  # the prompts, one token sampled each
    tables = (list(room.block_table), list(full.block_table))
    batch, _ = h.step()
    assert batch.seqs == [room, full]
    assert batch.num_new_tokens == [1, 1]
    assert room.block_table == tables[0]
    assert full.block_table[:1] == tables[1] and len(full.block_table) == 2
    assert h.block_manager.num_free_blocks() == 8 - 3
