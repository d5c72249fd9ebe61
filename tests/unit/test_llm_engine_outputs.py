"""The server's output processor of an engine process: text from token-id rows equal to what the
engine's own detokenizer makes, stop strings (a safety net: the process finds them first), late
rows of forgotten or finished requests dropped, errors passed through; and an LLMEngine without
text still ending a stop-string request in the step it hits the stop."""

from __future__ import annotations

from test_llm_detokenizer import BYTES  # token i is byte i, GPT-2's byte-level decoder

from fulcrum.errors import ModelError
from fulcrum.llm.detokenizer import IncrementalDetokenizer
from fulcrum.llm.engine_outputs import OutputProcessor
from fulcrum.llm.outputs import OutputRow
from fulcrum.llm.sampling_params import SamplingParams


def _row(request_id: str, token_ids: list[int], num_output: int, reason: str | None = None,
         error: ModelError | None = None) -> OutputRow:  # fmt: skip
    """A row as the engine process sends it: token ids, no text."""
    return (request_id, token_ids, "", reason, 3, num_output, 0, error, None, None)


def _rows_of(request_id: str, text: str, reason: str = "length") -> list[OutputRow]:
    data = list(text.encode())
    return [
        _row(request_id, [b], i + 1, reason if i == len(data) - 1 else None)
        for i, b in enumerate(data)
    ]


def test_text_is_what_the_engines_own_detokenizer_makes() -> None:
    processor = OutputProcessor(BYTES)
    sampling = SamplingParams(max_tokens=8)
    processor.add("a", sampling, number=1)
    pieces, reasons = [], []
    for row in _rows_of("a", "hé日!"):
        step = processor.process([row], num_applied=1)
        assert not step.stopped and not step.failed
        pieces += [o.new_text for o in step.outputs]
        reasons += [o.finish_reason for o in step.outputs]
    own = IncrementalDetokenizer.for_request(BYTES, sampling)
    expected = []
    for i, byte in enumerate("hé日!".encode()):
        own.add(byte)
        expected.append(own.take(final=i == len("hé日!".encode()) - 1))
    assert pieces == expected and "".join(pieces) == "hé日!"
    assert reasons[-1] == "length" and len(processor) == 0  # a finished request is forgotten


def test_a_stop_the_process_missed_ends_the_request_here_and_drops_later_rows() -> None:
    processor = OutputProcessor(BYTES)
    processor.add("a", SamplingParams(max_tokens=16, stop=("cd",)), number=1)
    rows = [_row("a", list(b"ab"), 2), _row("a", list(b"cde"), 5), _row("a", list(b"f"), 6)]
    first = processor.process(rows[:1], num_applied=1)
    assert first.outputs[0].new_text == "a" and first.outputs[0].finish_reason is None
    second = processor.process(rows[1:2], num_applied=1)
    assert second.stopped == ["a"]  # the caller tells the process to finish it
    out = second.outputs[0]
    assert (out.finish_reason, out.new_text, out.new_token_ids) == ("stop", "b", list(b"cde"))
    assert out.usage.completion_tokens == 5
    assert processor.process(rows[2:], num_applied=2).outputs == []  # computed meanwhile


def test_a_stop_in_a_step_that_ended_anyway_keeps_its_reason() -> None:
    processor = OutputProcessor(BYTES)
    processor.add("a", SamplingParams(max_tokens=3, stop=("b",)), number=1)
    step = processor.process([_row("a", list(b"abc"), 3, "length")], num_applied=1)
    assert not step.stopped
    assert (step.outputs[0].finish_reason, step.outputs[0].new_text) == ("length", "a")


def test_rows_of_forgotten_requests_and_of_a_finished_namesake_are_dropped() -> None:
    processor = OutputProcessor(BYTES)
    processor.add("gone", SamplingParams(max_tokens=8), number=1)
    processor.forget("gone")  # aborted on the loop
    assert processor.process([_row("gone", [97], 1)], num_applied=1).outputs == []
    processor.add("again", SamplingParams(max_tokens=8), number=7)  # a reused id, add no. 7
    late = processor.process([_row("again", [98], 9)], num_applied=6)  # before it was taken
    assert late.outputs == []
    now = processor.process([_row("again", [99], 1)], num_applied=7)
    assert [o.new_text for o in now.outputs] == ["c"]


def test_an_error_row_passes_through_and_a_failed_text_fails_only_its_request() -> None:
    processor = OutputProcessor(BYTES)
    processor.add("bad", SamplingParams(max_tokens=8), number=1)
    processor.add("broken", SamplingParams(max_tokens=8), number=2)
    processor.add("fine", SamplingParams(max_tokens=8), number=3)
    error = ModelError("row failed")
    rows = [_row("bad", [], 0, "error", error), _row("broken", [-1], 1), _row("fine", [97], 1)]
    step = processor.process(rows, num_applied=3)
    bad, broken, fine = step.outputs
    assert (bad.finish_reason, bad.error) == ("error", error)
    assert broken.finish_reason == "error" and broken.error is not None
    assert "output processing failed" in str(broken.error)
    assert step.failed == ["broken"]  # the caller aborts it in the process
    assert (fine.new_text, fine.finish_reason) == ("a", None)
    assert len(processor) == 1
