"""Rows/s of minilm in process: one instance on two threads against two one-thread instances
on one shared session (`share_session_between_instances`), at several batch sizes.

    .venv/bin/python benchmarks/instance_threads.py --repository /tmp/bench_models [--seconds 4]

Each layout runs closed loop (one Python thread per instance, each running batches back to back
for --seconds) through the backend the server uses (tokenizing included). Printed per layout and
batch size: rows/s and the process's CPU ms per row. No HTTP and no batcher: this is the ceiling
each layout gives the server, not what a client sees.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from corpus import sentences

from fulcrum.backends import Backend, create_backend
from fulcrum.config import load_model_config

LAYOUTS = {  # name: (instances, intra-op threads each)
    "1 instance x 2 threads": (1, 2),
    "2 instances x 1 thread, one session": (2, 1),
    "1 instance x 1 thread": (1, 1),
}


def load(repo: Path, instances: int, threads: int) -> Backend:
    config = load_model_config(repo / "minilm" / "config.toml", dir_name="minilm")
    parameters = dict(config.parameters)
    parameters.update(
        intra_op_threads=threads, spin_when_idle=False, share_session_between_instances=True
    )
    instances_table = msgspec.structs.replace(config.instances, count=instances)
    config = msgspec.structs.replace(config, parameters=parameters, instances=instances_table)
    return create_backend(config, repo / "minilm" / "1")


def rows_per_s(
    backend: Backend, instances: int, texts: list[str], size: int, seconds: float
) -> tuple[float, float]:
    """(rows/s, CPU ms per row) with `instances` threads running batches of `size` at once."""
    batches = [
        np.array([[t.encode()] for t in texts[i : i + size]], dtype=object)
        for i in range(0, len(texts) - size, size)
    ]
    backend.execute({"text": batches[0]})  # warm-up
    counts = [0] * instances
    stop_at = time.perf_counter() + seconds

    def work(k: int) -> None:
        i = k
        while time.perf_counter() < stop_at:
            backend.execute({"text": batches[i % len(batches)]})
            counts[k] += size
            i += instances

    cpu0, wall0 = time.process_time(), time.perf_counter()
    threads = [threading.Thread(target=work, args=(k,)) for k in range(instances)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall, cpu, rows = time.perf_counter() - wall0, time.process_time() - cpu0, sum(counts)
    return rows / wall, cpu / rows * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repository", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--sizes", default="1,4,8,16")
    parser.add_argument("--words", type=int, default=12)
    args = parser.parse_args()
    texts = sentences(512, args.words, seed=1)
    sizes = [int(s) for s in args.sizes.split(",")]
    print("| layout | " + " | ".join(f"batch {s}" for s in sizes) + " |")
    print("|---|" + "---:|" * len(sizes))
    for name, (instances, threads) in LAYOUTS.items():
        backend = load(args.repository, instances, threads)
        cells = []
        for size in sizes:
            rate, cpu_ms = rows_per_s(backend, instances, texts, size, args.seconds)
            cells.append(f"{rate:.0f} rows/s ({cpu_ms:.2f} ms CPU/row)")
        backend.close()
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
