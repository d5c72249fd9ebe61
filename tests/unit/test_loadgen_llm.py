"""LLM mode: SSE parsing, TTFT / ITL / TPOT by vLLM's definitions, request bodies."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from fulcrum.client import ClientError, Endpoint, Stream, _Exchange
from fulcrum.errors import InvalidInput
from fulcrum.loadgen.llm import LlmInputs, prepare_llm, read_events
from fulcrum.loadgen.records import Outcome, RequestRecord
from fulcrum.loadgen.results import llm_figures
from fulcrum.loadgen.stats import meets_all, parse_slo

ENDPOINT = Endpoint.from_url("http://127.0.0.1:8000")


def stream_of(chunks: list[bytes]) -> Stream:
    queue: asyncio.Queue[bytes | None] = asyncio.Queue()
    for chunk in [*chunks, None]:
        queue.put_nowait(chunk)
    exchange = _Exchange(asyncio.get_running_loop().create_future(), queue)
    exchange.status = 200
    return Stream(exchange, queue)


def event(payload: object) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


async def test_sse_events_split_across_chunks_are_counted() -> None:
    text = {"choices": [{"text": "a"}]}
    chat = {"choices": [{"delta": {"content": "b"}}]}
    role_only = {"choices": [{"delta": {"role": "assistant"}}]}
    usage = {"choices": [], "usage": {"completion_tokens": 5}}
    body = event(role_only) + event(text) + event(chat) + event(text) + event(usage)
    body += b"data: [DONE]\n\n"
    outcome = Outcome(200)
    await read_events(stream_of([body[:17], body[17:90], body[90:]]), outcome)
    assert len(outcome.token_times_s) == 3  # role-only and usage events carry no content
    assert outcome.num_output_tokens == 5  # usage wins over counting chunks


async def test_without_usage_each_content_chunk_is_a_token() -> None:
    outcome = Outcome(200)
    body = event({"choices": [{"text": "x"}]}) * 4 + b"data: [DONE]\n\n"
    await read_events(stream_of([body]), outcome)
    assert outcome.num_output_tokens == 4


async def test_bad_event_is_a_client_error() -> None:
    with pytest.raises(ClientError, match="bad SSE"):
        await read_events(stream_of([b"data: {not json\n\n"]), Outcome(200))


def streamed(start_s: float, token_times_s: list[float], num_tokens: int) -> RequestRecord:
    outcome = Outcome(200, token_times_s=token_times_s, num_output_tokens=num_tokens)
    return RequestRecord(start_s, start_s, token_times_s[-1], outcome)


def test_ttft_itl_tpot_follow_vllm() -> None:
    record = streamed(10.0, [10.1, 10.12, 10.15, 10.2], 4)
    assert record.ttft_s == pytest.approx(0.1)
    assert record.itl_s() == pytest.approx([0.02, 0.03, 0.05])
    assert record.tpot_s == pytest.approx((0.2 - 0.1) / 3)
    assert streamed(0.0, [0.5], 1).tpot_s is None  # one token: no per-token time
    figures = llm_figures([record, streamed(20.0, [20.3, 20.4], 2)], duration_s=2.0)
    assert figures.ttft.max_ms == pytest.approx(300)
    assert figures.output_tokens_per_s == pytest.approx(3.0)
    assert figures.mean_output_tokens == pytest.approx(3.0)
    assert figures.itl.count == 4
    assert meets_all(record, [parse_slo("ttft<=150ms"), parse_slo("tpot<=40ms")])
    assert not meets_all(record, [parse_slo("tpot<=20ms")])


def test_prepared_completion_and_chat_requests(tmp_path: Path) -> None:
    [raw] = prepare_llm(ENDPOINT, "tiny", LlmInputs(max_tokens=7, num_distinct=1))
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/completions HTTP/1.1")
    payload = msgspec.json.decode(body)
    assert payload["stream"] is True and payload["max_tokens"] == 7
    assert payload["model"] == "tiny" and payload["ignore_eos"] is True
    assert len(payload["prompt"].split()) == 32
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hi there", "max_tokens": 3}\n{"prompt": "bye"}\n')
    chat = prepare_llm(ENDPOINT, "tiny", LlmInputs(chat=True, input_file=path))
    bodies = [msgspec.json.decode(r.partition(b"\r\n\r\n")[2]) for r in chat]
    assert chat[0].startswith(b"POST /v1/chat/completions")
    assert bodies[0]["messages"] == [{"role": "user", "content": "hi there"}]
    assert [b["max_tokens"] for b in bodies] == [3, 64]
    path.write_text('{"text": "no prompt"}\n')
    with pytest.raises(InvalidInput):
        prepare_llm(ENDPOINT, "tiny", LlmInputs(input_file=path))
