"""What the per-request sampling features cost: output tokens/s of a batch where no request uses
them, against one where a quarter do (penalties and logprobs), one where a quarter also follow a
JSON schema, and one where all use the penalties; one run.

    .venv/bin/python benchmarks/sampling_features.py [--num-requests 256] [--repeats 3]

The saturating uniform workload of llm_throughput.py on tiny-llama at temperature 1 (the OpenAI
default). "quarter" gives every fourth request presence 0.5, frequency 0.5 and repetition 1.1
penalties and logprobs=5; "quarter+schema" adds a JSON schema (structured output) to another
quarter; "all" gives the penalties to every request. With a schema in the mix it also reports the
mean mask-fill time per step (on its worker thread) against the model's forward time. Setups
alternate per repeat and the median is reported, so a slow patch of the machine hits all of them
alike. Besides wall-clock tokens/s it reports tokens per CPU-second of this process (all its
threads, the mask fill's included), which other processes on a shared machine disturb far less.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from llm_throughput import workload

from fulcrum.llm.examples import build_tiny_llama
from fulcrum.llm.loader import load_checkpoint
from fulcrum.llm.params import EngineParams
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.structured_spec import StructuredSpec
from fulcrum.llm.sync_engine import LLMEngine

FEATURES = {
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "repetition_penalty": 1.1,
    "logprobs": 5,
}
SHARE = {"none": 0, "quarter": 4, "quarter+schema": 4, "all": 1}  # every k-th (0: none)
# A string longer than any max_tokens: a schema request runs to its length like the others, so
# every setup generates the same tokens.
NOTE = {"type": "string", "minLength": 4096}
SCHEMA = StructuredSpec(
    "json_schema",
    json.dumps({"type": "object", "properties": {"note": NOTE}, "required": ["note"]}),
)


class StepTimes:
    """Seconds spent filling grammar masks (worker thread) and in the model's forward."""

    def __init__(self) -> None:
        self.fill_s: list[float] = []
        self.forward_s: list[float] = []

    def timed(self, fn: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
        def wrapper(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                into.append(time.perf_counter() - start)

        return wrapper


def _instrument(engine: LLMEngine, times: StepTimes) -> None:
    structured = engine.runner.structured
    assert structured is not None
    fill = structured._fill
    structured._fill = times.timed(fill, times.fill_s)  # type: ignore[method-assign]
    model = engine.runner.model
    forward = times.timed(model.forward, times.forward_s)
    model.forward = forward  # type: ignore[method-assign]


def tokens_per_s(
    version_dir: Path,
    params: EngineParams,
    setup: str,
    num_requests: int,
    times: StepTimes | None = None,
) -> tuple[float, float]:
    """(output tokens per wall-clock second, per CPU-second of this process)."""
    engine = LLMEngine(load_checkpoint(version_dir), params)
    if times is not None:
        _instrument(engine, times)
    every = SHARE[setup]
    for i, r in enumerate(workload(num_requests, 1e9, seed=0)):
        extra: dict[str, Any] = FEATURES if every and i % every == 0 else {}
        if setup == "quarter+schema" and i % 4 == 1:
            extra = {"structured": SCHEMA}
        sampling = SamplingParams(max_tokens=r.num_output_tokens, ignore_eos=True, **extra)
        engine.add_request(str(i), r.prompt, sampling)
    start, start_cpu, num_tokens = time.perf_counter(), time.process_time(), 0
    while engine.has_unfinished():
        num_tokens += sum(len(out.new_token_ids) for out in engine.step())
    wall_s, cpu_s = time.perf_counter() - start, time.process_time() - start_cpu
    return num_tokens / wall_s, num_tokens / cpu_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument(
        "--setups", default=",".join(SHARE), help=f"comma-separated, of {', '.join(SHARE)}"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    directory = Path(tempfile.mkdtemp())
    version_dir = directory / build_tiny_llama(directory) / "1"
    params = EngineParams(
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        kv_cache_memory_mb=64,
        max_num_waiting=max(256, args.num_requests),
        num_threads=args.threads,  # else the engine pins torch's default on its step thread
    )
    tokens_per_s(version_dir, params, "none", 8)  # warm-up
    setups = [s for s in args.setups.split(",") if s in SHARE]
    runs: dict[str, list[tuple[float, float]]] = {s: [] for s in setups}
    times = StepTimes()
    for _ in range(args.repeats):
        for setup in setups:
            timed = times if setup == "quarter+schema" else None
            runs[setup].append(tokens_per_s(version_dir, params, setup, args.num_requests, timed))
    wall = {s: statistics.median(w for w, _ in v) for s, v in runs.items()}
    cpu = {s: statistics.median(c for _, c in v) for s, v in runs.items()}
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"sampling features (benchmarks/sampling_features.py), {when}; {platform.machine()}, "
        f"{torch.get_num_threads()} torch threads, torch {torch.__version__}; tiny-llama, "
        f"{args.num_requests} requests at once, median of {args.repeats}\n"
        f"| batch | tok/s (wall) | vs {setups[0]} | tok per CPU-s | vs {setups[0]} | wall runs |\n"
        "| --- | ---: | ---: | ---: | ---: | --- |"
    )
    base = setups[0]
    for s in setups:
        spread = " ".join(f"{w:.0f}" for w, _ in runs[s])
        print(f"| {s} | {wall[s]:.0f} | {wall[s] / wall[base]:.2f} | {cpu[s]:.0f} | "
              f"{cpu[s] / cpu[base]:.2f} | {spread} |")  # fmt: skip
    if times.fill_s:
        fill_ms = statistics.mean(times.fill_s) * 1e3
        forward_ms = statistics.mean(times.forward_s) * 1e3
        print(
            f"quarter+schema: mask fill {fill_ms:.2f} ms per step with schema rows "
            f"({len(times.fill_s)} steps; worker thread, overlapping the forward) vs forward "
            f"{forward_ms:.2f} ms per step ({len(times.forward_s)} steps): "
            f"{fill_ms / forward_ms:.1%}"
        )


if __name__ == "__main__":
    main()
