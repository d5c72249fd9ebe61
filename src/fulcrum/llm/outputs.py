"""What the engine hands back per request and step, and the per-request state behind it."""

from __future__ import annotations

from dataclasses import dataclass, field

from fulcrum.errors import ModelError
from fulcrum.llm.detokenizer import IncrementalDetokenizer
from fulcrum.llm.logprobs import TokenLogprob
from fulcrum.llm.metrics import LLMMetrics
from fulcrum.llm.sequence import Sequence


# Usage and RequestOutput are built per running request per step: slotted and not frozen, as a
# frozen dataclass's __init__ (object.__setattr__ per field) costs about 10x (0.3 vs 3 us).
@dataclass(slots=True)
class Usage:
    """Token counts of one request, as OpenAI's `usage` reports them."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class RequestOutput:
    """One step's increment of one request: new tokens and text; finish_reason when it ended."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finish_reason: str | None  # "stop", "length", "abort", "error"; None while running
    usage: Usage
    error: ModelError | None = None  # why this request alone failed (finish_reason "error")
    # One per new token when the request asked for logprobs, else empty.
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    # With the request's first output when it asked for prompt_logprobs (None for token 0).
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestState:
    """A request as the engine tracks it: its sequence, text so far, and timestamps."""

    request_id: str
    seq: Sequence
    detokenizer: IncrementalDetokenizer | None  # None: the server detokenises (engine process)
    arrival_s: float
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    num_sent_tokens: int = 0
    # Output tokens counted and detokenized; those sent lag behind by up to stream_interval - 1.
    num_seen_tokens: int = 0
    sent_prompt_logprobs: bool = False
    itl_s: list[float] = field(default_factory=list)

    def on_scheduled(self, now_s: float, metrics: LLMMetrics | None) -> None:
        """Record the first time the request is in a step (its queue time)."""
        if self.first_scheduled_s is None:
            self.first_scheduled_s = now_s
            if metrics is not None:
                metrics.queue_s.observe(now_s - self.arrival_s)

    def on_token(self, now_s: float, metrics: LLMMetrics | None, num_tokens: int = 1) -> None:
        """Record a step's new output tokens (several: accepted drafts) and their time (TTFT or
        inter-token latency)."""
        if self.first_token_s is None:
            self.first_token_s = now_s
            if metrics is not None:
                metrics.ttft_s.observe(now_s - self.arrival_s)
        elif metrics is not None and self.last_token_s is not None:
            metrics.itl_s.observe(now_s - self.last_token_s)
        self.last_token_s = now_s
        if metrics is not None:
            metrics.generation_tokens.inc(num_tokens)

    def on_finished(self, now_s: float, metrics: LLMMetrics | None, reason: str) -> None:
        """Record end-to-end latency and time per output token."""
        if metrics is None:
            return
        metrics.request_finished(reason)
        metrics.prompt_tokens.inc(self.seq.num_prompt_tokens)
        metrics.e2e_s.observe(now_s - self.arrival_s)
        num_output = self.seq.num_output_tokens
        if self.first_token_s is not None and num_output > 1:
            metrics.tpot_s.observe((now_s - self.first_token_s) / (num_output - 1))

    def is_due(self, stream_interval: int) -> bool:
        """True when a running request's tokens go out now: its first at once (time to first
        token), then whenever stream_interval of them wait."""
        num_sent = self.num_sent_tokens
        return not num_sent or self.num_seen_tokens - num_sent >= stream_interval

    def holds_tokens(self) -> bool:
        """True when stream_interval holds back tokens whose processing finished."""
        return self.num_sent_tokens < self.num_seen_tokens == self.seq.num_output_tokens

    def output(self, finish_reason: str | None) -> RequestOutput:
        """The increment since the last output."""
        seq = self.seq
        num_prompt = seq.num_prompt_tokens
        num_output = len(seq.token_ids) - num_prompt  # runs per request per step: no properties
        # Slice token_ids directly: output_token_ids copies the whole output every step.
        new_ids = seq.token_ids[num_prompt + self.num_sent_tokens :]
        new_logprobs = seq.output_logprobs[self.num_sent_tokens :]
        first = self.num_sent_tokens == 0 and not self.sent_prompt_logprobs
        self.sent_prompt_logprobs = True
        self.num_sent_tokens = num_output
        detokenizer = self.detokenizer
        text = "" if detokenizer is None else detokenizer.take(final=finish_reason is not None)
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=new_ids,
            new_text=text,
            finish_reason=finish_reason,
            usage=Usage(num_prompt, num_output, seq.num_cached_tokens),
            new_logprobs=new_logprobs,
            prompt_logprobs=seq.prompt_logprobs if first else None,
        )


def held_outputs(states: list[RequestState]) -> list[RequestOutput]:
    """The tokens stream_interval holds back of these requests, as outputs."""
    return [state.output(None) for state in states if state.holds_tokens()]


# An output as a plain tuple for the engine process's pipe: pickling tuples costs the stepping
# process about a seventh of what pickling the dataclasses does.
OutputRow = tuple[
    str, list[int], str, str | None, int, int, int, ModelError | None,
    list[TokenLogprob] | None, list[TokenLogprob | None] | None,
]  # fmt: skip


def pack_outputs(outputs: list[RequestOutput]) -> list[OutputRow]:
    """Outputs as rows (`unpack_outputs` rebuilds them equal)."""
    return [_row(o) for o in outputs]


def unpack_outputs(rows: list[OutputRow]) -> list[RequestOutput]:
    """The outputs `pack_outputs` packed."""
    return [_output(*row) for row in rows]


def _row(o: RequestOutput) -> OutputRow:
    usage = o.usage
    return (o.request_id, o.new_token_ids, o.new_text, o.finish_reason, usage.prompt_tokens,
            usage.completion_tokens, usage.cached_tokens, o.error, o.new_logprobs or None,
            o.prompt_logprobs)  # fmt: skip


def _output(
    request_id: str,
    new_token_ids: list[int],
    new_text: str,
    finish_reason: str | None,
    num_prompt: int,
    num_output: int,
    num_cached: int,
    error: ModelError | None,
    new_logprobs: list[TokenLogprob] | None,
    prompt_logprobs: list[TokenLogprob | None] | None,
) -> RequestOutput:
    usage = Usage(num_prompt, num_output, num_cached)
    return RequestOutput(request_id, new_token_ids, new_text, finish_reason, usage, error,
                         new_logprobs or [], prompt_logprobs)  # fmt: skip
