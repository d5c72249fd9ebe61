"""tiny-llama's token budget held to TTFT/TPOT SLOs (`adaptive_vs_static.py --llm`), in one run.

One `fulcrum serve` holding only tiny-llama. Its capacity is the requests/s of a closed loop of
64 streams (max_num_seqs) with the shipped config. A sweep of fixed `max_num_batched_tokens` at
the trace's peak rate picks the best fixed budget; then the same ramp as minilm's (Poisson
within each step, the same arrival times) is replayed over the OpenAI streaming API against the
shipped budget, the best fixed budget, the best fixed budget with TTFT admission (`slo_ttft_ms`
alone: predicted-late requests get a 503, the budget stays fixed), and the adaptive budget
(`slo_ttft_ms` / `slo_tpot_ms` set, `max_num_batched_tokens` = the sweep's largest as its
ceiling), switched by reloading the model with a config override. Goodput counts streams whose
TTFT and TPOT both met their SLOs.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).parent))
from load_trace import (
    PolicyResult,
    Step,
    arrival_times,
    print_steps,
    ramp_trace,
    reload,
    replay,
    summarize_steps,
)

from fulcrum.client import Endpoint
from fulcrum.demo import free_port, serve
from fulcrum.loadgen.bench import Bench, BenchOptions
from fulcrum.loadgen.inputs import LengthDist
from fulcrum.loadgen.llm import LlmInputs, LlmTarget, prepare_llm
from fulcrum.loadgen.records import RequestRecord
from fulcrum.loadgen.stats import Slo, meets_all
from fulcrum.loadgen.windows import MeasurePlan

MODEL = "tiny-llama"
BUDGETS = (128, 256, 512, 1024, 2048)


def add_llm_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument_group("--llm").add_argument
    add("--slo-ttft-ms", type=float, default=100.0)
    add("--slo-tpot-ms", type=float, default=20.0)
    add("--prompt-words", type=int, default=16)
    add("--max-tokens", type=int, default=64)
    add("--llm-clients", type=int, default=64, help="closed-loop streams for the capacity")


class LlmRunner:
    def __init__(self, url: str, args: argparse.Namespace, base: dict[str, object]) -> None:
        self.url = url
        self.args = args
        self.base = base  # the file's [parameters]: an override replaces the whole table
        self.slos = [Slo(metric="ttft", bound_ms=args.slo_ttft_ms, percentile=99.0),
                     Slo(metric="tpot", bound_ms=args.slo_tpot_ms, percentile=99.0)]  # fmt: skip
        inputs = LlmInputs(prompt_lengths=LengthDist(args.prompt_words, args.prompt_words),
                           max_tokens=args.max_tokens, num_distinct=64)  # fmt: skip
        endpoint = Endpoint.from_url(url)
        self.inputs = inputs
        self.target = LlmTarget(endpoint, prepare_llm(endpoint, MODEL, inputs))

    def good(self, record: RequestRecord) -> bool:
        return meets_all(record, self.slos)

    def override(self, **params: object) -> dict[str, object]:
        return {"parameters": {**self.base, **params}}

    def play(self, steps: list[Step], capacity: float, seed: int) -> PolicyResult:
        from adaptive_vs_static import run_async

        offsets = arrival_times(steps, capacity, seed)
        run = run_async(replay(self.target, steps, offsets, url=self.url, model=None,
                               timeout_s=self.args.timeout_s * 4))  # fmt: skip
        return PolicyResult("", None, summarize_steps(run, steps, self.slos, self.good),
                            steps[-1].end_s)  # fmt: skip

    def switch(self, override: dict[str, object], capacity: float) -> None:
        reload(self.url, MODEL, override)
        self.play([Step(0.0, self.args.warmup_s, 0.3)], capacity, seed=99)

    def capacity(self) -> float:
        from adaptive_vs_static import run_async

        plan = MeasurePlan(warmup_s=2.0, window_s=self.args.capacity_s,
                           max_duration_s=self.args.capacity_s)  # fmt: skip
        options = BenchOptions(model=MODEL, url=self.url, plan=plan, openai=True, llm=self.inputs)
        bench = Bench(options, self.target, [])
        return run_async(bench.point("concurrency", self.args.llm_clients)).throughput_rps


def run_llm(tmp: Path, args: argparse.Namespace) -> int:
    from fulcrum.examples import build_tiny_llama

    repo = tmp / "llm"
    build_tiny_llama(repo)
    base = msgspec.toml.decode((repo / MODEL / "config.toml").read_bytes())["parameters"]
    steps = ramp_trace(args.step_s, burst_s=args.burst_s, peak=args.peak)
    with serve(repo, free_port(), log_path=args.out / "llm_server.log") as url:
        runner = LlmRunner(url, args, base)
        adaptive = runner.override(
            max_num_batched_tokens=max(BUDGETS),
            slo_ttft_ms=args.slo_ttft_ms,
            slo_tpot_ms=args.slo_tpot_ms,
        )
        try:
            reload(url, MODEL, adaptive)
        except RuntimeError as exc:
            print(f"the adaptive token budget does not load here; nothing measured: {exc}")
            return 2
        reload(url, MODEL, None)
        capacity = args.capacity or runner.capacity()  # given: runs compare at the same rates
        how = "given" if args.capacity else f"shipped, {args.llm_clients} streams"
        print(f"capacity ({how}): {capacity:.1f} req/s", flush=True)
        sweep = []
        for budget in BUDGETS:
            runner.switch(runner.override(max_num_batched_tokens=budget), capacity)
            peak = runner.play([Step(0.0, args.sweep_s, args.peak)], capacity, args.seed + 1)
            sweep.append((budget, peak.goodput_rps))
            print(f"  sweep max_num_batched_tokens={budget}: goodput {peak.goodput_rps:.1f} "
                  f"req/s", flush=True)  # fmt: skip
        best = max(sweep, key=lambda row: row[1])[0]
        # The best fixed budget told the TTFT SLO too: admission sheds what would start late,
        # the budget stays fixed (no TPOT SLO, nothing moves it). What adaptive gains beyond it
        # is the moving budget's part; the rest is admission's.
        admitted = runner.override(max_num_batched_tokens=best, slo_ttft_ms=args.slo_ttft_ms)
        policies = [(f"shipped ({base['max_num_batched_tokens']} tokens)", None),
                    (f"best fixed ({best} tokens)", runner.override(max_num_batched_tokens=best)),
                    (f"best fixed + TTFT admission ({best} tokens)", admitted),
                    ("adaptive budget", adaptive)]  # fmt: skip
        results = []
        for name, override in policies:
            print(f"trace: {name} ...", flush=True)
            runner.switch(override or runner.override(), capacity)
            result = runner.play(steps, capacity, args.seed)
            result.name, result.config = name, override
            results.append(result)
    llm_report(results, capacity, sweep, args)
    return 0


def llm_report(results: list[PolicyResult], capacity: float, sweep: list[tuple[int, float]],
               args: argparse.Namespace) -> None:  # fmt: skip
    from load_trace_plot import plot_policies

    offered = sum(s.offered for s in results[0].steps)
    print(
        f"\ntiny-llama, capacity {capacity:.1f} req/s, {offered} requests; SLOs TTFT <= "
        f"{args.slo_ttft_ms:g} ms and TPOT <= {args.slo_tpot_ms:g} ms per request"
    )
    print("| policy | goodput req/s | 99% in SLO up to load | steps in SLO | 503 | timeouts |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        widest = r.widest_load()
        print(
            f"| {r.name} | {r.goodput_rps:.1f} | {'none' if widest is None else f'{widest:.0%}'}"
            f" | {sum(r.steps_within())}/{len(r.steps)} | {r.shed} | {r.timed_out} |"
        )
    print("\nper step: answered within SLOs / offered, admitted P99 TTFT / TPOT ms, 503s")
    print_steps(results, lambda s: f"{s.good}/{s.offered}, {s.p99_ms['ttft']:.0f} / "
                f"{s.p99_ms['tpot']:.1f}, {s.shed}")  # fmt: skip
    adaptive, fixed = results[-1], results[:-1]
    for r in fixed:
        if r.goodput_rps:
            print(f"adaptive / {r.name} goodput: {adaptive.goodput_rps / r.goodput_rps:.2f}x")
    path = plot_policies(results, capacity, args.out / "adaptive_llm.png", "ttft",
                         args.slo_ttft_ms, title=f"tiny-llama, capacity {capacity:.0f} req/s",
                         second=("tpot", args.slo_tpot_ms))  # fmt: skip
    print(f"plot: {path}")
    data = {"capacity_rps": capacity, "sweep": sweep, "results": [asdict(r) for r in results]}
    (args.out / "adaptive_llm.json").write_text(json.dumps(data, indent=1, default=str))
