"""How much slower MiniLM's first call is after the machine sat idle (cold caches).

    .venv/bin/python benchmarks/idle_penalty.py
    .venv/bin/python benchmarks/idle_penalty.py --spin [--rounds 3]
    .venv/bin/python benchmarks/idle_penalty.py --batch-cost [--rounds 8]
    .venv/bin/python benchmarks/idle_penalty.py --stragglers [--rounds 40] [--hog]

Times one-sentence `backend.execute` calls back to back, then after a sleep or a busy wait of
2, 10, 50 and 200 ms. Explains light-load latency on a shared VM; it measures the machine.

`--spin`: what ONNX Runtime's thread spinning costs and buys for isolated calls. For each
setting (spinning off; on within runs only, `spin_between_runs = false`; on between runs too,
ONNX Runtime's own default and Fulcrum's `allow_spinning = true`), a fresh process loads the
backend and makes 40 calls, each after a random 50-150 ms sleep: the median call time and the
process's CPU time per call (all threads, the sleep included, so spinning after a call counts),
and its resident memory. "when idle" is `spin_when_idle = true` (", within runs": with
`spin_between_runs = false`): calls through `execute_lone`, as the batcher makes a lone
request's, on a second, spinning session while it is measured faster. Settings run in turn,
--rounds times, so a drift of the shared machine reaches each alike.

`--batch-cost`: back-to-back `execute` time by batch rows (1 to 64 sentences, sizes interleaved
per round, median of --rounds): where the cost per row stops falling is the batch size worth
preferring.

`--stragglers`: 16-row batches back to back on backends that differ in how ORT splits a parallel
operator among its threads (static shares, Fulcrum's default, against `dynamic_block_base`),
interleaved batch by batch in one process; median, P90 and slowest batch per setting. A batch
whose pool thread loses its core waits for that thread's whole share under static splitting.
`--hog` runs a busy-looping process meanwhile (one core taken away, as by a load generator).
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np
import psutil

from fulcrum.backends import Backend, create_backend
from fulcrum.config import load_model_config
from fulcrum.examples import build_examples

SENTENCE = {
    "text": np.array([[b"The quick brown fox jumps over the lazy dog today."]], dtype=object)
}
SPIN = {  # name: [parameters] overrides
    "off": {"allow_spinning": False},
    "within runs": {"allow_spinning": True, "spin_between_runs": False},
    "between runs too": {"allow_spinning": True},
    "when idle, within runs": {"spin_when_idle": True, "spin_between_runs": False},
    "when idle": {"spin_when_idle": True},
}
BATCH_ROWS = (1, 2, 4, 8, 16, 32, 64)
SPLITS = {"static (default)": {}, "dynamic_block_base 4": {"dynamic_block_base": 4}}
HOG = "while True: pass"


def load(repo: Path, overrides: dict[str, bool]) -> Backend:
    config = load_model_config(repo / "minilm" / "config.toml", dir_name="minilm")
    config = msgspec.structs.replace(config, parameters={**config.parameters, **overrides})
    return create_backend(config, repo / "minilm" / "1")


def idle(repo: Path) -> None:
    backend = load(repo, {})

    def timed_ms() -> float:
        start = time.perf_counter()
        backend.execute(SENTENCE)
        return (time.perf_counter() - start) * 1e3

    hot = [timed_ms() for _ in range(20)]
    print(f"back to back: median {statistics.median(hot):.1f} ms")
    for idle_s in (0.002, 0.01, 0.05, 0.2):
        slept, spun = [], []
        for _ in range(8):
            time.sleep(idle_s)
            slept.append(timed_ms())
            end = time.perf_counter() + idle_s
            while time.perf_counter() < end:
                pass
            spun.append(timed_ms())
        print(
            f"after {idle_s * 1e3:4.0f} ms idle: sleep {statistics.median(slept):5.1f} ms, "
            f"busy wait {statistics.median(spun):5.1f} ms"
        )
    backend.close()


def one_setting(repo: Path, name: str) -> None:
    """In a fresh process: 40 isolated calls with this spin setting; prints 'ms cpu_ms rss'."""
    backend = load(repo, SPIN[name])
    execute = getattr(backend, "execute_lone", backend.execute)
    for _ in range(5):
        execute(SENTENCE)
    rnd = random.Random(0)
    call_ms = []
    cpu_start_s = time.process_time()
    for _ in range(40):
        time.sleep(rnd.uniform(0.05, 0.15))  # the idle gap is the workload
        start = time.perf_counter()
        execute(SENTENCE)
        call_ms.append((time.perf_counter() - start) * 1e3)
    cpu_ms = (time.process_time() - cpu_start_s) / 40 * 1e3
    rss_mib = psutil.Process().memory_info().rss / 2**20
    print(f"{statistics.median(call_ms):.3f} {cpu_ms:.3f} {rss_mib:.0f}")


def spin(repo: Path, rounds: int) -> None:
    found: dict[str, list[tuple[float, float]]] = {name: [] for name in SPIN}
    for _ in range(rounds):
        for name in SPIN:
            command = [sys.executable, __file__, "--one", name, "--repository", str(repo)]
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            call_ms, cpu_ms, rss_mib = (float(x) for x in out.split())
            found[name].append((call_ms, cpu_ms))
            print(f"  {name:17} call {call_ms:6.2f} ms, CPU {cpu_ms:6.2f} ms per call, "
                  f"RSS {rss_mib:.0f} MiB", flush=True)  # fmt: skip
    print("\nspinning | call ms, median of rounds (each) | CPU ms per call (each)")
    for name, values in found.items():
        calls, cpus = [v[0] for v in values], [v[1] for v in values]
        print(
            f"{name} | {statistics.median(calls):.2f} ({', '.join(f'{c:.1f}' for c in calls)}) | "
            f"{statistics.median(cpus):.2f} ({', '.join(f'{c:.1f}' for c in cpus)})"
        )


def batch_cost(repo: Path, rounds: int) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from corpus import sentences

    backend = load(repo, {})
    texts = [t.encode() for t in sentences(256, 12, seed=1)]
    times_s: dict[int, list[float]] = {n: [] for n in BATCH_ROWS}
    for k in range(rounds):
        for n in BATCH_ROWS:
            first = (k * 7 + n) % (len(texts) - n)  # other sentences each time
            batch = {"text": np.array([[t] for t in texts[first : first + n]], dtype=object)}
            start = time.perf_counter()
            backend.execute(batch)
            times_s[n].append(time.perf_counter() - start)
    print("rows | ms per batch, median (min-max) | ms per row")
    for n, values in times_s.items():
        ms = statistics.median(values) * 1e3
        print(f"{n} | {ms:.1f} ({min(values) * 1e3:.1f}-{max(values) * 1e3:.1f}) | {ms / n:.2f}")
    backend.close()


def stragglers(repo: Path, rounds: int, hog: bool) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from corpus import sentences

    backends = {name: load(repo, overrides) for name, overrides in SPLITS.items()}
    texts = [t.encode() for t in sentences(256, 12, seed=1)]
    times_s: dict[str, list[float]] = {name: [] for name in backends}
    hogger = subprocess.Popen([sys.executable, "-c", HOG]) if hog else None
    try:
        for k in range(rounds):
            first = (k * 16) % (len(texts) - 16)
            batch = {"text": np.array([[t] for t in texts[first : first + 16]], dtype=object)}
            for name in list(backends) if k % 2 else list(backends)[::-1]:  # alternate order
                start = time.perf_counter()
                backends[name].execute(batch)
                times_s[name].append(time.perf_counter() - start)
    finally:
        if hogger is not None:
            hogger.kill()
            hogger.wait()
    print(f"16-row batches, {rounds} each{' beside a busy loop' if hog else ''}: "
          "setting | median / P90 / slowest ms")  # fmt: skip
    for name, values in times_s.items():
        ms = sorted(v * 1e3 for v in values)
        p90 = ms[min(len(ms) - 1, int(0.9 * len(ms)))]
        print(f"{name} | {statistics.median(ms):.1f} / {p90:.1f} / {ms[-1]:.1f}")
    for backend in backends.values():
        backend.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spin", action="store_true", help="spinning's cost per isolated call")
    parser.add_argument("--batch-cost", action="store_true", help="batch time by rows")
    parser.add_argument("--stragglers", action="store_true", help="static vs dynamic splits")
    parser.add_argument("--hog", action="store_true", help="with --stragglers: a busy loop too")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repository", type=Path, help="an example repository (default: built)")
    parser.add_argument("--one", choices=sorted(SPIN), help=argparse.SUPPRESS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        repo = args.repository or Path(tmp)
        if args.repository is None:
            build_examples(repo)
        if args.one:
            one_setting(repo, args.one)
        elif args.spin:
            spin(repo, args.rounds)
        elif args.batch_cost:
            batch_cost(repo, args.rounds)
        elif args.stragglers:
            stragglers(repo, args.rounds, args.hog)
        else:
            idle(repo)
    return 0


if __name__ == "__main__":
    sys.exit(main())
