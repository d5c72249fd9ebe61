"""`stream_interval` wherever the engine steps (a server thread, an engine process, two engine
processes) and through the OpenAI routes, on the tiny Llama: each request's first token alone,
then chunks of N tokens, and in total the same text, tokens, logprobs and finish reasons as
N = 1; an abort mid-chunk leaves the process serving."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from fulcrum.config import load_model_config
from fulcrum.llm.engine import AsyncLLMEngine
from fulcrum.llm.examples import build_tiny_llama
from fulcrum.llm.loader import load_checkpoint
from fulcrum.llm.outputs import RequestOutput
from fulcrum.llm.params import EngineParams
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.sync_engine import LLMEngine
from fulcrum.server.app import create_app
from fulcrum.service import Service

CASES = [
    ("Hello there", SamplingParams(max_tokens=23, temperature=0.0, ignore_eos=True)),
    ("The cat", SamplingParams(max_tokens=32, temperature=0.0, stop=("e", "at"))),
    ("A story", SamplingParams(max_tokens=13, temperature=0.0, logprobs=2, ignore_eos=True)),
    ("Seeded", SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)),
    ("Once upon a time", SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=(4,))),
    ("Hello there, how", SamplingParams(max_tokens=17, temperature=0.0, prompt_logprobs=1)),
]
# One torch thread everywhere: the same float sums as the reference.
CONFIG = """platform = "llm"
[parameters]
num_kv_blocks = 128
num_threads = 1
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory: Path = tmp_path_factory.mktemp("models")
    for name, extra in (("every", ""), ("chunked", "engine_process = true\nstream_interval = 4\n")):
        build_tiny_llama(directory, name=name)
        (directory / name / "config.toml").write_text(CONFIG + extra)
    return directory


@pytest.fixture
async def started() -> AsyncIterator[list[AsyncLLMEngine]]:
    """Engines a test started, stopped even when it fails (no engine process outlives it)."""
    engines: list[AsyncLLMEngine] = []
    yield engines
    for engine in engines:
        await engine.stop(timeout_s=0.0)


async def _engine(
    repo: Path, started: list[AsyncLLMEngine], interval: int, mode: str, tmp_path: Path
) -> AsyncLLMEngine:
    """The model `every` served with another stream_interval, in another mode (from config)."""
    extra = {"thread": "", "process": "engine_process = true\n",
             "process2": "num_engine_processes = 2\n"}[mode]  # fmt: skip
    config_file = tmp_path / "config.toml"
    config_file.write_text(f'name = "tiny"\n{CONFIG}stream_interval = {interval}\n{extra}')
    config = load_model_config(config_file)
    engine = await asyncio.to_thread(
        AsyncLLMEngine.from_config, config, repo / "every" / "1", registry=CollectorRegistry()
    )
    started.append(engine)
    await engine.start()
    assert engine.engine.params.stream_interval == interval
    return engine


async def _read(engine: AsyncLLMEngine) -> list[list[RequestOutput]]:
    async def one(prompt: str, sampling: SamplingParams) -> list[RequestOutput]:
        return [output async for output in engine.generate(prompt, sampling)]

    return await asyncio.gather(*(one(prompt, sampling) for prompt, sampling in CASES))


def _whole(outputs: list[RequestOutput]) -> list[object]:
    """All one request's client read, joined; logprob values last (`_same`)."""
    last = outputs[-1]
    logprobs = [lp for o in outputs for lp in o.new_logprobs]
    return [
        "".join(o.new_text for o in outputs),
        [t for o in outputs for t in o.new_token_ids],
        last.finish_reason,
        (last.usage.prompt_tokens, last.usage.completion_tokens),
        [(lp.token_id, lp.rank, [t for t, _ in lp.top]) for lp in logprobs],
        outputs[0].prompt_logprobs is not None,
        [lp.logprob for lp in logprobs],
    ]


def _same(got: list[list[object]], expected: list[list[object]]) -> None:
    # Batches formed by arrival order differ between runs: logprobs move in their last digits.
    assert [g[:-1] for g in got] == [e[:-1] for e in expected]
    for g, e in zip(got, expected, strict=True):
        assert g[-1] == pytest.approx(e[-1], rel=1e-4)


def _check_chunks(outputs: list[RequestOutput], interval: int) -> None:
    sizes = [len(o.new_token_ids) for o in outputs]
    assert sizes[0] == 1, sizes  # the first token at once
    assert all(size == interval for size in sizes[1:-1]), sizes
    assert 1 <= sizes[-1] <= interval, sizes


@pytest.mark.parametrize(("mode", "interval"), [("thread", 4), ("process", 4), ("process2", 7)])
async def test_each_mode_reads_the_same_in_chunks(
    repo: Path, started: list[AsyncLLMEngine], mode: str, interval: int, tmp_path: Path
) -> None:
    reference = AsyncLLMEngine(
        LLMEngine(load_checkpoint(repo / "every" / "1"), EngineParams(num_kv_blocks=128,
                                                                      num_threads=1)),
        model_name="reference",
    )  # fmt: skip
    started.append(reference)
    await reference.start()
    expected = await _read(reference)
    assert all(len(o) == o[-1].usage.completion_tokens for o in expected)  # a token each
    engine = await _engine(repo, started, interval, mode, tmp_path)
    got = await _read(engine)
    _same([_whole(o) for o in got], [_whole(o) for o in expected])
    for outputs in got:
        _check_chunks(outputs, interval)
    assert {o[-1].finish_reason for o in got} == {"length", "stop"}
    assert engine.num_streams == 0


async def test_an_abort_mid_chunk_leaves_the_process_serving(
    repo: Path, started: list[AsyncLLMEngine], tmp_path: Path
) -> None:
    engine = await _engine(repo, started, 4, "process", tmp_path)
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    stream = engine.generate("Hello there", long)
    first = await anext(stream)
    second = await anext(stream)
    assert [len(first.new_token_ids), len(second.new_token_ids)] == [1, 4]
    await stream.aclose()  # between chunks: tokens held in the process are dropped with it
    assert engine.num_streams == 0
    outputs = [o async for o in engine.generate(*CASES[0])]
    _check_chunks(outputs, 4)
    assert outputs[-1].finish_reason == "length" and engine.is_healthy


@pytest.fixture
async def client(service: Service) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(service, manage_lifespan=False))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client


async def _sse(client: httpx.AsyncClient, model: str, body: dict[str, Any]) -> list[Any]:
    response = await client.post("/v1/completions", json={**body, "model": model, "stream": True})
    assert response.status_code == 200, response.text
    chunks = [c.removeprefix("data: ") for c in response.text.split("\n\n") if c]
    assert chunks[-1] == "[DONE]"
    return [json.loads(c) for c in chunks[:-1]]


async def test_served_stream_carries_several_tokens_per_chunk(client: httpx.AsyncClient) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 18, "temperature": 0, "logprobs": 1,
            "ignore_eos": True}  # fmt: skip
    every = await _sse(client, "every", body)
    chunked = await _sse(client, "chunked", body)
    assert [len(c["choices"][0]["logprobs"]["tokens"]) for c in every] == [1] * 18
    assert [len(c["choices"][0]["logprobs"]["tokens"]) for c in chunked] == [1, 4, 4, 4, 4, 1]
    assert chunked[-1]["choices"][0]["finish_reason"] == "length"
    for streamed in (body, {**body, "stop": ["e"]}):
        texts = ["".join(c["choices"][0]["text"] for c in await _sse(client, model, streamed))
                 for model in ("every", "chunked")]  # fmt: skip
        assert texts[0] == texts[1]
    for answered in ({**body, "stop": ["e"]}, {**body, "max_tokens": 9}):
        answers = []
        for model in ("every", "chunked"):
            response = await client.post("/v1/completions", json={**answered, "model": model})
            assert response.status_code == 200, response.text
            answers.append(response.json()["choices"][0])
        assert answers[0]["text"] == answers[1]["text"]
        assert answers[0]["finish_reason"] == answers[1]["finish_reason"]
        assert answers[0]["logprobs"]["tokens"] == answers[1]["logprobs"]["tokens"]
