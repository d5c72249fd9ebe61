"""What `--compute-nice` trades, without HTTP: the served minilm backend running 16-row batches
back to back on a lowered thread, beside a stand-in for the event loop at normal priority.

    .venv/bin/python benchmarks/compute_nice.py --repository /tmp/nice_models [--nices 0,2,5]
        [--repeats 3] [--seconds 10] [--loop-hz 900] [--loop-work-us 300]

Each (repeat, nice) is its own child process, interleaved: the backend is built on a thread at
that niceness (so ONNX Runtime's pool inherits it), warmed, then runs batches for --seconds while
a normal-priority thread wakes --loop-hz times a second and computes --loop-work-us each time
(the event loop refusing a 3x overload: ~900 requests/s, ~0.3 of a core). Reported: rows/s of
the model (its goodput ceiling), the loop's lateness (scheduled wake-up to running: what a 503
waits for a core) P50/P99, and preemptions per second of the compute threads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from corpus import sentences

from fulcrum.backends import create_backend
from fulcrum.config import load_model_config
from fulcrum.thread_priority import lower_this_thread

ROWS = 16


def preemptions() -> int:
    """Involuntary context switches of every thread of this process but the calling one."""
    me = threading.get_native_id()
    total = 0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) == me:
            continue
        try:
            for line in Path(f"/proc/self/task/{tid}/status").read_text().splitlines():
                if line.startswith("nonvoluntary_ctxt_switches"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total


def child(args: argparse.Namespace) -> dict[str, float]:
    config = load_model_config(args.repository / "minilm" / "config.toml", dir_name="minilm")
    texts = sentences(256, args.words, seed=1)
    batches = [np.array([[t.encode()] for t in texts[i : i + ROWS]], dtype=object)
               for i in range(0, len(texts), ROWS)]  # fmt: skip
    stop = threading.Event()
    ready = threading.Event()
    done_rows = [0]

    def compute() -> None:
        lower_this_thread(args.nice)
        backend = create_backend(config, args.repository / "minilm" / "1")
        for batch in batches:  # warm
            backend.execute({"text": batch})
        ready.set()
        i = 0
        while not stop.is_set():
            backend.execute({"text": batches[i % len(batches)]})
            done_rows[0] += ROWS
            i += 1

    worker = threading.Thread(target=compute)
    worker.start()
    ready.wait(120)
    interval_s = 1.0 / args.loop_hz
    work_s = args.loop_work_us / 1e6
    lateness: list[float] = []
    rows0, pre0 = done_rows[0], preemptions()
    start = next_s = time.perf_counter()
    end = start + args.seconds
    while next_s < end:
        next_s += interval_s
        delay = next_s - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        woke = time.perf_counter()
        lateness.append(max(0.0, woke - next_s))
        while time.perf_counter() - woke < work_s:  # the loop's work for one request
            pass
    elapsed = time.perf_counter() - start
    rows, pre = done_rows[0] - rows0, preemptions() - pre0
    stop.set()
    worker.join()
    lateness.sort()
    return {
        "nice": args.nice,
        "rows_per_s": rows / elapsed,
        "loop_late_p50_ms": statistics.median(lateness) * 1e3,
        "loop_late_p99_ms": lateness[int(0.99 * (len(lateness) - 1))] * 1e3,
        "compute_preempted_per_s": pre / elapsed,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repository", type=Path, required=True)
    parser.add_argument("--nices", default="0,2,5")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--loop-hz", type=float, default=900.0)
    parser.add_argument("--loop-work-us", type=float, default=300.0)
    parser.add_argument("--words", type=int, default=8)
    parser.add_argument("--nice", type=int, default=-1, help=argparse.SUPPRESS)  # a child's
    args = parser.parse_args()
    if args.nice >= 0:
        print(json.dumps(child(args)))
        return 0
    print(f"load average {os.getloadavg()}; loop {args.loop_hz:g}/s x {args.loop_work_us:g} us")
    print("| round | nice | model rows/s | loop late P50 ms | loop late P99 ms | compute "
          "preemptions/s |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|")
    for repeat in range(1, args.repeats + 1):
        for nice in (int(n) for n in args.nices.split(",")):
            out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--nice", str(nice)],
                                 check=True, capture_output=True, text=True).stdout  # fmt: skip
            r = json.loads(out.strip().splitlines()[-1])
            print(f"| {repeat} | {nice} | {r['rows_per_s']:.0f} | {r['loop_late_p50_ms']:.2f} | "
                  f"{r['loop_late_p99_ms']:.2f} | {r['compute_preempted_per_s']:.0f} |",
                  flush=True)  # fmt: skip
    print(f"load average {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
