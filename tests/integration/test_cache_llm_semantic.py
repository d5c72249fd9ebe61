"""The semantic tier for generations, as served: a paraphrased chat question is answered from
the cache (`Fulcrum-Cache: semantic`) with its own prompt tokens, streamed like the live answer;
swapped roles and negations, another tenant, another earlier conversation and sampled requests
are not; an embedder that is not loaded makes misses, never failures."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fulcrum.cache.tiered import ModelCache
from fulcrum.llm.examples import build_tiny_gpt2
from fulcrum.server.app import create_app
from fulcrum.service import Service

TINY_LLM = """platform = "llm"
[parameters]
num_kv_blocks = 64
block_size = 4
max_model_len = 128
[cache]
semantic = true
semantic_embedder = "{embedder}"
semantic_sampled = {sampled}
"""
# Three configurations of the same tiny LLM: the default, sampled hits allowed, and an embedder
# that is not served.
MODELS = {"tiny": ("minilm", "false"), "sampled": ("minilm", "true"), "orphan": ("absent", "false")}
QUESTION = "How do I reset my password?"
PARAPHRASE = "How can I reset my password, please?"


@pytest.fixture(scope="module")
def llm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root: Path = tmp_path_factory.mktemp("cache_llm_semantic")
    build_tiny_gpt2(root, name="tiny")
    return root / "tiny"


@pytest.fixture
def repo(tmp_path: Path, llm_dir: Path, example_repo: Path) -> Path:
    (tmp_path / "minilm").mkdir()
    (tmp_path / "minilm" / "1").symlink_to(example_repo / "minilm" / "1", target_is_directory=True)
    config = (example_repo / "minilm" / "config.toml").read_text()
    (tmp_path / "minilm" / "config.toml").write_text(config)
    for name, (embedder, sampled) in MODELS.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "1").symlink_to(llm_dir / "1", target_is_directory=True)
        text = TINY_LLM.format(embedder=embedder, sampled=sampled)
        (tmp_path / name / "config.toml").write_text(text)
    return tmp_path


@pytest.fixture
async def client(service: Service) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(service, manage_lifespan=False, admin_open=True)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


def ask(*turns: str, model: str = "tiny", **fields: Any) -> dict[str, Any]:
    """A greedy chat body; the turns alternate user / assistant and end with a user turn."""
    roles = ["user", "assistant"]
    messages = [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]
    return {"model": model, "messages": messages, "max_tokens": 12, "temperature": 0, **fields}


async def chat(client: httpx.AsyncClient, body: dict[str, Any], **headers: str) -> httpx.Response:
    response = await client.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return response


def status(response: httpx.Response) -> str:
    return response.headers["fulcrum-cache"]


def content(response: httpx.Response) -> str:
    text = response.json()["choices"][0]["message"]["content"]
    assert isinstance(text, str)
    return text


def model_cache(service: Service, name: str = "tiny") -> ModelCache:
    cache = service.caches.model(name)
    assert cache is not None
    return cache


async def test_a_paraphrase_is_a_semantic_hit_with_its_own_prompt_tokens(
    client: httpx.AsyncClient, service: Service
) -> None:
    first = await chat(client, ask(QUESTION))
    hit = await chat(client, ask(PARAPHRASE))
    assert (status(first), status(hit)) == ("miss", "semantic")
    assert content(hit) == content(first)
    assert hit.json()["choices"][0]["finish_reason"] == first.json()["choices"][0]["finish_reason"]
    # The same paraphrase computed live (another tenant's scope) gives its own prompt size.
    live = await chat(client, ask(PARAPHRASE), **{"X-Fulcrum-Tenant": "acme"})
    assert status(live) == "miss"
    assert content(live) != content(hit)  # so the hit's answer is the cached one
    assert hit.json()["usage"]["prompt_tokens"] == live.json()["usage"]["prompt_tokens"]
    assert hit.json()["usage"]["prompt_tokens"] != first.json()["usage"]["prompt_tokens"]
    assert hit.json()["usage"]["completion_tokens"] == first.json()["usage"]["completion_tokens"]
    stats = model_cache(service).stats
    assert stats.hits["semantic"] == 1 and stats.saved_s["semantic"] > 0
    assert stats.misses == 2
    text = (await client.get("/metrics")).text
    assert 'fulcrum_cache_hits_total{model="tiny",tier="semantic"} 1.0' in text


async def test_swapped_roles_and_negations_are_refused_by_the_verifier(
    client: httpx.AsyncClient, service: Service
) -> None:
    for asked, near_miss in (
        ("Convert 100 USD to EUR", "Convert 100 EUR to USD"),
        ("Is it safe to delete the cache folder?", "Is it unsafe to delete the cache folder?"),
    ):
        assert status(await chat(client, ask(asked))) == "miss"
        assert status(await chat(client, ask(near_miss))) == "miss", near_miss
    rejections = model_cache(service).stats.rejections
    assert rejections["order"] >= 1 and rejections["negation"] >= 1
    assert model_cache(service).stats.hits["semantic"] == 0


async def test_another_tenant_is_never_answered(client: httpx.AsyncClient) -> None:
    assert status(await chat(client, ask(QUESTION), **{"X-Fulcrum-Tenant": "acme"})) == "miss"
    for headers in ({"X-Fulcrum-Tenant": "globex"}, {"Authorization": "Bearer sk-other"}, {}):
        assert status(await chat(client, ask(PARAPHRASE), **headers)) == "miss", headers
    again = await chat(client, ask(PARAPHRASE), **{"X-Fulcrum-Tenant": "acme"})
    assert status(again) == "semantic"


async def test_only_the_same_earlier_conversation_is_answered(client: httpx.AsyncClient) -> None:
    france = ("What is the capital of France?", "Paris.")
    spain = ("What is the capital of Spain?", "Madrid.")
    assert status(await chat(client, ask(*france, "How do I get there by train?"))) == "miss"
    other = await chat(client, ask(*spain, "How can I get there by train?"))
    assert status(other) == "miss"
    alone = await chat(client, ask("How can I get there by train?"))
    assert status(alone) == "miss"
    same = await chat(client, ask(*france, "How can I get there by train?"))
    assert status(same) == "semantic"


async def test_chat_options_are_part_of_the_scope(client: httpx.AsyncClient) -> None:
    assert status(await chat(client, ask(QUESTION))) == "miss"
    plain = await chat(client, ask(PARAPHRASE, add_generation_prompt=False))
    assert status(plain) == "miss"


async def test_sampled_requests_are_answered_only_where_allowed(
    client: httpx.AsyncClient, service: Service
) -> None:
    sampled: dict[str, Any] = {"temperature": 1.0}
    for text in (QUESTION, QUESTION, PARAPHRASE):
        assert status(await chat(client, ask(text, **sampled))) == "miss"
    assert model_cache(service).stats.uncacheable == 3
    # A seeded draw is reproducible: a paraphrase with that seed may hit, another seed may not.
    assert status(await chat(client, ask(QUESTION, seed=7, **sampled))) == "miss"
    assert status(await chat(client, ask(PARAPHRASE, seed=8, **sampled))) == "miss"
    assert status(await chat(client, ask(PARAPHRASE, seed=7, **sampled))) == "semantic"
    # semantic_sampled = true: a sampled answer may be served again.
    allowed: dict[str, Any] = {"model": "sampled", **sampled}
    assert status(await chat(client, ask(QUESTION, **allowed))) == "miss"
    hit = await chat(client, ask(PARAPHRASE, **allowed))
    assert status(hit) == "semantic"


async def test_logprobs_are_never_answered_from_the_semantic_tier(
    client: httpx.AsyncClient,
) -> None:
    assert status(await chat(client, ask(QUESTION))) == "miss"
    with_logprobs = await chat(client, ask(PARAPHRASE, logprobs=True, top_logprobs=1))
    assert status(with_logprobs) == "miss"
    assert with_logprobs.json()["choices"][0]["logprobs"] is not None


def events(response: httpx.Response) -> list[dict[str, Any]]:
    lines = [line[6:] for line in response.text.split("\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def shape(chunks: list[dict[str, Any]]) -> list[object]:
    """What a client sees of a stream, minus ids, timestamps and usage."""
    return [[(c.get("delta"), c.get("finish_reason")) for c in e["choices"]] for e in chunks]


async def test_a_streamed_hit_streams_like_the_live_answer(client: httpx.AsyncClient) -> None:
    stream: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}}
    live = await chat(client, ask(QUESTION, **stream))
    hit = await chat(client, ask(PARAPHRASE, **stream))
    assert (status(live), status(hit)) == ("miss", "semantic")
    assert hit.headers["content-type"].startswith("text/event-stream")
    live_events, hit_events = events(live), events(hit)
    assert len(live_events) > 3
    assert shape(hit_events[:-1]) == shape(live_events[:-1])
    live_usage, hit_usage = live_events[-1]["usage"], hit_events[-1]["usage"]
    assert hit_usage["completion_tokens"] == live_usage["completion_tokens"]
    own = await chat(client, ask(PARAPHRASE), **{"X-Fulcrum-Tenant": "acme"})
    assert hit_usage["prompt_tokens"] == own.json()["usage"]["prompt_tokens"]


async def test_an_echoed_completion_hit_echoes_its_own_prompt(client: httpx.AsyncClient) -> None:
    body = {"model": "tiny", "max_tokens": 12, "temperature": 0, "echo": True}
    prompt, paraphrase = f"Question: {QUESTION}\nAnswer:", f"Question: {PARAPHRASE}\nAnswer:"
    first = await client.post("/v1/completions", json={**body, "prompt": prompt})
    hit = await client.post("/v1/completions", json={**body, "prompt": paraphrase})
    assert (status(first), status(hit)) == ("miss", "semantic")
    first_text, hit_text = first.json()["choices"][0]["text"], hit.json()["choices"][0]["text"]
    assert hit_text.startswith(paraphrase)
    assert hit_text.removeprefix(paraphrase) == first_text.removeprefix(prompt)


async def test_an_embedder_that_is_not_served_makes_misses_not_failures(
    client: httpx.AsyncClient, service: Service
) -> None:
    answers = [await chat(client, ask(t, model="orphan")) for t in (QUESTION, PARAPHRASE)]
    assert [status(a) for a in answers] == ["miss", "miss"]
    assert status(await chat(client, ask(PARAPHRASE, model="orphan"))) == "exact"
    cache = model_cache(service, "orphan")
    assert cache.stats.semantic_errors == 2  # one per failed lookup; nothing indexed after it
    assert cache.stats.hits == {"exact": 1, "semantic": 0}


async def test_a_prompt_past_the_context_is_refused_as_live_not_answered(
    client: httpx.AsyncClient, service: Service
) -> None:
    assert status(await chat(client, ask(QUESTION))) == "miss"
    too_long = await client.post("/v1/chat/completions", json=ask(PARAPHRASE, max_tokens=127))
    assert too_long.status_code == 400, too_long.text
    assert model_cache(service).stats.hits["semantic"] == 0


async def test_concurrent_paraphrases_are_each_answered(client: httpx.AsyncClient) -> None:
    assert status(await chat(client, ask(QUESTION))) == "miss"
    expected = content(await chat(client, ask(QUESTION)))
    variants = [
        PARAPHRASE,
        "How can I reset my password?",
        "how do i reset my password",
        "How do I reset my password please?",
    ]
    answers = await asyncio.gather(*(chat(client, ask(v)) for v in variants))
    assert [status(a) for a in answers] == ["semantic"] * len(variants)
    assert {content(a) for a in answers} == {expected}
