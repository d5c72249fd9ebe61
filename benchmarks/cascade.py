"""A cascade's decision, measured: escalation rate and end-to-end latency at each threshold.

    .venv/bin/python benchmarks/cascade.py [--requests 400] [--concurrency 4]
        [--thresholds 0.5,0.8,0.95] [--small-dim 64] [--big-dim 768] [--out FILE]
    .venv/bin/python benchmarks/cascade.py --llm [...]   # two LLMs over the OpenAI API:
                                                        # see benchmarks/cascade_llm.py

In process (one `Service`, python backend, no HTTP): `small` is a one-layer scorer (a
`small-dim` matmul per row) whose per-row `confidence` is the request's own value x, drawn
uniform in [0, 1) by the load; `big` runs `big-dim` x `big-dim` matmuls (eight layers) per row.
So the expected escalation rate at threshold t is t, and the measured rate checks the decision;
the latencies show what the cascade costs against `big` alone. Each configuration gets the same
inputs (same seed), closed loop at --concurrency; reported: escalation rate (measured and
expected), P50 / P99 / mean latency in ms, requests/s, and the same for `small` alone and
`big` alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from fulcrum.context import internal_context
from fulcrum.protocol.request import InferRequest
from fulcrum.service import Service

MODEL_PY = """
import numpy as np

class Model:
    def __init__(self, config, version_dir):
        dim = int(config.parameters["dim"])
        self.layers = int(config.parameters["layers"])
        self.w = np.random.default_rng(0).standard_normal((dim, dim)).astype(np.float32) / dim
        self.dim = dim

    def execute(self, batch):
        x = batch["x"]
        h = np.repeat(x, self.dim, axis=1)
        for _ in range(self.layers):
            h = np.tanh(h @ self.w)
        return {"y": h[:, :1].copy(), "confidence": x.copy()}
"""
CONFIG = """platform = "python"
max_batch_size = 8
inputs = [{{name = "x", datatype = "FP32", shape = [1]}}]
outputs = [{{name = "y", datatype = "FP32", shape = [1]}}{extra}]
[dynamic_batching]
max_queue_delay_ms = 0
[parameters]
dim = {dim}
layers = {layers}
"""
SCORE = ', {name = "confidence", datatype = "FP32", shape = [1]}'


def write_repository(root: Path, small_dim: int, big_dim: int, thresholds: list[float]) -> None:
    models = {"small": CONFIG.format(extra=SCORE, dim=small_dim, layers=1),
              "big": CONFIG.format(extra="", dim=big_dim, layers=8)}  # fmt: skip
    for t in thresholds:
        models[f"cascade-{t:g}"] = models["small"] + (
            f'[routing.cascade]\nthen = "big"\nscore_output = "confidence"\nthreshold = {t}\n'
        )
    for name, text in models.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.toml").write_text(text)
        (root / name / "1" / "model.py").write_text(MODEL_PY)


async def run(
    service: Service, model: str, values: list[float], concurrency: int
) -> dict[str, object]:
    latencies: list[float] = []
    escalated = 0
    queue = list(values)

    async def worker() -> None:
        nonlocal escalated
        while queue:
            x = queue.pop()
            request = InferRequest(None, {"x": np.array([[x]], np.float32)}, (), False, None,
                                   None, {})  # fmt: skip
            start = time.perf_counter()
            _, result = await service.infer(internal_context("v2"), model, None, request)
            latencies.append(time.perf_counter() - start)
            escalated += int(result.route is not None and "escalated" in result.route)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    ms = sorted(1000 * s for s in latencies)
    return {"model": model, "requests": len(ms), "escalation_rate": escalated / len(ms),
            "p50_ms": round(ms[len(ms) // 2], 2), "p99_ms": round(ms[int(len(ms) * 0.99)], 2),
            "mean_ms": round(statistics.fmean(ms), 2), "rps": round(len(ms) / wall, 1)}  # fmt: skip


async def main(args: argparse.Namespace) -> list[dict[str, object]]:
    thresholds = [float(t) for t in args.thresholds.split(",")]
    rng = random.Random(0)
    values = [rng.random() for _ in range(args.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_repository(root, args.small_dim, args.big_dim, thresholds)
        service = Service(root)
        await service.start()
        try:
            await run(service, "big", values[:50], args.concurrency)  # warm-up
            rows = [await run(service, "small", values, args.concurrency),
                    await run(service, "big", values, args.concurrency)]  # fmt: skip
            for t in thresholds:
                row = await run(service, f"cascade-{t:g}", values, args.concurrency)
                row["expected_rate"] = round(sum(v < t for v in values) / len(values), 3)
                rows.append(row)
        finally:
            await service.stop()
    return rows


if __name__ == "__main__" and "--llm" in sys.argv:
    sys.path.insert(0, str(Path(__file__).parent))
    from cascade_llm import main as llm_main

    llm_main([a for a in sys.argv[1:] if a != "--llm"])
elif __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--thresholds", default="0.5,0.8,0.95")
    parser.add_argument("--small-dim", type=int, default=64)
    parser.add_argument("--big-dim", type=int, default=768)
    parser.add_argument("--out", type=Path)
    parsed = parser.parse_args()
    text = "\n".join(json.dumps(r) for r in asyncio.run(main(parsed)))
    print(text)
    if parsed.out is not None:
        parsed.out.write_text(text + "\n")
