"""The result cache as served, both APIs: the `Fulcrum-Cache` header, hits that survive a new
request id, no answer across tenants, new loads not served old entries, large values not
cached, identical concurrent misses computed once, statistics and metrics; for generations,
greedy or seeded requests hit (a streamed hit streams like a live answer), sampled ones never."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from fulcrum.llm.examples import build_tiny_gpt2
from fulcrum.server.app import create_app
from fulcrum.service import Service

if TYPE_CHECKING:
    from redis_fixture import RedisServer

ECHO = """platform = "echo"
max_batch_size = 8
[[inputs]]
name = "x"
datatype = "FP32"
shape = [-1]
[[outputs]]
name = "x"
datatype = "FP32"
shape = [-1]
[parameters]
latency_a_ms = {latency_ms}
"""
CACHE = "[cache]\nmax_bytes = {max_bytes}\n"
TINY_LLM = """platform = "llm"
[parameters]
num_kv_blocks = 32
block_size = 4
max_model_len = 64
[cache]
"""


def write_echo(
    root: Path, name: str, *, latency_ms: int = 0, max_bytes: int | None = 1 << 20
) -> None:
    (root / name / "1").mkdir(parents=True, exist_ok=True)
    text = ECHO.format(latency_ms=latency_ms)
    if max_bytes is not None:
        text += CACHE.format(max_bytes=max_bytes)
    (root / name / "config.toml").write_text(text)


@pytest.fixture(scope="module")
def llm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root: Path = tmp_path_factory.mktemp("cache_llm")
    build_tiny_gpt2(root, name="tiny")
    (root / "tiny" / "config.toml").write_text(TINY_LLM)
    return root / "tiny"


@pytest.fixture
def repo(tmp_path: Path, llm_dir: Path) -> Path:
    write_echo(tmp_path, "echo")
    write_echo(tmp_path, "plain", max_bytes=None)
    write_echo(tmp_path, "slow", latency_ms=200)
    write_echo(tmp_path, "small", max_bytes=8192)  # values over 1 KiB are not cached
    (tmp_path / "tiny").symlink_to(llm_dir, target_is_directory=True)
    return tmp_path


@pytest.fixture
async def client(service: Service) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(service, manage_lifespan=False, admin_open=True)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


def body(*values: float) -> dict[str, object]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, len(values)],
                        "data": list(values)}]}  # fmt: skip


async def infer(
    client: httpx.AsyncClient, model: str, payload: dict[str, object], **headers: str
) -> httpx.Response:
    response = await client.post(f"/v2/models/{model}/infer", json=payload, headers=headers)
    assert response.status_code == 200, response.text
    return response


async def test_a_repeat_is_an_exact_hit_even_with_another_request_id(
    client: httpx.AsyncClient,
) -> None:
    first = await infer(client, "echo", {"id": "a", **body(1, 2)}, **{"X-Request-Id": "r1"})
    second = await infer(client, "echo", {"id": "b", **body(1, 2)}, **{"X-Request-Id": "r2"})
    assert first.headers["fulcrum-cache"] == "miss"
    assert second.headers["fulcrum-cache"] == "exact"
    assert second.json()["outputs"] == first.json()["outputs"]
    assert second.json()["id"] == "b" and second.headers["x-request-id"] == "r2"
    assert "cache;dur=" in second.headers["server-timing"]
    other = await infer(client, "echo", body(1, 3))
    assert other.headers["fulcrum-cache"] == "miss"


async def test_a_model_without_a_cache_has_no_header(client: httpx.AsyncClient) -> None:
    for _ in range(2):
        response = await infer(client, "plain", body(1))
        assert "fulcrum-cache" not in response.headers


async def test_a_result_is_never_served_to_another_tenant(client: httpx.AsyncClient) -> None:
    assert (await infer(client, "echo", body(4), **{"X-Fulcrum-Tenant": "acme"})).headers[
        "fulcrum-cache"
    ] == "miss"
    for headers in ({"X-Fulcrum-Tenant": "globex"}, {"Authorization": "Bearer sk-other"}, {}):
        response = await infer(client, "echo", body(4), **headers)
        assert response.headers["fulcrum-cache"] == "miss", headers
    again = await infer(client, "echo", body(4), **{"X-Fulcrum-Tenant": "acme"})
    assert again.headers["fulcrum-cache"] == "exact"


async def test_request_parameters_are_part_of_the_key(client: httpx.AsyncClient) -> None:
    await infer(client, "echo", body(5))
    tagged = await infer(client, "echo", {**body(5), "parameters": {"flavour": "x"}})
    assert tagged.headers["fulcrum-cache"] == "miss"
    timed = await infer(client, "echo", {**body(5), "parameters": {"timeout": 5_000_000}})
    assert timed.headers["fulcrum-cache"] == "exact"  # how long to wait is not what to answer


async def test_a_value_over_an_eighth_of_the_budget_is_not_cached(
    client: httpx.AsyncClient, service: Service
) -> None:
    large = body(*range(300))  # 1200 bytes of output > 8192 / 8
    for _ in range(2):
        assert (await infer(client, "small", large)).headers["fulcrum-cache"] == "miss"
    await infer(client, "small", body(1))
    assert (await infer(client, "small", body(1))).headers["fulcrum-cache"] == "exact"
    cache = service.caches.model("small")
    assert cache is not None and cache.stats.not_stored["too_large"] == 2


async def test_identical_concurrent_misses_run_once(
    client: httpx.AsyncClient, service: Service
) -> None:
    answers = await asyncio.gather(*(infer(client, "slow", body(7)) for _ in range(4)))
    assert [a.headers["fulcrum-cache"] for a in answers] == ["miss"] * 4
    stats = (await client.get("/v2/models/slow/stats")).json()["model_stats"][0]
    assert stats["execution_count"] == 1
    assert stats["cache"]["coalesced"] == 3


async def test_statistics_and_metrics_report_the_cache(client: httpx.AsyncClient) -> None:
    await infer(client, "echo", body(9))
    await infer(client, "echo", body(9))
    await infer(client, "echo", body(9))
    # A batch is counted in the loop turn after its callers are answered (off their path); the
    # in-process transport ran the two hits and reaches the statistics without one in between.
    await asyncio.sleep(0)
    row = (await client.get("/v2/models/echo/stats")).json()["model_stats"][0]
    assert row["inference_stats"]["cache_hit"]["count"] == 2
    assert row["inference_stats"]["cache_miss"]["count"] == 1
    assert row["inference_stats"]["success"]["count"] == 3  # hits are successes, as in Triton
    assert row["execution_count"] == 1
    assert row["cache"]["tiers"]["exact"]["hits"] == 2 and row["cache"]["misses"] == 1
    assert row["cache"]["tiers"]["exact"]["entries"] == 1
    text = (await client.get("/metrics")).text
    assert 'fulcrum_cache_hits_total{model="echo",tier="exact"} 2.0' in text
    assert 'fulcrum_cache_misses_total{model="echo"} 1.0' in text
    assert 'fulcrum_cache_entries{model="echo",tier="exact"} 1.0' in text


async def test_a_reload_with_other_files_is_not_served_old_entries(
    client: httpx.AsyncClient, service: Service, repo: Path
) -> None:
    await infer(client, "echo", body(6))
    assert (await infer(client, "echo", body(6))).headers["fulcrum-cache"] == "exact"
    (repo / "echo" / "1" / "weights.bin").write_bytes(b"new weights")
    assert (await client.post("/v2/repository/models/echo/load", json={})).status_code == 200
    assert (await infer(client, "echo", body(6))).headers["fulcrum-cache"] == "miss"
    (repo / "echo" / "2").mkdir()
    text = (repo / "echo" / "config.toml").read_text()
    (repo / "echo" / "config.toml").write_text(text)
    assert (await client.post("/v2/repository/models/echo/load", json={})).status_code == 200
    response = await infer(client, "echo", body(6))
    assert response.json()["model_version"] == "2"
    assert response.headers["fulcrum-cache"] == "miss"  # a new version: new keys


async def test_an_unloaded_models_cache_is_dropped(
    client: httpx.AsyncClient, service: Service
) -> None:
    await infer(client, "echo", body(8))
    cache = service.caches.model("echo")
    assert cache is not None and cache.exact.store.stats().entries == 1
    assert (await client.post("/v2/repository/models/echo/unload", json={})).status_code == 200
    assert service.caches.model("echo") is None
    assert cache.exact.store.stats().entries == 0


GREEDY = {"model": "tiny", "prompt": "Hello there", "max_tokens": 6, "temperature": 0}


async def complete(client: httpx.AsyncClient, request: dict[str, object]) -> httpx.Response:
    response = await client.post("/v1/completions", json=request)
    assert response.status_code == 200, response.text
    return response


async def test_a_greedy_completion_hits_with_the_same_text_and_usage(
    client: httpx.AsyncClient,
) -> None:
    first = await complete(client, GREEDY)
    second = await complete(client, GREEDY)
    assert first.headers["fulcrum-cache"] == "miss"
    assert second.headers["fulcrum-cache"] == "exact"
    a, b = first.json(), second.json()
    assert b["choices"][0]["text"] == a["choices"][0]["text"]
    assert b["choices"][0]["finish_reason"] == a["choices"][0]["finish_reason"]
    assert b["usage"]["prompt_tokens"] == a["usage"]["prompt_tokens"]
    assert b["usage"]["completion_tokens"] == a["usage"]["completion_tokens"]
    other_tenant = await client.post(
        "/v1/completions", json=GREEDY, headers={"X-Fulcrum-Tenant": "globex"}
    )
    assert other_tenant.headers["fulcrum-cache"] == "miss"


def chunks(response: httpx.Response) -> list[dict[str, object]]:
    lines = [line[6:] for line in response.text.split("\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def shape(events: list[dict[str, object]]) -> list[tuple[object, object]]:
    """What a client sees of a stream, minus ids and timestamps."""
    out: list[tuple[object, object]] = []
    for event in events:
        choices = event["choices"]
        assert isinstance(choices, list)
        out.append(
            (
                [(c.get("text"), c.get("finish_reason")) for c in choices],
                event.get("usage"),
            )
        )
    return out


async def test_a_streamed_hit_streams_like_the_live_answer(client: httpx.AsyncClient) -> None:
    request = {**GREEDY, "prompt": "Once upon", "stream": True,
               "stream_options": {"include_usage": True}}  # fmt: skip
    live = await complete(client, request)
    hit = await complete(client, request)
    assert live.headers["fulcrum-cache"] == "miss" and hit.headers["fulcrum-cache"] == "exact"
    assert hit.headers["content-type"].startswith("text/event-stream")
    live_events, hit_events = chunks(live), chunks(hit)
    assert len(live_events) > 2
    live_usage = live_events[-1]["usage"]
    hit_usage = hit_events[-1]["usage"]
    assert isinstance(live_usage, dict) and isinstance(hit_usage, dict)
    assert hit_usage["completion_tokens"] == live_usage["completion_tokens"]
    assert shape(hit_events[:-1]) == shape(live_events[:-1])


async def test_sampled_completions_are_never_cached_but_seeded_ones_are(
    client: httpx.AsyncClient,
) -> None:
    sampled = {**GREEDY, "temperature": 1.0}
    for _ in range(2):
        assert (await complete(client, sampled)).headers["fulcrum-cache"] == "miss"
    seeded = {**sampled, "seed": 42}
    first = await complete(client, seeded)
    second = await complete(client, seeded)
    assert (first.headers["fulcrum-cache"], second.headers["fulcrum-cache"]) == ("miss", "exact")
    assert second.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]


async def test_a_greedy_chat_hits(client: httpx.AsyncClient) -> None:
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "temperature": 0}  # fmt: skip
    first = await client.post("/v1/chat/completions", json=chat)
    second = await client.post("/v1/chat/completions", json=chat)
    assert first.status_code == 200, first.text
    assert (first.headers["fulcrum-cache"], second.headers["fulcrum-cache"]) == ("miss", "exact")
    a, b = first.json()["choices"][0], second.json()["choices"][0]
    assert b["message"] == a["message"]


SEMANTIC = '\n[cache]\nsemantic = true\nsemantic_embedder = "minilm"\n'


@pytest.fixture
async def semantic_client(example_repo: Path, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    """minilm twice on the same files: `minilm` plain (the embedder), `faq` with both tiers."""
    for name, extra in (("minilm", ""), ("faq", SEMANTIC)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "1").symlink_to(example_repo / "minilm" / "1", target_is_directory=True)
        text = (example_repo / "minilm" / "config.toml").read_text()
        (tmp_path / name / "config.toml").write_text(text + extra)
    svc = Service(tmp_path)
    await svc.start()
    app = create_app(svc, manage_lifespan=False)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        yield c
    await svc.stop()


def text_body(text: str) -> dict[str, object]:
    return {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1, 1], "data": [text]}]}


async def test_a_paraphrase_is_a_semantic_hit_and_a_swapped_role_is_not(
    semantic_client: httpx.AsyncClient,
) -> None:
    first = await infer(semantic_client, "faq", text_body("How do I reset my password?"))
    assert first.headers["fulcrum-cache"] == "miss"
    para = await infer(semantic_client, "faq", text_body("How can I reset my password?"))
    assert para.headers["fulcrum-cache"] == "semantic"
    assert para.json()["outputs"] == first.json()["outputs"]
    await infer(semantic_client, "faq", text_body("convert 100 USD to EUR"))
    swapped = await infer(semantic_client, "faq", text_body("convert 100 EUR to USD"))
    assert swapped.headers["fulcrum-cache"] == "miss"
    other_tenant = await infer(
        semantic_client, "faq", text_body("How can I reset my password?"),
        **{"X-Fulcrum-Tenant": "globex"},
    )  # fmt: skip
    assert other_tenant.headers["fulcrum-cache"] == "miss"
    row = (await semantic_client.get("/v2/models/faq/stats")).json()["model_stats"][0]
    assert row["cache"]["tiers"]["semantic"]["hits"] == 1
    assert sum(row["cache"]["tiers"]["semantic"]["rejections"].values()) >= 1


async def test_replicas_share_hits_through_redis_and_survive_it_going_away(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    write_echo(tmp_path, "echo", max_bytes=None)
    config = tmp_path / "echo" / "config.toml"
    config.write_text(config.read_text() + f'[cache]\nbackend = "{redis_server.url}"\n'
                      "redis_timeout_ms = 50\n")  # fmt: skip
    replicas = [Service(tmp_path), Service(tmp_path)]
    for svc in replicas:
        await svc.start()
    try:
        clients = [
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=create_app(s, manage_lifespan=False)),
                base_url="http://t",
            )
            for s in replicas
        ]
        one, two = clients
        assert (await infer(one, "echo", body(3))).headers["fulcrum-cache"] == "miss"
        assert (await infer(two, "echo", body(3))).headers["fulcrum-cache"] == "exact"
        redis_server.kill()
        for client in clients:  # Redis gone: misses, never failures
            assert (await infer(client, "echo", body(3))).headers["fulcrum-cache"] == "miss"
        for client in clients:
            await client.aclose()
    finally:
        for svc in replicas:
            await svc.stop()
