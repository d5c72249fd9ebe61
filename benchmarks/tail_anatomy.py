"""Where the P99 of the middle of the range goes: every request of an open-loop Poisson point
(default 80% of the shipped minilm config's capacity) split into its parts, for the shipped
config and any --variant, interleaved per repeat with the same arrivals.

Per request: the load generator's own lag (scheduled -> sent); the server's queue wait and
batch compute with the batch's rows (Server-Timing `queue`, `compute`, `batch`); the server's own
path (`total` - queue - compute: body read, decode, enqueue, hand-back to the loop, encode);
outside (latency - lag - total: the connection, ASGI before the handler, response write, client
read); and the server's garbage-collector pauses that overlap it (gc.callbacks, recorded in the
server process by a wrapper around `fulcrum serve`; perf_counter is one clock machine-wide).

    .venv/bin/python benchmarks/tail_anatomy.py --repository /tmp/bench_models --out /tmp/tail \\
        --variant 'gc frozen:...' --repeats 3

Prints, per server and repeat, the median of each part over all requests and over the slowest
1%, how much slower than its rows predict each slow request's batch ran, and the GC summary.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from adaptive_ends import copy_with
from health_under_flood import serving

from fulcrum.client import Endpoint
from fulcrum.loadgen.driver import PerfTimer, Slot
from fulcrum.loadgen.kserve import PreparedRequest, V2Slot, V2Target
from fulcrum.loadgen.open_loop import run_open_loop
from fulcrum.loadgen.records import Outcome, RequestRecord
from fulcrum.loadgen.windows import MeasurePlan

# Runs `fulcrum serve` with a GC recorder: each collection's start, pause and generation, and
# the collector's settings, written as JSON when the server exits (SIGTERM shuts uvicorn down).
GC_WRAPPER = """
import atexit, gc, json, sys, time
path = sys.argv[1]
events, start = [], [0.0]
def on_gc(phase, info):
    now = time.perf_counter()
    if phase == "start":
        start[0] = now
    else:
        events.append((start[0], now - start[0], info["generation"]))
gc.callbacks.append(on_gc)
def dump():
    with open(path, "w") as f:
        json.dump({"events": events, "threshold": gc.get_threshold(), "count": gc.get_count(),
                   "frozen": gc.get_freeze_count()}, f)
atexit.register(dump)
from fulcrum.cli import main
sys.exit(main(sys.argv[2:]))
"""
PARTS = ("latency", "lag", "queue", "compute", "rows", "server_path", "outside", "gc")


@dataclass
class Server:
    name: str
    url: str
    gc_path: Path
    requests: list[PreparedRequest]
    repeats: list[list[dict[str, float]]] = field(default_factory=list)


class TracedOutcome(Outcome):
    """An outcome with the server's `total` (handler start -> response built), in ms."""

    __slots__ = ("total_ms",)

    def __init__(self, outcome: Outcome, total_ms: float | None) -> None:
        super().__init__(outcome.status, outcome.num_rows, outcome.queue_ms, outcome.compute_ms,
                         outcome.batch_size, outcome.error)  # fmt: skip
        self.total_ms = total_ms


class TracedSlot:
    """A V2 slot that keeps the `total` Server-Timing entry too."""

    def __init__(self, target: V2Target) -> None:
        self.target = target
        self.slot = V2Slot(target)

    async def send(self, timeout_s: float) -> Outcome:
        target = self.target
        request = target.requests[target.num_sent % len(target.requests)]
        target.num_sent += 1
        response = await self.slot.connection.request(request.raw, timeout_s=timeout_s)
        timing = response.server_timing_ms()
        outcome = Outcome(response.status, 1, timing.get("queue"), timing.get("compute"),
                          timing.get("batch"))  # fmt: skip
        return TracedOutcome(outcome, timing.get("total"))

    def close(self) -> None:
        self.slot.close()


class TracedTarget(V2Target):
    def open_slot(self) -> Slot:
        return TracedSlot(self)


@contextmanager
def traced_serving(repo: Path, src: Path, log_path: Path, gc_path: Path) -> Iterator[str]:
    with serving(repo, src, log_path, launcher=("-c", GC_WRAPPER, str(gc_path))) as (url, _):
        yield url


def parts(record: RequestRecord) -> dict[str, float] | None:
    """The request's parts in ms (None: not answered, or no Server-Timing)."""
    out = record.outcome
    if not (out.ok and isinstance(out, TracedOutcome) and out.total_ms is not None):
        return None
    if out.queue_ms is None or out.compute_ms is None or out.batch_size is None:
        return None
    latency = record.latency_s * 1e3
    lag = record.lag_s * 1e3
    return {
        "latency": latency, "lag": lag, "queue": out.queue_ms, "compute": out.compute_ms,
        "rows": out.batch_size, "server_path": out.total_ms - out.queue_ms - out.compute_ms,
        "outside": latency - lag - out.total_ms, "sent_s": record.sent_s, "done_s": record.done_s,
    }  # fmt: skip


def measure(server: Server, rate: float, seconds: float, seed: int) -> list[dict[str, float]]:
    from adaptive_vs_static import run_async

    plan = MeasurePlan(warmup_s=1.0, window_s=seconds, max_duration_s=seconds, num_stable=1)
    target = TracedTarget(Endpoint.from_url(server.url), server.requests)
    raw = run_async(run_open_loop(target, rate, plan, PerfTimer(), seed=seed, timeout_s=10.0))
    rows = [p for p in map(parts, raw.measurement.records) if p is not None]
    num_sent = len(raw.measurement.records)
    print(f"  {server.name:24} {rate:6.1f}/s answered {len(rows)} of {num_sent}, "
          f"generator behind {raw.num_behind}", flush=True)  # fmt: skip
    return rows


def add_gc(rows: list[dict[str, float]], events: list[list[float]]) -> None:
    """Each request's overlap with the server's GC pauses, in ms."""
    if not rows:
        return
    starts = np.array([e[0] for e in events])
    ends = starts + np.array([e[1] for e in events])
    for row in rows:
        hit = (starts < row["done_s"]) & (ends > row["sent_s"])
        overlap = np.minimum(ends[hit], row["done_s"]) - np.maximum(starts[hit], row["sent_s"])
        row["gc"] = float(overlap.sum()) * 1e3


def report(server: Server, k: int, rows: list[dict[str, float]]) -> None:
    latencies = sorted(r["latency"] for r in rows)
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    tail = [r for r in rows if r["latency"] >= p99]
    # A run slower per row than the point's other batches of its size was slowed (preempted,
    # a stall) rather than merely large.
    per_row: dict[int, list[float]] = {int(r["rows"]): [] for r in rows}
    for r in rows:
        per_row[int(r["rows"])].append(r["compute"] / r["rows"])
    typical = {n: statistics.median(v) for n, v in per_row.items()}

    def med(group: list[dict[str, float]], key: str) -> str:
        return f"{statistics.median(r[key] for r in group):.1f}"

    p50 = statistics.median(latencies)
    print(f"\n{server.name}, repeat {k + 1}: {len(rows)} answered, P50 {p50:.1f} ms, "
          f"P99 {p99:.1f} ms; medians (ms; rows)")  # fmt: skip
    print("| requests | " + " | ".join(PARTS) + " |")
    print("|---|" + "---:|" * len(PARTS))
    for label, group in (("all", rows), (f"slowest 1% ({len(tail)})", tail)):
        print(f"| {label} | " + " | ".join(med(group, p) for p in PARTS) + " |")
    tail_per_row = statistics.median(r["compute"] / r["rows"] for r in tail)
    print(f"slowest 1%: compute per row {tail_per_row:.1f} ms (all requests' batches "
          f"{statistics.median(r['compute'] / r['rows'] for r in rows):.1f}); queue > compute in "
          f"{sum(r['queue'] > r['compute'] for r in tail)} of {len(tail)}; ms per row by batch "
          "rows: " + ", ".join(f"{n}:{typical[n]:.1f}" for n in sorted(typical)))  # fmt: skip
    for r in sorted(tail, key=lambda r: -r["latency"])[:8]:
        print("   " + "  ".join(f"{p} {r[p]:.1f}" for p in PARTS))


def gc_summary(server: Server) -> None:
    """The collections that ran while a measured point did (not at start-up or warm-up)."""
    data = json.loads(server.gc_path.read_text())
    spans = [(min(r["sent_s"] for r in rows), max(r["done_s"] for r in rows))
             for rows in server.repeats if rows]  # fmt: skip
    events = [e for e in data["events"] if any(a <= e[0] <= b for a, b in spans)]
    pauses = [e[1] * 1e3 for e in events]
    by_gen = [sum(1 for e in events if e[2] == g) for g in range(3)]
    measured_s = sum(b - a for a, b in spans)
    print(f"{server.name}: over {measured_s:.0f} s measured, {len(pauses)} collections "
          f"(gen 0/1/2: {by_gen}), {sum(pauses):.0f} ms in all, slowest "
          f"{max(pauses, default=0.0):.1f} ms, {sum(x > 5 for x in pauses)} over 5 ms; "
          f"threshold {data['threshold']}, frozen {data['frozen']} objects")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repository", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("/tmp/tail_anatomy"))
    parser.add_argument("--src", type=Path, default=Path(__file__).parent.parent / "src")
    parser.add_argument("--rate", type=float, help="req/s (default: --fraction of --capacity)")
    parser.add_argument("--capacity", type=float, help="open-loop capacity, req/s")
    parser.add_argument("--fraction", type=float, default=0.8)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--words", type=int, default=12)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...")
    args = parser.parse_args()
    from adaptive_vs_static import v2_requests

    args.out.mkdir(parents=True, exist_ok=True)
    repo = args.repository.resolve()
    all_servers: list[Server] = []
    with ExitStack() as stack:
        configs = [("fulcrum shipped", repo)]
        for i, spec in enumerate(args.variant):
            name, assignments = spec.split(":", 1)
            dest = args.out / f"repo{i}"
            shutil.rmtree(dest, ignore_errors=True)  # a copy left by an earlier run
            configs.append((name, copy_with(repo, dest, assignments.split(","))))
        for i, (name, where) in enumerate(configs):
            gc_path = args.out / f"gc{i}.json"
            url = stack.enter_context(traced_serving(where, args.src.resolve(),
                                                     args.out / f"s{i}.log", gc_path))  # fmt: skip
            all_servers.append(Server(name, url, gc_path, v2_requests(url, 256, args.words)))
        rate = args.rate or _rate(all_servers[0], args)
        for k in range(args.repeats):
            for server in all_servers:
                server.repeats.append(measure(server, rate, args.seconds, args.seed + k))
    for server in all_servers:  # the servers exited: their GC records are written
        events = json.loads(server.gc_path.read_text())["events"]
        for k, rows in enumerate(server.repeats):
            add_gc(rows, events)
            report(server, k, rows)
        gc_summary(server)
    return 0


def _rate(shipped: Server, args: argparse.Namespace) -> float:
    from adaptive_vs_static import capacity_rps, run_async
    from load_trace import open_loop_capacity

    capacity = args.capacity
    if capacity is None:
        target = V2Target(Endpoint.from_url(shipped.url), shipped.requests)
        closed = capacity_rps(shipped.url, target, 4.0)
        capacity = run_async(open_loop_capacity(target, shipped.url, "minilm", closed))
    print(f"capacity {capacity:.1f} req/s open loop; measuring at {args.fraction:.0%}", flush=True)
    return float(args.fraction * capacity)


if __name__ == "__main__":
    sys.exit(main())
