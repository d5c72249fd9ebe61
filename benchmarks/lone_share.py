"""What the `spin_when_idle` session costs: memory, and how often it runs as load rises.

    .venv/bin/python benchmarks/lone_share.py [--repository R] [--rates 5,20,60,120,160]
        [--seconds 8] [--rounds 1]
    .venv/bin/python benchmarks/lone_share.py --memory [--rounds 3]

`--memory`: in a fresh process per setting (spin_when_idle off; on with each session loading its
own weights, as before the sessions shared them; on, sharing), load the `minilm` backend, run a
few lone and ordinary calls, and read RSS and Pss (/proc/self/smaps_rollup); then check that the
two sessions' outputs are bitwise equal on batches of 1 to 16 sentences.

In one process, without HTTP: the shipped `minilm` config with `spin_when_idle = true`, its
batcher and instance pool as the server builds them, fed open loop (Poisson arrivals, one
sentence a request) at each rate in turn. Per rate: the lone runs per second while runs are
sparse (those the spinning session may take, if it is measured faster), the runs per second on
the spinning session (counted by a wrapper around it) and on the ordinary one, the process's CPU
(all threads: a spinning pool burns ~45 ms of CPU after each of its runs), P50/P99 latency from
submit and the requests refused (503). At high load the spinning session should not run at all:
its pool would spin beside the batches' pool on the same cores. Each rate follows a 1 s pause,
as in the benchmarks' searches, so its first few runs come after an idle instance.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from fulcrum.backends import create_backend
from fulcrum.backends.onnx import OnnxBackend
from fulcrum.batcher import DynamicBatcher
from fulcrum.config import load_model_config
from fulcrum.errors import FulcrumError
from fulcrum.examples import build_examples
from fulcrum.instances import InstancePool

sys.path.insert(0, str(Path(__file__).parent))
from corpus import sentences


class CountingSession:
    """An `InferenceSession` stand-in that counts the runs it passes on."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.num_runs = 0

    def run(self, names: list[str], feeds: dict[str, np.ndarray]) -> Any:
        self.num_runs += 1
        return self.session.run(names, feeds)


async def one_rate(
    batcher: DynamicBatcher, rate: float, seconds: float, texts: list[bytes], seed: int
) -> tuple[list[float], int]:
    """Open loop at `rate` for `seconds`; latencies (s) of the answered requests, and the sent."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1 / rate, int(rate * seconds * 1.5) + 10)
    arrivals = np.cumsum(gaps)
    arrivals = arrivals[arrivals < seconds]
    latencies: list[float] = []

    async def one(text: bytes) -> None:
        start = time.perf_counter()
        try:
            await batcher.submit({"text": np.array([[text]], dtype=object)})
        except FulcrumError:  # shed by the adaptive policy (503): counted as refused
            return
        latencies.append(time.perf_counter() - start)

    start_s = time.perf_counter()
    tasks = []
    for k, at in enumerate(arrivals):
        delay = start_s + float(at) - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(texts[k % len(texts)])))
    await asyncio.gather(*tasks)
    return latencies, len(arrivals)


async def run(repo: Path, rates: list[float], seconds: float, rounds: int) -> None:
    config = load_model_config(repo / "minilm" / "config.toml", dir_name="minilm")
    config = msgspec.structs.replace(
        config, parameters={**config.parameters, "spin_when_idle": True}
    )
    backend = create_backend(config, repo / "minilm" / "1")
    assert isinstance(backend, OnnxBackend) and backend.lone_session is not None
    lone = CountingSession(backend.lone_session)
    plain = CountingSession(backend.session)
    backend.lone_session = lone  # type: ignore[assignment]
    backend.session = plain  # type: ignore[assignment]
    pool = InstancePool([backend], name="minilm")
    batcher = DynamicBatcher(config, pool.run, dispatch_lone=pool.lone_dispatch)
    batcher.start()
    texts = [t.encode() for t in sentences(256, 12, seed=1)]
    await one_rate(batcher, 20, 1.0, texts, seed=99)  # warm-up
    print("rate req/s | round | lone runs/s while sparse | spinning-session runs/s | other runs/s"
          " | CPU cores | P50 / P99 ms | refused")  # fmt: skip
    for k in range(rounds):
        for rate in rates:
            await asyncio.sleep(1.0)  # an idle second between rates, as the benchmarks pause
            lone.num_runs = plain.num_runs = 0
            num_picks = backend.lone_choice.num_picks  # one a lone run while runs are sparse
            cpu_s, wall_s = time.process_time(), time.perf_counter()
            latencies, num_sent = await one_rate(
                batcher, rate, seconds, texts, seed=k * 100 + int(rate)
            )
            cpu_s, wall_s = time.process_time() - cpu_s, time.perf_counter() - wall_s
            ms = sorted(x * 1e3 for x in latencies)
            p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
            sparse = (backend.lone_choice.num_picks - num_picks) / wall_s
            runs = f"{sparse:.1f} | {lone.num_runs / wall_s:.1f} | {plain.num_runs / wall_s:.1f}"
            cpu, p50 = cpu_s / wall_s, statistics.median(ms)
            refused = num_sent - len(ms)
            print(f"{rate:g} | {k + 1} | {runs} | {cpu:.2f} | {p50:.1f} / {p99:.0f} | {refused}",
                  flush=True)  # fmt: skip
    await batcher.stop()
    pool.close()


MEMORY_SETTINGS = ("off", "on, unshared", "on, shared")


def memory_one(repo: Path, setting: str) -> None:
    """In a fresh process: load, run, print 'rss_mib pss_mib shared_mib bitwise_equal'."""
    import fulcrum.backends.onnx as onnx_backend

    if setting == "on, unshared":  # each session loads its own copy, as before the sharing
        onnx_backend._ort_values = lambda path: {}  # type: ignore[attr-defined]
    config = load_model_config(repo / "minilm" / "config.toml", dir_name="minilm")
    spin = setting != "off"
    config = msgspec.structs.replace(
        config, parameters={**config.parameters, "spin_when_idle": spin}
    )
    backend = create_backend(config, repo / "minilm" / "1")
    assert isinstance(backend, OnnxBackend)
    texts = [t.encode() for t in sentences(64, 12, seed=3)]
    equal = True
    for rows in (1, 2, 5, 16):
        batch = {"text": np.array([[t] for t in texts[:rows]], dtype=object)}
        plain = backend.execute(batch)
        backend.execute_lone(batch)
        if backend.lone_session is not None:
            lone = backend._execute(backend.lone_session, batch)
            equal = equal and all(np.array_equal(plain[k], lone[k]) for k in plain)
    shared_mib = sum(v.numpy().nbytes for v in backend.shared_weights.values()) / 2**20
    before = smaps_mib()
    # Heap that glibc keeps after the loaders freed it (the model file's parse) counts in RSS
    # but is not the sessions': the second reading gives it back first.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    after = smaps_mib()
    print(f"{before['Rss']:.0f} {before['Pss']:.0f} {after['Rss']:.0f} {after['Pss']:.0f} "
          f"{shared_mib:.1f} {equal}")  # fmt: skip


def smaps_mib() -> dict[str, float]:
    rollup = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        rollup[key] = int(value.split()[0]) / 1024
    return rollup


def memory(repo: Path, rounds: int) -> None:
    print("setting | round | RSS / Pss MiB | after malloc_trim | shared tables MiB | bitwise equal")
    for k in range(rounds):
        for setting in MEMORY_SETTINGS:
            command = [sys.executable, __file__, "--memory-one", setting, "--repository", str(repo)]
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            rss, pss, rss_trim, pss_trim, shared, equal = out.split()
            print(f"{setting} | {k + 1} | {rss} / {pss} | {rss_trim} / {pss_trim} | {shared} | "
                  f"{equal}", flush=True)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repository", type=Path, help="an example repository (default: built)")
    parser.add_argument("--rates", default="5,20,60,120,160", help="requests/s, comma-separated")
    parser.add_argument("--seconds", type=float, default=8.0, help="per rate")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--memory", action="store_true", help="RSS/Pss of each setting")
    parser.add_argument("--memory-one", choices=MEMORY_SETTINGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        repo = args.repository or Path(tmp)
        if args.repository is None:
            build_examples(repo)
        if args.memory_one:
            memory_one(repo, args.memory_one)
        elif args.memory:
            memory(repo, args.rounds)
        else:
            asyncio.run(run(repo, rates, args.seconds, args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
