"""Adaptive batching against static configs on `minilm`, over one load trace, in one run.

    .venv/bin/python benchmarks/adaptive_vs_static.py [--out DIR] [--step-s 3] [--repository R]
    .venv/bin/python benchmarks/adaptive_vs_static.py --ends   # light and mid load vs bare ORT
    .venv/bin/python benchmarks/adaptive_vs_static.py --llm    # tiny-llama token budget

One `fulcrum serve --model minilm` process. First its capacity: the highest Poisson rate it
sustains open loop (`load_trace.open_loop_capacity`, stepped up from the requests/s a closed loop
of 32 clients gets from the shipped config under Triton's rules, the better of two), since the
trace is sent open loop and a closed loop overstates what a server sustains that way (the
closed-loop rate is measured again at the end, to show how far the machine drifted). Then a small
sweep of static configs (max_batch_size x max_queue_delay_ms) at the trace's peak rate (1.5x
capacity) picks the best static config for the peak, and `fulcrum tune` searches the batching
knobs for the config with the highest rate whose P99 holds the SLO (`static_by_tune.py`; skip it
with --no-tune). Then the same trace (Poisson arrivals within each step, from 10% of capacity up
to 150% and back, with a 1 s burst at 200% on the way up and on the way down; the same arrival
times for every policy) is replayed open loop against (a) no batching (no [dynamic_batching]),
(b) the shipped config under Triton's rules (`policy = "triton"`), (c) the sweep's best static
config for the peak and tune's winner, (d) `policy = "adaptive"` with `slo_p99_ms`. The server
serves a copy of minilm whose file is under Triton's rules (what tune reads).
Policies are switched by reloading the model with a config override (POST
/v2/repository/models/minilm/load), not by restarting the server; each gets a 2 s warm-up at 30% of
capacity after its reload. With --rounds N the trace is replayed N times per policy (round k with
seed + k, the policies' order reversed every other round), and adaptive's ratios are given per
round with their median: one replay's goodput swings by several percent on a shared machine.

Per policy: goodput (answers within the SLO per second over the whole trace), the widest load
range where 99% of requests were answered within the SLO (a 503 or a timeout counts as late),
admitted P99 and mean batch size per step (from /v2/models/minilm/stats), 503s; the ratio of
adaptive's goodput to each static config's and to the best of them over the trace; a plot (load,
P99, batch size over time, one line per policy) and the figures as JSON under --out. Every static
config is told the SLO (`static_override`), as the shipped one is. The load generator shares the
machine's cores with the server, as in every benchmark here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
from collections.abc import Coroutine, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from corpus import sentences
from health_under_flood import serving
from load_trace import (
    PolicyResult,
    Step,
    StepResult,
    arrival_times,
    open_loop_capacity,
    policy_state,
    print_steps,
    ramp_trace,
    reload,
    replay,
    settle,
    summarize_steps,
)
from static_by_tune import add_tune_args, triton_copy, tuned_static

from fulcrum.client import Endpoint
from fulcrum.demo_bench import under_triton_rules
from fulcrum.loadgen.bench import Bench, BenchOptions
from fulcrum.loadgen.kserve import PreparedRequest, V2Target, encode_request
from fulcrum.loadgen.records import RequestRecord
from fulcrum.loadgen.stats import Slo
from fulcrum.loadgen.windows import MeasurePlan

MODEL = "minilm"
# The static sweep at the peak: (max_batch_size, max_queue_delay_ms). (64, 0) is the shipped one.
SWEEP = ((8, 0.0), (16, 0.0), (32, 0.0), (64, 0.0), (16, 5.0), (64, 5.0))
NO_BATCHING: dict[str, object] = {"dynamic_batching": None}
CAPACITY_CLIENTS = 32
T = TypeVar("T")


def static_override(max_batch: int, delay_ms: float, slo_ms: float) -> dict[str, object]:
    """A static config told the SLO, as the shipped one is: under Triton's rules slo_p99_ms only
    bounds the queue at what drains within it (without one the bound is a second's drain)."""
    batching = {"policy": "triton", "max_queue_delay_ms": delay_ms, "slo_p99_ms": slo_ms}
    return {"max_batch_size": max_batch, "dynamic_batching": batching}


def adaptive_override(slo_ms: float, profile: str | None) -> dict[str, object]:
    batching: dict[str, object] = {"policy": "adaptive", "slo_p99_ms": slo_ms}
    if profile:
        batching["profile"] = profile
    return {"dynamic_batching": batching}


def v2_requests(url: str, num: int, num_words: int) -> list[PreparedRequest]:
    """One-sentence JSON infer requests (JSON bodies, as most clients send them)."""
    endpoint = Endpoint.from_url(url)
    out = []
    for text in sentences(num, num_words, seed=1):
        tensors = {"text": np.array([[text.encode()]], dtype=object)}
        out.append(PreparedRequest(encode_request(endpoint, MODEL, tensors, binary=False), 1))
    return out


def capacity_rps(url: str, target: V2Target, seconds: float) -> float:
    """Closed-loop requests/s of the config as loaded: what it sustains at saturation."""
    plan = MeasurePlan(warmup_s=1.5, window_s=seconds, max_duration_s=seconds)
    bench = Bench(BenchOptions(model=MODEL, url=url, plan=plan), target, [])
    point = run_async(bench.point("concurrency", CAPACITY_CLIENTS))
    return point.throughput_rps


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    import uvloop

    return uvloop.run(coro)


class Runner:
    """Replays traces against one server, reloading the model between policies."""

    def __init__(self, url: str, target: V2Target, args: argparse.Namespace) -> None:
        self.url = url
        self.target = target
        self.args = args
        self.slo = Slo(bound_ms=args.slo_ms, percentile=99.0)

    def good(self, record: RequestRecord) -> bool:
        return record.outcome.ok and record.latency_s * 1e3 <= self.args.slo_ms

    def play(self, steps: Sequence[Step], capacity: float, seed: int) -> list[StepResult]:
        offsets = arrival_times(steps, capacity, seed)
        run = run_async(replay(self.target, steps, offsets, url=self.url, model=MODEL,
                               timeout_s=self.args.timeout_s))  # fmt: skip
        run_async(settle(self.url, MODEL))
        return summarize_steps(run, steps, [self.slo], self.good)

    def switch(self, override: dict[str, object] | None, capacity: float) -> None:
        """Reload with `override`, then a short warm-up (not measured) at 30% of capacity."""
        reload(self.url, MODEL, override)
        self.play([Step(0.0, self.args.warmup_s, 0.3)], capacity, seed=99)

    def policy(self, name: str, override: dict[str, object] | None, steps: Sequence[Step],
               capacity: float, seed: int) -> PolicyResult:  # fmt: skip
        self.switch(override, capacity)
        results = self.play(steps, capacity, seed)
        state = policy_state(self.url, MODEL)
        return PolicyResult(name, override, results, steps[-1].end_s, state)

    def sweep(self, capacity: float) -> list[tuple[int, float, float]]:
        """(max_batch_size, delay, goodput req/s) of each static config at the peak rate."""
        peak = [Step(0.0, self.args.sweep_s, self.args.peak)]
        out = []
        for max_batch, delay_ms in SWEEP:
            self.switch(static_override(max_batch, delay_ms, self.args.slo_ms), capacity)
            steps = self.play(peak, capacity, self.args.seed + 1)
            goodput = steps[0].good / self.args.sweep_s
            print(f"  sweep max_batch_size={max_batch:3d} delay={delay_ms:g} ms: goodput "
                  f"{goodput:6.1f} req/s, P99 {steps[0].p99_ms['latency']:7.1f} ms, "
                  f"503 {steps[0].shed}, timeouts {steps[0].timed_out}", flush=True)  # fmt: skip
            out.append((max_batch, delay_ms, goodput))
        return out


def adaptive_loads(url: str, slo_ms: float, profile: str | None) -> str | None:
    """None when `policy = "adaptive"` loads; else why not (the server's answer)."""
    try:
        reload(url, MODEL, adaptive_override(slo_ms, profile))
    except RuntimeError as exc:
        return str(exc)
    return None


def run_trace(repo: Path, tmp: Path, args: argparse.Namespace) -> dict[str, object]:
    steps = ramp_trace(args.step_s, burst_s=args.burst_s, peak=args.peak)
    # The file's config under Triton's rules, served from a copy that `fulcrum tune` reads too.
    repo = triton_copy(repo, tmp, MODEL)
    with serving(repo, args.src.resolve(), args.out / "server.log") as (url, _port):
        target = V2Target(Endpoint.from_url(url), v2_requests(url, 256, args.words))
        runner = Runner(url, target, args)
        # The static configs and the capacity are under Triton's rules (minilm ships the adaptive
        # policy, whose 503s would lower a closed loop's rate).
        triton = under_triton_rules(repo / MODEL / "config.toml")
        runner.switch(triton, 20.0)
        capacity = args.capacity or measure_capacity(url, target, args)
        print(f"capacity (shipped config, open loop{'' if not args.capacity else ', as given'}): "
              f"{capacity:.1f} req/s; peak {args.peak:g}x = {capacity * args.peak:.0f} req/s",
              flush=True)  # fmt: skip
        sweep = runner.sweep(capacity)
        best_batch, best_delay, _ = max(sweep, key=lambda row: row[2])
        policies: list[tuple[str, dict[str, object] | None]] = [
            ("no batching", NO_BATCHING),
            ("shipped static", triton),
            (f"best static (batch {best_batch}, delay {best_delay:g})",
             static_override(best_batch, best_delay, args.slo_ms)),
        ]  # fmt: skip
        tuned = None if args.no_tune else tuned_static(url, repo, MODEL, args, capacity)
        if tuned is not None:
            policies.append(tuned)
        why_not = adaptive_loads(url, args.slo_ms, args.profile)
        if why_not is None:
            policies.append((f"adaptive (slo {args.slo_ms:g} ms)",
                             adaptive_override(args.slo_ms, args.profile)))  # fmt: skip
        else:
            print(f"adaptive does not load here, run without it: {why_not}", flush=True)
        # Round k replays seed + k's arrivals for every policy, in the order reversed every
        # other round, so that a drift of the shared machine reaches all policies alike.
        rounds: list[list[PolicyResult]] = []
        for k in range(args.rounds):
            played: dict[str, PolicyResult] = {}
            for name, override in policies if k % 2 == 0 else policies[::-1]:
                print(f"trace (round {k + 1} of {args.rounds}): {name} ...", flush=True)
                played[name] = runner.policy(name, override, steps, capacity, args.seed + k)
            rounds.append([played[name] for name, _ in policies])
        reload(url, MODEL, triton)
        after = capacity_rps(url, target, args.capacity_s)
    return {"capacity_rps": capacity, "capacity_after_rps": after, "sweep": sweep,
            "results": rounds[0], "rounds": rounds, "steps": steps,
            "adaptive_error": why_not}  # fmt: skip


def measure_capacity(url: str, target: V2Target, args: argparse.Namespace) -> float:
    """The highest Poisson rate the shipped config sustains open loop (the trace is sent open
    loop), stepped up from a closed loop's rate, the better of two: on a shared machine a
    neighbour only ever makes it look lower."""
    first = [capacity_rps(url, target, args.capacity_s) for _ in range(2)]
    closed = max(first)
    print(f"closed loop ({CAPACITY_CLIENTS} clients): {closed:.1f} req/s (of {first[0]:.1f}, "
          f"{first[1]:.1f})", flush=True)  # fmt: skip
    capacity = run_async(open_loop_capacity(target, url, MODEL, closed))
    if capacity <= 0:
        raise SystemExit("not even 0.2x the closed-loop rate was sustained: machine too busy")
    return capacity


def report(found: dict[str, object], args: argparse.Namespace) -> None:
    results: list[PolicyResult] = found["results"]  # type: ignore[assignment]
    capacity: float = found["capacity_rps"]  # type: ignore[assignment]
    steps = results[0].steps
    offered = sum(s.offered for s in steps)
    print(f"\ntrace: {len(steps)} steps, {results[0].duration_s:.0f} s, {offered} requests; "
          f"capacity {capacity:.1f} req/s at the start, {found['capacity_after_rps']:.1f} at the "
          f"end; SLO P99 <= {args.slo_ms:g} ms")  # fmt: skip
    print("| policy | goodput req/s | answered in SLO | 99% in SLO up to load | steps in SLO "
          "| 503 | timeouts |\n|---|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    for r in results:
        widest = r.widest_load()
        within = r.steps_within()
        print(f"| {r.name} | {r.goodput_rps:.1f} | {sum(s.good for s in r.steps) / offered:.0%} "
              f"| {'none' if widest is None else f'{widest:.0%}'} | {sum(within)}/{len(within)} "
              f"| {r.shed} | {r.timed_out} |")  # fmt: skip
    print("\nper step: admitted P99 ms / mean batch size")
    print_steps(results, lambda s: f"{s.p99_ms['latency']:.0f} / {_fmt(s.mean_batch)}")
    adaptive = [r for r in results if r.name.startswith("adaptive")]
    statics = [r for r in results if not r.name.startswith(("adaptive", "no batching"))]
    if adaptive:
        print()
        for r in statics:  # the goal is against tune's pick (the sweep's without tune)
            ratio = adaptive[0].goodput_rps / r.goodput_rps if r.goodput_rps else np.inf
            print(f"adaptive / {r.name} goodput: {ratio:.2f}x")
        if statics:
            best = max(statics, key=lambda r: r.goodput_rps)
            ratio = adaptive[0].goodput_rps / best.goodput_rps if best.goodput_rps else np.inf
            print(f"adaptive / the best static over this trace ({best.name}): {ratio:.2f}x "
                  f"(goal >= 1.3x against the best static config)")  # fmt: skip
    for r in results:
        print(f"{r.name}: policy state after the trace: {json.dumps(r.state, default=str)}")
    report_rounds(found["rounds"])  # type: ignore[arg-type]
    print(
        f"machine: {platform.machine()}, {len(os.sched_getaffinity(0))} CPUs, load average "
        f"{os.getloadavg()[0]:.1f}; {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC"
    )


def report_rounds(rounds: list[list[PolicyResult]]) -> None:
    """With --rounds > 1: each policy's goodput in every round, and adaptive's ratios per round
    (the same arrivals within a round), with their median and spread."""
    if len(rounds) < 2:
        return
    print(f"\n{len(rounds)} rounds: goodput req/s (answered in SLO) per round; median")
    print("| policy | " + " | ".join(f"round {k + 1}" for k in range(len(rounds))) + " | median |")
    print("|---|" + "---:|" * (len(rounds) + 1))
    offered = sum(s.offered for s in rounds[0][0].steps)
    for i, first in enumerate(rounds[0]):
        cells = [f"{r[i].goodput_rps:.1f} ({sum(s.good for s in r[i].steps) / offered:.0%})"
                 for r in rounds]  # fmt: skip
        median = float(np.median([r[i].goodput_rps for r in rounds]))
        print(f"| {first.name} | " + " | ".join(cells) + f" | {median:.1f} |")
    names = [r.name for r in rounds[0]]
    if not any(name.startswith("adaptive") for name in names):
        return
    a = next(i for i, name in enumerate(names) if name.startswith("adaptive"))
    statics = [i for i, name in enumerate(names) if not name.startswith(("adaptive", "no batch"))]
    for label, pick in [(names[i], [i]) for i in statics] + [("the best static", statics)]:
        ratios = [r[a].goodput_rps / max(max(r[i].goodput_rps for i in pick), 1e-9)
                  for r in rounds]  # fmt: skip
        print(f"adaptive / {label}: " + ", ".join(f"{x:.2f}x" for x in ratios)
              + f"; median {np.median(ratios):.2f}x")  # fmt: skip


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def save(found: dict[str, object], args: argparse.Namespace) -> None:
    from load_trace_plot import plot_policies

    results: list[PolicyResult] = found["results"]  # type: ignore[assignment]
    capacity: float = found["capacity_rps"]  # type: ignore[assignment]
    path = plot_policies(results, capacity, args.out / "adaptive_vs_static.png", "latency",
                         args.slo_ms, title=f"minilm, capacity {capacity:.0f} req/s")  # fmt: skip
    print(f"plot: {path}")
    data = {**found, "results": [asdict(r) for r in results], "args": vars(args)}
    data["rounds"] = [[asdict(r) for r in played] for played in found["rounds"]]  # type: ignore[attr-defined]
    data["steps"] = [asdict(s) for s in found["steps"]]  # type: ignore[attr-defined]
    (args.out / "adaptive_vs_static.json").write_text(json.dumps(data, indent=1, default=str))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--ends", action="store_true", help="light and mid load beside a bare FastAPI + ORT app")
    add("--llm", action="store_true", help="tiny-llama: adaptive token budget vs fixed budgets")
    add("--repository", type=Path, help="an example repository (default: built in a temp dir)")
    add("--out", type=Path, default=Path("bench-out/adaptive_vs_static"), help="plot and JSON here")
    add("--src", type=Path, default=Path(__file__).parent.parent / "src",
        help="source tree put first on the server's PYTHONPATH")  # fmt: skip
    add("--slo-ms", type=float, default=100.0, help="P99 SLO and adaptive's slo_p99_ms")
    add("--profile", choices=["realtime", "throughput", "mixed"], help="adaptive's profile")
    add("--step-s", type=float, default=3.0, help="seconds per load level of the trace")
    add("--burst-s", type=float, default=1.0, help="seconds of each 200%% burst (0: none)")
    add("--peak", type=float, default=1.5, help="the trace's peak, a multiple of capacity")
    add("--sweep-s", type=float, default=5.0, help="seconds per static config at the peak")
    add("--capacity-s", type=float, default=4.0, help="seconds of the capacity measurement")
    add("--warmup-s", type=float, default=2.0, help="unmeasured load after each reload")
    add("--timeout-s", type=float, default=5.0, help="client timeout per request")
    add("--words", type=int, default=12, help="words per sentence")
    add("--seed", type=int, default=0)
    add("--rounds", type=int, default=1, help="replays of the trace per policy (seed + round)")
    from adaptive_ends import add_ends_args
    from adaptive_llm import add_llm_args

    add_ends_args(parser)
    add_llm_args(parser)
    add_tune_args(parser)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        if args.llm:
            from adaptive_llm import run_llm

            return run_llm(Path(tmp), args)
        repo = args.repository or build_repository(Path(tmp))
        if args.ends:
            from adaptive_ends import run_ends

            return run_ends(repo, args)
        found = run_trace(repo, Path(tmp), args)
    report(found, args)
    save(found, args)
    return 0


def build_repository(tmp: Path) -> Path:
    from fulcrum.examples import build_examples

    repo = tmp / "models"
    build_examples(repo)
    return repo


if __name__ == "__main__":
    sys.exit(main())
