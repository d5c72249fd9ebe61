"""The exact result cache on minilm (issue 12): what a hit costs against a miss, and throughput
with a workload that repeats 30% of its queries, cache on against cache off, in one run.

    .venv/bin/python benchmarks/cache_bench.py [--repository /tmp/cc_models] [--seconds 10]
        [--clients 16] [--repeat 0.3] [--samples 300] [--out /tmp/cache_bench.json]

The repository is `fulcrum examples`' (built in a temporary folder when not given). Two copies
of minilm share its files: `minilm` without a cache and `minilm_cached` with `[cache]`.

Part 1, server time, in process: one request at a time through what the server does besides
HTTP framing (decode the v2 body, `Service.infer`, encode the response), for a miss (a sentence
never seen) and an exact hit (a sentence answered before); p50 and p99 of --samples each.
Part 2, over HTTP, one `fulcrum serve` holding both copies: the same client-observed timing
for a miss and a hit, one request at a time; then a closed loop of --clients clients for
--seconds per round, rounds alternating off, on, off, on; each off/on pair sends the same query
sequence (a new one per pair, so no round primes the next), where each query repeats an earlier
one of its sequence with probability --repeat (else it is new).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from corpus import sentences

from fulcrum.context import internal_context
from fulcrum.demo import free_port, serve
from fulcrum.protocol import decode_infer_request, encode_infer_response
from fulcrum.service import Service, ServiceSettings

CACHED, PLAIN = "minilm_cached", "minilm"
CACHE_TABLE = "\n[cache]\nmax_bytes = 268435456\n"


def build_repository(source: Path | None, tmp: Path) -> Path:
    """Both copies of minilm; the version folder is linked, not copied (90 MB)."""
    if source is None:
        from fulcrum.examples import build_examples

        source = tmp / "examples"
        build_examples(source)
    repo = tmp / "repo"
    for name, extra in ((PLAIN, ""), (CACHED, CACHE_TABLE)):
        (repo / name).mkdir(parents=True)
        (repo / name / "1").symlink_to((source / "minilm" / "1").resolve())
        text = (source / "minilm" / "config.toml").read_text()
        (repo / name / "config.toml").write_text(text + extra)
    return repo


def v2_body(text: str) -> bytes:
    request = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1, 1], "data": [text]}]}
    return json.dumps(request).encode()


def percentiles(values_s: list[float]) -> dict[str, float]:
    ms = sorted(v * 1e3 for v in values_s)
    return {
        "n": len(ms),
        "p50_ms": round(statistics.median(ms), 4),
        "p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 4),
    }


async def server_time(repo: Path, samples: int) -> dict[str, dict[str, float]]:
    """Part 1: decode, infer and encode in process, a miss against a hit."""
    service = Service(repo, ServiceSettings(load_models=(CACHED,)))
    await service.start()
    try:
        texts = sentences(samples + 20, 16, seed=1)

        async def once(text: str) -> tuple[float, str]:
            start = time.perf_counter()
            request = decode_infer_request(v2_body(text), None)
            _, result = await service.infer(internal_context("v2"), CACHED, None, request)
            encode_infer_response(CACHED, "1", None, result.outputs, request.outputs, False)
            return time.perf_counter() - start, getattr(result, "cache", "none")

        for text in texts[samples:]:  # warm-up: first runs, allocator, caches
            await once(text)
        misses, hits = [], []
        for text in texts[:samples]:
            took_s, status = await once(text)
            assert status == "miss", status
            misses.append(took_s)
        for text in texts[:samples]:
            took_s, status = await once(text)
            assert status == "exact", status
            hits.append(took_s)
        return {"miss": percentiles(misses), "exact_hit": percentiles(hits)}
    finally:
        await service.stop()


def http_time(url: str, samples: int) -> dict[str, dict[str, float]]:
    """Part 2a: the client's view of one request at a time, a miss against a hit."""
    texts = sentences(samples, 16, seed=2)
    timings: dict[str, list[float]] = {"miss": [], "exact_hit": []}
    with httpx.Client(base_url=url, timeout=30) as client:
        for phase, expected in (("miss", "miss"), ("exact_hit", "exact")):
            for text in texts:
                start = time.perf_counter()
                response = client.post(f"/v2/models/{CACHED}/infer", content=v2_body(text))
                timings[phase].append(time.perf_counter() - start)
                assert response.headers["fulcrum-cache"] == expected, response.headers
    return {phase: percentiles(values) for phase, values in timings.items()}


def workload(num: int, repeat: float, seed: int) -> list[str]:
    """`num` queries; each repeats an earlier one with probability `repeat`, else is new."""
    rng = random.Random(seed)
    fresh = iter(sentences(num, 16, seed=seed + 100))
    queries: list[str] = []
    for _ in range(num):
        queries.append(rng.choice(queries) if queries and rng.random() < repeat else next(fresh))
    return queries


async def closed_loop(
    url: str, model: str, queries: list[str], clients: int, seconds: float
) -> dict[str, object]:
    """Part 2b: `clients` clients, each sending the next query when answered, for `seconds`."""
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    position = 0
    deadline = time.perf_counter() + seconds

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal position
        while time.perf_counter() < deadline and position < len(queries):
            text = queries[position]
            position += 1
            start = time.perf_counter()
            response = await client.post(f"/v2/models/{model}/infer", content=v2_body(text))
            latencies.append(time.perf_counter() - start)
            status = (
                response.headers.get("fulcrum-cache", "none")
                if response.is_success
                else (f"http {response.status_code}")
            )
            statuses[status] = statuses.get(status, 0) + 1

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
        elapsed_s = time.perf_counter() - start
    return {
        "model": model,
        "requests": len(latencies),
        "throughput_rps": round(len(latencies) / elapsed_s, 1),
        **percentiles(latencies),
        "statuses": statuses,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repository", type=Path, help="a `fulcrum examples` repository")
    p.add_argument("--seconds", type=float, default=10.0, help="per throughput round")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--repeat", type=float, default=0.3, help="share of queries repeated")
    p.add_argument("--samples", type=int, default=300, help="requests per timing")
    p.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cache_bench_") as tmp_name:
        tmp = Path(tmp_name)
        repo = build_repository(args.repository, tmp)
        figures: dict[str, object] = {"server_time": asyncio.run(server_time(repo, args.samples))}
        print("server time (in process):", json.dumps(figures["server_time"]), flush=True)
        with serve(repo, free_port(), log_path=tmp / "serve.log") as url:
            figures["http_time"] = http_time(url, args.samples)
            print("client time (HTTP):", json.dumps(figures["http_time"]), flush=True)
            rounds = []
            rates: dict[str, list[float]] = {PLAIN: [], CACHED: []}
            for i, model in enumerate((PLAIN, CACHED, PLAIN, CACHED)):
                # Each off/on pair sends one sequence, new to the cache (no round primes another).
                queries = workload(100_000, args.repeat, seed=10 + i // 2)
                result = asyncio.run(closed_loop(url, model, queries, args.clients, args.seconds))
                print("round:", json.dumps(result), flush=True)
                rounds.append(result)
                rates[model].append(float(str(result["throughput_rps"])))
            figures["throughput"] = rounds
    figures["speedup"] = round(statistics.mean(rates[CACHED]) / statistics.mean(rates[PLAIN]), 3)
    print(f"cache on / off throughput: {figures['speedup']}x")
    if args.out is not None:
        args.out.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
