"""Iteration-level scheduling: one token budget per step shared by running sequences (decodes and
prefill chunks) and newly admitted ones; preemption by recompute when KV blocks run out."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fulcrum.errors import ConfigError, FulcrumError, InvalidInput, QueueFull
from fulcrum.llm.block_manager import BlockManager
from fulcrum.llm.sequence import FinishReason, Sequence, SequenceStatus

if TYPE_CHECKING:
    from fulcrum.llm.speculative import Speculation

# Per sequence of a step: its sampled token, the tokens verified after its drafts, or None.
StepTokens = int | list[int] | None


@dataclass
class ScheduledBatch:
    """What one model step computes, and who was preempted to make room for it."""

    # seqs[i] computes token_ids[c : c + num_new_tokens[i]] at positions c.., where
    # c = seqs[i].num_computed_tokens; it samples iff c + num_new_tokens[i] == seqs[i].num_tokens
    # + len(seqs[i].spec_token_ids) (a decode that verifies drafts computes 1 + len(drafts)).
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # preempted (by recompute) this step

    @property
    def is_empty(self) -> bool:
        """True when the step has nothing to compute."""
        return not self.seqs

    @property
    def num_batched_tokens(self) -> int:
        """Tokens computed this step across all sequences."""
        return sum(self.num_new_tokens)

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        """Schedule num_new_tokens of seq."""
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)

    def remove(self, seq: Sequence) -> None:
        """Unschedule seq (it was preempted later in the same step)."""
        index = self.seqs.index(seq)
        del self.seqs[index]
        del self.num_new_tokens[index]


class Scheduler:
    """Decides each step which tokens of which sequences run, within the budget and KV memory.

    max_num_batched_tokens is the latency/throughput dial: a small budget keeps every step short
    (low inter-token latency, prompts chunked finely), a large one batches more prefill per step
    (higher throughput and lower time to first token under load, slower steps for the decodes).
    `set_limits` lowers the budget and running limit actually used below these maxima (the SLO
    controller, fulcrum.llm.budget, does so each step); unset, the maxima apply.
    Not thread-safe: the engine calls it from one thread.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_num_waiting: int,
    ) -> None:
        if min(max_num_seqs, max_num_batched_tokens, max_num_waiting) < 1:
            raise ConfigError(
                f"max_num_seqs ({max_num_seqs}), max_num_batched_tokens "
                f"({max_num_batched_tokens}) and max_num_waiting ({max_num_waiting}) must be >= 1"
            )
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_waiting = max_num_waiting
        self.token_budget: int | None = None  # None: max_num_batched_tokens
        self.max_running: int | None = None  # None: max_num_seqs
        self.num_preemptions = 0  # cumulative
        self._waiting: list[Sequence] = []  # sorted by Sequence.sort_key
        self._running: list[Sequence] = []  # in admission order
        self._seqs: dict[int, Sequence] = {}  # every waiting or running sequence by id
        self.speculation: Speculation | None = None  # drafts for decodes (off: None)

    @property
    def num_running(self) -> int:
        """Sequences holding KV blocks and scheduled every step."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Sequences queued for admission (preempted ones included)."""
        return len(self._waiting)

    @property
    def num_decoding(self) -> int:
        """Running sequences past their prefill: each computes one token per step."""
        return sum(s.num_tokens - s.num_computed_tokens == 1 for s in self._running)

    @property
    def num_queued_tokens(self) -> int:
        """Tokens still to prefill before their first new token, waiting and running alike."""
        num_left = [s.num_tokens - s.num_computed_tokens for s in self._running]
        running = sum(n for n in num_left if n > 1)  # 1: a decode
        return running + sum(s.num_tokens - s.num_computed_tokens for s in self._waiting)

    @property
    def finish_steps(self) -> tuple[int, ...]:
        """Per running sequence, the steps until it ends at its max_tokens at the latest,
        ascending (for admission: when a running slot frees)."""
        return tuple(
            sorted(max(0, s.sampling.max_tokens - s.num_output_tokens) for s in self._running)
        )

    def set_limits(self, token_budget: int, max_running: int) -> None:
        """Use this token budget and running limit from the next step, within the maxima."""
        if min(token_budget, max_running) < 1:
            raise FulcrumError(f"token budget {token_budget} and max running {max_running}: < 1")
        self.token_budget = min(token_budget, self.max_num_batched_tokens)
        self.max_running = min(max_running, self.max_num_seqs)

    @property
    def has_unfinished(self) -> bool:
        """True while any sequence is waiting or running."""
        return bool(self._seqs)

    def get(self, seq_id: int) -> Sequence | None:
        """The waiting or running sequence with this id, if any."""
        return self._seqs.get(seq_id)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; QueueFull when max_num_waiting are already queued."""
        if seq.seq_id in self._seqs:
            raise InvalidInput(f"sequence id {seq.seq_id} is already scheduled")
        if seq.status is not SequenceStatus.WAITING or seq.block_table:
            raise InvalidInput(f"sequence {seq.seq_id} is not a new sequence")
        seq.sampling.validate()
        # The last sampled token is never computed, so it needs no KV slot.
        num_max_kv_tokens = seq.num_prompt_tokens + seq.sampling.max_tokens - 1
        num_kv_tokens = self.block_manager.num_blocks * self.block_manager.block_size
        if num_max_kv_tokens > num_kv_tokens:
            raise InvalidInput(
                f"prompt ({seq.num_prompt_tokens} tokens) plus max_tokens "
                f"({seq.sampling.max_tokens}) exceeds the KV cache ({num_kv_tokens} tokens)"
            )
        if len(self._waiting) >= self.max_num_waiting:
            raise QueueFull(f"{len(self._waiting)} sequences are waiting (max_num_waiting)")
        self._enqueue(seq)
        self._seqs[seq.seq_id] = seq

    def abort(self, seq_id: int) -> Sequence | None:
        """Remove the sequence and free its blocks now; None if it is unknown or finished."""
        seq = self._seqs.get(seq_id)
        if seq is not None:
            self._finish(seq, FinishReason.ABORT)
        return seq

    def finish(self, seq_id: int, reason: FinishReason) -> None:
        """Finish a sequence for a reason found outside the scheduler (e.g. a stop string)."""
        seq = self._seqs.get(seq_id)
        if seq is not None:
            self._finish(seq, reason)

    def schedule(self) -> ScheduledBatch:
        """Pick this step's work: running sequences first, then admissions with what is left."""
        batch = ScheduledBatch()
        self._schedule_running(batch)
        # After a preemption memory is short: admitting now would only preempt again.
        if not batch.preempted:
            self._schedule_waiting(batch)
        return batch

    def update(self, batch: ScheduledBatch, sampled: list[StepTokens]) -> list[Sequence]:
        """Apply a finished step; returns the sequences that got a new token (finished included)."""
        if len(sampled) != len(batch.seqs):
            raise FulcrumError(f"{len(sampled)} sampled tokens for {len(batch.seqs)} sequences")
        updated: list[Sequence] = []
        running = SequenceStatus.RUNNING
        commit = self.block_manager.commit
        for seq, num_new_tokens, token_id in zip(
            batch.seqs, batch.num_new_tokens, sampled, strict=True
        ):
            if seq.status is not running:
                continue  # aborted or finished between schedule() and update()
            if seq.spec_token_ids:
                self._accept_verified(seq, token_id)
                updated.append(seq)
                continue
            seq.num_computed_tokens += num_new_tokens
            commit(seq)
            if seq.num_computed_tokens < len(seq.token_ids):
                if token_id is not None:
                    raise FulcrumError(
                        f"sequence {seq.seq_id} sampled in the middle of its prefill"
                    )
                continue
            if token_id is None or isinstance(token_id, list):
                raise FulcrumError(
                    f"sequence {seq.seq_id} computed its last token but sampled none"
                )
            seq.append_token(token_id)
            reason = self._stop_reason(seq, token_id)
            if reason is not None:
                self._finish(seq, reason)
            updated.append(seq)
        return updated

    def _accept_verified(self, seq: Sequence, tokens: StepTokens) -> None:
        """Apply a verification step: the accepted drafts plus the model's token, cut at the first
        stop; the rejected drafts' KV slots are freed, and only final tokens reach the cache."""
        num_drafted = len(seq.spec_token_ids)
        if not isinstance(tokens, list) or not 1 <= len(tokens) <= num_drafted + 1:
            raise FulcrumError(f"sequence {seq.seq_id}: {tokens!r} for {num_drafted} drafts")
        seq.spec_token_ids = []
        if self.speculation is not None:
            self.speculation.stats.record(num_drafted, len(tokens) - 1)
        # K/V is valid for the last token and the accepted drafts (equal to the tokens taken).
        seq.num_computed_tokens += len(tokens)
        for token_id in tokens:
            seq.append_token(token_id)
            reason = self._stop_reason(seq, token_id)
            if reason is not None:
                self._finish(seq, reason)
                return
        self.block_manager.trim(seq)
        self.block_manager.commit(seq)

    def _spare_draft_tokens(self) -> int:
        if self.speculation is None:
            return 0
        budget = self.max_num_batched_tokens if self.token_budget is None else self.token_budget
        prefill_pending = bool(self._waiting) or any(
            s.num_tokens - s.num_computed_tokens > 1 for s in self._running
        )
        return self.speculation.spare_tokens(budget, len(self._running), prefill_pending)

    def _schedule_drafts(self, seq: Sequence, spare: int, batch: ScheduledBatch) -> bool:
        """Schedule a decode with its drafts; False (nothing scheduled) when it has none."""
        if self.speculation is None or seq.num_tokens - seq.num_computed_tokens != 1:
            return False
        drafts = self.speculation.drafts(seq, spare)
        # Draft slots never preempt anyone: without free blocks the sequence decodes plainly.
        if not drafts or not self.block_manager.allocate_slots(seq, 1 + len(drafts)):
            return False
        seq.spec_token_ids = drafts
        batch.add(seq, 1 + len(drafts))
        return True

    def _budget_left(self, batch: ScheduledBatch) -> int:
        budget = self.max_num_batched_tokens if self.token_budget is None else self.token_budget
        return budget - batch.num_batched_tokens

    def _schedule_running(self, batch: ScheduledBatch) -> None:
        # Admission order puts decodes first: a sequence still in prefill took all the budget
        # left when it was admitted, so nobody was admitted after it. A long prompt is thus
        # chunked to what the decodes leave and never delays anyone's next token.
        spare = self._spare_draft_tokens()  # beyond one token per running sequence
        # The budget left is tracked here, not summed over the batch per sequence (quadratic in
        # the running sequences); it is summed again only after a preemption shrank the batch.
        budget = self._budget_left(batch)
        running = SequenceStatus.RUNNING
        block_size = self.block_manager.block_size
        for seq in list(self._running):
            if budget < 1:
                break
            if seq.status is not running:
                continue  # preempted earlier in this step
            if seq.spec_token_ids:
                seq.spec_token_ids = []
            if spare > 0 and self._schedule_drafts(seq, spare, batch):
                spare -= len(seq.spec_token_ids)
                budget = self._budget_left(batch)
                continue
            num_new_tokens = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            # Most decodes still have room in their last block: no allocation to ask for.
            if seq.num_computed_tokens + num_new_tokens <= len(seq.block_table) * block_size:
                batch.add(seq, num_new_tokens)
                budget -= num_new_tokens
                continue
            num_preempted = len(batch.preempted)
            if self._reserve(seq, num_new_tokens, batch):
                batch.add(seq, num_new_tokens)
                budget -= num_new_tokens
            if len(batch.preempted) != num_preempted:
                budget = self._budget_left(batch)

    def _reserve(self, seq: Sequence, num_new_tokens: int, batch: ScheduledBatch) -> bool:
        """Get blocks for seq's next tokens, preempting as needed; False if seq was preempted."""
        while not self.block_manager.allocate_slots(seq, num_new_tokens):
            victim = max(self._running, key=lambda s: s.sort_key)
            self._preempt(victim, batch)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        """Preempt by recompute: free the blocks, forget computed tokens, queue again."""
        self._running.remove(seq)
        if seq in batch.seqs:
            batch.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq)
        batch.preempted.append(seq)

    def _schedule_waiting(self, batch: ScheduledBatch) -> None:
        # Strict order: the head blocks later arrivals, so a big prompt is never starved.
        max_running = self.max_num_seqs if self.max_running is None else self.max_running
        while self._waiting and len(self._running) < max_running:
            budget = self._budget_left(batch)
            if budget < 1:
                return
            seq = self._waiting[0]
            num_new_tokens = self.block_manager.admit(seq, budget)
            if num_new_tokens == 0:
                return
            del self._waiting[0]
            seq.status = SequenceStatus.RUNNING
            self._running.append(seq)
            batch.add(seq, num_new_tokens)

    def _enqueue(self, seq: Sequence) -> None:
        # A preempted sequence keeps its arrival time, so it goes back ahead of later arrivals.
        seq.status = SequenceStatus.WAITING
        bisect.insort(self._waiting, seq, key=lambda s: s.sort_key)

    def _stop_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        sampling = seq.sampling
        num_output_tokens = len(seq.token_ids) - seq.num_prompt_tokens
        if num_output_tokens < sampling.min_tokens:  # <= max_tokens: never past the length
            return None  # vLLM: no stop before min_tokens (their logits were masked anyway)
        if token_id == seq.eos_token_id and not sampling.ignore_eos:
            return FinishReason.STOP
        if token_id in sampling.stop_token_ids:
            return FinishReason.STOP
        if num_output_tokens >= sampling.max_tokens:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
        self.block_manager.free(seq)
        del self._seqs[seq.seq_id]
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
