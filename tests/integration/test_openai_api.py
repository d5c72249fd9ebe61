"""OpenAI-compatible routes in process (httpx.ASGITransport) over a real tiny engine."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fulcrum.llm.engine import AsyncLLMEngine
from fulcrum.llm.examples import build_tiny_gpt2
from fulcrum.server.app import create_app
from fulcrum.service import Service

TINY_CONFIG = """platform = "llm"
[parameters]
num_kv_blocks = 64
block_size = 4
max_model_len = 128
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory: Path = tmp_path_factory.mktemp("models")
    build_tiny_gpt2(directory, name="tiny")
    (directory / "tiny" / "config.toml").write_text(TINY_CONFIG)
    return directory


@pytest.fixture
async def client(service: Service) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(service, manage_lifespan=False)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client


def _events(body: str) -> list[Any]:
    assert body.endswith("data: [DONE]\n\n")
    chunks = [line.removeprefix("data: ") for line in body.split("\n\n") if line]
    return [json.loads(c) for c in chunks[:-1]]


GREEDY = {"model": "tiny", "temperature": 0, "max_tokens": 12, "ignore_eos": True}


async def test_models_lists_generative_models(client: httpx.AsyncClient) -> None:
    response = await client.get("/v1/models")
    assert response.status_code == 200
    data = response.json()["data"]
    assert [(m["id"], m["object"], m["max_model_len"]) for m in data] == [("tiny", "model", 128)]


async def test_completion_returns_text_and_usage(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/completions", json={**GREEDY, "prompt": "Hello there"})
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    assert isinstance(choice["text"], str) and choice["text"]
    usage = body["usage"]
    assert usage["completion_tokens"] == 12
    assert usage["total_tokens"] == usage["prompt_tokens"] + 12
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_repeated_prompt_reports_cached_tokens(client: httpx.AsyncClient) -> None:
    prompt = list(range(10, 30))  # 20 token ids: five full blocks of 4
    first = (await client.post("/v1/completions", json={**GREEDY, "prompt": prompt})).json()
    second = (await client.post("/v1/completions", json={**GREEDY, "prompt": prompt})).json()
    assert first["usage"]["prompt_tokens"] == 20
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 16
    assert second["choices"][0]["text"] == first["choices"][0]["text"]


async def test_streamed_text_equals_the_json_answer(client: httpx.AsyncClient) -> None:
    request = {**GREEDY, "prompt": "The quick brown"}
    whole = (await client.post("/v1/completions", json=request)).json()
    response = await client.post(
        "/v1/completions",
        json={**request, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert response.headers["content-type"].startswith("text/event-stream")
    events = _events(response.text)
    text_chunks, usage_chunk = events[:-1], events[-1]
    assert "".join(e["choices"][0]["text"] for e in text_chunks) == whole["choices"][0]["text"]
    assert text_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 12


async def test_chat_completion_and_stream(client: httpx.AsyncClient) -> None:
    request = {**GREEDY, "messages": [{"role": "user", "content": "Tell me a story"}]}
    body = (await client.post("/v1/chat/completions", json=request)).json()
    assert body["object"] == "chat.completion"
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant"
    response = await client.post("/v1/chat/completions", json={**request, "stream": True})
    events = _events(response.text)
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert streamed == message["content"]
    assert "usage" not in events[-1]  # include_usage was not asked for


async def test_stop_string_ends_with_stop(client: httpx.AsyncClient) -> None:
    request = {**GREEDY, "prompt": "Hello there", "max_tokens": 30}
    text = (await client.post("/v1/completions", json=request)).json()["choices"][0]["text"]
    stop = text[3:6]
    if not stop.strip() or stop in text[:3]:
        pytest.skip(f"no usable stop string in {text!r}")
    body = (await client.post("/v1/completions", json={**request, "stop": stop})).json()
    assert body["choices"][0] == {
        "index": 0,
        "logprobs": None,
        "finish_reason": "stop",
        "text": text[: text.index(stop)],
    }


@pytest.mark.parametrize(
    ("patch", "status", "needle"),
    [
        ({"n": 0}, 400, "n:"),  # n > 1 is served now (issue 13): n bounded to 1..MAX_N
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"max_tokens": 500}, 400, "max_tokens"),
        ({"max_tokens": "many"}, 400, "max_tokens"),
        ({"temperature": -1}, 400, "temperature"),
        ({"top_p": 0}, 400, "top_p"),
        ({"model": "nope"}, 404, "nope"),
        ({"prompt": [[1, 2], "x"]}, 400, "prompt"),  # batched prompts are served, mixed not
        ({"logprobs": 21}, 400, "logprobs"),  # logprobs are served, up to 20
    ],
)
async def test_bad_requests_get_openai_errors(
    client: httpx.AsyncClient, patch: dict[str, Any], status: int, needle: str
) -> None:
    response = await client.post("/v1/completions", json={**GREEDY, "prompt": "hi", **patch})
    assert response.status_code == status
    error = response.json()["error"]
    assert needle in error["message"]
    assert error["code"] == status
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


async def test_malformed_json_and_missing_messages(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", content=b"{not json")
    assert response.status_code == 400
    response = await client.post("/v1/chat/completions", json={"model": "tiny"})
    assert response.status_code == 400
    assert "messages" in response.json()["error"]["message"]


async def test_queue_full_is_503_with_retry_after(
    client: httpx.AsyncClient, engine: AsyncLLMEngine
) -> None:
    engine._num_waiting = engine.engine.params.max_num_waiting  # as published under load
    response = await client.post("/v1/completions", json={**GREEDY, "prompt": "hi"})
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert response.json()["error"]["type"] == "service_unavailable_error"


async def test_chat_without_max_tokens_may_fill_the_context(client: httpx.AsyncClient) -> None:
    request = {
        "model": "tiny",
        "temperature": 0,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "Hi"}],
    }
    usage = (await client.post("/v1/chat/completions", json=request)).json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 128  # max_model_len
