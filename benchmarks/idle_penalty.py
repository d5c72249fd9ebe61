"""How much slower MiniLM's first call is after the machine sat idle (cold caches).

    .venv/bin/python benchmarks/idle_penalty.py

Times one-sentence `backend.execute` calls back to back, then after a sleep or a busy wait of
2, 10, 50 and 200 ms. Explains light-load latency on a shared VM; it measures the machine.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from fulcrum.backends import create_backend
from fulcrum.config import load_model_config
from fulcrum.examples import build_examples

SENTENCE = {
    "text": np.array([[b"The quick brown fox jumps over the lazy dog today."]], dtype=object)
}


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        build_examples(repo)
        config = load_model_config(repo / "minilm" / "config.toml", dir_name="minilm")
        backend = create_backend(config, repo / "minilm" / "1")

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
    return 0


if __name__ == "__main__":
    sys.exit(main())
