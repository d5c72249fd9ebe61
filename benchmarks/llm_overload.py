"""tiny-llama held at a constant overload, for comparing TTFT admission between code trees.

The trace of `adaptive_vs_static.py --llm` takes 7 minutes and mixes every load level; this holds
one level (default 1.3x capacity) for a short stretch, so the same comparison repeats many times
in the time the trace takes once. Each round starts one `fulcrum serve` per tree (`--src
NAME:PATH`, in turn, the same arrivals), reloads tiny-llama with the SLO config (`--config
adaptive`: both SLOs and a 2048-token ceiling, as the trace's adaptive budget; `admission`: a
fixed 512-token budget with `slo_ttft_ms` alone), warms it up and replays Poisson arrivals over the
OpenAI streaming API. Per run: the share of all requests answered within both SLOs, the 503s,
and of the admitted: TTFT P50/P99 at the client and how many started late. The load generator
shares the machine's cores with the server, so client-side TTFT includes its own delays.

    .venv/bin/python benchmarks/llm_overload.py --src old:/tmp/old/src --src new:src --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).parent))
from adaptive_llm import BUDGETS, MODEL, LlmRunner, add_llm_args
from adaptive_vs_static import run_async
from health_under_flood import serving
from load_trace import Step, arrival_times, replay

from fulcrum.examples import build_tiny_llama
from fulcrum.loadgen.stats import percentile_ms


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--src", action="append", default=[], metavar="NAME:PATH",
        help="a code tree to serve (repeatable; default: this checkout's src)")  # fmt: skip
    add("--config", choices=["adaptive", "admission"], default="adaptive")
    add("--load", type=float, default=1.3, help="multiple of capacity")
    add("--seconds", type=float, default=15.0, help="seconds of load per run")
    add("--rounds", type=int, default=3, help="runs of every tree, alternating")
    add("--capacity", type=float, help="req/s (default: measured once, closed loop)")
    add("--capacity-s", type=float, default=4.0)
    add("--warmup-s", type=float, default=2.0, help="unmeasured load after each reload")
    add("--timeout-s", type=float, default=5.0)
    add("--out", type=Path, default=Path("bench-out/llm_overload"))
    add_llm_args(parser)
    return parser.parse_args(argv)


def trees(args: argparse.Namespace) -> list[tuple[str, Path]]:
    named = args.src or [f"tree:{Path(__file__).parent.parent / 'src'}"]
    out = []
    for item in named:
        name, _, path = item.partition(":")
        if not path:
            raise SystemExit(f"--src {item!r}: expected NAME:PATH")
        out.append((name, Path(path).resolve()))
    return out


def one_run(repo: Path, src: Path, args: argparse.Namespace, capacity: float | None) -> dict:
    base = msgspec.toml.decode((repo / MODEL / "config.toml").read_bytes())["parameters"]
    with serving(repo, src, args.out / "server.log", model=MODEL) as (url, _):
        runner = LlmRunner(url, args, base)
        capacity = capacity or runner.capacity()
        if args.config == "adaptive":
            override = runner.override(max_num_batched_tokens=max(BUDGETS),
                                       slo_ttft_ms=args.slo_ttft_ms,
                                       slo_tpot_ms=args.slo_tpot_ms)  # fmt: skip
        else:
            override = runner.override(max_num_batched_tokens=512, slo_ttft_ms=args.slo_ttft_ms)
        runner.switch(override, capacity)
        steps = [Step(0.0, args.seconds, args.load)]
        offsets = arrival_times(steps, capacity, seed=5)
        run = run_async(replay(runner.target, steps, offsets, url=url, model=None,
                               timeout_s=args.timeout_s * 4))  # fmt: skip
    records = run.records
    admitted = [r for r in records if r.outcome.ok and r.ttft_s is not None]
    ttft = runner.slos[0]  # TTFT at P99
    return {
        "capacity": capacity,
        "offered": len(records),
        "good": sum(runner.good(r) for r in records),
        "shed": sum(r.outcome.status == 503 for r in records),
        "admitted": len(admitted),
        "late": sum(r.ttft_s * 1000 > ttft.bound_ms for r in admitted),  # type: ignore[operator]
        "ttft_p50": percentile_ms(admitted, msgspec.structs.replace(ttft, percentile=50.0)),
        "ttft_p99": percentile_ms(admitted, ttft),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    repo = args.out / "repo"
    if not (repo / MODEL).exists():
        build_tiny_llama(repo)
    capacity = args.capacity
    rows: dict[str, list[dict]] = {}
    print(f"tiny-llama, config {args.config!r}, {args.load:g}x capacity for {args.seconds:g} s; "
          f"SLOs TTFT <= {args.slo_ttft_ms:g} ms, TPOT <= {args.slo_tpot_ms:g} ms")  # fmt: skip
    print("| round | tree | offered | within both SLOs | 503 | admitted late | TTFT P50 / P99 ms |")
    print("|---:|---|---:|---:|---:|---:|---|")
    for round_ in range(1, args.rounds + 1):
        for name, src in trees(args):
            row = one_run(repo, src, args, capacity)
            capacity = capacity or row["capacity"]  # the first run's measurement, for all
            rows.setdefault(name, []).append(row)
            print(f"| {round_} | {name} | {row['offered']} | {row['good'] / row['offered']:.1%} | "
                  f"{row['shed']} | {row['late']} of {row['admitted']} | "
                  f"{row['ttft_p50']:.0f} / {row['ttft_p99']:.0f} |", flush=True)  # fmt: skip
    print(f"\ncapacity {capacity:.1f} req/s")
    for name, runs in rows.items():
        shares = [r["good"] / r["offered"] for r in runs]
        late = [r["late"] / max(1, r["admitted"]) for r in runs]
        print(f"{name}: within both SLOs median {statistics.median(shares):.1%} "
              f"({min(shares):.1%}-{max(shares):.1%}); admitted late median "
              f"{statistics.median(late):.1%} ({min(late):.1%}-{max(late):.1%})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
