"""The official `openai` client against the Ray ingress: embeddings (a batch model through the
service's forwarding) and completions and chat, streamed and not (the request carried to the
LLM's replica, its stream relayed through a streaming handle), equal to a single process."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from ray_cluster import Cluster

from fulcrum.server.app import create_app
from fulcrum.service import Service, ServiceSettings

pytestmark = pytest.mark.ray
LLM = "tiny-gpt2"


def client(cluster: Cluster) -> openai.OpenAI:
    if LLM not in cluster.models:
        pytest.fail("the [examples] extra is installed with [all]; tiny-gpt2 must be here")
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", timeout=120)


def in_process(repository: Path, model: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The same request answered by single-process Fulcrum (its app over an in-process Service)."""

    async def run() -> dict[str, Any]:
        service = Service(repository, ServiceSettings(load_models=(model,)))
        await service.start()
        try:
            app = create_app(service, manage_lifespan=False)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://x") as http:
                response = await http.post(path, json=body, timeout=120)
                assert response.status_code == 200, response.text
                answer: dict[str, Any] = response.json()
                return answer
        finally:
            await service.stop()

    return asyncio.run(run())


def test_models_list_names_the_served_models(cluster: Cluster) -> None:
    ids = {model.id for model in client(cluster).models.list()}
    assert {LLM, "minilm"} <= ids


def test_embeddings_equal_single_process(cluster: Cluster) -> None:
    texts = ["The quick brown fox.", "Batching on a cluster."]
    answer = client(cluster).embeddings.create(model="minilm", input=texts)
    got = np.array([item.embedding for item in answer.data], dtype=np.float32)
    body = {"model": "minilm", "input": texts}
    expected = in_process(cluster.repository, "minilm", "/v1/embeddings", body)
    want = np.array([item["embedding"] for item in expected["data"]], dtype=np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert answer.usage.prompt_tokens == expected["usage"]["prompt_tokens"]


def test_greedy_completion_streamed_equals_single_process(cluster: Cluster) -> None:
    body = {"model": LLM, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    stream = client(cluster).completions.create(**body, stream=True)
    pieces = [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert len(pieces) > 1  # relayed as it was made, not as one block
    expected = in_process(cluster.repository, LLM, "/v1/completions", body)
    assert "".join(pieces) == expected["choices"][0]["text"]


def test_chat_not_streamed_equals_single_process(cluster: Cluster) -> None:
    messages = [{"role": "user", "content": "Say something."}]
    body = {"model": LLM, "messages": messages, "max_tokens": 8, "temperature": 0}
    answer = client(cluster).chat.completions.create(**body)
    expected = in_process(cluster.repository, LLM, "/v1/chat/completions", body)
    assert answer.choices[0].message.content == expected["choices"][0]["message"]["content"]
    assert answer.usage is not None
    assert answer.usage.completion_tokens == expected["usage"]["completion_tokens"]


def test_unknown_model_is_an_openai_404(cluster: Cluster) -> None:
    with pytest.raises(openai.NotFoundError):
        client(cluster).completions.create(model="nope", prompt="x", max_tokens=2)
