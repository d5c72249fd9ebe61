"""The choices of one OpenAI completion or chat answer, built from the merged outputs of its
sequences (batched prompts times n): text, echo, finish reason, logprobs (OpenAI's legacy format
for completions, `content` entries for chat), vLLM's prompt_logprobs, and usage; as one JSON body
or as server-sent events."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from fulcrum.errors import FulcrumError, ModelError
from fulcrum.protocol.openai import (
    chat_logprob_entry,
    completion_logprobs,
    envelope,
    usage_json,
)

if TYPE_CHECKING:
    from fulcrum.llm.logprobs import TokenLogprob
    from fulcrum.llm.outputs import RequestOutput
    from fulcrum.server.openai_tools import ToolAnswer
    from fulcrum.service import LLMCall
    from fulcrum.service_openai import ChoiceOutput

# One admitted choice's stream of engine outputs.
Choice = AsyncIterator["RequestOutput"]

log = logging.getLogger(__name__)
_json = msgspec.json.Encoder()


@dataclass(frozen=True)
class PromptInfo:
    """One prompt of the request: its tokens and, for echo, its text."""

    token_ids: list[int]
    text: str


def prompt_infos(
    calls: list[LLMCall], texts: list[str | None] | None, *, echo: bool
) -> list[PromptInfo]:
    """Each prompt's tokens and, when echoed, its text (a token prompt decoded)."""
    if not echo:
        return [PromptInfo(call.token_ids, "") for call in calls]
    given = texts or [None] * len(calls)
    return [
        PromptInfo(call.token_ids, text if text is not None else call.decode(call.token_ids))
        for call, text in zip(calls, given, strict=True)
    ]


@dataclass(frozen=True)
class AnswerSpec:
    """What the answer must say and how: one per request."""

    request_id: str
    model: str
    chat: bool
    prompts: list[PromptInfo]
    n: int
    decode: Callable[[int], str]  # one token id -> its text, special tokens kept (vLLM)
    logprobs: bool = False  # the request asked for logprobs of its output tokens
    echo: bool = False  # completions: the prompt precedes the text (and its logprobs)
    prompt_logprobs: bool = False  # vLLM's extension: the prompt's logprobs in each choice
    tools: ToolAnswer | None = None  # chat: how the text is read for tool calls

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def prompt_of(self, index: int) -> PromptInfo:
        return self.prompts[index // self.n]


@dataclass
class _Choice:
    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None
    usage: Any = None


def _usage(outputs: dict[int, _Choice], spec: AnswerSpec) -> dict[str, Any]:
    # Each prompt counts once, however many choices it has (vLLM and OpenAI).
    first = [outputs[i * spec.n].usage for i in range(len(spec.prompts)) if i * spec.n in outputs]
    prompt_tokens = sum(u.prompt_tokens for u in first if u is not None)
    cached = sum(u.cached_tokens for u in first if u is not None)
    completion = sum(c.usage.completion_tokens for c in outputs.values() if c.usage is not None)
    return usage_json(prompt_tokens, completion, cached)


def _top(spec: AnswerSpec, entry: TokenLogprob) -> list[tuple[str, float]]:
    return [(spec.decode(t), v) for t, v in entry.top]


def _chat_logprobs(spec: AnswerSpec, entries: list[TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            chat_logprob_entry(spec.decode(e.token_id), e.logprob, _top(spec, e)) for e in entries
        ]
    }


def _completion_logprobs(
    spec: AnswerSpec, entries: list[TokenLogprob | None], tokens: list[int], first_offset: int
) -> dict[str, Any]:
    texts = [spec.decode(t) for t in tokens]
    tops: list[dict[str, float] | None] = []
    for text, entry in zip(texts, entries, strict=True):
        if entry is None:
            tops.append(None)
            continue
        # vLLM's legacy top_logprobs hold the chosen token beside the top alternatives.
        top = dict(_top(spec, entry))
        top.setdefault(text, entry.logprob)
        tops.append(top)
    values = [None if e is None else e.logprob for e in entries]
    return completion_logprobs(texts, values, tops, first_offset)


def _prompt_logprobs_json(
    spec: AnswerSpec, entries: list[TokenLogprob | None]
) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs: per prompt token, {token id: {logprob, rank, decoded_token}} for
    the token itself and its top alternatives; None for the first token."""
    out: list[dict[str, Any] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        found = {str(entry.token_id): (entry.logprob, entry.rank)}
        for rank, (token, value) in enumerate(entry.top, start=1):
            found.setdefault(str(token), (value, rank))
        out.append(
            {
                t: {"logprob": max(v, -9999.0), "rank": r, "decoded_token": spec.decode(int(t))}
                for t, (v, r) in found.items()
            }
        )
    return out


def _choice_json(spec: AnswerSpec, index: int, choice: _Choice) -> dict[str, Any]:
    text = "".join(choice.texts)
    out: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": choice.finish_reason}
    prompt = spec.prompt_of(index)
    if spec.chat:
        out["message"] = {"role": "assistant", "content": text}
        if spec.tools is not None:
            out["message"], out["finish_reason"] = spec.tools.message(text, choice.finish_reason)
        if spec.logprobs:
            out["logprobs"] = _chat_logprobs(spec, choice.logprobs)
    else:
        out["text"] = prompt.text + text if spec.echo else text
        if spec.logprobs:
            out["logprobs"] = _echoed_logprobs(spec, prompt, choice)
    if spec.prompt_logprobs and choice.prompt_logprobs is not None:
        out["prompt_logprobs"] = _prompt_logprobs_json(spec, choice.prompt_logprobs)
    return out


def _echoed_logprobs(spec: AnswerSpec, prompt: PromptInfo, choice: _Choice) -> dict[str, Any]:
    entries: list[TokenLogprob | None] = list(choice.logprobs)
    tokens = [e.token_id for e in choice.logprobs]
    if spec.echo and choice.prompt_logprobs is not None:
        entries = list(choice.prompt_logprobs) + entries
        tokens = prompt.token_ids + tokens
    return _completion_logprobs(spec, entries, tokens, 0)


def _absorb(choice: _Choice, output: RequestOutput) -> None:
    choice.texts.append(output.new_text)
    choice.logprobs.extend(output.new_logprobs)
    if output.prompt_logprobs is not None:
        choice.prompt_logprobs = output.prompt_logprobs
    choice.finish_reason = output.finish_reason
    choice.usage = output.usage


async def collect(spec: AnswerSpec, outputs: AsyncGenerator[ChoiceOutput, None]) -> dict[str, Any]:
    """The whole answer as one JSON body; cancelled (the client left), it aborts every choice."""
    choices: dict[int, _Choice] = {}
    async with contextlib.aclosing(outputs):
        async for item in outputs:
            _absorb(choices.setdefault(item.index, _Choice()), item.output)
    body = envelope(
        spec.request_id,
        spec.object,
        spec.model,
        [_choice_json(spec, i, choices[i]) for i in sorted(choices)],
    )
    body["usage"] = _usage(choices, spec)
    return body


def _sse(payload: object) -> bytes:
    return b"data: " + _json.encode(payload) + b"\n\n"


class _Stream:
    """Chunks of a streamed answer, one per output of one choice."""

    def __init__(self, spec: AnswerSpec) -> None:
        self.spec = spec
        self.obj = "chat.completion.chunk" if spec.chat else "text_completion"
        self.offsets: dict[int, int] = {}  # completions: characters sent per choice
        self.echoed: set[int] = set()  # completions with echo: choices whose prompt went out
        self.tools = None if spec.tools is None else spec.tools.stream()

    def chunk(self, choices: list[dict[str, Any]]) -> bytes:
        return _sse(envelope(self.spec.request_id, self.obj, self.spec.model, choices))

    def opening(self, index: int) -> bytes | None:
        """The first chunk of a chat choice: its role."""
        if not self.spec.chat:
            return None
        delta = {"role": "assistant", "content": ""}
        return self.chunk([{"index": index, "delta": delta, "logprobs": None,
                            "finish_reason": None}])  # fmt: skip

    def step(self, index: int, output: RequestOutput) -> bytes | None:
        spec = self.spec
        echo = spec.echo and index not in self.echoed  # the prompt goes with the first chunk
        if not (output.new_text or output.finished or output.new_logprobs or echo):
            return None
        choice: dict[str, Any] = {"index": index, "logprobs": None,
                                  "finish_reason": output.finish_reason}  # fmt: skip
        if spec.chat:
            choice["delta"] = {"content": output.new_text} if output.new_text else {}
            if self.tools is not None:  # text may be held while it could open a call
                delta, choice["finish_reason"] = self.tools.delta(
                    index, output.new_text, output.finish_reason
                )
                if not (delta or output.finished or output.new_logprobs):
                    return None
                choice["delta"] = delta
            if spec.logprobs:
                choice["logprobs"] = _chat_logprobs(spec, output.new_logprobs)
            return self.chunk([choice])
        self.echoed.add(index)
        prompt = spec.prompt_of(index)
        choice["text"] = prompt.text + output.new_text if echo else output.new_text
        if spec.logprobs:
            entries: list[TokenLogprob | None] = list(output.new_logprobs)
            tokens = [e.token_id for e in output.new_logprobs]
            if echo and output.prompt_logprobs is not None:
                entries = list(output.prompt_logprobs) + entries
                tokens = prompt.token_ids + tokens
            start = self.offsets.get(index, 0)
            body = _completion_logprobs(spec, entries, tokens, start)
            choice["logprobs"] = body
            self.offsets[index] = start + sum(len(t) for t in body["tokens"])
        return self.chunk([choice])


async def events(
    spec: AnswerSpec,
    outputs: AsyncGenerator[ChoiceOutput, None],
    *,
    include_usage: bool,
    error_json: Callable[[FulcrumError], dict[str, Any]],
) -> AsyncIterator[bytes]:
    """The answer as server-sent events ending with `data: [DONE]`; an error mid-stream is sent
    as an error event (the status line went out long ago)."""
    stream = _Stream(spec)
    choices: dict[int, _Choice] = {}
    try:
        async with contextlib.aclosing(outputs):  # closed early: every choice is aborted
            for index in range(len(spec.prompts) * spec.n):
                opening = stream.opening(index)
                if opening is not None:
                    yield opening
            async for item in outputs:
                choice = choices.setdefault(item.index, _Choice())
                choice.usage = item.output.usage
                chunk = stream.step(item.index, item.output)
                if chunk is not None:
                    yield chunk
    except FulcrumError as exc:  # the engine died, shut down or the deadline passed: say so
        yield _sse(error_json(exc))
    except Exception as exc:
        log.exception("stream of %s failed", spec.request_id)
        yield _sse(error_json(ModelError(f"generation failed: {type(exc).__name__}")))
    if include_usage and choices:
        chunk_body = envelope(spec.request_id, stream.obj, spec.model, [])
        chunk_body["usage"] = _usage(choices, spec)
        yield _sse(chunk_body)
    yield b"data: [DONE]\n\n"
