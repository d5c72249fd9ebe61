"""The server's CPU per output token with engine processes: the process that holds the engine
client (event loop, pipe readers and senders), by thread, as llm_throughput drives it.

    .venv/bin/python benchmarks/llm_server_cpu.py [--engine process,process2] [--repeats 3]
        [--num-requests 512] [--rate 1000] [--max-num-seqs 256] [--max-num-batched-tokens 2048]
        [--profile-loop PATH] [--stream-interval 1,4,8]

Each repeat runs every --engine mode on the same uniform workload (prompt 16-256 tokens, output
8-128) through AsyncLLMEngine.generate, one asyncio task per request, as llm_throughput's
"process" rows do, and reports tok/s beside the CPU time this process spent per output token:
the event loop's thread, the reader threads (unpickling each step's report, detokenising,
building outputs), the sender threads, and the rest. CPU time (thread clocks), not wall time:
the figure that holds on a shared machine. Run it with PYTHONPATH=<other tree>/src to compare
two trees; --profile-loop writes a cProfile of the event loop thread of the last run.
--stream-interval runs each mode at each `stream_interval` (a request's tokens handed out every
N), the settings' order rotating between repeats like the modes'.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import dataclasses
import os
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from llm_throughput import _drive, engine_mode, stream_intervals, workload

from fulcrum.llm.engine import AsyncLLMEngine
from fulcrum.llm.examples import build_tiny_llama
from fulcrum.llm.metrics import LLMMetrics
from fulcrum.llm.params import EngineParams


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds of each live thread of this process, by role."""
    roles: dict[str, float] = {}
    for thread in threading.enumerate():
        if thread.ident is None:
            continue
        try:
            clock = time.pthread_getcpuclockid(thread.ident)
            cpu_s = time.clock_gettime(clock)
        except (OSError, ValueError):  # ended meanwhile
            continue
        name = thread.name
        if thread is threading.main_thread():
            role = "loop"
        elif name.startswith("llm-reader"):
            role = "readers"
        elif name.startswith("llm-sender"):
            role = "senders"
        else:
            role = "other threads"
        roles[role] = roles.get(role, 0.0) + cpu_s
    return roles


def process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def run(
    mode: str, interval: int, version_dir: Path, params: EngineParams, args: argparse.Namespace
) -> str:
    from prometheus_client import CollectorRegistry

    from fulcrum.llm.engine_group import EngineGroupClient
    from fulcrum.llm.engine_process import ProcessEngineClient

    _, num = engine_mode(mode)
    process_params = dataclasses.replace(
        params, engine_process=True, num_engine_processes=num, stream_interval=interval
    )
    kind = EngineGroupClient if num > 1 else ProcessEngineClient
    metrics = LLMMetrics(CollectorRegistry(), "tiny-llama")
    client = await asyncio.to_thread(kind, version_dir, process_params, "tiny-llama", metrics)
    engine = AsyncLLMEngine(client.front, model_name="tiny-llama", client=client)
    await engine.start()
    try:
        await _drive(engine, workload(16, 1000.0, 0))  # warm-up
        requests = workload(args.num_requests, args.rate, args.seed)
        profile = cProfile.Profile() if args.profile_loop else None
        threads0, process0, wall0 = thread_cpu_s(), process_cpu_s(), time.perf_counter()
        if profile is not None:
            profile.enable()
        start_s = await _drive(engine, requests)
        if profile is not None:
            profile.disable()
            profile.dump_stats(args.profile_loop)
        threads1, process1 = thread_cpu_s(), process_cpu_s()
        wall_s = time.perf_counter() - wall0
    finally:
        await engine.stop()
    num_tokens = sum(len(r.tokens) for r in requests)
    elapsed_s = max(r.done_s for r in requests) - start_s
    per_token = {k: (threads1[k] - threads0.get(k, 0.0)) / num_tokens * 1e6 for k in threads1}
    total_us = (process1 - process0) / num_tokens * 1e6
    parts = ", ".join(f"{k} {v:.1f}" for k, v in sorted(per_token.items()))
    load = os.getloadavg()[0]
    return (
        f"{mode:9s} si {interval:<2d} {num_tokens / elapsed_s:7.0f} tok/s  "
        f"server CPU {total_us:5.1f} us/token "
        f"({parts}; {wall_s:.1f} s, load {load:.2f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="process,process2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=512)
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile-loop", default="", help="cProfile of the loop thread to here")
    parser.add_argument(
        "--stream-interval", default=[1], type=stream_intervals, help="values, comma-separated"
    )
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp())
    version_dir = directory / build_tiny_llama(directory) / "1"
    params = EngineParams(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_mb=64,
        max_num_waiting=max(256, args.num_requests),
        num_threads=args.threads,
    )
    settings = [(m, n) for m in args.engine.split(",") for n in args.stream_interval]
    for repeat in range(args.repeats):
        first = repeat % len(settings)
        for mode, interval in settings[first:] + settings[:first]:
            print(asyncio.run(run(mode, interval, version_dir, params, args)), flush=True)


if __name__ == "__main__":
    main()
