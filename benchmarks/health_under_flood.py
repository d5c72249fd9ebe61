"""Health probes under a flood: how long GET /v2/health/live and /ready take while minilm is
saturated by many keep-alive clients, against the same probes on an idle server.

    .venv/bin/python benchmarks/health_under_flood.py [--runs 3] [--concurrency 192]
        [--seconds 15] [--src src] [--set parameters.intra_op_threads=1]

Each run starts `fulcrum serve --model minilm` on a free 127.0.0.1 port (with --src first on its
PYTHONPATH, so one script measures two trees), probes it idle, then probes it while a closed loop
of `--concurrency` connections sends one short sentence each. The flood runs in this process; the
prober is its own process with its own connection, so its timings never wait on the flood's loop.
The server is stopped (SIGTERM, then SIGKILL) at the end of every run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection as Pipe
from multiprocessing.process import BaseProcess
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from corpus import sentences
from serving_efficiency import apply_overrides

from fulcrum.client import Connection, Endpoint, build_request
from fulcrum.demo import free_port, wait_ready
from fulcrum.examples import build_examples
from fulcrum.protocol import RequestedOutput, encode_infer_request

PATHS = ("/v2/health/live", "/v2/health/ready")


def probe(port: int, rate_hz: float, seconds: float, out: Pipe) -> None:
    """Child process: GET live and ready in turn at `rate_hz` on one keep-alive connection;
    sends back {path: [latency_s, ...]} and the number of non-200 answers."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    latencies: dict[str, list[float]] = {p: [] for p in PATHS}
    bad = 0
    start = time.perf_counter()
    for i in range(int(seconds * rate_hz)):
        # an absolute schedule: a slow answer does not push the later probes back
        delay = start + i / rate_hz - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        path = PATHS[i % 2]
        t0 = time.perf_counter()
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        latencies[path].append(time.perf_counter() - t0)
        bad += response.status != 200
    conn.close()
    out.send((latencies, bad))


def probed(port: int, rate_hz: float, seconds: float) -> tuple[BaseProcess, Pipe]:
    ours, theirs = mp.Pipe(duplex=False)
    proc = mp.get_context("spawn").Process(target=probe, args=(port, rate_hz, seconds, theirs))
    proc.start()
    return proc, ours


async def flood(url: str, concurrency: int, until: float) -> tuple[int, int]:
    """(answers 200, other answers) of a closed loop of `concurrency` connections."""
    endpoint = Endpoint.from_url(url)
    requests = []
    for text in sentences(512, 8, seed=1):
        body, headers = encode_infer_request(
            {"text": np.array([[text.encode()]], dtype=object)},
            binary=True,
            outputs=(RequestedOutput("embedding", True),),
        )
        requests.append(build_request(endpoint, "POST", "/v2/models/minilm/infer",
                                      headers=headers, body=body))  # fmt: skip
    ok = bad = 0

    async def worker(k: int) -> None:
        nonlocal ok, bad
        connection = Connection(endpoint)
        i = k
        while time.perf_counter() < until:
            response = await connection.request(requests[i % len(requests)], timeout_s=60)
            i += concurrency
            if response.status == 200:
                ok += 1
            else:
                bad += 1
        connection.close()

    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return ok, bad


@contextlib.contextmanager
def serving(
    repo: Path,
    src: Path,
    log_path: Path,
    model: str = "minilm",
    extra: Sequence[str] = (),
    launcher: Sequence[str] = ("-m", "fulcrum.cli"),
) -> Iterator[tuple[str, int]]:
    """`fulcrum serve` of one model of repo (the code under src) on a free loopback port;
    `extra`: more `fulcrum serve` flags (e.g. --compute-nice 5); `launcher`: the interpreter
    arguments that run the CLI (a wrapper script that records something around it)."""
    port = free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(src), env.get("PYTHONPATH", "")) if p)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, *launcher, "serve", "--repository", str(repo),
             "--model", model, "--host", "127.0.0.1", "--port", str(port), *extra],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, proc, timeout_s=180)
            print(f"  server pid {proc.pid} on {url}", flush=True)
            yield url, port
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def summary(latencies: dict[str, list[float]]) -> dict[str, float]:
    both = sorted(x * 1e3 for values in latencies.values() for x in values)
    p99 = both[min(len(both) - 1, int(0.99 * len(both)))]
    return {"n": len(both), "p50": statistics.median(both), "p99": p99, "max": both[-1]}


def one_run(repo: Path, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    with serving(repo, args.src.resolve(), repo / "server.log") as (url, port):
        proc, pipe = probed(port, args.rate, args.seconds)
        latencies, bad = pipe.recv()
        proc.join()
        out["idle"] = {**summary(latencies), "non200": bad}
        flood_s = args.warmup + args.seconds + 2.0  # outlasts the prober's start and its run
        until = time.perf_counter() + flood_s
        import uvloop

        async def flooded() -> tuple[int, int, dict[str, list[float]], int]:
            task = asyncio.ensure_future(flood(url, args.concurrency, until))
            await asyncio.sleep(args.warmup)
            proc, pipe = probed(port, args.rate, args.seconds)
            # the prober's answer arrives on a pipe: wait for it off the flood's loop
            latencies, bad = await asyncio.to_thread(pipe.recv)
            ok, errors = await task
            proc.join()
            return round(ok / flood_s), errors, latencies, bad

        rate, errors, latencies, bad = uvloop.run(flooded())
        out["flood"] = {**summary(latencies), "non200": bad, "req_s": rate, "errors": errors}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=192)
    parser.add_argument("--seconds", type=float, default=15.0, help="probing time per phase")
    parser.add_argument("--rate", type=float, default=20.0, help="probes per second")
    parser.add_argument("--warmup", type=float, default=3.0, help="flood before probing")
    parser.add_argument("--src", type=Path, default=Path(__file__).parent.parent / "src",
                        help="source tree put first on the server's PYTHONPATH")  # fmt: skip
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override minilm's config.toml, e.g. --set parameters.intra_op_threads=1",
    )  # fmt: skip
    args = parser.parse_args()
    print(f"server from {args.src.resolve()} {args.set}; {args.concurrency} flood connections; "
          f"{args.rate:g} probes/s for {args.seconds:g} s; load {os.getloadavg()}")  # fmt: skip
    print("| run | phase | probes | P50 ms | P99 ms | max ms | non-200 | flood req/s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        build_examples(repo)
        apply_overrides(repo / "minilm" / "config.toml", args.set)
        for run in range(1, args.runs + 1):
            for phase, s in one_run(repo, args).items():
                rate = f"{s['req_s']:.0f} ({s['errors']:.0f} errors)" if "req_s" in s else "-"
                print(f"| {run} | {phase} | {s['n']:.0f} | {s['p50']:.1f} | {s['p99']:.1f} | "
                      f"{s['max']:.1f} | {s['non200']:.0f} | {rate} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
