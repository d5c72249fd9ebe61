"""Through the OpenAI routes, a model served with `engine_process = true` answers byte for byte
as the same model served by an engine thread (greedy and seeded text, stop strings, logprobs,
n > 1, streaming, structured output, tool calls), and its fulcrum_llm_* series are scraped from
the server's registry."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fulcrum.context import internal_context
from fulcrum.llm.engine_process import ProcessEngineClient
from fulcrum.llm.examples import build_tiny_llama
from fulcrum.server.app import create_app
from fulcrum.service import Service
from fulcrum.service_llm import LLMServable

TEMPLATE = (Path(__file__).parent.parent / "data" / "chat_templates" / "qwen2_5.jinja").read_text()
CONFIG = """platform = "llm"
[parameters]
num_kv_blocks = 512
block_size = 4
max_model_len = 1024
tool_call_parser = "hermes"
# The same torch threads in both modes (by default the engine process leaves the server a core):
# a float sum in another order moves a logprob in its 7th digit.
num_threads = 1
"""
SCHEMA: Any = {
    "type": "object",
    "properties": {"name": {"type": "string", "enum": ["ada", "bob"]},
                   "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}  # fmt: skip
TOOLS: Any = [{"type": "function", "function": {"name": "now", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}]  # fmt: skip
HERMES = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
USER: Any = [{"role": "user", "content": "What time is it?"}]
REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": "Hello there", "max_tokens": 16, "temperature": 0,
                         "ignore_eos": True}),
    ("/v1/completions", {"prompt": "The cat", "max_tokens": 32, "temperature": 0,
                         "stop": ["e", "at"]}),
    ("/v1/completions", {"prompt": "The cat", "max_tokens": 32, "temperature": 0,
                         "stop": ["e"], "include_stop_str_in_output": True}),
    ("/v1/completions", {"prompt": "A story", "max_tokens": 8, "temperature": 1.0, "seed": 3,
                         "n": 2, "logprobs": 2, "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 60, "temperature": 1.0, "seed": 1,
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "p", "schema": SCHEMA}}}),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 60, "tools": TOOLS,
                              "structured_outputs": {"choice": [HERMES]}}),
]  # fmt: skip


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory: Path = tmp_path_factory.mktemp("models")
    for name, extra in (("thread", ""), ("proc", "engine_process = true\n")):
        build_tiny_llama(directory, name=name)
        (directory / name / "config.toml").write_text(CONFIG + extra)
        tok_config = directory / name / "1" / "tokenizer_config.json"
        tokens = json.loads(tok_config.read_text())
        tok_config.write_text(json.dumps({**tokens, "chat_template": TEMPLATE}))  # renders tools
    return directory


@pytest.fixture
async def client(service: Service) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(service, manage_lifespan=False))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client


def _normal(body: Any) -> Any:
    """The answer without what differs by design between two calls: ids, times, model name."""
    if isinstance(body, dict):
        return {k: _normal(v) for k, v in body.items() if k not in ("id", "created", "model")}
    if isinstance(body, list):
        return [_normal(v) for v in body]
    return body


async def _answer(client: httpx.AsyncClient, model: str, path: str, body: Any) -> Any:
    response = await client.post(path, json={**body, "model": model})
    assert response.status_code == 200, response.text
    answer = response.json()
    for choice in answer["choices"]:  # tool call ids are random
        for call in (choice.get("message") or {}).get("tool_calls") or []:
            call.pop("id")
    return _normal(answer)


async def _streamed(client: httpx.AsyncClient, model: str) -> list[Any]:
    body = {"model": model, "prompt": "Once", "max_tokens": 12, "temperature": 0,
            "stream": True, "stop": ["o"]}  # fmt: skip
    response = await client.post("/v1/completions", json=body)
    chunks = [c.removeprefix("data: ") for c in response.text.split("\n\n") if c]
    return [_normal(json.loads(c)) for c in chunks[:-1]]


async def test_process_mode_answers_as_thread_mode(client: httpx.AsyncClient) -> None:
    for path, body in REQUESTS:
        expected = await _answer(client, "thread", path, body)
        assert await _answer(client, "proc", path, body) == expected, (path, body)
    tool = await _answer(client, "proc", *REQUESTS[-1])
    assert tool["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "now"
    assert json.loads((await _answer(client, "proc", *REQUESTS[-2]))["choices"][0]["message"][
        "content"])["name"] in ("ada", "bob")  # fmt: skip
    assert await _streamed(client, "proc") == await _streamed(client, "thread")
    lines = (await client.get("/metrics")).text.splitlines()
    for name in ("generation_tokens_total", "time_to_first_token_seconds_count",
                 "request_success_total", "num_requests_running"):  # fmt: skip
        series = [x for x in lines if x.startswith(f"fulcrum_llm_{name}{{") and 'model="proc"' in x]
        assert series, name


def _client_of(service: Service) -> ProcessEngineClient:
    servable = service._repository.get("proc")[2]
    assert isinstance(servable, LLMServable)
    client = servable.engine._client
    assert isinstance(client, ProcessEngineClient)
    return client


async def test_hot_reload_and_unload_end_the_engine_process(
    service: Service, client: httpx.AsyncClient
) -> None:
    old = _client_of(service)
    old_process = old._gen.process
    await service.load(internal_context(), "proc")  # a reload: a new engine, the old one stopped
    new = _client_of(service)
    assert new is not old and new.pid != old_process.pid
    assert old_process.exitcode == 0  # told to stop after its drain: exited, not killed
    assert (await _answer(client, "proc", *REQUESTS[0])) == await _answer(
        client, "thread", *REQUESTS[0]
    )
    new_process = new._gen.process
    await service.unload(internal_context(), "proc")
    assert new_process.exitcode == 0
