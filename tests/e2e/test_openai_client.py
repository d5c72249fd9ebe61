"""The official `openai` client against a real HTTP server (uvicorn on a free loopback port)
serving the tiny Llama through the OpenAI routes: JSON, streaming, errors, disconnect."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import uvicorn

from fulcrum.llm.engine import AsyncLLMEngine
from fulcrum.llm.examples import build_tiny_llama
from fulcrum.server.app import create_app
from fulcrum.service import Service
from fulcrum.service_llm import LLMServable

pytestmark = pytest.mark.e2e


class Server:
    def __init__(self, url: str, service: Service) -> None:
        self.url = url
        self.service = service
        self.registry = service.metrics.registry

    @property
    def engine(self) -> AsyncLLMEngine:
        servable = self.service._repository.get("tiny-llama")[2]
        assert isinstance(servable, LLMServable)
        return servable.engine


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    directory: Path = tmp_path_factory.mktemp("models")
    name = build_tiny_llama(directory)
    config = directory / name / "config.toml"
    config.write_text(config.read_text() + "num_kv_blocks = 128\n")
    service = Service.from_repository(directory)
    app = create_app(service)
    # Bound before the thread starts: clients may connect at once (the backlog holds them).
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not uv.started:  # the lifespan loads the model before uvicorn listens
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    try:
        yield Server(f"http://127.0.0.1:{port}", service)
    finally:
        uv.should_exit = True
        thread.join(timeout=30)
        sock.close()


@pytest.fixture
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_real_fulcrum_serve_with_the_example_llms(server_url: str) -> None:
    """`fulcrum serve` over the example repository: both tiny LLMs, streaming and not."""
    with openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0) as c:
        assert {m.id for m in c.models.list()} >= {"tiny-gpt2", "tiny-llama"}
        for model in ("tiny-gpt2", "tiny-llama"):
            done = c.completions.create(model=model, prompt="The server", max_tokens=8,
                                        temperature=0)  # fmt: skip
            assert done.usage is not None and done.usage.completion_tokens == 8
            chunks = list(c.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=6,
                temperature=0, stream=True,
            ))  # fmt: skip
            assert chunks and chunks[-1].choices[0].finish_reason == "length"


def test_openai_embeddings_equal_the_v2_answer(server_url: str) -> None:
    """The official client's embeddings.create (it asks for base64 by default) against minilm."""
    texts = ["hello world", "the server answers both APIs"]
    with openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0) as c:
        created = c.embeddings.create(model="minilm", input=texts)
        floats = c.embeddings.create(model="minilm", input=texts, encoding_format="float")
    v2 = httpx.post(
        f"{server_url}/v2/models/minilm/infer",
        json={"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2, 1], "data": texts}]},
        timeout=30,
    ).json()
    expected = np.array(v2["outputs"][0]["data"], np.float32).reshape(2, -1)
    for answer in (created, floats):
        got = np.array([d.embedding for d in answer.data], np.float32)
        np.testing.assert_allclose(got, expected, atol=1e-6)
    assert created.usage.prompt_tokens == floats.usage.prompt_tokens > 0


def test_models_and_completion(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["tiny-llama"]
    completion = client.completions.create(
        model="tiny-llama",
        prompt="Once upon a time",
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 10


def test_streaming_chat_with_usage(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "Hello! How are you today?"}]
    whole = client.chat.completions.create(
        model="tiny-llama",
        messages=messages,
        max_tokens=12,
        temperature=0,
        seed=1,
        extra_body={"ignore_eos": True},
    )
    stream = client.chat.completions.create(
        model="tiny-llama",
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_errors_raise_the_clients_exceptions(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="n"):  # n > 1 is served (issue 13)
        client.completions.create(model="tiny-llama", prompt="hi", n=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="missing", prompt="hi")


def test_disconnect_mid_stream_aborts_and_frees_blocks(server: Server) -> None:
    request = {
        "model": "tiny-llama",
        "prompt": "Tell me a story",
        "max_tokens": 800,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=request, timeout=30) as r:
        next(r.iter_lines())  # the stream is running; now the client goes away
    labels = {
        "model": "tiny-llama",
        "version": "1",
        "variant": "default",
        "finished_reason": "abort",
    }
    deadline = time.monotonic() + 20
    while server.registry.get_sample_value("fulcrum_llm_request_success_total", labels) != 1.0:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.02)
    assert server.engine.engine.block_manager.usage() == 0.0
