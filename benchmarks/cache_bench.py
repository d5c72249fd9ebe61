"""The result cache on minilm (issue 12): what an exact and a semantic hit cost against a miss,
and throughput with a workload that repeats 30% of its queries, cache on against off, in one run.

    .venv/bin/python benchmarks/cache_bench.py [--repository /tmp/cc_models] [--seconds 10]
        [--clients 16] [--repeat 0.3] [--samples 300] [--out /tmp/cache_bench.json]

The repository is `fulcrum examples`' (built in a temporary folder when not given). Three copies
of minilm share its files: `minilm` without a cache, `minilm_cached` with `[cache]` and
`minilm_semantic` with `[cache] semantic = true` (rules verifier, calibrated threshold; it embeds
with `minilm`).

Part 1, server time, in process: one request at a time through what the server does besides
HTTP framing (decode the v2 body, `Service.infer`, encode the response), for a miss (a sentence
never seen) and an exact hit (a sentence answered before); p50 and p99 of --samples each. Then,
on `minilm_semantic`, in rounds of one tenant each (a new scope, so nothing of a round is found in
the next): misses (new sentences, which also push the earlier rounds' texts out of the tier's
memo of embeddings), then for each shipped pair of the kinds below, `a` (a miss) and then `b`:
a semantic hit for paraphrases that reorder clauses, a verifier rejection for near misses of
kinds "order" and "negation". Only requests whose outcome is the expected one are timed, and
the counts of every outcome are reported.
Part 2, over HTTP, one `fulcrum serve` holding the copies: the same client-observed timing
for a miss and an exact hit, one request at a time; then a closed loop of --clients clients for
--seconds per round, rounds alternating off, on, off, on; each off/on pair sends the same query
sequence (a new one per pair, so no round primes the next), where each query repeats an earlier
one of its sequence with probability --repeat (else it is new).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from corpus import sentences

from fulcrum.cache.calibration import Pair, load_pairs, shipped_pairs
from fulcrum.cache.semantic import _MEMO_TEXTS
from fulcrum.context import internal_context
from fulcrum.demo import free_port, serve
from fulcrum.protocol import decode_infer_request, encode_infer_response
from fulcrum.service import Service, ServiceSettings

CACHED, PLAIN, SEMANTIC = "minilm_cached", "minilm", "minilm_semantic"
CACHE_TABLE = "\n[cache]\nmax_bytes = 268435456\n"
SEMANTIC_TABLE = CACHE_TABLE + "semantic = true\n"
HIT_KINDS = ("paraphrase-reorder",)  # all 40 served at the shipped threshold (RESULTS.md)
REJECT_KINDS = ("order", "negation")  # above the threshold, but the verifier refuses them
# More new texts than the semantic tier memoizes embeddings of: after them, a text of an
# earlier round is embedded again, as it would be in a server that has not just seen it.
NUM_FLUSH = _MEMO_TEXTS + 16


def build_repository(source: Path | None, tmp: Path) -> Path:
    """The three copies of minilm; the version folder is linked, not copied (90 MB)."""
    if source is None:
        from fulcrum.examples import build_examples

        source = tmp / "examples"
        build_examples(source)
    repo = tmp / "repo"
    for name, extra in ((PLAIN, ""), (CACHED, CACHE_TABLE), (SEMANTIC, SEMANTIC_TABLE)):
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


async def timed_infer(
    service: Service, model: str, text: str, tenant: str = "default"
) -> tuple[float, str]:
    """Server time of one request (decode, infer, encode) and where its answer came from."""
    ctx = dataclasses.replace(internal_context("v2"), tenant=tenant)
    start = time.perf_counter()
    request = decode_infer_request(v2_body(text), None)
    _, result = await service.infer(ctx, model, None, request)
    encode_infer_response(model, "1", None, result.outputs, request.outputs, False)
    return time.perf_counter() - start, getattr(result, "cache", "none")


async def server_time(repo: Path, samples: int) -> dict[str, object]:
    """Part 1: decode, infer and encode in process, a miss against an exact and a semantic hit."""
    service = Service(repo, ServiceSettings(load_models=(CACHED, SEMANTIC, PLAIN)))
    await service.start()
    try:
        figures: dict[str, object] = dict(await exact_time(service, samples))
        figures.update(await semantic_time(service, samples))
        return figures
    finally:
        await service.stop()


async def exact_time(service: Service, samples: int) -> dict[str, dict[str, float]]:
    """A miss against an exact hit on `minilm_cached`."""
    texts = sentences(samples + 20, 16, seed=1)
    for text in texts[samples:]:  # warm-up: first runs, allocator, caches
        await timed_infer(service, CACHED, text)
    misses, hits = [], []
    for text in texts[:samples]:
        took_s, status = await timed_infer(service, CACHED, text)
        assert status == "miss", status
        misses.append(took_s)
    for text in texts[:samples]:
        took_s, status = await timed_infer(service, CACHED, text)
        assert status == "exact", status
        hits.append(took_s)
    return {"miss": percentiles(misses), "exact_hit": percentiles(hits)}


@dataclasses.dataclass
class SemanticTimings:
    """Server times by outcome on `minilm_semantic`, and how often each outcome happened."""

    times_s: dict[str, list[float]] = dataclasses.field(
        default_factory=lambda: {
            "semantic_miss": [],
            "semantic_miss_short": [],
            "semantic_hit": [],
            "verifier_rejection": [],
        }
    )
    counts: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    def count(self, group: str, outcome: str) -> None:
        outcomes = self.counts.setdefault(group, {})
        outcomes[outcome] = outcomes.get(outcome, 0) + 1


async def semantic_time(service: Service, samples: int) -> dict[str, object]:
    """Misses, semantic hits and verifier rejections on `minilm_semantic`, in rounds of one
    tenant each; enough rounds for about `samples` paraphrases."""
    cache = service.caches.model(SEMANTIC)
    assert cache is not None and cache.semantic is not None, "minilm_semantic has no semantic tier"
    pairs = load_pairs(shipped_pairs())
    paraphrases = [p for p in pairs if p.kind in HIT_KINDS]
    near_misses = [p for p in pairs if p.kind in REJECT_KINDS]
    num_rounds = max(1, math.ceil(samples / len(paraphrases)))
    fresh = iter(sentences((num_rounds + 1) * NUM_FLUSH, 16, seed=3))
    for _ in range(20):  # warm-up: the embedder's and the index's first runs
        await timed_infer(service, SEMANTIC, next(fresh), tenant="warm-up")
    timings = SemanticTimings()
    for i in range(num_rounds):
        tenant = f"round-{i}"
        for _ in range(NUM_FLUSH):
            took_s, status = await timed_infer(service, SEMANTIC, next(fresh), tenant)
            timings.count("new sentences", status)
            if status == "miss":
                timings.times_s["semantic_miss"].append(took_s)
        await ask_pairs(service, paraphrases, tenant, timings, rejections=False)
        await ask_pairs(service, near_misses, tenant, timings, rejections=True)
    served = sum(n.get("semantic", 0) for n in timings.counts.values())
    assert cache.stats.hits["semantic"] == served, (cache.stats.hits, timings.counts)
    figures: dict[str, object] = {
        name: percentiles(values) for name, values in timings.times_s.items() if values
    }
    figures["semantic_counts"] = timings.counts
    figures["semantic_rounds"] = num_rounds
    return figures


async def ask_pairs(
    service: Service,
    pairs: list[Pair],
    tenant: str,
    timings: SemanticTimings,
    *,
    rejections: bool,
) -> None:
    """Ask `a` (a miss, unless an earlier pair had the same `a`), then `b`. `b` is timed when it
    is what the pair was chosen for: a semantic hit, or a miss the verifier refused."""
    cache = service.caches.model(SEMANTIC)
    assert cache is not None
    group = "near misses (b)" if rejections else "paraphrases (b)"
    for pair in pairs:
        took_s, status = await timed_infer(service, SEMANTIC, pair.a, tenant)
        timings.count("pair a", status)
        if status == "miss":
            timings.times_s["semantic_miss_short"].append(took_s)
        refused_before = sum(cache.stats.rejections.values())
        took_s, status = await timed_infer(service, SEMANTIC, pair.b, tenant)
        refused = sum(cache.stats.rejections.values()) > refused_before
        outcome = status if status != "miss" else "rejected" if refused else "below threshold"
        timings.count(group, outcome)
        if (outcome == "rejected") if rejections else (outcome == "semantic"):
            timings.times_s["verifier_rejection" if rejections else "semantic_hit"].append(took_s)


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
