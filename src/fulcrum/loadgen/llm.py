"""The OpenAI target: streamed completions, with each output chunk's arrival time recorded.

TTFT, ITL and TPOT follow vLLM's `bench serve`: TTFT is the first content chunk's arrival
after the scheduled send, ITL the gaps between chunks, TPOT (latency - TTFT) / (tokens - 1).
"""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import numpy as np

from fulcrum.client import ClientError, Endpoint, Stream, build_request
from fulcrum.errors import InvalidInput
from fulcrum.loadgen.inputs import LengthDist, read_jsonl, synthetic_text
from fulcrum.loadgen.records import Outcome
from fulcrum.loadgen.streaming import StreamTarget


class LlmInputs(msgspec.Struct, frozen=True, kw_only=True):
    """How to build the requests of an OpenAI run."""

    chat: bool = False  # /v1/chat/completions instead of /v1/completions
    prompt_lengths: LengthDist = LengthDist(32, 32)  # words
    max_tokens: int = 64
    ignore_eos: bool = True  # vLLM's extension: fixed output lengths make runs comparable
    input_file: Path | None = None  # JSONL rows with "prompt" (and optional "max_tokens")
    num_distinct: int = 16
    seed: int = 0


class _PromptRow(msgspec.Struct):
    prompt: str
    max_tokens: int | None = None


class _Usage(msgspec.Struct):
    completion_tokens: int = 0


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


def _body(model: str, prompt: str, max_tokens: int, inputs: LlmInputs) -> bytes:
    payload: dict[str, object] = {
        "model": model,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if inputs.ignore_eos:
        payload["ignore_eos"] = True
    if inputs.chat:
        payload["messages"] = [{"role": "user", "content": prompt}]
    else:
        payload["prompt"] = prompt
    return msgspec.json.encode(payload)


def prepare_llm(endpoint: Endpoint, model: str, inputs: LlmInputs) -> list[bytes]:
    """Raw HTTP requests a run cycles through."""
    path = "/v1/chat/completions" if inputs.chat else "/v1/completions"
    if inputs.input_file is not None:
        rows = read_jsonl(inputs.input_file)
        try:
            lines = [msgspec.convert(row, _PromptRow) for row in rows]
        except msgspec.ValidationError as exc:
            raise InvalidInput(f"{inputs.input_file}: {exc}") from exc
        prompts = [(r.prompt, r.max_tokens or inputs.max_tokens) for r in lines]
    else:
        rng = np.random.default_rng(inputs.seed)
        prompts = [
            (synthetic_text(inputs.prompt_lengths.sample(rng), rng), inputs.max_tokens)
            for _ in range(max(1, inputs.num_distinct))
        ]
    if any(not p for p, _ in prompts):
        raise InvalidInput("every JSONL row needs a non-empty 'prompt'")
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    return [
        build_request(endpoint, "POST", path, headers=headers, body=_body(model, p, n, inputs))
        for p, n in prompts
    ]


async def read_events(stream: Stream, outcome: Outcome) -> None:
    """Consume an SSE stream up to `data: [DONE]`, stamping each content chunk's arrival."""
    buffer = b""
    num_chunks = 0
    async for data in stream.chunks():
        now_s = time.perf_counter()
        buffer += data
        *events, buffer = buffer.split(b"\n\n")
        for event in events:
            payload = event.removeprefix(b"data:").strip()
            if not payload or payload == b"[DONE]":
                continue
            try:
                chunk = _decode_chunk(payload)
            except msgspec.DecodeError as exc:
                raise ClientError(f"bad SSE event: {payload[:200]!r}") from exc
            if chunk.usage is not None:
                outcome.num_output_tokens = chunk.usage.completion_tokens
            if any(c.text or (c.delta and c.delta.content) for c in chunk.choices):
                outcome.token_times_s.append(now_s)
                num_chunks += 1
    if outcome.num_output_tokens == 0:
        outcome.num_output_tokens = num_chunks  # no usage report: one token per chunk


class LlmTarget(StreamTarget):
    """Hands out slots that send the prepared streaming completions round-robin."""

    def __init__(self, endpoint: Endpoint, requests: list[bytes]) -> None:
        super().__init__(endpoint, requests, read_events)
