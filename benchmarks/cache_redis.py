"""What the Redis cache backend costs: a hit, and a request while Redis is down or paused, with
the circuit breaker and without it (the counterfactual: every call pays the timeout).

    .venv/bin/python benchmarks/cache_redis.py [--timeout-ms 5] [--seconds 3]

Part 1 times `RedisStore.get` in process against a redis-server on a free loopback port.
Part 2 serves an echo model (0 ms compute) with `[cache] backend = redis://...` through
`fulcrum serve` and times v2 requests from a client: a hit, a miss, and requests while Redis is
killed. Needs `redis-server` on PATH (scripts/redis-server.sh).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from fulcrum.cache.breaker import CircuitBreaker
from fulcrum.cache.redis_store import RedisStore
from fulcrum.demo import free_port, serve

KEY = bytes(32)
VALUE = b"x" * 256  # about one small result, encoded
ECHO = """platform = "echo"
max_batch_size = 8
inputs = [{{name = "x", datatype = "FP32", shape = [4]}}]
outputs = [{{name = "y", datatype = "FP32", shape = [4]}}]
[dynamic_batching]
max_queue_delay_ms = 0
[cache]
backend = "{url}"
redis_timeout_ms = {timeout_ms}
"""


@contextmanager
def redis_server(port: int) -> Iterator[subprocess.Popen[bytes]]:
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server is not installed: bash scripts/redis-server.sh")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port)
        yield proc
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()


def wait_for_port(port: int) -> None:
    import socket

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.01)
    sys.exit(f"redis-server did not listen on {port}")


def percentiles_us(samples_s: list[float]) -> str:
    ordered = sorted(samples_s)
    p50 = ordered[len(ordered) // 2] * 1e6
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e6
    return f"p50 {p50:8.1f} µs  p99 {p99:8.1f} µs  max {ordered[-1] * 1e6:8.1f} µs"


async def paced(
    call: Callable[[], Awaitable[object]], seconds: float, every_s: float
) -> list[float]:
    """Time `call` once every `every_s` for `seconds` (a steady trickle of requests)."""
    samples = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        await call()
        samples.append(time.perf_counter() - start)
        await asyncio.sleep(max(0.0, every_s - samples[-1]))
    return samples


async def store_part(timeout_s: float, seconds: float) -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    with redis_server(port) as proc:
        store = RedisStore(url, timeout_s=timeout_s, namespace="bench")
        await store.set(KEY, VALUE, ttl_s=None)  # may miss its timeout while connecting
        await asyncio.sleep(0.5)  # past the breaker's first back-off
        await store.set(KEY, VALUE, ttl_s=None)
        hits = []
        num_missed = 0
        for _ in range(2000):
            start = time.perf_counter()
            found = await store.get(KEY)
            elapsed = time.perf_counter() - start
            if found == VALUE:
                hits.append(elapsed)
            else:
                num_missed += 1
                await asyncio.sleep(0.2)  # past the back-off: time hits, not skips
        print(
            f"store hit (GET, 256 B)           {percentiles_us(hits)}  "
            f"({num_missed} of 2000 missed their timeout or were skipped)"
        )
        for fault, sig in (("paused (SIGSTOP)", signal.SIGSTOP), ("killed", signal.SIGKILL)):
            proc.send_signal(sig)
            for label, breaker in (
                ("breaker", CircuitBreaker()),
                ("no breaker", CircuitBreaker(min_backoff_s=0.0, max_backoff_s=0.0)),
            ):
                faulty = RedisStore(url, timeout_s=timeout_s, namespace="bench", breaker=breaker)
                await faulty.get(KEY)  # the first failure opens the breaker

                async def miss(store: RedisStore = faulty) -> None:
                    assert await store.get(KEY) is None

                samples = await paced(miss, seconds, every_s=0.001)
                mean_us = statistics.fmean(samples) * 1e6
                print(
                    f"store get, Redis {fault:16s} {label:10s}: mean {mean_us:7.1f} µs  "
                    f"{percentiles_us(samples)}  ({faulty.link.num_errors} calls sent of "
                    f"{len(samples) + 1})"
                )
                await faulty.close()
        await store.close()


class Timed:
    """One request as the client saw it and as the server reported it (Server-Timing)."""

    def __init__(self, elapsed_s: float, status: str, server_timing: str) -> None:
        self.elapsed_s = elapsed_s
        self.status = status
        parts = dict(p.strip().split(";dur=") for p in server_timing.split(",") if ";dur=" in p)
        self.cache_s = float(parts.get("cache", "nan")) / 1e3
        self.server_s = sum(float(v) for v in parts.values()) / 1e3  # queue + compute + cache


async def timed_infer(client: httpx.AsyncClient, url: str, i: int) -> Timed:
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [i, i, i, i]}]}
    start = time.perf_counter()
    response = await client.post(f"{url}/v2/models/echo/infer", json=body)
    elapsed = time.perf_counter() - start
    assert response.status_code == 200, response.text
    status = response.headers.get("Fulcrum-Cache", "?")
    return Timed(elapsed, status, response.headers.get("Server-Timing", ""))


def report(label: str, rows: list[Timed]) -> None:
    statuses = Counter(r.status for r in rows)
    print(f"{label:28s} {len(rows):5d} requests {dict(sorted(statuses.items()))}")
    print(f"    client latency            {percentiles_us([r.elapsed_s for r in rows])}")
    print(f"    server time               {percentiles_us([r.server_s for r in rows])}")
    print(f"    of which cache (cache;dur) {percentiles_us([r.cache_s for r in rows])}")


async def fault_phase(
    client: httpx.AsyncClient, url: str, seconds: float, first: int
) -> list[Timed]:
    """Fresh rows (every one a miss) at a steady 500 requests/s while Redis is faulty."""
    rows: list[Timed] = []
    n = iter(range(first, first + 10_000_000))

    async def one() -> None:
        rows.append(await timed_infer(client, url, next(n)))

    await paced(one, seconds, every_s=0.002)
    return rows


async def server_part(timeout_ms: float, seconds: float, root: Path) -> None:
    redis_port = free_port()
    (root / "echo" / "1").mkdir(parents=True)
    config = ECHO.format(url=f"redis://127.0.0.1:{redis_port}/0", timeout_ms=timeout_ms)
    (root / "echo" / "config.toml").write_text(config)
    with redis_server(redis_port) as proc, serve(root, free_port(), log_path=root / "log") as url:
        async with httpx.AsyncClient() as client:
            for i in range(200):  # warm: connections, code paths
                await timed_infer(client, url, i)
            hits, misses = [], []
            for i in range(1000):
                misses.append(await timed_infer(client, url, 100_000 + i))  # new: a miss
                hits.append(await timed_infer(client, url, 100_000 + i))
            report("exact hit (Redis up)", hits)
            report("miss (Redis up)", misses)
            proc.send_signal(signal.SIGSTOP)
            report("miss (Redis paused)", await fault_phase(client, url, seconds, 200_000))
            proc.send_signal(signal.SIGCONT)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            report("miss (Redis killed)", await fault_phase(client, url, seconds, 300_000))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout-ms", type=float, default=5.0)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    asyncio.run(store_part(args.timeout_ms / 1000, args.seconds))
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(server_part(args.timeout_ms, args.seconds, Path(tmp)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
