"""The load generator's own ceiling: requests/s one process can issue, and the latency it adds.

A trivial HTTP endpoint (raw asyncio, fixed reply) runs in a separate process. Measured here:
closed-loop throughput at several concurrencies with the generator's CPU share, the highest
open-loop rate it keeps on schedule, and its latency at concurrency 1 against a bare socket
ping-pong (the floor: the same bytes with no generator around them).

    .venv/bin/python benchmarks/loadgen_ceiling.py [--duration 3]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import socket
import statistics
import subprocess
import sys
import time

import uvloop

from fulcrum.client import Endpoint, build_request
from fulcrum.loadgen.closed_loop import run_closed_loop
from fulcrum.loadgen.driver import PerfTimer
from fulcrum.loadgen.kserve import PreparedRequest, V2Target
from fulcrum.loadgen.open_loop import run_open_loop
from fulcrum.loadgen.results import PointResult, summarize_point
from fulcrum.loadgen.server_stats import ServerSplit
from fulcrum.loadgen.windows import MeasurePlan

REPLY = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: application/json\r\n\r\n{}"


class _Trivial(asyncio.Protocol):
    """Answers every request (headers only, no body) with the same bytes."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        num = self.buffer.count(b"\r\n\r\n")
        if num:
            self.buffer = self.buffer[self.buffer.rfind(b"\r\n\r\n") + 4 :]
            self.transport.write(REPLY * num)  # type: ignore[attr-defined]


def serve(port: int) -> None:
    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(_Trivial, "127.0.0.1", port)
        await server.serve_forever()

    uvloop.run(main())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_listening(port: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("trivial server did not start")


async def bare_ping_pong(port: int, duration_s: float) -> list[float]:
    """Round trips of the same request with nothing but a stream around the socket."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    raw = build_request(Endpoint("127.0.0.1", port), "GET", "/")
    latencies_s: list[float] = []
    end_s = time.perf_counter() + duration_s
    while time.perf_counter() < end_s:
        start_s = time.perf_counter()
        writer.write(raw)
        await reader.readexactly(len(REPLY))
        latencies_s.append(time.perf_counter() - start_s)
    writer.close()
    return latencies_s


def target(port: int) -> V2Target:
    endpoint = Endpoint("127.0.0.1", port)
    return V2Target(endpoint, [PreparedRequest(build_request(endpoint, "GET", "/"), 1)])


async def closed(port: int, concurrency: int, plan: MeasurePlan) -> PointResult:
    raw = await run_closed_loop(target(port), concurrency, plan, PerfTimer())
    return summarize_point("concurrency", concurrency, raw, [], ServerSplit())


async def opened(port: int, rate: float, plan: MeasurePlan) -> PointResult:
    raw = await run_open_loop(target(port), rate, plan, PerfTimer(), arrivals="constant")
    return summarize_point("rate", rate, raw, [], ServerSplit())


async def measure(port: int, duration_s: float) -> None:
    # Fixed-length points: the ceiling is read at a known duration, not at first stability.
    plan = MeasurePlan(warmup_s=0.5, window_s=duration_s, max_duration_s=duration_s)
    print(f"# loadgen ceiling  {time.strftime('%Y-%m-%d')}  {platform.machine()}, "
          f"{platform.python_version()}, uvloop")  # fmt: skip
    bare = await bare_ping_pong(port, duration_s)
    bare_p50_ms = statistics.median(bare) * 1000
    print(f"bare ping-pong c=1: {len(bare) / duration_s:9.0f} req/s  p50 {bare_p50_ms:.3f} ms")
    for concurrency in (1, 4, 16, 64):
        p = await closed(port, concurrency, plan)
        us_per_request = p.client_cpu / p.throughput_rps * 1e6 if p.throughput_rps else 0
        print(f"closed c={concurrency:<3}      {p.throughput_rps:9.0f} req/s  "
              f"p50 {p.latency.p50_ms:.3f} ms  p99 {p.latency.p99_ms:.3f} ms  "
              f"client cpu {p.client_cpu:4.0%}  {us_per_request:5.1f} us cpu/request")  # fmt: skip
        if concurrency == 1:
            added_ms = p.latency.p50_ms - bare_p50_ms
            ratio = p.throughput_rps * duration_s / len(bare)
            print(f"  latency added at c=1: p50 {added_ms * 1000:+.0f} us; "
                  f"generator/bare throughput {ratio:.2f}")  # fmt: skip
    for rate in (2000.0, 8000.0, 16000.0):
        p = await opened(port, rate, plan)
        print(f"open {rate:6.0f} rps    {p.throughput_rps:9.0f} req/s  "
              f"p50 {p.latency.p50_ms:.3f} ms  p99 {p.latency.p99_ms:.3f} ms  "
              f"late sends {p.num_behind:6d}  max lag {p.max_lag_ms:7.1f} ms  "
              f"client cpu {p.client_cpu:4.0%}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return 0
    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port)])
    try:
        wait_listening(port)
        uvloop.run(measure(port, args.duration))
    finally:
        server.terminate()
        server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
