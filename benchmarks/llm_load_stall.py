"""What loading an LLM does to the P99 of steady v2 traffic on another model.

    .venv/bin/python benchmarks/llm_load_stall.py [--src src] [--python .venv/bin/python]
        [--rate 40] [--repeats 3] [--baseline 8] [--tail 1]

Serves `minilm` from the example repository with `fulcrum serve` (a child process on a free
127.0.0.1 port, run by --python with --src first on PYTHONPATH, so the same script measures an
older checkout), sends it one short sentence per request open loop at --rate requests/s, and per
repeat: a baseline window, then `POST /v2/repository/models/tiny-llama/load` while the traffic
goes on (the load window runs from the load call to --tail seconds after it answers), then unload
(its duration and the worst latency until --settle seconds after it are shown too). Latency counts
from each request's scheduled send time, so a stalled server shows in full. The first load in a
server process also imports torch and the engine, so it is summarised apart from the reloads.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from fulcrum.demo import wait_ready

BODY = (
    b'{"inputs":[{"name":"text","shape":[1,1],"datatype":"BYTES",'
    b'"data":["The quick brown fox jumps over the lazy dog today."]}]}'
)
LLM_MODEL = "tiny-llama"
REQUEST_TIMEOUT_S = 60.0
# A request sent just before the load call is still in the server when the load starts: the
# baseline window ends this long before the load, so it never counts the load's own stall.
GUARD_S = 0.5
LOAD_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class Sample:
    sent_s: float  # scheduled send time, perf_counter seconds
    latency_ms: float
    ok: bool


@dataclass(frozen=True, slots=True)
class Window:
    start_s: float
    end_s: float

    def latencies_ms(self, samples: list[Sample]) -> list[float]:
        return sorted(s.latency_ms for s in samples if self.start_s <= s.sent_s < self.end_s)


@dataclass(frozen=True, slots=True)
class Repeat:
    load_s: float
    unload_s: float
    baseline: Window
    during: Window
    after_unload: Window


class OpenLoop:
    """Sends BODY at a constant rate until stopped, whatever the server's answers take."""

    def __init__(self, client: httpx.AsyncClient, url: str, rate: float) -> None:
        self.client, self.url, self.period_s = client, url, 1.0 / rate
        self.samples: list[Sample] = []
        self.errors: list[str] = []
        self._stop = asyncio.Event()
        self._inflight: set[asyncio.Task[None]] = set()

    async def run(self, max_duration_s: float) -> None:
        start = time.perf_counter()
        for i in range(int(max_duration_s / self.period_s)):
            due = start + i * self.period_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), max(0.0, due - time.perf_counter()))
            if self._stop.is_set():
                break
            task = asyncio.create_task(self._one(due))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)
        if self._inflight:
            await asyncio.wait(self._inflight, timeout=REQUEST_TIMEOUT_S + 5)

    def stop(self) -> None:
        self._stop.set()

    async def _one(self, due: float) -> None:
        headers = {"content-type": "application/json"}
        try:
            response = await self.client.post(self.url, content=BODY, headers=headers)
            ok = response.status_code == 200
            if not ok:
                self.errors.append(f"HTTP {response.status_code}: {response.text[:200]}")
        except httpx.HTTPError as exc:
            ok = False
            self.errors.append(repr(exc))
        self.samples.append(Sample(due, (time.perf_counter() - due) * 1e3, ok))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(src: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(src), env.get("PYTHONPATH", "")) if p)
    return env


def percentile(sorted_ms: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    if not sorted_ms:
        return float("nan")
    rank = max(1, -(-len(sorted_ms) * q // 100))
    return sorted_ms[int(rank) - 1]


async def measure(base: str, args: argparse.Namespace) -> tuple[list[Repeat], OpenLoop]:
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    async with httpx.AsyncClient(limits=limits, timeout=REQUEST_TIMEOUT_S) as client:
        traffic = OpenLoop(client, f"{base}/v2/models/minilm/infer", args.rate)
        budget_s = args.warmup + args.repeats * (args.baseline + args.tail + 5 + LOAD_TIMEOUT_S)
        sender = asyncio.create_task(traffic.run(budget_s))
        repeats: list[Repeat] = []
        try:
            await asyncio.sleep(args.warmup)
            for _ in range(args.repeats):
                repeats.append(await one_repeat(client, base, args))
        finally:
            traffic.stop()
            await sender
    return repeats, traffic


async def one_repeat(client: httpx.AsyncClient, base: str, args: argparse.Namespace) -> Repeat:
    baseline_start = time.perf_counter()
    await asyncio.sleep(args.baseline)
    load_start = time.perf_counter()
    response = await client.post(
        f"{base}/v2/repository/models/{LLM_MODEL}/load", json={}, timeout=LOAD_TIMEOUT_S
    )
    load_end = time.perf_counter()
    if response.status_code != 200:
        raise RuntimeError(f"load answered {response.status_code}: {response.text[:300]}")
    await asyncio.sleep(args.tail)
    unload_start = time.perf_counter()
    response = await client.post(
        f"{base}/v2/repository/models/{LLM_MODEL}/unload", json={}, timeout=LOAD_TIMEOUT_S
    )
    if response.status_code != 200:
        raise RuntimeError(f"unload answered {response.status_code}: {response.text[:300]}")
    unload_end = time.perf_counter()
    await asyncio.sleep(args.settle)  # the next baseline starts once the unload has settled
    return Repeat(
        load_s=load_end - load_start,
        unload_s=unload_end - unload_start,
        baseline=Window(baseline_start, load_start - GUARD_S),
        during=Window(load_start, load_end + args.tail),
        after_unload=Window(unload_start, unload_end + args.settle),
    )


def summary(sorted_ms: list[float]) -> tuple[float, float, float]:
    """(P50, P99, max) in ms."""
    return percentile(sorted_ms, 50), percentile(sorted_ms, 99), sorted_ms[-1]


def spread(xs: list[float], fmt: str) -> str:
    return f"{min(xs):{fmt}}-{max(xs):{fmt}}"


def report(repeats: list[Repeat], traffic: OpenLoop) -> None:
    print(f"{'repeat':>6} {'load s':>7} | {'baseline P50/P99/max ms':>24} | "
          f"{'during load P50/P99/max ms':>27} | {'n':>4} | {'added P99 ms':>12} | "
          f"{'unload s':>8} {'max ms':>6}")  # fmt: skip
    added, loads, base_p99, during_p99 = [], [], [], []
    for i, rep in enumerate(repeats, 1):
        during = rep.during.latencies_ms(traffic.samples)
        b50, b99, bmax = summary(rep.baseline.latencies_ms(traffic.samples))
        d50, d99, dmax = summary(during)
        unload_max = summary(rep.after_unload.latencies_ms(traffic.samples))[2]
        added.append(d99 - b99)
        loads.append(rep.load_s)
        base_p99.append(b99)
        during_p99.append(d99)
        print(
            f"{i:>6} {rep.load_s:>7.2f} | {b50:>7.1f} {b99:>7.1f} {bmax:>8.1f} | "
            f"{d50:>8.1f} {d99:>8.1f} {dmax:>9.1f} | {len(during):>4} | {d99 - b99:>12.1f} | "
            f"{rep.unload_s:>8.2f} {unload_max:>6.0f}"
        )
    # The first load in a server process also imports the LLM stack (torch and the engine);
    # later loads show what a reload costs, so the two are summarised apart.
    print(f"first load: {loads[0]:.2f} s, added P99 {added[0]:.1f} ms")
    if len(repeats) > 1:
        print(
            f"later loads ({len(repeats) - 1}): load {spread(loads[1:], '.2f')} s, "
            f"baseline P99 {spread(base_p99[1:], '.1f')} ms, during-load P99 "
            f"{spread(during_p99[1:], '.1f')} ms, added P99 {spread(added[1:], '.1f')} ms"
        )
    failed = sum(not s.ok for s in traffic.samples)
    print(f"requests: {len(traffic.samples)} sent, {failed} failed")
    for error in sorted(set(traffic.errors))[:5]:
        print(f"  error: {error}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable, help="interpreter for the server")
    parser.add_argument("--src", type=Path, default=Path(__file__).parent.parent / "src",
                        help="source tree put first on the server's PYTHONPATH")  # fmt: skip
    parser.add_argument("--rate", type=float, default=40.0, help="v2 requests/s")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds before the 1st window")
    parser.add_argument("--baseline", type=float, default=8.0, help="seconds of baseline")
    parser.add_argument("--tail", type=float, default=1.0, help="seconds after the load answers")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds after the unload")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    src = args.src.resolve()
    env = child_env(src)
    with tempfile.TemporaryDirectory() as tmp:
        repo, log_path = Path(tmp) / "repo", Path(tmp) / "serve.log"
        subprocess.run([args.python, "-m", "fulcrum.cli", "examples", str(repo)], env=env,
                       check=True, timeout=600, stdout=subprocess.DEVNULL)  # fmt: skip
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        print(f"server: {args.python} with {src} first on PYTHONPATH, {args.rate:g} req/s")
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [args.python, "-m", "fulcrum.cli", "serve", "--repository", str(repo),
                 "--model", "minilm", "--host", "127.0.0.1", "--port", str(port)],
                env=env, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
            try:
                wait_ready(base, proc, timeout_s=180)
                repeats, traffic = asyncio.run(measure(base, args))
            except BaseException:
                print(log_path.read_text(errors="replace")[-3000:], file=sys.stderr)
                raise
            finally:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=30)
    report(repeats, traffic)
    return 0


if __name__ == "__main__":
    sys.exit(main())
