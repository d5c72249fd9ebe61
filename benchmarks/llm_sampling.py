"""What sampling costs the engine: output tokens/s under greedy and random sampling, in one run.

    .venv/bin/python benchmarks/llm_sampling.py [--num-requests 512] [--record]

The saturating uniform workload of llm_throughput.py (prompt 16-256, output 8-128 tokens, all
requests offered at once) on tiny-llama, once per sampling setup: greedy, temperature 1 (the
OpenAI default), temperature 0.8 with top-p 0.9, and temperature 0.8 with top-k 50 and a seed
per request. Prints tokens/s and the ratio to greedy; --record appends to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import tempfile
import time
from pathlib import Path

import torch
from llm_throughput import workload

from fulcrum.llm.examples import build_tiny_llama
from fulcrum.llm.loader import load_checkpoint
from fulcrum.llm.params import EngineParams
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.sync_engine import LLMEngine

SETUPS: dict[str, dict[str, float | int]] = {
    "greedy": {"temperature": 0.0},
    "temperature 1": {"temperature": 1.0},
    "temperature 0.8, top-p 0.9": {"temperature": 0.8, "top_p": 0.9},
    "temperature 0.8, top-k 50, seeded": {"temperature": 0.8, "top_k": 50},
}


def tokens_per_s(version_dir: Path, params: EngineParams, setup: str, num_requests: int) -> float:
    engine = LLMEngine(load_checkpoint(version_dir), params)
    for i, r in enumerate(workload(num_requests, 1e9, seed=0)):
        seed = i if "seeded" in setup else None
        sampling = SamplingParams(
            max_tokens=r.num_output_tokens, ignore_eos=True, seed=seed, **SETUPS[setup]
        )
        engine.add_request(str(i), r.prompt, sampling)
    start, num_tokens = time.perf_counter(), 0
    while engine.has_unfinished():
        num_tokens += sum(len(out.new_token_ids) for out in engine.step())
    return num_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--record", action="store_true", help="append to benchmarks/RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    directory = Path(tempfile.mkdtemp())
    version_dir = directory / build_tiny_llama(directory) / "1"
    params = EngineParams(
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        kv_cache_memory_mb=64,
        max_num_waiting=max(256, args.num_requests),
    )
    tokens_per_s(version_dir, params, "greedy", 8)  # warm-up
    results = {s: tokens_per_s(version_dir, params, s, args.num_requests) for s in SETUPS}
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"\n## LLM sampling cost (benchmarks/llm_sampling.py), {when}\n",
        f"Machine: {platform.machine()}, {torch.get_num_threads()} torch threads, torch "
        f"{torch.__version__}, CPU. tiny-llama; {args.num_requests} requests at once, prompt "
        "16-256, output 8-128 tokens; max_num_seqs 256, max_num_batched_tokens 2048. Command: "
        f"`.venv/bin/python benchmarks/llm_sampling.py --num-requests {args.num_requests}`.\n",
        "| sampling | output tok/s | vs greedy |",
        "| --- | ---: | ---: |",
        *(f"| {s} | {v:.0f} | {v / results['greedy']:.2f} |" for s, v in results.items()),
        "",
    ]
    report = "\n".join(lines)
    print(report)
    if args.record:
        with (Path(__file__).parent / "RESULTS.md").open("a") as f:
            f.write(report)


if __name__ == "__main__":
    main()
