"""Where a served model's CPU goes under load: each thread of `fulcrum serve`, and the client.

    .venv/bin/python benchmarks/cpu_by_thread.py --repository /tmp/bench_models \
        [--rates 60,140,240,280] [--seconds 15]

One `fulcrum serve --model minilm` process; at each rate the load generator sends one-sentence
JSON requests open loop (Poisson) for --seconds, and the script reads every server thread's CPU
time from /proc before and after. Prints, per rate, P50 / P99, refusals, the mean batch size, and
each thread's share of one core with its ms of CPU per request: the event loop (the main
thread), the instance thread, ONNX Runtime's pool threads (by thread id), and this process (the
load generator). Where the rows add up to the machine's cores, the rate is at its CPU ceiling.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

from adaptive_ends import Server, point
from adaptive_vs_static import v2_requests
from health_under_flood import serving

from fulcrum.loadgen.stats import Slo

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of `pid`, by thread id."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue  # the thread ended
        fields = stat[stat.rindex(")") + 2 :].split()
        out[tid] = (int(fields[11]) + int(fields[12])) * TICK_S
    return out


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repository", type=Path, required=True)
    parser.add_argument("--src", type=Path, default=Path(__file__).parent.parent / "src")
    parser.add_argument("--rates", default="60,140,240,280")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--out", type=Path, default=Path("/tmp/cpu_by_thread"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    slo = Slo(bound_ms=100.0, percentile=99.0)
    with serving(args.repository, args.src.resolve(), args.out / "serve.log") as (url, _):
        pid = server_pid()
        server = Server("fulcrum", url, v2_requests(url, 256, 12))
        for rate in (float(r) for r in args.rates.split(",")):
            before, mine = thread_cpu_s(pid), own_cpu_s()
            start_s = time.monotonic()
            result = point(server, rate, args.seconds, slo, seed=1)
            wall_s = time.monotonic() - start_s
            after, mine = thread_cpu_s(pid), own_cpu_s() - mine
            num = rate * wall_s
            latency, batch = result.latency, result.server.mean_batch_size
            print(f"{rate:g} requests/s: P50 {latency.p50_ms:.1f} P99 {latency.p99_ms:.1f} ms, "
                  f"errors {result.errors}, mean batch {batch}; share of one core "
                  "(ms CPU per request):")  # fmt: skip
            used = {tid: cpu - before.get(tid, 0.0) for tid, cpu in after.items()}
            for tid, cpu_s in sorted(used.items(), key=lambda kv: -kv[1]):
                if cpu_s >= 0.01 * wall_s:
                    name = "event loop (main thread)" if tid == str(pid) else f"thread {tid}"
                    print(f"  {name:26} {cpu_s / wall_s:5.2f}  ({cpu_s / num * 1e3:.2f})")
            print(f"  {'load generator':26} {mine / wall_s:5.2f}  ({mine / num * 1e3:.2f})",
                  flush=True)  # fmt: skip
    return 0


def server_pid() -> int:
    """The `fulcrum serve` child of this process (the one `serving` started)."""
    me = str(os.getpid())
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if stat[stat.rindex(")") + 2 :].split()[1] == me:
                return int(entry)
    raise RuntimeError("no fulcrum serve child found")


if __name__ == "__main__":
    sys.exit(main())
