"""Two `fulcrum serve` processes sharing one real redis-server as their exact cache: a result
computed by one is a hit on the other, and Redis killed and restarted under load fails no
request, with hits resuming once it is back."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fulcrum.demo import serve
from redis_fixture import RedisServer, free_port, redis_server_binary

pytestmark = pytest.mark.e2e

ECHO = """platform = "echo"
max_batch_size = 8
inputs = [{{name = "x", datatype = "FP32", shape = [4]}}]
outputs = [{{name = "y", datatype = "FP32", shape = [4]}}]
parameters = {{latency_a_ms = 2.0}}
[dynamic_batching]
max_queue_delay_ms = 1
[cache]
backend = "{url}"
redis_timeout_ms = 500.0
"""
# A wide Redis timeout: a busy CI machine must not turn a shared hit into a miss. The faults
# below are a killed Redis (refused at once); a paused one is tests/unit/test_redis_store.py's.
NUM_WORKERS = 8
NUM_DISTINCT = 40  # the load repeats these rows, so most requests are hits while Redis is up
REQUESTS_PER_PHASE = 300
# How long hits may take to resume after the restart: the breaker's longest back-off (2 s)
# plus a probe, with a wide margin for a busy machine. A bound on a wait, not a speed claim.
RESUME_BOUND_S = 30.0


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    log = tmp_path_factory.mktemp("redis") / "redis.log"
    server = RedisServer(redis_server_binary(), free_port(), log)
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="module")
def servers(redis: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    repo = tmp_path_factory.mktemp("repo")
    (repo / "echo" / "1").mkdir(parents=True)
    (repo / "echo" / "config.toml").write_text(ECHO.format(url=redis.url))
    logs = tmp_path_factory.mktemp("logs")
    with contextlib.ExitStack() as stack:
        urls = []
        for name in ("a", "b"):
            log_path = logs / f"{name}.log"
            try:
                urls.append(stack.enter_context(serve(repo, free_port(), log_path=log_path)))
            except RuntimeError:
                print(log_path.read_text())
                raise
        yield urls


def body(i: int) -> dict[str, object]:
    row = [float(i), i + 0.25, i + 0.5, i + 0.75]
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": row}]}


async def infer(client: httpx.AsyncClient, url: str, i: int) -> httpx.Response:
    return await client.post(f"{url}/v2/models/echo/infer", json=body(i), timeout=30)


async def test_a_result_computed_by_one_server_is_a_hit_on_the_other(servers: list[str]) -> None:
    a, b = servers
    async with httpx.AsyncClient() as client:
        for url in servers:  # each server's first Redis call also opens its connection
            assert (await infer(client, url, -1)).status_code == 200
        first = await infer(client, a, 1_000)
        assert first.status_code == 200, first.text
        assert first.headers["Fulcrum-Cache"] == "miss"
        second = await infer(client, b, 1_000)
        assert second.status_code == 200, second.text
        assert second.headers["Fulcrum-Cache"] == "exact"
        assert second.json()["outputs"] == first.json()["outputs"]


class Load:
    """Workers that send the repeated rows to both servers, alternately, recording every
    response's status and cache header, until told to stop."""

    def __init__(self, client: httpx.AsyncClient, urls: list[str]) -> None:
        self.client = client
        self.urls = urls
        self.results: list[tuple[int, str]] = []
        self.stop = asyncio.Event()
        self._wanted = 0
        self._reached = asyncio.Event()

    async def worker(self, w: int) -> None:
        n = 0
        while not self.stop.is_set():
            i = (w * 7 + n) % NUM_DISTINCT
            response = await infer(self.client, self.urls[n % 2], i)
            self.results.append((response.status_code, response.headers.get("Fulcrum-Cache", "")))
            n += 1
            if len(self.results) >= self._wanted:
                self._reached.set()

    async def until(self, num_more: int) -> list[tuple[int, str]]:
        """Wait for `num_more` responses more; return them."""
        start = len(self.results)
        self._wanted = start + num_more
        self._reached.clear()
        await self._reached.wait()
        return self.results[start:]


async def test_redis_killed_mid_run_fails_no_request_and_hits_resume(
    redis: RedisServer, servers: list[str]
) -> None:
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=NUM_WORKERS * 2)) as client:
        load = Load(client, servers)
        workers = [asyncio.create_task(load.worker(w)) for w in range(NUM_WORKERS)]
        try:
            before = await load.until(REQUESTS_PER_PHASE)
            redis.kill()
            during = await load.until(REQUESTS_PER_PHASE)
            redis.start()  # same port, empty
            after = await load.until(REQUESTS_PER_PHASE)
        finally:
            load.stop.set()
            await asyncio.gather(*workers)
        assert [s for s, _ in load.results if s != 200] == []
        assert "exact" in {c for _, c in before}
        assert {c for _, c in during} <= {"exact", "miss"}  # in-flight hits finish; no error
        assert {c for _, c in during[-NUM_WORKERS:]} == {"miss"}  # Redis down: misses
        assert {c for _, c in after} <= {"exact", "miss"}

        # Hits resume: a row computed on one server is a hit on the other (through Redis).
        deadline = time.monotonic() + RESUME_BOUND_S
        i = 10_000
        while True:
            assert (await infer(client, servers[0], i)).status_code == 200
            shared = await infer(client, servers[1], i)
            assert shared.status_code == 200
            if shared.headers["Fulcrum-Cache"] == "exact":
                break
            assert time.monotonic() < deadline, "no shared hit after Redis came back"
            i += 1


def test_a_missing_redis_server_fails_with_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no redis-server on it
    with pytest.raises(pytest.fail.Exception, match=r"scripts/redis-server\.sh"):
        redis_server_binary()
