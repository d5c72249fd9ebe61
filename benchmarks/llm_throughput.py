"""Continuous batching vs transformers' `generate` on the tiny Llama, in one run.

    .venv/bin/python benchmarks/llm_throughput.py [--num-requests 512] [--rate 1000] [--record]
        [--engine sync,thread,process,process2] [--static-threads 1,2] [--skip-one-at-a-time]
        [--stream-interval 1,4]

Two mixed workloads (prompt 16-256 tokens, Poisson arrivals at --rate requests/s, more than any
setup here keeps up with, so each runs at its capacity) differ only in their output lengths:
"uniform", 8-128 tokens, and "geometric", the lengths a constant per-token stop probability gives
(mean 64 like uniform's, a long tail capped at 512), the shape of real chat outputs. Each is
served three ways in this process on the CPU: Fulcrum's engine (continuous batching, paged KV
cache), `generate` one request at a time (FIFO), and `generate` in static batches of each of
--batch-sizes (a batch forms from what has arrived and returns when its longest member is done).
Then a shared-system-prompt workload runs on the engine with prefix caching on and off. Reports
output tokens/s, P50/P99 time to first token and end-to-end latency, the engine against the
static batch size with the most tokens/s; --record appends the figures to benchmarks/RESULTS.md.
--engine says how the engine is driven (several: one row each, in the same run): "sync" steps
LLMEngine directly in this loop (no asyncio, no server); "thread" and "process" drive
AsyncLLMEngine.generate from one asyncio task per request, its engine stepped by a thread or by
an engine process (`engine_process = true`), as the server drives it; "processN" by N engine
processes (`num_engine_processes = N`, each with --threads torch threads). --static-threads runs
the static batches at each of several torch thread counts (0: torch's default), so that engines
using several cores meet a static batch using them too. --stream-interval runs each engine row at
each of several `stream_interval`s (a request's tokens handed out every N; one row each).
Needs transformers (a test dependency).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import platform
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fulcrum.llm.engine import AsyncLLMEngine
from fulcrum.llm.examples import build_tiny_llama
from fulcrum.llm.loader import load_checkpoint
from fulcrum.llm.params import EngineParams
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.sync_engine import LLMEngine


@dataclass
class Request:
    arrival_s: float
    prompt: list[int]
    num_output_tokens: int
    first_token_s: float = 0.0
    done_s: float = 0.0
    tokens: list[int] = field(default_factory=list)


@dataclass
class Result:
    name: str
    tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    # Decode rows computed per output token returned: a static batch runs every member until
    # its longest is done. The engine computes each sequence's own rows (a preempted one is
    # recomputed as prefill), so 1.0.
    rows_per_token: float = 1.0


ENGINE_MODES = {
    "sync": "stepped in the benchmark's loop",
    "thread": "AsyncLLMEngine, engine thread",
    "process": "AsyncLLMEngine, engine process",
}


def engine_mode(mode: str) -> tuple[str, int]:
    """("process", N) for "processN" (N engine processes); (mode, 1) otherwise."""
    suffix = mode.removeprefix("process")
    if mode.startswith("process") and suffix.isdigit() and int(suffix) >= 1:
        return "process", int(suffix)
    return mode, 1


def stream_intervals(text: str) -> list[int]:
    """`--stream-interval 1,4`: the values, each an integer >= 1."""
    try:
        values = [int(n) for n in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers >= 1, comma-separated")
    return values


def engine_label(mode: str) -> str:
    base, num = engine_mode(mode)
    label = ENGINE_MODES[base]
    return label if num == 1 else f"AsyncLLMEngine, {num} engine processes"


# Output lengths of a workload: (name, how they are drawn).
LENGTHS = {
    "uniform": "output 8-128 tokens, uniform",
    "geometric": "output geometric, mean 64, 8-512 tokens",
}


def workload(
    num: int,
    rate: float,
    seed: int,
    *,
    lengths: str = "uniform",
    system_prompt_len: int = 0,
) -> list[Request]:
    """Poisson arrivals; varied lengths (or a shared system prompt plus a short question)."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 500) for _ in range(system_prompt_len)]
    t, requests = 0.0, []
    for _ in range(num):
        t += rng.expovariate(rate)
        if system_prompt_len:
            prompt, num_out = (
                system + [rng.randrange(3, 500) for _ in range(rng.randint(8, 32))],
                16,
            )
        else:
            prompt = [rng.randrange(3, 500) for _ in range(rng.randint(16, 256))]
            if lengths == "geometric":  # stop with probability 1/64 after each token
                num_out = min(512, max(8, 1 + int(rng.expovariate(1 / 63))))
            else:
                num_out = rng.randint(8, 128)
        requests.append(Request(t, prompt, num_out))
    return requests


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(name: str, requests: list[Request], start_s: float) -> Result:
    span_s = max(r.done_s for r in requests) - start_s
    ttft = [r.first_token_s - (start_s + r.arrival_s) for r in requests]
    e2e = [r.done_s - (start_s + r.arrival_s) for r in requests]
    num_tokens = sum(r.num_output_tokens for r in requests)
    return Result(
        name,
        num_tokens / span_s,
        _pct(ttft, 0.5),
        _pct(ttft, 0.99),
        _pct(e2e, 0.5),
        _pct(e2e, 0.99),
    )


def run_engine(name: str, engine: LLMEngine, requests: list[Request]) -> Result:
    """Requests join the running batch at the first step after they arrive."""
    by_id = {str(i): r for i, r in enumerate(requests)}
    pending = list(by_id.items())
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0][1].arrival_s <= now:
            rid, r = pending.pop(0)
            engine.add_request(
                rid,
                r.prompt,
                SamplingParams(max_tokens=r.num_output_tokens, temperature=0.0, ignore_eos=True),
            )
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0][1].arrival_s - now))
            continue
        for out in engine.step():
            r = by_id[out.request_id]
            r.first_token_s = r.first_token_s or time.perf_counter()
            r.tokens += out.new_token_ids
            if out.finished:
                r.done_s = time.perf_counter()
    return summarize(name, requests, start)


async def _drive(engine: AsyncLLMEngine, requests: list[Request]) -> float:
    """One task per request: it arrives on time, then streams its outputs."""
    loop = asyncio.get_running_loop()
    start = time.perf_counter()
    start_loop = loop.time()

    async def one(rid: str, r: Request) -> None:
        await asyncio.sleep(max(0.0, start_loop + r.arrival_s - loop.time()))  # its arrival
        sampling = SamplingParams(max_tokens=r.num_output_tokens, temperature=0.0, ignore_eos=True)
        async for out in engine.generate(r.prompt, sampling, request_id=rid):
            r.first_token_s = r.first_token_s or time.perf_counter()
            r.tokens += out.new_token_ids
            if out.finished:
                r.done_s = time.perf_counter()

    await asyncio.gather(*(one(str(i), r) for i, r in enumerate(requests)))
    return start


async def _run_async(
    name: str, mode: str, version_dir: Path, params: EngineParams, workloads: list[list[Request]]
) -> list[Result]:
    """Each workload through one AsyncLLMEngine (started once, before the clock starts)."""
    from prometheus_client import CollectorRegistry

    from fulcrum.llm.engine_group import EngineGroupClient
    from fulcrum.llm.engine_process import ProcessEngineClient
    from fulcrum.llm.metrics import LLMMetrics

    metrics = LLMMetrics(CollectorRegistry(), "tiny-llama")
    base, num_processes = engine_mode(mode)
    if base == "process":
        process_params = dataclasses.replace(
            params, engine_process=True, num_engine_processes=num_processes
        )
        kind = EngineGroupClient if num_processes > 1 else ProcessEngineClient
        client = await asyncio.to_thread(kind, version_dir, process_params, "tiny-llama", metrics)
        engine = AsyncLLMEngine(client.front, model_name="tiny-llama", client=client)
        print(f"{mode}: engine pids {engine.child_pids}", flush=True)
    else:
        sync = LLMEngine(load_checkpoint(version_dir), params, metrics=metrics)
        engine = AsyncLLMEngine(sync, model_name="tiny-llama")
    await engine.start()
    await _drive(engine, workload(16, 1000.0, 0))  # warm-up (each process its kernels)
    results = []
    for requests in workloads:
        start = await _drive(engine, requests)
        results.append(summarize(name, requests, start))
        _print_rss(engine.child_pids)
    await engine.stop()
    return results


def _print_rss(pids: tuple[int, ...]) -> None:
    from fulcrum.lifecycle.memory import MIB, process_rss_bytes

    sizes = [process_rss_bytes(pid) for pid in pids]
    shown = ", ".join(
        f"{pid}: {(size or 0) / MIB:.0f} MiB" for pid, size in zip(pids, sizes, strict=True)
    )
    if pids:
        print(f"engine process RSS after the run: {shown}", flush=True)


def run_async_engine(
    name: str, mode: str, version_dir: Path, params: EngineParams, workloads: list[list[Request]]
) -> list[Result]:
    """AsyncLLMEngine, stepped by a thread or an engine process, driven as the server does."""
    return asyncio.run(_run_async(name, mode, version_dir, params, workloads))


class _FirstToken:
    """A `generate` streamer that notes when the first new token appears."""

    def __init__(self) -> None:
        self.num_puts = 0
        self.first_s = 0.0

    def put(self, value: Any) -> None:
        self.num_puts += 1
        if self.num_puts == 2:  # the first put is the prompt
            self.first_s = time.perf_counter()

    def end(self) -> None:
        pass


def _hf_generate(model: Any, batch: list[Request]) -> float:
    """Left-padded batch through `generate`; returns the time of the first new token."""
    width = max(len(r.prompt) for r in batch)
    ids = torch.tensor([[0] * (width - len(r.prompt)) + r.prompt for r in batch])
    mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch])
    num_new = max(r.num_output_tokens for r in batch)
    streamer = _FirstToken()
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=num_new,
            min_new_tokens=num_new,
            do_sample=False,
            pad_token_id=0,
            streamer=streamer,
        )
    for row, r in enumerate(batch):
        r.tokens = out[row, width : width + r.num_output_tokens].tolist()
    return streamer.first_s


def run_static(name: str, model: Any, requests: list[Request], batch_size: int) -> Result:
    """Batches of what has arrived (at most batch_size); each returns when its longest is done."""
    queue = list(requests)
    num_rows = 0
    start = time.perf_counter()
    while queue:
        now = time.perf_counter() - start
        if queue[0].arrival_s > now:
            time.sleep(queue[0].arrival_s - now)
            now = queue[0].arrival_s
        batch = [r for r in queue[:batch_size] if r.arrival_s <= now]
        del queue[: len(batch)]
        num_rows += len(batch) * max(r.num_output_tokens for r in batch)
        first_s = _hf_generate(model, batch)
        done_s = time.perf_counter()
        for r in batch:
            r.first_token_s, r.done_s = first_s, done_s
    result = summarize(name, requests, start)
    result.rows_per_token = num_rows / sum(r.num_output_tokens for r in requests)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=512)
    parser.add_argument("--rate", type=float, default=1000.0, help="Poisson arrivals per second")
    parser.add_argument(
        "--batch-sizes", default="32,64,128,256", help="static batch sizes, comma-separated"
    )
    parser.add_argument("--lengths", default="uniform,geometric", help="workloads to run")
    # The token budget is the engine's latency/throughput dial: 2048 takes several whole prompts
    # (16-256 tokens) beside the decodes of up to 256 sequences per step.
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--shared-requests",
        type=int,
        default=256,
        help="requests of the shared-system-prompt workload (arriving at --rate)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for both sides (1: robust on a shared machine)",
    )
    parser.add_argument(
        "--static-threads",
        default="",
        help="torch threads of the static batches, comma-separated (0: torch's default); "
        "default: --threads",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--engine",
        default="sync",
        help="how the engine is driven, comma-separated: sync (LLMEngine.step in this loop), "
        "thread, process or processN (AsyncLLMEngine, as served; N engine processes)",
    )
    parser.add_argument(
        "--skip-one-at-a-time",
        action="store_true",
        help="leave out `generate` one request at a time (the slowest row by far)",
    )
    parser.add_argument(
        "--stream-interval",
        default=[1],
        type=stream_intervals,
        help="the engine's stream_interval, comma-separated: a row per engine mode per value",
    )
    parser.add_argument("--record", action="store_true", help="append to benchmarks/RESULTS.md")
    args = parser.parse_args()
    intervals: list[int] = args.stream_interval
    default_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    import transformers

    directory = Path(tempfile.mkdtemp())
    version_dir = directory / build_tiny_llama(directory) / "1"
    hf: Any = transformers.AutoModelForCausalLM.from_pretrained(version_dir)
    hf.eval()
    params = EngineParams(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_mb=64,
        max_num_waiting=max(256, args.num_requests),  # the benchmark offers all its requests
    )

    def fresh(prefix_caching: bool = True, interval: int = 1) -> LLMEngine:
        # num_threads: the engine pins its stepping thread's count (0 would be torch's default
        # as first imported, not --threads).
        changes = {"enable_prefix_caching": prefix_caching, "num_threads": args.threads,
                   "stream_interval": interval}  # fmt: skip
        return LLMEngine(load_checkpoint(version_dir), dataclasses.replace(params, **changes))

    engines = args.engine.split(",")
    for mode in engines:
        if engine_mode(mode)[0] not in ENGINE_MODES:
            parser.error(f"--engine {mode!r}: expected some of {list(ENGINE_MODES)} or processN")
    static_threads = [
        int(t) or default_threads for t in (args.static_threads or str(args.threads)).split(",")
    ]
    engine_params = dataclasses.replace(params, num_threads=args.threads)

    def run_engine_mode(mode: str, interval: int, requests: list[Request]) -> Result:
        name = f"engine (continuous batching), {engine_label(mode)}"
        if intervals != [1]:
            name += f", stream_interval {interval}"
        if mode == "sync":
            return run_engine(name, fresh(interval=interval), requests)
        mode_params = dataclasses.replace(engine_params, stream_interval=interval)
        return run_async_engine(name, mode, version_dir, mode_params, [requests])[0]

    _hf_generate(hf, workload(2, args.rate, args.seed))  # warm-up both sides
    run_engine("warm-up", fresh(), workload(4, args.rate, args.seed))
    by_lengths: dict[str, list[Result]] = {}
    for lengths in args.lengths.split(","):

        def mixed(lengths: str = lengths) -> list[Request]:
            return workload(args.num_requests, args.rate, args.seed, lengths=lengths)

        results = [run_engine_mode(m, n, mixed()) for m in engines for n in intervals]
        results += _statics(args, hf, mixed, static_threads)
        # Now, before the long one-at-a-time run: the figures of a run cut short are not lost.
        print(f"{lengths}:", *_table(results), _verdict(results), sep="\n", flush=True)
        results += _one_at_a_time(args, hf, mixed)
        by_lengths[lengths] = results
    shared = [
        run_engine(
            label,
            fresh(on),
            workload(args.shared_requests, args.rate, args.seed + 1, system_prompt_len=512),
        )
        for on, label in ((True, "prefix caching on"), (False, "prefix caching off"))
    ]
    report = render(args, by_lengths, shared)
    print(report)
    if args.record:
        with (Path(__file__).parent / "RESULTS.md").open("a") as f:
            f.write(report)


def _statics(
    args: argparse.Namespace,
    model: Any,
    requests: Callable[[], list[Request]],
    static_threads: list[int],
) -> list[Result]:
    """Static batches of each size, at each torch thread count."""
    results = []
    for size in (int(b) for b in args.batch_sizes.split(",")):
        for threads in static_threads:
            torch.set_num_threads(threads)
            label = f"generate, static batches of {size}"
            if len(static_threads) > 1:
                label += f", {threads} torch threads"
            results.append(run_static(label, model, requests(), size))
    torch.set_num_threads(args.threads)
    return results


def _one_at_a_time(
    args: argparse.Namespace, model: Any, requests: Callable[[], list[Request]]
) -> list[Result]:
    if args.skip_one_at_a_time:
        return []
    return [run_static("generate, one at a time", model, requests(), 1)]


def _table(results: list[Result]) -> list[str]:
    lines = [
        "| setup | output tok/s | TTFT P50 s | TTFT P99 s | e2e P50 s | e2e P99 s "
        "| decode rows / output token |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {r.name} | {r.tokens_per_s:.0f} | {r.ttft_p50_s:.3f} | {r.ttft_p99_s:.3f} | "
        f"{r.e2e_p50_s:.3f} | {r.e2e_p99_s:.3f} | {r.rows_per_token:.2f} |"
        for r in results
    ]
    return lines


def _verdict(results: list[Result]) -> str:
    """Each engine row against the static batch size with the most output tokens/s."""
    engines = [r for r in results if r.name.startswith("engine")]
    statics = [r for r in results if r.name.startswith("generate, static")]
    static = max(statics, key=lambda r: r.tokens_per_s)
    lines = []
    for engine in engines:
        ratio = engine.tokens_per_s / static.tokens_per_s
        met = ratio >= 3.0 and engine.e2e_p99_s <= static.e2e_p99_s
        lines.append(
            f"{engine.name} / best static batching ({static.name}): {ratio:.1f}x output "
            f"tokens/s, P99 e2e {engine.e2e_p99_s:.2f} s vs {static.e2e_p99_s:.2f} s; goal "
            f"(>= 3x at equal or lower P99) {'met' if met else 'not met'}.\n"
        )
    return "\n".join(lines)


def render(
    args: argparse.Namespace, by_lengths: dict[str, list[Result]], shared: list[Result]
) -> str:
    on, off = shared
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"\n## LLM engine throughput (benchmarks/llm_throughput.py), {when}\n",
        f"Machine: {platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}, CPU. Model: tiny-llama (2 layers, hidden 64, float32).",
        f"Command: `.venv/bin/python benchmarks/llm_throughput.py --num-requests "
        f"{args.num_requests} --rate {args.rate:g} --batch-sizes {args.batch_sizes} "
        f"--max-num-seqs {args.max_num_seqs} --max-num-batched-tokens "
        f"{args.max_num_batched_tokens} --engine {args.engine} --threads {args.threads} "
        f"--static-threads {args.static_threads or args.threads} --stream-interval "
        f"{','.join(map(str, args.stream_interval))}`. Static batches: left-padded "
        "prompts, max_new_tokens = the batch's longest output.\n",
    ]
    for lengths, results in by_lengths.items():
        lines += [
            f"Workload {lengths!r}: {args.num_requests} requests, Poisson {args.rate:g}/s, "
            f"prompt 16-256 tokens, {LENGTHS[lengths]}, greedy.\n",
            *_table(results),
            "",
            _verdict(results),
        ]
    lines += [
        f"Shared 512-token system prompt + 8-32-token question, 16 output tokens, "
        f"{args.shared_requests} requests, Poisson {args.rate:g}/s:\n",
        *_table(shared),
        "",
        f"Prefix caching: {on.tokens_per_s / off.tokens_per_s:.1f}x output tokens/s, "
        f"TTFT P50 {off.ttft_p50_s / max(on.ttft_p50_s, 1e-9):.1f}x lower.\n",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
