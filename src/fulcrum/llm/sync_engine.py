"""LLMEngine: the synchronous step loop (schedule -> run -> update -> detokenize) over one model;
`fulcrum.llm.engine.AsyncLLMEngine` drives it from one dedicated thread. A failure inside a step
fails only the requests it can be traced to; the engine keeps serving the others."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import cast

from fulcrum.extras import check_torch_version, missing_extra, require_extra

try:
    import torch
except ImportError as exc:  # the engine is the optional [llm] extra: name it, not just the module
    raise missing_extra("llm", "torch", exc) from exc
else:
    require_extra("llm")
    check_torch_version(torch.__version__, extra="llm")

from fulcrum.errors import FulcrumError, InvalidInput, ModelError, QueueFull
from fulcrum.llm.block_manager import BlockManager
from fulcrum.llm.budget import StepRecord, TokenBudget
from fulcrum.llm.chat import ChatTemplate
from fulcrum.llm.detokenizer import IncrementalDetokenizer
from fulcrum.llm.engine_front import EngineFront
from fulcrum.llm.engine_gauges import EngineGauges
from fulcrum.llm.loader import DTYPES, LoadedLLM, load_checkpoint
from fulcrum.llm.metrics import LLMMetrics
from fulcrum.llm.outputs import RequestOutput, RequestState, Usage, held_outputs
from fulcrum.llm.params import EngineParams
from fulcrum.llm.request_setup import complete_sampling, scoring_salt
from fulcrum.llm.runner import ModelRunner, num_blocks_for_budget
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.scheduler import ScheduledBatch, Scheduler, StepTokens
from fulcrum.llm.sequence import FinishReason, Sequence
from fulcrum.llm.speculative import Speculation
from fulcrum.llm.structured import StructuredOutputs
from fulcrum.llm.threads import pin_num_threads
from fulcrum.types import Clock

log = logging.getLogger(__name__)
# Whole steps that fail in a row before the engine gives up on its state (a lost device fails
# every step): the step raises, the engine thread ends, and its supervisor rebuilds the engine.
MAX_CONSECUTIVE_FAILED_STEPS = 3


class LLMEngine(EngineFront):
    """Continuous batching over one model; not thread-safe: one thread calls every method."""

    def __init__(
        self,
        loaded: LoadedLLM,
        params: EngineParams,
        *,
        metrics: LLMMetrics | None = None,
        clock: Clock | None = None,
        detokenize: bool = True,
    ) -> None:
        """detokenize=False: outputs carry token ids, text only of requests with stop strings,
        for an engine process whose server detokenises (fulcrum.llm.engine_outputs)."""
        dtype = DTYPES[params.dtype]
        num_blocks = params.num_kv_blocks or num_blocks_for_budget(
            loaded.model, params.block_size, params.kv_cache_memory_mb, dtype
        )
        super().__init__(
            loaded.tokenizer,
            ChatTemplate(  # compiled once
                loaded.chat_template,
                loaded.special_tokens,
                trust_request_templates=params.trust_request_chat_template,
            ),
            params,
            vocab_size=loaded.model.vocab_size,
            eos_token_ids=loaded.eos_token_ids,
            # No sequence can outgrow the KV pool, so the pool caps the usable context too.
            max_model_len=min(
                params.max_model_len or loaded.max_model_len,
                loaded.max_model_len,
                num_blocks * params.block_size,
            ),
            metrics=metrics,
            clock=clock,
        )
        self.chat_template = loaded.chat_template
        self.special_tokens = loaded.special_tokens
        self.prefix_cache_key = loaded.prefix_cache_key
        self.detokenize = detokenize
        self.runner = ModelRunner(
            loaded.model,
            block_size=params.block_size,
            num_kv_blocks=num_blocks,
            device=torch.device(params.resolve_device()),
            dtype=dtype,
        )
        self.runner.structured = StructuredOutputs(self.grammars.compile, self.vocab_size)
        self._requests: dict[str, RequestState] = {}
        self._by_seq: dict[int, RequestState] = {}
        self._seq_ids = itertools.count()
        self._num_failed_steps = 0  # whole steps failed in a row
        spec = params.speculative
        self.speculation = None if spec is None else Speculation(spec)  # kept across resets
        self.block_manager, self.scheduler = self._new_state()

    def _new_state(self) -> tuple[BlockManager, Scheduler]:
        params = self.params
        block_manager = BlockManager(
            self.runner.num_kv_blocks,
            params.block_size,
            enable_prefix_caching=params.enable_prefix_caching,
        )
        scheduler = Scheduler(
            block_manager,
            max_num_seqs=params.max_num_seqs,
            max_num_batched_tokens=params.max_num_batched_tokens,
            max_num_waiting=params.max_num_waiting,
        )
        scheduler.speculation = self.speculation
        if self.budget is not None:  # a reset keeps what was learnt of the machine's speed
            scheduler.set_limits(self.budget.state.token_budget, self.budget.state.max_running)
        metrics = self.metrics
        self._gauges = None if metrics is None else EngineGauges(metrics, scheduler, block_manager)
        return block_manager, scheduler

    @classmethod
    def from_checkpoint(
        cls,
        directory: Path,
        params: EngineParams,
        *,
        metrics: LLMMetrics | None = None,
        detokenize: bool = True,
    ) -> LLMEngine:
        """Load a Hugging Face checkpoint directory and build the engine for it."""
        loaded = load_checkpoint(
            directory,
            dtype=params.dtype,
            device=params.resolve_device(),
            model_file=params.model_file,
            quantization=params.quantization,
        )
        return cls(loaded, params, metrics=metrics, detokenize=detokenize)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_s: float | None = None,
        check_slo: bool = True,
    ) -> None:
        """Queue a request; InvalidInput for a bad one, QueueFull beyond max_num_waiting, Shed
        when predicted to miss slo_ttft_ms (check_slo=False: the caller already checked)."""
        if request_id in self._requests:
            raise InvalidInput(f"request id {request_id!r} is already running")
        self.check_request(prompt_token_ids, sampling)
        if check_slo:
            self.check_admission(len(prompt_token_ids))
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        sampling = complete_sampling(sampling, self.eos_token_ids, self._encode_plain)
        cache_salt = scoring_salt(sampling, cache_salt)
        rope_key = self.prefix_cache_key(len(prompt_token_ids))
        if rope_key is not None:  # K/V rotated by the prompt's length: shared only at that length
            cache_salt = f"{cache_salt or ''}/{rope_key}"
        arrival = self.clock.now() if arrival_s is None else arrival_s
        seq = Sequence(
            next(self._seq_ids),
            prompt_token_ids,
            sampling,
            arrival_s=arrival,
            priority=priority,
            cache_salt=cache_salt,
            eos_token_id=eos,
        )
        self.runner.track(seq)  # a structured request's matcher
        try:
            self.scheduler.add(seq)
        except FulcrumError as exc:
            self.runner.release(seq.seq_id)
            if isinstance(exc, QueueFull) and self.metrics is not None:
                self.metrics.request_shed("queue_full")
            raise
        detokenizer = None
        # Without text (an engine process), stop strings are still looked for here, so the
        # request ends in the very step it would in thread mode: the batches, and so every
        # request's floats, stay the same as the thread's (the server cuts the text).
        if self.detokenize or sampling.stop:
            detokenizer = IncrementalDetokenizer.for_request(self.tokenizer, sampling)
        state = RequestState(request_id, seq, detokenizer, arrival)
        self._requests[request_id] = state
        self._by_seq[seq.seq_id] = state
        self._publish_queue()
        self.update_gauges()

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; its final output, or None if unknown."""
        state = self._requests.get(request_id)
        if state is None:
            return None
        self.scheduler.abort(state.seq.seq_id)
        output = self._finish(state, FinishReason.ABORT.value)
        self._publish_queue()  # an idle engine must not shed by the queue it had
        self.update_gauges()  # an abort with no step after it must not leave them stale
        return output

    def finish_stopped(self, request_id: str) -> None:
        """End a request as a stop string found by the server ends it (a safety net: this
        engine finds the same one first); unknown (already finished) ids are ignored."""
        state = self._requests.get(request_id)
        if state is None:
            return
        self.scheduler.finish(state.seq.seq_id, FinishReason.STOP)
        self._finish(state, FinishReason.STOP.value)
        self._publish_queue()
        self.update_gauges()

    def abort_all(self) -> list[RequestOutput]:
        """Abort every request (shutdown); their final outputs."""
        return [out for rid in list(self._requests) if (out := self.abort(rid)) is not None]

    def reset(self) -> list[str]:
        """Forget every request without trusting the scheduler's state (after a crash), keeping
        the weights and the KV pool; the ids of the requests dropped."""
        dropped = list(self._requests)
        if self.metrics is not None:
            for _ in dropped:  # their streams were failed when the engine crashed
                self.metrics.request_finished("error")
        self._requests.clear()
        self._by_seq.clear()
        self._num_failed_steps = 0
        self.runner.reset()
        self.block_manager, self.scheduler = self._new_state()
        self._publish_queue()
        self.update_gauges()
        return dropped

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self._requests)

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def step(self) -> list[RequestOutput]:
        """Run one iteration; outputs of the requests that finished in it or whose new tokens
        are due (each token with stream_interval = 1; every N tokens, the first at once, else)."""
        pin_num_threads(self.params.num_threads)  # whichever thread steps this engine
        if self.budget is not None:
            return self._step_within_budget(self.budget)
        batch = self.scheduler.schedule()
        outputs = [] if batch.is_empty else self._run_batch(batch)
        self.update_gauges()
        return outputs

    def _step_within_budget(self, budget: TokenBudget) -> list[RequestOutput]:
        """step() timed, its record fed to the SLO controller, whose limits the next step uses."""
        start_s = self.clock.now()
        batch = self.scheduler.schedule()
        num_decode_tokens = sum(  # taken before update() moves num_computed_tokens
            n == 1 and seq.num_tokens - seq.num_computed_tokens == 1
            for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
        )
        outputs = [] if batch.is_empty else self._run_batch(batch)
        if not batch.is_empty:
            self._observe_step(budget, batch, num_decode_tokens, self.clock.now() - start_s)
        self.update_gauges()
        return outputs

    def _observe_step(
        self, budget: TokenBudget, batch: ScheduledBatch, num_decode_tokens: int, step_s: float
    ) -> None:
        num_tokens = batch.num_batched_tokens
        predicted_s = budget.model.predict(num_tokens) if budget.model.is_ready else None
        state = budget.observe_step(
            self._queue_record(num_tokens - num_decode_tokens, num_decode_tokens, step_s)
        )
        self.scheduler.set_limits(state.token_budget, state.max_running)
        if self.metrics is not None:
            self.metrics.step_observed_s.set(step_s)
            if predicted_s is not None:
                self.metrics.step_predicted_s.set(predicted_s)

    def _run_batch(self, batch: ScheduledBatch) -> list[RequestOutput]:
        now_s = self.clock.now()
        by_seq = self._by_seq
        # Tokens held back by stream_interval go out before a wait of unknown length.
        outputs = held_outputs([by_seq[seq.seq_id] for seq in batch.preempted])
        for seq in batch.seqs:
            state = by_seq[seq.seq_id]
            if state.first_scheduled_s is None:  # per sequence per step: skip the call after
                state.on_scheduled(now_s, self.metrics)
        try:
            sampled = self.runner.run(batch)
        except Exception as exc:
            self._num_failed_steps += 1
            if self._num_failed_steps >= MAX_CONSECUTIVE_FAILED_STEPS:
                raise
            # The step's own sequences wrote the KV slots it touched: aborting them frees
            # those blocks uncommitted, so no later request reads what the failed step wrote.
            log.exception("LLM step failed; failing its %d requests", len(batch.seqs))
            error = ModelError(f"the model step failed: {exc!r}")
            return outputs + [o for s in batch.seqs for o in self._fail(by_seq[s.seq_id], error)]
        self._num_failed_steps = 0
        tokens = cast("list[StepTokens]", sampled)  # unless a row failed (checked next)
        if any(isinstance(token, ModelError) for token in sampled):
            tokens = []
            for seq, token in zip(batch.seqs, sampled, strict=True):
                if isinstance(token, ModelError):  # this row alone: update() skips its seq
                    outputs.extend(self._fail(self._by_seq[seq.seq_id], token))
                    token = None
                tokens.append(token)
        return outputs + self._postprocess_all(self.scheduler.update(batch, tokens))

    def _postprocess_all(self, updated: list[Sequence]) -> list[RequestOutput]:
        """The outputs of a step's sequences that are due (stream_interval) or failed."""
        now_s = self.clock.now()
        outputs: list[RequestOutput] = []
        for seq in updated:
            state = self._by_seq[seq.seq_id]
            try:
                if (output := self._postprocess(state, now_s)) is not None:  # None: not due
                    outputs.append(output)
            except Exception as exc:  # e.g. the detokenizer on a bad token: only this request
                log.exception("LLM request %r failed after its step", state.request_id)
                outputs.extend(self._fail(state, ModelError(f"output processing failed: {exc!r}")))
        return outputs

    def _postprocess(self, state: RequestState, now_s: float) -> RequestOutput | None:
        seq = state.seq
        last_token_s = state.last_token_s
        first_new = seq.num_prompt_tokens + state.num_seen_tokens  # more than one new: drafts
        state.on_token(now_s, self.metrics, len(seq.token_ids) - first_new)
        if self.budget is not None:
            if last_token_s is None:
                self.budget.observe_ttft(now_s - state.arrival_s)
            else:
                self.budget.observe_itl(now_s - last_token_s)
        detokenizer = state.detokenizer
        if detokenizer is not None:
            for token_id in seq.token_ids[first_new:]:
                detokenizer.add(token_id)  # every step: a stop string ends it in this one
            if detokenizer.stopped and not seq.is_finished:
                self.scheduler.finish(seq.seq_id, FinishReason.STOP)
        # A complete grammar ends the answer (before min_tokens too: the grammar wins, as vLLM).
        if not seq.is_finished and self.runner.grammar_complete(seq.seq_id):
            self.scheduler.finish(seq.seq_id, FinishReason.STOP)
        state.num_seen_tokens = len(seq.token_ids) - seq.num_prompt_tokens
        if seq.finish_reason is not None:
            return self._finish(state, seq.finish_reason.value)
        return state.output(None) if state.is_due(self.params.stream_interval) else None

    def _fail(self, state: RequestState, error: ModelError) -> list[RequestOutput]:
        """End one request with an error, whatever stage it failed in (after the tokens held
        back, if its text is sound); frees its blocks."""
        seq = state.seq
        outputs = [state.output(None)] if state.holds_tokens() else []
        self.scheduler.abort(seq.seq_id)  # None when the scheduler already finished it
        self._requests.pop(state.request_id, None)
        self._by_seq.pop(seq.seq_id, None)
        self.runner.release(seq.seq_id)
        if self.metrics is not None:
            self.metrics.request_finished("error")
        usage = Usage(seq.num_prompt_tokens, seq.num_output_tokens, seq.num_cached_tokens)
        return [*outputs, RequestOutput(state.request_id, [], "", "error", usage, error=error)]

    def _finish(self, state: RequestState, reason: str) -> RequestOutput:
        del self._requests[state.request_id]
        del self._by_seq[state.seq.seq_id]
        self.runner.release(state.seq.seq_id)
        state.on_finished(self.clock.now(), self.metrics, reason)
        return state.output(reason)

    def _publish_queue(self) -> None:
        if self.budget is not None:
            self.budget.observe_queue(self._queue_record())

    def _queue_record(
        self, num_prefill_tokens: int = 0, num_decode_tokens: int = 0, step_s: float = 0.0
    ) -> StepRecord:
        scheduler = self.scheduler
        return StepRecord(
            num_prefill_tokens=num_prefill_tokens,
            num_decode_tokens=num_decode_tokens,
            step_s=step_s,
            num_running=scheduler.num_running,
            num_decoding=scheduler.num_decoding,
            num_queued_tokens=scheduler.num_queued_tokens,
            num_waiting=scheduler.num_waiting,
            finish_steps=scheduler.finish_steps,
        )

    def update_gauges(self) -> None:
        """Publish the scheduler's state to the gauges (and the counters' increments)."""
        if self._gauges is not None:
            self._gauges.publish(self.speculation)
