"""The server's side of an engine process's outputs (vLLM V1's OutputProcessor): the process sends
token ids, and here, in the server's reader thread, each request's text grows token by token
with the same `IncrementalDetokenizer` over the same tokenizer.json as `LLMEngine` uses in thread
mode, so a client reads the same bytes while the stepping process spends no time on text.

Unlike vLLM V1, the process still looks for stop strings itself, in the few requests that have
any: it then ends them in the very step the thread would, so batches (and the floats of every
other request in them) stay as in thread mode, and no token is computed past a stop. The same
search runs here for the text; should it find a stop the process did not report, the request
ends here and the process is told to finish it (its later tokens are dropped)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from fulcrum.errors import ModelError
from fulcrum.llm.detokenizer import IncrementalDetokenizer
from fulcrum.llm.outputs import OutputRow, RequestOutput, Usage
from fulcrum.llm.sampling_params import SamplingParams


@dataclass(slots=True)
class _Tracked:
    detokenizer: IncrementalDetokenizer | None  # with stop strings
    # The add's command number: a report made before the process took it (num_applied lower)
    # can only hold rows of an earlier request of the same id.
    number: int
    # Without stop strings: the detokenizer's DecodeStream, stepped directly. Nothing is then
    # held back, so the text is exactly the stream's pieces, and the Python around them per
    # token (about a third of the reader's time per token) goes.
    stream: DecodeStream | None


@dataclass(slots=True)
class ProcessedStep:
    """One step's outputs with text, and what the engine process must be told of them."""

    outputs: list[RequestOutput] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)  # a stop string ended them here
    failed: list[str] = field(default_factory=list)  # their text failed: abort them there


class OutputProcessor:
    """Text of the requests in flight in one engine process. `add` and `forget` run on the event
    loop, `process` on the reader thread: single dict operations, atomic under the GIL."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._requests: dict[str, _Tracked] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, request_id: str, sampling: SamplingParams, number: int) -> None:
        """Track a request whose add is command `number` of the process."""
        if sampling.stop:
            detokenizer = IncrementalDetokenizer.for_request(self._tokenizer, sampling)
            self._requests[request_id] = _Tracked(detokenizer, number, None)
        else:
            stream = DecodeStream(skip_special_tokens=sampling.skip_special_tokens)
            self._requests[request_id] = _Tracked(None, number, stream)

    def forget(self, request_id: str) -> None:
        """Drop a request (aborted, refused): its later rows are ignored."""
        self._requests.pop(request_id, None)

    def clear(self) -> None:
        """Drop every request (the process is gone with them)."""
        self._requests.clear()

    def process(self, rows: list[OutputRow], num_applied: int) -> ProcessedStep:
        """The outputs of one step's rows, as thread mode would have produced them."""
        step = ProcessedStep()
        for row in rows:
            tracked = self._requests.get(row[0])
            if tracked is None or tracked.number > num_applied:
                continue  # forgotten, or a late row of a finished namesake
            try:
                output = self._output(tracked, row)
            except Exception as exc:  # e.g. the detokenizer on a bad token: only this request
                self._requests.pop(row[0], None)
                step.failed.append(row[0])
                usage = Usage(row[4], row[5], row[6])
                error = ModelError(f"output processing failed: {exc!r}")
                output = RequestOutput(row[0], [], "", "error", usage, error=error)
            else:
                if output.finish_reason == "stop" and row[3] is None:
                    step.stopped.append(row[0])
            step.outputs.append(output)
        return step

    def _output(self, tracked: _Tracked, row: OutputRow) -> RequestOutput:
        (request_id, token_ids, _, reason, num_prompt, num_output, num_cached, error,
         logprobs, prompt_logprobs) = row  # fmt: skip
        usage = Usage(num_prompt, num_output, num_cached)
        if error is not None:  # this request alone failed in the process
            self._requests.pop(request_id, None)
            return RequestOutput(request_id, [], "", "error", usage, error=error)
        stream = tracked.stream
        if stream is not None:
            tokenizer = self._tokenizer
            text = "".join([piece for t in token_ids if (piece := stream.step(tokenizer, t))])
            if reason is not None:
                self._requests.pop(request_id, None)
            return RequestOutput(request_id, token_ids, text, reason, usage, None, logprobs or [],
                                 prompt_logprobs)  # fmt: skip
        detokenizer = tracked.detokenizer
        assert detokenizer is not None  # one of the two, by add
        for token_id in token_ids:
            detokenizer.add(token_id)
        # A stop string ends a running request; one the step ended anyway (length, EOS, a
        # complete grammar) keeps its reason with its text cut, as in LLMEngine._postprocess.
        if detokenizer.stopped and reason is None:
            reason = "stop"
        if reason is not None:
            self._requests.pop(request_id, None)
        text = detokenizer.take(final=reason is not None)
        return RequestOutput(request_id, token_ids, text, reason, usage, None, logprobs or [],
                             prompt_logprobs)  # fmt: skip
