"""A retry storm: closed-loop clients that send their next request the moment they get an
answer, a 503 included (Retry-After ignored), against the shipped minilm (issue #11).

    .venv/bin/python benchmarks/retry_storm.py [--clients 32] [--seconds 20] [--rounds 2]
        [--variant after=src] [--variant before=/tmp/storm_before/src]
        [--variant off=src:--refusals-per-connection=0] [--capacity 105]

Each variant (NAME=SRC[:FLAG,FLAG...]: a source tree and extra `fulcrum serve` flags) gets its
own `fulcrum serve --model minilm` per round, variants alternating within each round. Capacity
is the open-loop capacity of the first server (as `overload_minute.py` measures it, under
Triton's rules), unless `--capacity` gives it. Per run, over `--seconds` of storm after a warm-up:
answered req/s (and as a share of capacity), refusals/s, answered P50/P99 (from each request's
send, holds included), the server's CPU in cores (event loop and compute threads apart) and this
process's, a prober's health P99 (its own process and connection, 20 Hz), the adaptive policy's
counters and the server's `fulcrum_refusal_holds_total`. Figures also go to --out as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from adaptive_vs_static import build_repository, run_async, v2_requests
from health_under_flood import probed, serving, summary
from load_trace import Step, policy_state, reload
from overload_minute import (
    CpuAccount,
    config_override,
    measure_capacity,
    play,
    policy_counts,
    server_process,
)

from fulcrum.client import Endpoint
from fulcrum.loadgen.driver import send_once
from fulcrum.loadgen.kserve import V2Target
from fulcrum.loadgen.records import RequestRecord

MODEL = "minilm"
PROBE_HZ = 20.0
HOLDS = re.compile(r"^fulcrum_refusal_holds_total (\S+)$", re.M)


@dataclass
class StormRun:
    """One variant's server under the storm."""

    variant: str
    round: int
    load_before: float
    answered_rps: float
    answered_share: float  # of capacity
    refused_rps: float
    other: int  # neither 200 nor 503 (timeouts, errors)
    answered_p50_ms: float
    answered_p99_ms: float
    # answered requests sent after an answer (not a refusal) on their connection: no hold can
    # precede them, so this is the server's own latency for what it admits
    answered_after_answer_p99_ms: float
    refused_p99_ms: float
    health_p99_ms: float
    health_bad: int
    server_cores: float
    server_threads_cores: dict[str, float]
    generator_cores: float
    holds: float | None  # fulcrum_refusal_holds_total gained (None: the tree has no such metric)
    policy: dict[str, float] | None


def percentile_ms(values_s: list[float], q: float) -> float:
    if not values_s:
        return float("nan")
    ordered = sorted(values_s)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3


async def closed_loop(
    target: V2Target, clients: int, seconds: float
) -> list[tuple[RequestRecord, bool]]:
    """`clients` connections, each sending its next request as soon as an answer arrives; each
    record with whether the previous request on its connection was refused."""
    records: list[tuple[RequestRecord, bool]] = []
    until = time.perf_counter() + seconds

    async def client() -> None:
        slot = target.open_slot()
        after_refusal = False
        try:
            while time.perf_counter() < until:
                sent_s = time.perf_counter()
                outcome = await send_once(slot, 30.0)
                record = RequestRecord(sent_s, sent_s, time.perf_counter(), outcome)
                records.append((record, after_refusal))
                after_refusal = outcome.status == 503
        finally:
            slot.close()

    await asyncio.gather(*(client() for _ in range(clients)))
    return records


def holds_total(url: str) -> float | None:
    found = HOLDS.search(httpx.get(f"{url}/metrics", timeout=30).text)
    return None if found is None else float(found.group(1))


def storm(url: str, port: int, target: V2Target, args: argparse.Namespace, capacity: float,
          name: str, round_: int) -> StormRun:  # fmt: skip
    load = os.getloadavg()[0]
    run_async(closed_loop(target, args.clients, 3.0))  # warm-up: the policy meets the storm
    proc = server_process(port)
    prober, pipe = probed(port, PROBE_HZ, args.seconds)
    policy_before, holds_before = policy_state(url, MODEL), holds_total(url)
    with CpuAccount(proc) as cpu:
        records = run_async(closed_loop(target, args.clients, args.seconds))
    policy_after, holds_after = policy_state(url, MODEL), holds_total(url)
    latencies, health_bad = pipe.recv()
    prober.join()
    answered = [r.latency_s for r, _ in records if r.outcome.ok]
    after_answer = [
        r.latency_s for r, after_refusal in records if r.outcome.ok and not after_refusal
    ]
    refused = [r.latency_s for r, _ in records if r.outcome.status == 503]
    gained = None if holds_after is None else holds_after - (holds_before or 0.0)
    return StormRun(
        variant=name, round=round_, load_before=load,
        answered_rps=len(answered) / cpu.seconds,
        answered_share=len(answered) / cpu.seconds / capacity,
        refused_rps=len(refused) / cpu.seconds, other=len(records) - len(answered) - len(refused),
        answered_p50_ms=percentile_ms(answered, 0.5), answered_p99_ms=percentile_ms(answered, 0.99),
        answered_after_answer_p99_ms=percentile_ms(after_answer, 0.99),
        refused_p99_ms=percentile_ms(refused, 0.99),
        health_p99_ms=summary(latencies)["p99"], health_bad=health_bad,
        server_cores=cpu.cores(cpu.server_s),
        server_threads_cores={k: round(cpu.cores(v), 2) for k, v in cpu.threads_s.items()
                              if cpu.cores(v) >= 0.01},
        generator_cores=cpu.cores(cpu.generator_s), holds=gained,
        policy=policy_counts(policy_before, policy_after),
    )  # fmt: skip


def parse_variant(text: str) -> tuple[str, Path, list[str]]:
    """NAME=SRC[:FLAG,FLAG...] -> (name, source tree, extra `fulcrum serve` flags)."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise argparse.ArgumentTypeError(f"expected NAME=SRC[:FLAG,...], got {text!r}")
    src, _, flags = rest.partition(":")
    extra = [part for flag in flags.split(",") if flag for part in flag.split("=", 1)]
    return name, Path(src).resolve(), extra


def run(repo: Path, args: argparse.Namespace) -> dict[str, object]:
    capacity = args.capacity
    runs: list[StormRun] = []
    for round_ in range(1, args.rounds + 1):
        for name, src, extra in args.variant:
            log = args.out / f"server.{name}.r{round_}.log"
            with serving(repo, src, log, extra=extra) as (url, port):
                target = V2Target(Endpoint.from_url(url), v2_requests(url, 256, args.words))
                play(url, target, [Step(0.0, 3.0, 1.0)], 20.0, seed=1, timeout_s=10.0)  # warm
                if capacity <= 0:
                    triton = config_override(repo, "triton", args.slo_ms)
                    _, capacity = measure_capacity(url, target, triton)
                    reload(url, MODEL, None)  # back to the shipped config
                    print(f"open-loop capacity {capacity:.1f} req/s", flush=True)
                print(f"{name} round {round_} (load {os.getloadavg()[0]:.2f}) ...", flush=True)
                outcome = storm(url, port, target, args, capacity, name, round_)
                runs.append(outcome)
                print("  " + json.dumps(asdict(outcome)), flush=True)
    return {"capacity_rps": capacity, "clients": args.clients, "seconds": args.seconds,
            "runs": [asdict(r) for r in runs], "load_average": os.getloadavg()}  # fmt: skip


def report(found: dict[str, object]) -> None:
    print(f"\n{found['clients']} closed-loop clients retrying every 503 at once, "
          f"{found['seconds']:g} s; open-loop capacity "
          f"{found['capacity_rps']:.1f} req/s")  # fmt: skip
    print("| variant | round | load | answered req/s (/ capacity) | refusals/s | answered P50 / "
          "P99 ms (after an answer) | health P99 ms | server cores (loop) | client cores "
          "| holds |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in found["runs"]:  # type: ignore[attr-defined]
        loop = r["server_threads_cores"].get("main", 0.0)
        print(f"| {r['variant']} | {r['round']} | {r['load_before']:.2f} | "
              f"{r['answered_rps']:.1f} ({r['answered_share']:.2f}) | {r['refused_rps']:.0f} | "
              f"{r['answered_p50_ms']:.0f} / {r['answered_p99_ms']:.0f} "
              f"({r['answered_after_answer_p99_ms']:.0f}) | "
              f"{r['health_p99_ms']:.1f} | {r['server_cores']:.2f} ({loop:.2f}) | "
              f"{r['generator_cores']:.2f} | {r['holds']} |")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=1, help="rounds over the variants")
    parser.add_argument(
        "--variant",
        type=parse_variant,
        action="append",
        help="NAME=SRC[:FLAG,FLAG...] (repeatable; default: this tree as shipped)",
    )
    parser.add_argument(
        "--capacity", type=float, default=0.0, help="req/s taken as capacity (0: measure)"
    )
    parser.add_argument("--slo-ms", type=float, default=100.0)
    parser.add_argument("--words", type=int, default=8)
    parser.add_argument("--repository", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("/tmp/retry_storm"))
    args = parser.parse_args(argv)
    if not args.variant:
        args.variant = [("shipped", (Path(__file__).parent.parent / "src").resolve(), [])]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        found = run(args.repository or build_repository(Path(tmp)), args)
    report(found)
    (args.out / "retry_storm.json").write_text(json.dumps(found, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
