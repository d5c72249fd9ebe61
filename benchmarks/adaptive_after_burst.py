"""Light load right after a burst, for the adaptive policy: what it refuses once a burst is over.

    .venv/bin/python benchmarks/adaptive_after_burst.py --before-src /tmp/before/src [--repeats 2]

Two `fulcrum serve --model minilm` processes with the shipped config (`policy = "adaptive"`), one
running the code under --before-src, one under --src, up at once on 127.0.0.1 and measured in
turn (the order alternates per repeat, so a drift of the shared machine reaches both alike). Per
server and repeat: a closed-loop burst of --burst-clients clients for --burst-s seconds, then at
once (no warm-up) Poisson open loop at each --light-rates rate for --light-s seconds. Per light
point: 503s, P50/P99 of the answered requests, the share answered within the SLO and within 1 s;
and the policy's state from the statistics API before the burst, after it and after each point
(fit, error, arrival margin, overhead reserve, shed counts).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from adaptive_vs_static import build_repository, run_async, v2_requests
from health_under_flood import serving
from load_trace import policy_state, settle

from fulcrum.client import Endpoint
from fulcrum.loadgen.bench import Bench, BenchOptions
from fulcrum.loadgen.kserve import V2Target
from fulcrum.loadgen.results import PointResult
from fulcrum.loadgen.stats import Slo
from fulcrum.loadgen.windows import MeasurePlan

MODEL = "minilm"
STATE_KEYS = ("batch_fixed_ms", "batch_row_ms", "batch_error", "arrival_margin",
              "overhead_reserve_ms", "batch_limit", "shed_deadline", "shed_late", "shed_head",
              "probes", "batches_observed")  # fmt: skip


def state(url: str) -> dict[str, object]:
    found = policy_state(url, MODEL)
    if not isinstance(found, dict):
        return {}
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in found.items()
            if k in STATE_KEYS}  # fmt: skip


def measure(url: str, mode: str, level: float, seconds: float, warmup_s: float,
            seed: int) -> PointResult:  # fmt: skip
    plan = MeasurePlan(warmup_s=warmup_s, window_s=seconds, max_duration_s=seconds, num_stable=1)
    options = BenchOptions(model=MODEL, url=url, plan=plan, seed=seed, timeout_s=10.0)
    target = V2Target(Endpoint.from_url(url), v2_requests(url, 256, 12))
    slo = Slo(bound_ms=100.0, percentile=99.0)
    return run_async(Bench(options, target, [slo]).point(mode, level))


def one(name: str, url: str, args: argparse.Namespace, seed: int) -> dict[str, object]:
    run_async(settle(url, MODEL))
    found: dict[str, object] = {"server": name, "load": os.getloadavg()[0], "before": state(url)}
    burst = measure(url, "concurrency", args.burst_clients, args.burst_s, 0.5, seed)
    found["burst_rps"] = burst.throughput_rps
    found["after_burst"] = state(url)
    points = []
    for rate in args.light_rates:
        p = measure(url, "rate", rate, args.light_s, 0.0, seed)
        within = (p.goodput_rps or 0.0) * p.duration_s / max(1, p.num_requests)
        # cdf_ms: a sorted sample of the answered requests' latencies
        answered = sum(1 for ms in p.cdf_ms if ms <= 1000.0) / max(1, len(p.cdf_ms))
        one_s = answered * p.num_ok / max(1, p.num_requests)
        points.append({"rate": rate, "n": p.num_requests, "refused": p.errors.get("503", 0),
                       "errors": p.errors, "p50_ms": p.latency.p50_ms, "p99_ms": p.latency.p99_ms,
                       "within_slo": within, "within_1s": one_s, "state": state(url)})  # fmt: skip
        print(f"  {name:7} {rate:4g}/s n {p.num_requests:4} 503 {p.errors.get('503', 0):3} "
              f"P50 {p.latency.p50_ms:6.1f} P99 {p.latency.p99_ms:7.1f} ms within SLO "
              f"{within:.0%} within 1 s {one_s:.0%}", flush=True)  # fmt: skip
    found["light"] = points
    print(f"  {name:7} load {found['load']:.1f} burst {burst.throughput_rps:.1f}/s; after the "
          f"burst {found['after_burst']}\n          after the light load {points[-1]['state']}",
          flush=True)  # fmt: skip
    return found


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--before-src", type=Path, required=True, help="the code to compare against (its src/)")
    add("--src", type=Path, default=Path(__file__).parent.parent / "src", help="the code to test")
    add("--repeats", type=int, default=2)
    add("--burst-clients", type=int, default=32)
    add("--burst-s", type=float, default=10.0)
    add("--light-rates", type=lambda s: [float(r) for r in s.split(",")], default=[2.0, 5.0, 10.0])
    add("--light-s", type=float, default=15.0)
    add("--out", type=Path, default=Path("bench-out/adaptive_after_burst"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        repo = build_repository(Path(tmp))
        copy = Path(tmp) / "copy"
        shutil.copytree(repo / MODEL, copy / MODEL)
        before_log, after_log = args.out / "before.log", args.out / "after.log"
        with serving(copy, args.before_src.resolve(), before_log) as (before_url, _), \
                serving(repo, args.src.resolve(), after_log) as (after_url, _):  # fmt: skip
            servers = [("before", before_url), ("after", after_url)]
            for k in range(args.repeats):
                for name, url in servers if k % 2 == 0 else servers[::-1]:
                    runs.append(one(name, url, args, seed=k))
    (args.out / "runs.json").write_text(json.dumps(runs, indent=1))
    print("\n| server | repeat | load | rate | 503 | P50 ms | P99 ms | within SLO | within 1 s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for i, run in enumerate(runs):
        for p in run["light"]:  # type: ignore[attr-defined]
            print(f"| {run['server']} | {i // 2} | {run['load']:.1f} | {p['rate']:g} | "
                  f"{p['refused']} | {p['p50_ms']:.1f} | {p['p99_ms']:.0f} | "
                  f"{p['within_slo']:.0%} | {p['within_1s']:.0%} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
