"""A cascade across two generative models on the OpenAI API (real tiny engines: `small` a
GPT-2, `big` a Llama with its own tokenizer and chat template): thresholds that force each
path, completions and chat, streamed and not; the route header, the decision metrics, the
score measured from the small model's own logprobs, and those logprobs kept out of answers
that did not ask for them."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fulcrum.llm.examples import ENGINE_PARAMETERS, build_tiny_gpt2, build_tiny_llama
from fulcrum.server.app import create_app
from fulcrum.service import Service

# A random tiny model's mean token logprob is near -log(vocab) (about -6): -1000 keeps every
# answer, 0 escalates every one.
CASCADE = '[routing.cascade]\nthen = "big"\nthreshold = {threshold}\nscore = "{score}"\n'
GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
CHAT = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    for name in ("sure", "unsure", "plain"):
        build_tiny_gpt2(root, name=name)
    build_tiny_llama(root, name="big", seed=1)
    head = f'platform = "llm"\n\n{ENGINE_PARAMETERS}'
    (root / "sure" / "config.toml").write_text(
        head + CASCADE.format(threshold=-1000.0, score="mean_logprob")
    )
    (root / "unsure" / "config.toml").write_text(  # `fast`: a variant `big` does not have
        head
        + "[variants.fast]\n[routing.ab]\narms = { fast = 1.0 }\n"
        + CASCADE.format(threshold=0.0, score="min_logprob")
    )
    return root


@pytest.fixture
async def client(service: Service) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(service, manage_lifespan=False))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


async def complete(client: httpx.AsyncClient, model: str, **extra: Any) -> httpx.Response:
    body = {"model": model, "prompt": "Hello world", **GREEDY, **extra}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response


async def chat(client: httpx.AsyncClient, model: str, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": CHAT, **GREEDY, **extra}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response


def streamed_text(response: httpx.Response, chat: bool) -> tuple[str, list[Any]]:
    """The text of an SSE answer and every chunk's logprobs."""
    text, logprobs = "", []
    for line in response.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[6:])["choices"]:
            text += choice["delta"].get("content", "") if chat else choice["text"]
            logprobs.append(choice["logprobs"])
    return text, logprobs


def header_score(response: httpx.Response) -> float:
    return float(response.headers["Fulcrum-Route"].rsplit("score=", 1)[1])


async def test_a_confident_answer_is_the_small_models_own(client: httpx.AsyncClient) -> None:
    answer = await complete(client, "sure")
    assert answer.headers["Fulcrum-Route"].startswith("cascade=first; score=-")
    plain = (await complete(client, "plain")).json()["choices"][0]
    choice = answer.json()["choices"][0]
    assert choice["text"] == plain["text"]
    assert choice["logprobs"] is None  # the scoring logprobs stay inside
    streamed = await complete(client, "sure", stream=True)
    assert streamed.headers["Fulcrum-Route"] == answer.headers["Fulcrum-Route"]
    text, logprobs = streamed_text(streamed, chat=False)
    assert text == plain["text"]
    assert logprobs and all(x is None for x in logprobs)


async def test_the_score_is_the_mean_of_the_answers_own_logprobs(
    client: httpx.AsyncClient,
) -> None:
    asked = await complete(client, "sure", logprobs=2)
    entries = asked.json()["choices"][0]["logprobs"]
    mean = math.fsum(entries["token_logprobs"]) / len(entries["token_logprobs"])
    assert header_score(asked) == pytest.approx(mean, abs=1e-4)
    # The request's own logprobs, as asked: two alternatives per token (and the chosen one).
    assert all(1 <= len(top) <= 3 for top in entries["top_logprobs"])


async def test_an_unsure_answer_is_escalated_to_the_big_model(client: httpx.AsyncClient) -> None:
    answer = await complete(client, "unsure")
    route = answer.headers["Fulcrum-Route"]
    assert route.startswith("ab=fast; cascade=escalated; then=big; score=-"), route  # with A/B
    big = (await complete(client, "big")).json()["choices"][0]
    assert answer.json()["choices"][0]["text"] == big["text"]
    assert answer.json()["choices"][0]["logprobs"] is None
    streamed = await complete(client, "unsure", stream=True)
    assert streamed.headers["Fulcrum-Route"].startswith("ab=fast; cascade=escalated; then=big")
    assert streamed_text(streamed, chat=False)[0] == big["text"]
    small = await complete(client, "plain", logprobs=0)
    worst = min(small.json()["choices"][0]["logprobs"]["token_logprobs"])
    assert header_score(answer) == pytest.approx(worst, abs=1e-4)  # min_logprob


async def test_the_variant_the_caller_named_is_the_small_models(
    client: httpx.AsyncClient,
) -> None:
    body = {"model": "unsure", "prompt": "Hello world", **GREEDY}
    named = await client.post("/v1/completions", json=body, headers={"X-Fulcrum-Variant": "fast"})
    assert named.status_code == 200, named.text  # `big` serves its own default variant
    big = (await complete(client, "big")).json()["choices"][0]["text"]
    assert named.json()["choices"][0]["text"] == big


async def test_chat_is_rendered_again_with_the_big_models_template(
    client: httpx.AsyncClient,
) -> None:
    big = (await chat(client, "big")).json()["choices"][0]["message"]["content"]
    escalated = await chat(client, "unsure")
    assert escalated.json()["choices"][0]["message"]["content"] == big
    streamed = await chat(client, "unsure", stream=True)
    assert streamed_text(streamed, chat=True)[0] == big
    kept = await chat(client, "sure", stream=True, logprobs=True, top_logprobs=1)
    assert kept.headers["Fulcrum-Route"].startswith("cascade=first")
    text, logprobs = streamed_text(kept, chat=True)
    plain = (await chat(client, "plain")).json()["choices"][0]["message"]["content"]
    assert text == plain
    assert any(x is not None and x["content"] for x in logprobs)  # asked for: kept


async def test_decisions_and_scores_are_counted(client: httpx.AsyncClient) -> None:
    await complete(client, "sure", n=2, temperature=1.0, seed=3)
    await complete(client, "unsure")
    metrics = (await client.get("/metrics")).text
    assert 'fulcrum_cascade_decisions_total{decision="first",model="sure",then="big"} 1.0' in (
        metrics
    )
    assert (
        'fulcrum_cascade_decisions_total{decision="escalated",model="unsure",then="big"} 1.0'
        in metrics
    )
    assert 'fulcrum_cascade_logprob_score_count{model="sure"} 2.0' in metrics  # one per choice
    rows = (await client.get("/v2/models/unsure/stats")).json()["model_stats"]
    assert [r["routing"]["cascade"] for r in rows] == [{"escalated": 1}]


async def test_a_cascade_to_a_batch_model_is_refused_at_load(tmp_path: Path) -> None:
    build_tiny_gpt2(tmp_path, name="small")
    (tmp_path / "echo" / "1").mkdir(parents=True)
    (tmp_path / "echo" / "config.toml").write_text(
        'platform = "echo"\nmax_batch_size = 8\n'
        'inputs = [{name = "x", datatype = "FP32", shape = [1]}]\n'
        'outputs = [{name = "x", datatype = "FP32", shape = [1]}]\n'
    )
    config = (tmp_path / "small" / "config.toml").read_text()
    (tmp_path / "small" / "config.toml").write_text(
        config + '[routing.cascade]\nthen = "echo"\nthreshold = -1.0\n'
    )
    service = Service(tmp_path)
    await service.start()
    try:
        row = next(r for r in service._repository.index() if r["name"] == "small")
    finally:
        await service.stop()
    assert row["state"] == "UNAVAILABLE"
    assert "routing.cascade.then" in row["reason"]
    assert "platform 'llm'" in row["reason"]
