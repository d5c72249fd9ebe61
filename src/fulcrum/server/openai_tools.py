"""Tool calls in OpenAI chat answers, as vLLM shapes them: each choice's text read by the model's
tool-call parser (tool_choice "auto") or by the reader of forced output ("required", a named
function) into `message.tool_calls`, or streamed as `delta.tool_calls` (id, type and name first,
then argument fragments). finish_reason is "tool_calls" when a call ended an auto or required
answer; a named call keeps the engine's reason, as in vLLM and OpenAI."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from fulcrum.errors import InvalidInput
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.structured_spec import StructuredSpec
from fulcrum.llm.tool_parsers import (
    CallDelta,
    StreamParser,
    ToolCall,
    extract,
    keeps_special_tokens,
    new_parser,
    openai_call_id,
)
from fulcrum.llm.tool_parsers.forced import NamedParser, RequiredParser
from fulcrum.llm.tools import ToolPlan


@dataclass(frozen=True, slots=True)
class ToolAnswer:
    """How one request's choices are read for tool calls."""

    plan: ToolPlan
    parser_name: str  # the model's `tool_call_parser` ("" for none)

    def new_parser(self) -> StreamParser:
        plan = self.plan
        if plan.mode == "named":
            return NamedParser(plan.named or "", openai_call_id)
        if plan.mode == "required":
            return RequiredParser(openai_call_id)
        return new_parser(self.parser_name)

    def sampling(self, params: SamplingParams) -> SamplingParams:
        """The request's sampling with what its tools need: the forced schema as structured
        output, or special tokens kept when the parser's markers are special tokens."""
        if self.plan.is_forced:
            if params.structured is not None:
                raise InvalidInput(
                    f"tool_choice: {self.plan.mode} tool choice forces the output's format; it "
                    "cannot be combined with response_format or structured outputs",
                    param="tool_choice",
                )
            spec = StructuredSpec(kind="json_schema", source=self.plan.forced_schema())
            return dataclasses.replace(params, structured=spec)
        if keeps_special_tokens(self.parser_name):
            return dataclasses.replace(params, skip_special_tokens=False)
        return params

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole choice's message and finish reason."""
        result = extract(self.new_parser(), text)
        calls = result.calls if self.plan.parallel else result.calls[:1]
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        message = {
            "role": "assistant",
            "content": result.content,
            "tool_calls": [_call_json(c) for c in calls],
        }
        return message, self.finish_reason(finish_reason)

    def finish_reason(self, reason: str | None) -> str | None:
        if reason == "stop" and self.plan.mode != "named":
            return "tool_calls"
        return reason

    def stream(self) -> ToolStream:
        return ToolStream(self)


@dataclass
class ToolStream:
    """The streamed deltas of every choice of one answer (a parser per choice)."""

    answer: ToolAnswer
    _parsers: dict[int, StreamParser] = field(default_factory=dict)
    _called: set[int] = field(default_factory=set)

    def delta(
        self, index: int, text: str, finish_reason: str | None
    ) -> tuple[dict[str, Any], str | None]:
        """The delta for choice `index`'s new text and its finish reason (the engine's, or
        "tool_calls" once a call was made)."""
        parser = self._parsers.get(index)
        if parser is None:
            parser = self._parsers[index] = self.answer.new_parser()
        piece = parser.feed(text)
        if finish_reason is not None:
            piece.extend(parser.finish())
        out: dict[str, Any] = {}
        if piece.content:
            out["content"] = piece.content
        calls = [c for c in piece.calls if self.answer.plan.parallel or c.index == 0]
        if calls:
            out["tool_calls"] = [_delta_json(c) for c in calls]
            self._called.add(index)
        if finish_reason is not None and index in self._called:
            finish_reason = self.answer.finish_reason(finish_reason)
        return out, finish_reason


def _call_json(call: ToolCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def _delta_json(call: CallDelta) -> dict[str, Any]:
    if call.id is None:
        return {"index": call.index, "function": {"arguments": call.arguments}}
    return {
        "index": call.index,
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def tool_answer(plan: ToolPlan, parser_name: str) -> ToolAnswer | None:
    """How the request's answer is read for calls; None when it is not (tool_choice "none").
    "auto" needs the model's parser: without one it is a 400, as in vLLM."""
    if plan.mode == "none":
        return None
    if plan.mode == "auto" and not parser_name:
        raise InvalidInput(
            'tool_choice: "auto" needs a tool-call parser for this model (set tool_call_parser '
            "in its [parameters], as vLLM's --enable-auto-tool-choice --tool-call-parser); "
            'use "required", a named function or "none"',
            param="tool_choice",
        )
    return ToolAnswer(plan, parser_name)
